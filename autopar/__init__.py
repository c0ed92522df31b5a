"""autopar: zero-code-change auto-parallelization for PyTorch (data x 3D tensor parallelism).

    with autopar.auto_parallelize(tensor=(row, col, depth), data=D):
        model = MyModel()

The names below load on first use (PEP 562), so ``import passes`` or ``import autopar.config`` does not
pull in the runtime (which imports the passes back).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AutoparError": "autopar.errors",
    "ParallelConfig": "autopar.config",
    "Plan": "autopar.decisions",
    "auto_parallelize": "autopar.context",
    "comm_stats": "autopar.runtime.comm.collectives",
    "detach": "autopar.parallel_model",
    "full_optimizer_state_dict": "autopar.parallel_model",
    "full_state_dict": "autopar.parallel_model",
    "latest_checkpoint": "autopar.checkpoints",
    "load_full_optimizer_state_dict": "autopar.parallel_model",
    "no_sync": "autopar.parallel_model",
    "parallelize_module": "autopar.context",
    "plan_of": "autopar.parallel_model",
    "reset_comm_stats": "autopar.runtime.comm.collectives",
    "save_checkpoint": "autopar.checkpoints",
    "train_step": "autopar.train",
    "wait_for_checkpoint": "autopar.checkpoints",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:  # a submodule: autopar.memory, autopar.trace, ...
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'autopar' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
