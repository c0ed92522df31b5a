"""Checkpoints on disk that cannot be lost or mixed: a directory per save, published when complete.

A DCP checkpoint is many files (each rank's pieces) and DCP's ``.metadata``, which rank 0 writes once every
rank has written its files. Saved over one directory in place, a rank killed mid-save leaves the old metadata
over a mix of old and new files (a resume "at step 8" from steps 4 and 8), or the only checkpoint truncated.

So ``save_checkpoint(state, root, step)`` writes into ``root/step-<step>.partial``, and rank 0 renames it to
``root/step-<step>`` once DCP has finished on every rank (its last step is collective): a directory named
``step-<n>`` is always complete, a crash leaves only a ``.partial`` that nothing reads, and the previous save
stays loadable. ``latest_checkpoint(root)`` finds the newest complete one. A save never overwrites a published
directory. ``async_save=True`` writes with ``dcp.async_save``: the state is copied to host memory before the
call returns and training goes on while a thread writes and then publishes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from autopar.errors import CheckpointError, ConfigError
from autopar.runtime.interop.state_dicts import host_copy
from autopar.runtime.comm.mesh import save_group

log = logging.getLogger("autopar")

_STEP = re.compile(r"^step-(\d+)$")
_pending: concurrent.futures.Future | None = None
"""The last asynchronous save, waited for before the next one starts (DCP writes one at a time)."""


def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """Where the save of ``step`` is published: ``root/step-<step, 9 digits>``."""
    return Path(root) / f"step-{step:09d}"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete save under ``root`` (the highest step whose directory is published and holds DCP's
    ``.metadata``); None if there is none. ``.partial`` directories (a save that did not finish) are skipped."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / ".metadata").exists()]
    return max(steps)[1] if steps else None


def save_checkpoint(state: dict[str, Any], root: str | os.PathLike, step: int, *, keep: int | None = None,
                    async_save: bool = False, process_group: dist.ProcessGroup | None = None
                    ) -> Path | concurrent.futures.Future:
    """Saves ``state`` (what ``dcp.save`` takes: ``{"model": model.state_dict(), "optim": ...}``) as the checkpoint
    of ``step`` under ``root``; every rank calls it. Returns the published directory, or with ``async_save`` a
    future of it (done once written and published, or raising why not; the next save waits for it, and a
    failure is logged as one warning line: the previous save stays the newest complete one).

    ``keep``: after publishing, rank 0 deletes the oldest complete saves beyond this many. Raises
    ``CheckpointError`` if ``step``'s directory is already published (a save is never overwritten in place).
    """
    global _pending
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step={step!r} is invalid. Use the training step as an int >= 0.")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"keep={keep!r} is invalid. Use None (keep every save) or an int >= 1.")
    if _pending is not None:  # (its failure, if any, was logged and is its future's to raise)
        previous, _pending = _pending, None
        concurrent.futures.wait([previous])
    final = checkpoint_path(root, step)
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank() if dist.is_initialized() else 0
    box = [None]
    if rank == 0:
        if final.exists():
            box = [f"the checkpoint of step {step} is already published at {final}; autopar never overwrites a save "
                   "in place (a rank killed mid-save would leave it mixed). Save under a new step, or delete it first."]
        else:
            shutil.rmtree(partial, ignore_errors=True)  # (a save that did not finish before a restart)
            partial.mkdir(parents=True)
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0, group=process_group)
    if box[0] is not None:
        raise CheckpointError(box[0])

    def publish() -> Path:
        if rank == 0:
            os.replace(partial, final)  # (atomic: the directory appears whole)
            if keep is not None:
                _prune(Path(root), keep)
        return final

    if not async_save:
        dcp.save(state, checkpoint_id=partial, process_group=process_group)
        published = publish()
        if dist.is_initialized():
            dist.barrier(group=process_group)  # (every rank sees it published when it returns)
        return published
    # DCP's background save runs collectives from another thread: on a gloo group of its own, never interleaved
    # with the training's; staged by autopar (a fused piece's boxes stay several boxes, see host_copy).
    written = dcp.async_save(state, storage_writer=_HostStaged(partial), process_group=_group(process_group))
    done: concurrent.futures.Future = concurrent.futures.Future()

    def finished(f: Any) -> None:
        try:
            f.result()
            done.set_result(publish())
        except BaseException as e:  # noqa: BLE001  (the save failed: nothing is published; the error is the future's)
            log.warning("autopar: the checkpoint of step %d was not saved (%s); %s stays the newest complete one",
                        step, e, latest_checkpoint(root))
            done.set_exception(e)

    written.add_done_callback(finished)
    _pending = done
    return done


class _HostStaged(FileSystemWriter):
    """DCP's file writer, staging the state dict with ``host_copy`` (async_save stages through its writer)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return host_copy(state_dict)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False


def _group(given: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group asynchronous saves run on: the script's, or a gloo group of autopar's (``mesh.save_group``)."""
    return given if given is not None or not dist.is_initialized() else save_group()


def wait_for_checkpoint() -> None:
    """Waits for the last ``save_checkpoint(..., async_save=True)`` (before the script exits)."""
    global _pending
    if _pending is not None:
        previous, _pending = _pending, None
        previous.result()


def _prune(root: Path, keep: int) -> None:
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)))
    for _, p in steps[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
