"""autopar: zero-code-change auto-parallelization for PyTorch (data x 3D tensor parallelism).

    with autopar.auto_parallelize(tensor=(row, col, depth), data=D):
        model = MyModel()
"""

from autopar.runtime.collectives import comm_stats, reset_comm_stats
from autopar.config import ParallelConfig, Plan
from autopar.context import (auto_parallelize, full_optimizer_state_dict, full_state_dict,
                             load_full_optimizer_state_dict, no_sync, plan_of)
from autopar.errors import AutoparError
from autopar.train import train_step

__all__ = [
    "AutoparError",
    "ParallelConfig",
    "Plan",
    "auto_parallelize",
    "comm_stats",
    "full_optimizer_state_dict",
    "full_state_dict",
    "load_full_optimizer_state_dict",
    "no_sync",
    "plan_of",
    "reset_comm_stats",
    "train_step",
]
