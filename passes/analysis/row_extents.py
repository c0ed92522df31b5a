"""Which dims of each value of a captured graph scale with the batch rows.

The batch analysis follows the rows op by op (``batch_rules``). Where it cannot (a sort of the rows, an
index by data, a view that buries them), it still has to know which values hold rows and where: a value
made for this rank's rows (``arange(n_tokens)``) must not meet the whole batch's, and a reduction of a value
whose layout it lost completes over the batch only if it covers every dim that holds rows.

Two sources, the same answer:

- a graph captured with a symbolic row count: a dim holds rows when its size mentions that symbol;
- a graph captured with a static row count: the capture is repeated with twice the rows and each op's
  output sizes compared (``compare_rows`` records ``passes.ir.RowsInfo`` on each op). A model whose graph
  changes with the row count (other ops) records nothing: the analysis then knows no more than before.

Pure: functions of the graphs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autopar.compat import OpOverload, size_hint
from passes.ir import RowsInfo, graph_info, input_info, record_graph_info, rows_info

#: An output's row dims: the dims of a tensor whose size scales with the rows (empty: it holds none),
#: or None where nothing is known.
RowDims = tuple[int, ...] | None


def _outputs(node: fx.Node) -> tuple[Any, ...]:
    val = node.meta.get("val")
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def compare_rows(gm: fx.GraphModule, other: fx.GraphModule) -> bool:
    """Records on each op of ``gm`` the dims of its output(s) whose sizes differ in ``other``, the same model
    captured with more rows. Returns False (records nothing) when the two graphs are not the same ops (a
    ``contiguous`` copy one of them makes and the other does not aside: ``_layout_only``)."""
    mine, theirs = list(gm.graph.nodes), list(other.graph.nodes)
    copies: list[fx.Node] = []
    if not _same_ops(mine, theirs):  # compared without their contiguous copies, which take their input's rows
        copies = [n for n in mine if _layout_only(n)]
        mine, theirs = [n for n in mine if not _layout_only(n)], [n for n in theirs if not _layout_only(n)]
        if not _same_ops(mine, theirs):
            return False
    found: list[tuple[fx.Node, RowsInfo]] = []
    for a, b in zip(mine, theirs):
        if a.op != "call_function":
            continue
        va, vb = _outputs(a), _outputs(b)
        if len(va) != len(vb):
            return False
        dims: list[tuple[int, ...] | None] = []
        for x, y in zip(va, vb):
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                dims.append(None)
                continue
            if x.dim() != y.dim():
                return False
            dims.append(tuple(d for d, (s, t) in enumerate(zip(x.shape, y.shape)) if _differs(s, t)))
        found.append((a, RowsInfo(tuple(dims))))
    of = dict(found)
    for copy in copies:  # (in graph order: a copy of a copy finds its input's)
        source = copy.args[0] if copy.args else None
        if source in of:
            of[copy] = of[source]
            found.append((copy, of[source]))
    for node, info in found:
        if node.meta.get("autopar") is None:
            node.meta["autopar"] = info
    record_graph_info(gm, rows_compared=True)
    return True


def _same_ops(mine: list[fx.Node], theirs: list[fx.Node]) -> bool:
    return len(mine) == len(theirs) and all(_same_op(a, b) for a, b in zip(mine, theirs))


def _layout_only(node: fx.Node) -> bool:
    """A ``contiguous`` copy: where a capture of one row has none (a slice across a dim of size one is
    contiguous already, so the op traces to nothing: HF's shifted labels), the capture with more rows has it;
    it changes no value, so a comparison that fails with it is tried without it."""
    return node.op == "call_function" and node.target is torch.ops.aten.contiguous.default


def _differs(s: Any, t: Any) -> bool:
    """Whether a size differs between the two captures: compared by their example values where symbolic (a
    length captured for every size is a symbol of each capture's own); one the data decides (an unbacked
    size: ``split`` by ``.tolist()``) is taken to hold rows."""
    try:
        return int(size_hint(s)) != int(size_hint(t))
    except Exception:  # noqa: BLE001  (no example value: data-dependent)
        return True


def _same_op(a: fx.Node, b: fx.Node) -> bool:
    """Whether two nodes of two captures of one model do the same: the same op (a submodule's or a captured
    call's name and object differ between captures; their kind does not)."""
    if a.op != b.op:
        return False
    if a.op in ("get_attr", "call_module", "placeholder", "output") or a.target == b.target:
        return True
    return type(a.target) is type(b.target) and not isinstance(a.target, OpOverload) and \
        getattr(a.target, "__name__", None) == getattr(b.target, "__name__", None)


def _symbol(gm: fx.GraphModule) -> Any:
    """The symbol of this rank's row count where ``gm`` was captured with a symbolic one, else None."""
    for node in gm.graph.nodes:
        info = input_info(node) if node.op == "placeholder" else None
        if info is not None and info.batch_split:
            val = node.meta.get("val")
            size = val.shape[info.batch_dim] if isinstance(val, torch.Tensor) else None
            if isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None:
                return size.node.expr
            return None
    return None


class RowExtents:
    """Reads which dims of a value hold rows, from ``RowsInfo`` or from a symbolic row count."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.symbol = _symbol(gm)
        self.compared = graph_info(gm).rows_compared

    @property
    def known(self) -> bool:
        return self.symbol is not None or self.compared

    def of(self, node: Any, index: int | None = None) -> RowDims:
        """The row dims of ``node``'s output (``index``: of its ``index``-th output), or None if unknown."""
        if not isinstance(node, fx.Node):
            return ()
        vals = _outputs(node)
        i = 0 if index is None else index
        if i >= len(vals) or not isinstance(vals[i], torch.Tensor):
            return ()
        if self.symbol is not None:
            return tuple(d for d, s in enumerate(vals[i].shape)
                         if isinstance(s, torch.SymInt) and self.symbol in s.node.expr.free_symbols)
        info = rows_info(node)
        if info is not None and i < len(info.dims):
            return info.dims[i]
        if node.op == "placeholder":
            inp = input_info(node)
            return (inp.batch_dim,) if inp is not None and inp.batch_split else ()
        return None
