"""The vocabulary of an emitted graph: metadata on captured nodes and the distributed ops passes insert.

The ops are markers: calling one raises. The runtime binds each marker node to an implementation
over real process groups (autopar.runtime). Keeping them abstract keeps the passes free of
process groups and lets a graph be planned, printed and checked without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch.fx as fx

from autopar.config import Layout, Orientation


class InputKind(StrEnum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"
    USER = "user"


@dataclass(frozen=True, slots=True)
class InputInfo:
    """``node.meta["autopar"]`` of a placeholder of a captured graph."""

    kind: InputKind
    target: str
    """Parameter/buffer FQN, constant name, or the user input's position in the flattened inputs."""
    requires_grad: bool
    batch_split: bool = False
    """True for user inputs whose dim 0 is the batch: each rank receives its slice of it."""


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """``gm.meta["autopar_batch"]``: how the global batch was split when this graph was captured."""

    global_size: int
    local_sizes: tuple[int, ...]
    """Rows per batch shard, in batch-index order (see ParallelConfig.batch_sizes)."""
    index: int
    """Which shard this graph was captured for."""


@dataclass(frozen=True, slots=True)
class MatmulSpec:
    weight: str
    orientation: Orientation
    in_features: int
    out_features: int
    weight_in_out: bool
    has_bias: bool


@dataclass(frozen=True, slots=True)
class ConvertSpec:
    src: Layout
    dst: Layout
    full_size: int
    """Size of the full (unsharded) last dimension."""


@dataclass(frozen=True, slots=True)
class GatherOutputSpec:
    layout: Layout
    full_size: int
    batch_split: bool


class UnboundOpError(RuntimeError):
    pass


def sharded_matmul(x, weight, bias, spec: MatmulSpec):
    """``x @ W^T + b`` with W cut 3D-wise per ``spec.orientation`` (AxoNN). Input layout is
    ``spec.orientation.in_layout``, output layout ``out_layout``."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def convert_layout(x, spec: ConvertSpec):
    """Re-lays out the last dimension of ``x`` from ``spec.src`` to ``spec.dst``."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


def gather_output(x, spec: GatherOutputSpec):
    """Makes a model output full on every rank: features gathered, then batch rows gathered."""
    raise UnboundOpError("autopar marker op called before the runtime bound it to process groups")


# Generated FX code spells specs as constructor calls (``ConvertSpec(src=Layout.ROW, ...)``); make
# those names resolvable so graphs holding specs recompile and print as runnable code.
for _obj in (Layout, Orientation, MatmulSpec, ConvertSpec, GatherOutputSpec):
    _module = "autopar.config" if _obj in (Layout, Orientation) else __name__
    fx.graph._register_custom_builtin(_obj.__name__, f"from {_module} import {_obj.__name__}", _obj)


def input_info(node: fx.Node) -> InputInfo | None:
    info = node.meta.get("autopar")
    return info if isinstance(info, InputInfo) else None
