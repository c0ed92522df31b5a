"""How a benchmark job's rank ends: its process groups destroyed, then an exit that skips the interpreter's
finalization.

A gloo rank that exits normally finalizes the interpreter while autopar's models and meshes still hold
process groups: gloo's worker threads can then be torn down in the middle of finalization. One clean-clone
CI run (2026-11-29) saw rank 0 of ``benchmarks.inference`` abort that way ("terminate called without an
active exception", SIGABRT) after its work was done; nine reruns of the test passed. torch's own attempt at
an exit hook for this (pytorch/pytorch#179291) was abandoned. The test fixture's ranks already end with
``os._exit`` (tests/conftest.py); the jobs torchrun starts here do the same once every file is written.
"""

from __future__ import annotations

import os
import sys


def end_job() -> None:
    """Destroys the process groups, flushes this rank's output and exits with status 0 without finalizing."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
