"""Small read-only facts about captured ATen graphs: shapes, owning modules, matmuls on parameters."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autopar.compat import op_schema, pytree, size_hint
from passes.ir import InputKind, input_info, sharded_embedding

aten = torch.ops.aten

_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default)


def tensor_meta(node: fx.Node) -> torch.Tensor | None:
    """The fake/meta tensor recorded for a node at capture, or None for non-tensor values."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def module_of(node: fx.Node) -> str:
    """FQN of the innermost module that produced ``node`` ('' for the root module)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path.startswith("L__self__") else path


def param_name(node: object) -> str | None:
    """The parameter FQN if ``node`` is a parameter placeholder."""
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return None
    info = input_info(node)
    return info.target if info is not None and info.kind is InputKind.PARAMETER else None


@dataclass(frozen=True, slots=True)
class MatmulMatch:
    """A matmul whose one operand is a 2-D parameter: ``y = x @ W^T (+ b)``."""

    node: fx.Node
    x: fx.Node
    weight: str
    weight_node: fx.Node
    """The node the matmul reads the weight through (the placeholder, or a transpose of it)."""
    bias: str | None
    weight_in_out: bool
    op: str
    in_features: int
    out_features: int
    module: str


def _is_transpose_2d(node: object) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _TRANSPOSES:
        return False
    if node.target is aten.permute.default:
        return list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])
    if node.target is aten.transpose.int:
        return sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]
    return True


def match_matmul(node: fx.Node) -> MatmulMatch | None:
    """Recognizes linear / addmm (HF Conv1D) / mm / matmul with a 2-D parameter as the weight."""
    if node.op != "call_function":
        return None
    target = node.target
    bias_node = None
    if target is aten.linear.default:
        x, w = node.args[0], node.args[1]
        bias_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        weight_node, in_out = w, False
    elif target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        bias_node, x, w = node.args[0], node.args[1], node.args[2]
        weight_node, in_out = w, True
    elif target in (aten.mm.default, aten.matmul.default):
        x, w = node.args[0], node.args[1]
        weight_node, in_out = w, True
    else:
        return None
    name, param_node = param_name(weight_node), weight_node
    if name is None and _is_transpose_2d(weight_node):
        param_node = weight_node.args[0]
        name = param_name(param_node)
        in_out = not in_out
    if name is None or param_name(x) is not None or not isinstance(x, fx.Node):
        return None
    wt = tensor_meta(param_node)  # the stored (in, out) or (out, in) weight
    xt = tensor_meta(x)
    if wt is None or xt is None or wt.dim() != 2 or xt.dim() < 1:
        return None
    bias = None
    if bias_node is not None:
        bias = param_name(bias_node)
        bt = tensor_meta(bias_node)
        if bias is None or bt is None or bt.dim() != 1:
            return None  # a computed or broadcast bias: leave the op alone
    in_features, out_features = (wt.shape[0], wt.shape[1]) if in_out else (wt.shape[1], wt.shape[0])
    if xt.shape[-1] != in_features:
        return None
    return MatmulMatch(node, x, name, weight_node, bias, in_out, str(target.__name__).split(".")[0],
                       int(in_features), int(out_features), module_of(node))


def find_matmuls(gm: fx.GraphModule) -> list[MatmulMatch]:
    """Every matmul on a 2-D parameter, in graph order."""
    return [m for n in gm.graph.nodes if (m := match_matmul(n)) is not None]


def param_uses(gm: fx.GraphModule) -> dict[str, int]:
    """How many ops read each parameter (through transposes too): a shared weight reads more than once."""
    uses: dict[str, int] = {}
    for node in gm.graph.nodes:
        name = param_name(node)
        if name is None:
            continue
        count = 0
        for user in node.users:
            count += len(user.users) if _is_transpose_2d(user) else 1
        uses[name] = count
    return uses


def rows_of(t: torch.Tensor) -> int:
    """Number of 'rows': every dimension but the last, multiplied."""
    n = 1
    for s in t.shape[:-1]:
        n *= int(s)
    return n


ATTENTION_STEP_FACTOR = 3.5
"""A fused attention's forward + backward FLOPs over its forward's: backward recomputes the scores and
runs four more products (dV, dP, dQ, dK), as FlashAttention and torch's CPU flash kernel do."""


def attention_flops(node: fx.Node) -> int:
    """Forward FLOPs of ``scaled_dot_product_attention``'s two products (scores ``q k^T`` and ``p v``) as
    captured (whole heads, this capture's batch); half of them where ``is_causal`` (fused kernels skip
    the masked blocks). 0 for any other node."""
    if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
        return 0
    q, k, v = (tensor_meta(a) if isinstance(a, fx.Node) else None for a in node.args[:3])
    if q is None or k is None or v is None:
        return 0
    causal = causal_attention(node)
    queries = 1
    for s in q.shape[:-1]:
        queries *= int(_hint(s))
    flops = 2 * queries * int(_hint(k.shape[-2])) * (int(_hint(q.shape[-1])) + int(_hint(v.shape[-1])))
    return flops // 2 if causal else flops


def causal_attention(node: fx.Node) -> bool:
    """Whether ``scaled_dot_product_attention`` at ``node`` is causal (``is_causal``)."""
    return bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False))


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """``node``'s input nodes, each once, in order."""
    return list(dict.fromkeys(node.all_input_nodes))


def carries_grad(node: fx.Node, requires_grad: dict[fx.Node, bool]) -> bool:
    """Whether ``node``'s value needs a gradient: an input needs one and it outputs a float tensor."""
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (list, tuple)) else (vals,)
    return (any(requires_grad.get(i, False) for i in tensor_inputs(node))
            and any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals))



def _hint(v: Any) -> Any:
    """A SymInt's example value (its size at capture), without adding a guard."""
    return size_hint(v)


def _is_symbolic(val: Any) -> bool:
    for v in pytree.tree_leaves(val):
        if isinstance(v, torch.SymInt):
            return True
        if isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride())):
            return True
    return False


def _concrete(v: Any) -> Any:
    if isinstance(v, torch.SymInt):
        return _hint(v)
    if isinstance(v, torch.Tensor):
        t = torch.empty_strided([_hint(s) for s in v.shape], [_hint(s) for s in v.stride()], dtype=v.dtype,
                                device="meta")
        return t.requires_grad_(v.requires_grad) if t.is_floating_point() or t.is_complex() else t
    return v


def sizes_fixed(gm: fx.GraphModule) -> bool:
    """Whether an analysis fixed a symbolic input size of ``gm`` (a comparison that made torch's shape
    environment replace the symbol by the capture's value): the graph then takes that size only."""
    for n in gm.graph.nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) and s.node.expr.is_number
                                                 for s in val.shape):
            return True
    return False


@contextlib.contextmanager
def hinted(gm: fx.GraphModule) -> Iterator[None]:
    """While inside, every node of ``gm`` (and its subgraphs) whose recorded value has symbolic sizes (a
    capture with dynamic dims) records an example-sized meta tensor instead: plans and estimates see the
    capture's sizes and add no guards."""
    saved = []
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            val = n.meta.get("val")
            if val is not None and _is_symbolic(val):
                saved.append((n, val))
                n.meta["val"] = pytree.tree_map(_concrete, val)
                n.meta[SYMBOLIC] = val
    try:
        yield
    finally:
        for n, val in saved:
            n.meta["val"] = val
            del n.meta[SYMBOLIC]


SYMBOLIC = "autopar_symbolic_val"
"""Inside ``hinted``: a node's recorded value with its symbolic sizes (its ``val`` holds example sizes)."""


def symbolic_dim(node: fx.Node, dim: int) -> bool:
    """Whether dim ``dim`` of ``node``'s value is symbolic (a capture for every size), inside ``hinted`` too."""
    val = node.meta.get(SYMBOLIC, node.meta.get("val"))
    return isinstance(val, torch.Tensor) and dim < val.dim() and isinstance(val.shape[dim], torch.SymInt)


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with a graph and ``meta`` of its own (nodes' recorded values shared, not copied),
    sharing its parameters and submodules: for analyses of one capture under different ``meta``."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out).meta = dict(gm.graph.output_node().meta)
    copy_ = fx.GraphModule(gm, graph)
    copy_.meta.update(gm.meta)
    return copy_


#: Norms that update running statistics in place when training with them (not in their schemas).
_RUNNING_STATS = frozenset({torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
                            torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten.instance_norm.default})


def writes_state(node: fx.Node) -> bool:
    """Whether running ``node`` changes state that outlives the call, so running it again (a recomputed
    block) would change it twice: an op that writes in place into a graph input (a buffer such as BatchNorm's
    ``num_batches_tracked``, a parameter, an input) or a view of one, or a norm that updates its running
    statistics."""
    return bool(written_inputs(node))


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The graph inputs (placeholders) ``node`` writes in place: through views, and a training norm's running
    statistics (which its schema does not mark)."""
    t = node.target
    if node.op != "call_function":
        return []
    schema = op_schema(t)
    if t in _RUNNING_STATS:
        values = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value))
                  for i, a in enumerate(schema.arguments)}
        if not values.get("training", values.get("use_input_stats", False)):
            return []
        written = [values.get("running_mean"), values.get("running_var")]
    elif schema is None or not schema.is_mutable:
        return []
    else:
        written = [node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                   for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    out = []
    for x in written:
        while isinstance(x, fx.Node) and x.op == "call_function" and x.args and isinstance(x.args[0], fx.Node) \
                and _is_view(x.target):
            x = x.args[0]
        if isinstance(x, fx.Node) and x.op == "placeholder":
            out.append(x)
    return out


def _is_view(target: Any) -> bool:
    schema = op_schema(target)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None and \
        not schema.returns[0].alias_info.is_write


def storage_root(node: Any) -> Any:
    """The node whose storage ``node`` shares: through views, ``getitem`` of a split and in-place ops (each
    returns its first argument's storage)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is operator.getitem:
            node = node.args[0]
            continue
        schema = op_schema(node.target)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None or not node.args \
                or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    return node


class InPlaceWrites:
    """Where a graph's in-place ops write: a reader of a value written after it was made (DeepSeek's MLA fills
    ``new_empty`` with two ``copy_``) must read it after the writes, not where it was made."""

    def __init__(self, graph: fx.Graph) -> None:
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.at: dict[fx.Node, list[int]] = {}
        for n in graph.nodes:
            schema = op_schema(n.target) if n.op == "call_function" else None
            if schema is None or not schema.is_mutable:
                continue
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                    if isinstance(v, fx.Node):
                        self.at.setdefault(storage_root(v), []).append(self.position[n])

    def between(self, producer: fx.Node, consumer: fx.Node) -> bool:
        """Whether an in-place op writes ``producer``'s storage after it and before ``consumer``."""
        start, end = self.position.get(producer), self.position.get(consumer)
        if start is None or end is None:
            return False
        return any(start < p < end for p in self.at.get(storage_root(producer), ()))


def token_lookups(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(embedding, its token ids) for each lookup of ids that come from a user input and hold a sequence (static
    length, last dim): where context parallelism cuts the tokens (``passes.split_context``)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.embedding.default, sharded_embedding):
            continue
        ids = node.args[1]
        val = tensor_meta(ids) if isinstance(ids, fx.Node) else None
        if val is None or val.dim() < 2 or not isinstance(val.shape[-1], int) or not _from_user(ids):
            continue
        out.append((node, ids))
    return out


def token_split_nodes(gm: fx.GraphModule, ranks: int) -> frozenset[fx.Node]:
    """The nodes that hold this rank's tokens under context parallelism over ``ranks``: every node computed from a
    token lookup (``token_lookups``). Whole-sequence tensors made apart from them (rotary tables, position ids,
    labels) stay whole and are cut where they meet split ones; an op that reads the whole sequence back
    (``context_gather``) is counted split too. Empty where ``passes.split_context`` leaves the graph whole: lookups of
    different lengths, or a length that does not divide into ``2 * ranks`` chunks."""
    lookups = token_lookups(gm)
    lengths = {int(tensor_meta(ids).shape[-1]) for _, ids in lookups}
    if ranks <= 1 or len(lengths) != 1 or next(iter(lengths)) % (2 * ranks):
        return frozenset()
    todo = [node for node, _ in lookups]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen or n.op == "output":
            continue
        seen.add(n)
        todo.extend(n.users)
    return frozenset(seen)


def _from_user(node: fx.Node) -> bool:
    """Whether ``node`` is computed from a user input."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            info = input_info(n)
            if info is not None and info.kind is InputKind.USER:
                return True
        todo.extend(n.all_input_nodes)
    return False
