"""machine: a device and its interconnect, as the plan search prices a step on it.

``Machine`` is data (``autopar/hardware/*.json``, or what ``python -m autopar.plan --calibrate`` writes):
the matmul rate, the memory, bandwidth and latency within a node and between nodes, and on a
calibrated machine the measured rates of a rank's own work and tables of collectives. A collective
runs within a node when its group's ranks do (rank placement is row-major over data, pipeline, depth,
row, col). Pure: no process groups.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.config import MESH_AXES, ParallelConfig
from autopar.decisions import collective_bytes
from passes.analysis.estimate_costs import Collective


@dataclass(frozen=True, slots=True)
class Machine:
    """A device and its interconnect. Rates are what a step sustains, not peaks."""

    name: str
    flops_per_second: float
    """Sustained matmul rate per device."""
    memory_bytes: int
    """Memory per device."""
    intra_bytes_per_second: float
    """Per-rank bandwidth of a collective whose group lies within one node (NVLink)."""
    inter_bytes_per_second: float
    """Per-rank bandwidth of a collective whose group spans nodes (InfiniBand / Ethernet)."""
    intra_latency: float = 0.0
    """Fixed seconds per collective within a node."""
    inter_latency: float = 0.0
    """Fixed seconds per collective across nodes."""
    gpus_per_node: int = 8
    cores: int = 0
    """CPU cores a node's ranks share (``--calibrate`` on a CPU); 0: each rank has a device of its own.
    Where a node's ranks outnumber its cores, the rates (measured with every rank busy at once) are shared
    ones, and a pipeline's idle ranks give their cores to the busy ones (``pipeline_span``)."""
    memory_bytes_per_second: float = 0.0
    """Sustained memory bandwidth of the optimizer's update (AdamW touches seven bytes per byte of
    parameter: reads parameter, gradient and two moments, writes three); 0: the update is not timed."""
    activation_bytes_per_second: float = 0.0
    """Saved activation bytes per second of forward + backward elementwise work (norms, activations,
    softmax: ``--calibrate`` times a chain of them); 0: half the memory rate (each saved byte written in
    forward and read in backward)."""
    op_seconds: float = 0.0
    """Seconds an operator costs beyond its arithmetic, forward and backward (dispatch and autograd, on
    small tensors: ``--calibrate`` times a chain of them); 0: not timed (a GPU's launches overlap)."""
    collectives: Mapping[str, Mapping[int, tuple[tuple[int, float], ...]]] | None = None
    """Measured seconds of one collective within a node, by kind and group size: (message bytes,
    seconds) points, message as ``decisions.collective_bytes`` reads it (``--calibrate`` writes them).
    Where a collective's kind and group were measured this replaces bandwidth and latency: a small
    machine's collectives are far from linear in bytes (gloo changes algorithm with size, and ranks
    sharing cores wait for one another's time slices)."""
    crossed_collectives: Mapping[str, Mapping[int, tuple[tuple[int, float], ...]]] | None = None
    """As ``collectives``, measured with calls alternating between crossing groups of that size (a 2D
    grid's rows and columns): a grid with more than one tensor axis meets its forward and backward
    collectives so (a rank's partner in one group waits on its partner in the other)."""
    skew_seconds: float = 0.0
    """Where a node's ranks outnumber its ``cores``: how late the last rank reaches a blocking collective
    after a long stretch of compute (the scheduler runs some ranks while others wait a time slice), on top
    of the collective's own time; a collective after ``s`` seconds of compute pays ``min(s, skew_seconds)``
    (``arrival_skew``). ``--calibrate`` measures it on a CPU; 0: none."""

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Machine:
        known = {f.name for f in dataclasses.fields(Machine)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hardware fields {unknown}; expected some of {sorted(known)}")
        data = dict(data)
        for key in ("collectives", "crossed_collectives"):
            if data.get(key) is not None:
                data[key] = {kind: {int(g): tuple((int(b), float(t)) for b, t in points)
                                    for g, points in groups.items()}
                             for kind, groups in data[key].items()}
        return Machine(**data)

    @staticmethod
    def from_json(text: str) -> Machine:
        return Machine.from_dict(json.loads(text))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    def link(self, config: ParallelConfig, axis: str) -> tuple[float, float]:
        """(bytes per second, seconds per call) of a collective over ``axis`` ('batch': data x depth; 'a+b':
        several axes) of ``config``: within a node when every rank of the group is."""
        if axis == "world":  # (the per-call agreement: every rank)
            axes: tuple[str, ...] = MESH_AXES
        else:
            axes = ("data", "depth") if axis == "batch" else tuple(a for a in axis.split("+") if a)
        span = max((_stride(config, a) * config.size(a) for a in axes if config.size(a) > 1), default=1)
        if span <= self.gpus_per_node:
            return self.intra_bytes_per_second, self.intra_latency
        return self.inter_bytes_per_second, self.inter_latency

    def seconds(self, config: ParallelConfig, c: Collective) -> float:
        """One collective of ``config``'s: the measured points of its kind and group size where its group
        lies within a node (interpolated in log-log, extrapolated at the measured bandwidth), else its
        link's bandwidth and latency."""
        axis = "pipeline" if c.kind == "send" else c.axis
        crossed = c.phase != "step" and sum(config.size(a) > 1 for a in ("row", "col", "depth")) > 1
        return self.on_link(self.link(config, axis), crossed, c.kind, c.group_size, c.message_bytes)

    def on_link(self, link: tuple[float, float], crossed: bool, kind: str, group_size: int, message_bytes: int
                ) -> float:
        """``seconds`` of a collective whose group's link (``link``: bytes per second, seconds per call) and
        crossing (a forward or backward collective of a grid with two or more tensor axes) are known."""
        rate, latency = link
        points = None
        if crossed:
            points = (self.crossed_collectives or {}).get(kind, {}).get(group_size)
        points = points or (self.collectives or {}).get(kind, {}).get(group_size)
        if not points or rate != self.intra_bytes_per_second or latency != self.intra_latency:
            return float(collective_bytes(kind, group_size, message_bytes)) / rate + latency
        return interpolate(points, message_bytes)


def interpolate(points: Sequence[tuple[int, float]], size: int) -> float:
    """Seconds at ``size`` bytes from measured (bytes, seconds) points, sorted by bytes: log-log between
    points; below the first, its time; above the last, the last's time plus the bytes beyond it at the
    last two points' rate."""
    if size <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if size <= b1:
            if t0 <= 0 or t1 <= 0:
                return t0 + (t1 - t0) * (size - b0) / (b1 - b0)
            f = math.log(size / b0) / math.log(b1 / b0)
            return t0 * (t1 / t0) ** f
    (b0, t0), (b1, t1) = points[-2:] if len(points) > 1 else ((0, 0.0), points[-1])
    per_byte = max(t1 - t0, 0.0) / (b1 - b0) if b1 > b0 else 0.0
    return t1 + (size - b1) * per_byte


def _stride(config: ParallelConfig, axis: str) -> int:
    """Ranks between neighbours along ``axis`` (row-major over MESH_AXES)."""
    stride = 1
    for a in reversed(MESH_AXES):
        if a == axis:
            return stride
        stride *= config.size(a)
    raise ValueError(f"unknown mesh axis {axis!r}")
