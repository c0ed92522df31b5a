"""Module -> graph: ``torch.export.export(strict=False)`` on a fake-tensor copy of a meta shadow of the model.

The shadow shares no storage with the model: its parameters and buffers are meta tensors with the
full (serial) shapes, so capture costs no memory and still works after the real model's parameters
were replaced by this rank's shards. Each capture exports a copy of it whose parameters, buffers and
inputs are fake tensors on the device the model runs on, so tensors the model makes inside forward
meet them as in the real model. Captures are per input signature; each rank captures with its own
local batch shape, so batch sizes in view/reshape ops are this rank's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx, nn
# export's own check of inputs against an ExportedProgram's ranges and shared symbols (torch-internal: the
# public path, ExportedProgram.module(), would wrap the graph autopar rewrites)
from torch.export.graph_signature import InputKind as ExportInputKind
from torch.export.graph_signature import OutputKind

from autopar.compat import FakeTensorMode, fx_without_stack_traces, pytree
from autopar.custom_functions import kept_during_capture, unwrap_calls
from autopar.errors import CaptureError, InputError
from autopar.hf_caches import cache_outputs
from passes.analysis.batch_dims import analyze_batch
from passes.analysis.row_extents import RowExtents, compare_rows
from passes.causal_attention import MAX_ELEMENTS, causal_attention
from passes.ir import BatchInfo, InputInfo, InputKind, Sharding, record_graph_info

log = logging.getLogger(__name__)

_KINDS = {
    ExportInputKind.PARAMETER: InputKind.PARAMETER,
    ExportInputKind.BUFFER: InputKind.BUFFER,
    ExportInputKind.CONSTANT_TENSOR: InputKind.CONSTANT,
    ExportInputKind.USER_INPUT: InputKind.USER,
}


@dataclass
class Captured:
    """One captured graph and how to call it."""

    gm: fx.GraphModule
    in_spec: pytree.TreeSpec
    """Tree structure of the (args, kwargs) it was captured with."""
    out_spec: pytree.TreeSpec
    user_leaves: tuple[int, ...]
    """For each USER placeholder, its index among the flattened (args, kwargs) leaves."""
    constants: dict[str, Any]
    accepts: Callable[[list[Any]], bool] | None = None
    """Captured with dynamic dims: whether input leaves of these sizes fit the graph (None: static)."""
    twice: fx.GraphModule | None = None
    """The same call captured with twice this shard's rows, where the batch analysis needed it to tell which
    values hold rows (``capture_shard``)."""


def _acceptor(ep: Any) -> Callable[[list[Any]], bool]:
    """A check that input leaves fit a graph captured with symbolic sizes: each dim static or in its
    symbol's range, symbols that must agree agree, sizes that are expressions of symbols (``s0 + 1``) equal
    them (export's own input check, compiled once: it costs a sympy substitution per dim and call), then
    the guards export recorded on the inputs (relations such as mask length = cache length + 1). autopar
    runs the graph module, not the ExportedProgram, so nothing else would check them."""
    sig = ep.graph_signature
    users = [n for n, spec in zip([n for n in ep.graph.nodes if n.op == "placeholder"], sig.input_specs)
             if spec.kind is ExportInputKind.USER_INPUT]
    vals = [n.meta.get("val") for n in users]
    env = next((d.node.shape_env for v in vals if isinstance(v, torch.Tensor) for d in v.shape
                if isinstance(d, torch.SymInt)), None)
    symbols: dict[sympy.Symbol, tuple[int, int]] = {}
    static: list[tuple[int, int, int]] = []  # (leaf, dim, size)
    derived: list[tuple[int, int, sympy.Expr]] = []
    for i, v in enumerate(vals):
        if not isinstance(v, torch.Tensor):
            continue
        for d, size in enumerate(v.shape):
            if not isinstance(size, torch.SymInt):
                static.append((i, d, int(size)))
            elif isinstance(size.node.expr, sympy.Symbol) and size.node.expr not in symbols:
                symbols[size.node.expr] = (i, d)
            else:
                derived.append((i, d, size.node.expr))
    names = list(symbols)
    where = [symbols[n] for n in names]
    bounds = []
    for n in names:
        r = ep.range_constraints.get(n)
        lo = int(r.lower) if r is not None and isinstance(r.lower, sympy.Integer) else 0  # (int_oo: unbounded)
        hi = int(r.upper) if r is not None and isinstance(r.upper, sympy.Integer) else None
        bounds.append((lo, hi))
    modules = [{"Min": min, "Max": max}, "math"]
    sizes_of = [(i, d, sympy.lambdify(names, e, modules=modules)) for i, d, e in derived]
    compiled: list[Any] = []

    def guards() -> tuple[Any, list[tuple[int, int]]]:
        """Read at the first check, after autopar's analyses and passes ran on the graph: one that fixed a
        size (``int()`` of a symbolic one, or a comparison: the batch analysis's entries per row) left its
        guard here, or replaced the symbol by its value (then the graph takes that value only)."""
        if not compiled:
            exprs = [env.replace(g.expr) for g in env.guards] if env is not None else []
            # a symbol the environment replaced (by its value, or by another symbol's expression: two sizes an
            # analysis compared and found equal) must equal what replaced it
            exprs += [sympy.Eq(n, r) for n in names if env is not None and (r := env.replace(n)) != n
                      and not r.is_number]
            exprs = [g for g in exprs if g.free_symbols and g.free_symbols <= set(names)]
            fixed = [(k, int(r)) for k, n in enumerate(names) if env is not None and (r := env.replace(n)).is_number]
            compiled.append((sympy.lambdify(names, sympy.And(*exprs), modules=modules) if exprs else None, fixed))
        return compiled[0]

    def accepts(leaves: list[Any]) -> bool:
        if any(leaves[i].shape[d] != size for i, d, size in static):
            return False
        values = [int(leaves[i].shape[d]) for i, d in where]
        if any(v < lo or (hi is not None and v > hi) for v, (lo, hi) in zip(values, bounds, strict=True)):
            return False
        if any(int(leaves[i].shape[d]) != int(size(*values)) for i, d, size in sizes_of):
            return False
        check, fixed = guards()
        if any(values[k] != value for k, value in fixed):
            return False
        return check is None or bool(check(*values))

    return accepts


def meta_shadow(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors of the same shapes."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:
        raise CaptureError(f"cannot copy {type(model).__name__} to the meta device for capture ({e}). "
                           "autopar needs models to be deep-copyable.") from e


def _fake_copy(shadow: nn.Module, leaves: list[Any], device: torch.device | str) -> tuple[nn.Module, list[Any]]:
    """A copy of the meta ``shadow`` whose parameters and buffers, and the tensor ``leaves``, are fake
    tensors on ``device`` (one FakeTensorMode, which torch.export then uses)."""

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    with fake:
        for t in list(shadow.parameters()) + list(shadow.buffers()):
            f = torch.empty(t.shape, dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        out = [torch.empty(x.shape, dtype=x.dtype, device=device).requires_grad_(x.requires_grad)
               if isinstance(x, torch.Tensor) else x for x in leaves]
    return copy.deepcopy(shadow, memo), out


def symbolic_dims(model: nn.Module, leaves: list[Any], rows: Mapping[int, int] | None = None,
                  split: bool = False, sequence: bool = True) -> dict[int, dict[int, Any]]:
    """The input dims a call is captured with as symbolic sizes (leaf index -> {dim: Dim.AUTO}),
    so that one graph serves every size of them:

    - the batch dim of the leaves in ``rows`` (leaf -> batch dim: given when the batch is not split over
      ranks), for every model;
    - the sequence dim of token ids and masks (dim 1 of 2-D integer tensors); for HF generating models
      also of float 2-D tensors and of key/value cache tensors (dim 2 of 4-D ones), so one graph serves
      every prompt length and decode step.

    Size 1 stays static (a call of size 1 is captured as it is: export would specialize it, with a
    warning); export keeps static whatever the model fixes, and ``Captured.accepts`` says which sizes a
    graph takes. With ``split`` (data x depth split the batch, each rank's graph sees its rows) the rows of
    every batch leaf are one symbol, as they are one number: the batch analysis follows them through the
    inputs alike (export would give each input its own). ``sequence=False`` keeps the sequence dims static
    (context parallelism's training graphs: a graph per length, each split over the context ranks)."""
    generating = getattr(model, "can_generate", lambda: False)()
    out: dict[int, dict[int, Any]] = {}
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor) or not sequence:
            continue
        if generating and x.dim() == 4 and x.is_floating_point():
            out[i] = {2: torch.export.Dim.AUTO}
        elif x.dim() == 2 and x.shape[1] > 1 and (generating or not x.is_floating_point()):
            out[i] = {1: torch.export.Dim.AUTO}
    together = torch.export.Dim("rows", min=2)
    for i, d in (rows or {}).items():
        if split or leaves[i].shape[d] > 1:
            out.setdefault(i, {})[d] = together if split else torch.export.Dim.AUTO
    return out


def _flat_export(copy_: nn.Module, fake_leaves: list[Any], in_spec: pytree.TreeSpec,
                 dynamic: Mapping[int, dict[int, Any]]) -> Any:
    """Exports ``copy_`` called on the flattened input leaves with ``dynamic`` as export's dynamic shapes.

    The throwaway copy's class becomes a subclass whose forward takes the leaves and rebuilds (args,
    kwargs): export takes no dynamic shapes for a forward's ``**kwargs`` (HF's ``return_dict``), and one
    spec per leaf fits any signature. Parameter names do not change; the user inputs are the leaves in
    order, as with a plain export.
    """
    cls = type(copy_)

    def forward(self: nn.Module, *flat: Any) -> Any:
        args, kwargs = pytree.tree_unflatten(list(flat), in_spec)
        return cls.forward(self, *args, **kwargs)

    copy_.__class__ = type(cls.__name__, (cls,), {"forward": forward})
    dims = tuple(dynamic.get(i) for i in range(len(fake_leaves)))
    return torch.export.export(copy_, tuple(fake_leaves), strict=False, dynamic_shapes=(dims,))


def capture(shadow: nn.Module, args: tuple, kwargs: dict, *, requires_grad: dict[str, bool],
            batch: BatchInfo | None, split: Mapping[int, int] | None = None,
            device: torch.device | str = "cpu", dynamic: Mapping[int, dict[int, Any]] | None = None,
            arrived: Mapping[int, Sharding] | None = None, mask_elements: int = MAX_ELEMENTS) -> Captured:
    """Exports ``shadow`` on fake copies of the given (already batch-sliced) inputs.

    Parameters, buffers and inputs are fake tensors on ``device`` (the device the model runs on): no
    memory, no compute, and tensors the model makes inside forward without a device (``torch.ones(n)``)
    or from Python values (``x[:, [-1]]``) meet them as they would in the real model; such constants
    keep their values.

    Args:
        requires_grad: parameter FQN -> whether the real parameter needs a gradient.
        batch: how the batch was split, recorded on the graph; None when nothing is split.
        split: the input leaves that hold the batch: leaf index -> its batch dim.
        dynamic: input dims captured as symbolic sizes: leaf index -> {dim: Dim} (``symbolic_dims``).
        arrived: input leaves that arrive as this rank's piece (``autopar.runtime.execution.kept_state``): index -> layout.
    """
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    copy_, fake_leaves = _fake_copy(shadow, leaves, device)
    fake_args, fake_kwargs = pytree.tree_unflatten(fake_leaves, in_spec)
    try:
        with cache_outputs(copy_, "use_cache" in fake_kwargs), kept_during_capture():
            if not dynamic:
                ep = torch.export.export(copy_, tuple(fake_args), dict(fake_kwargs), strict=False)
            else:
                ep = _flat_export(copy_, fake_leaves, in_spec, dynamic)
    except CaptureError:
        raise
    except Exception as e:
        raise CaptureError(
            f"torch.export could not capture {type(shadow).__name__} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). autopar needs a model torch.export can trace "
            "with strict=False; data-dependent control flow is the usual cause.") from e
    sig = ep.graph_signature
    bad = [o for o in sig.output_specs if o.kind is not OutputKind.USER_OUTPUT]
    if bad:
        raise CaptureError(f"{type(shadow).__name__}.forward mutates state ({', '.join(f'{o.kind.name} {o.target}' for o in bad)}). "
                           "autopar does not yet support in-place buffer updates (e.g. BatchNorm running stats); "
                           "use a model without them or put it in eval mode.")
    gm = ep.graph_module
    changed = unwrap_calls(gm)  # a custom autograd Function: one call of it, its own backward
    changed |= _drop_export_asserts(gm)
    # HF's causal mask, materialized under tracing, back to is_causal (``mask_elements``: the largest mask it
    # evaluates on CPU to tell)
    changed |= causal_attention(gm, max_elements=mask_elements).changed
    if changed:  # (once: ~17 ms of a ~0.5 s capture for a 2-layer HF model)
        gm.recompile()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user_leaves: list[int] = []
    for node, spec in zip(placeholders, sig.input_specs, strict=True):
        kind = _KINDS.get(spec.kind)
        if kind is None:
            raise CaptureError(f"unsupported graph input kind {spec.kind.name} for {spec.target!r}.")
        if kind is InputKind.USER:
            index = len(user_leaves)  # export lists every (args, kwargs) leaf as a user input, in order
            user_leaves.append(index)
            leaf = leaves[index]
            is_tensor = isinstance(leaf, torch.Tensor)
            dim = (split or {}).get(index) if batch is not None else None
            info = InputInfo(kind, str(index), bool(is_tensor and leaf.requires_grad), dim is not None, dim or 0,
                             (arrived or {}).get(index))
        elif kind is InputKind.PARAMETER:
            info = InputInfo(kind, spec.target, requires_grad.get(spec.target, True))
        else:
            info = InputInfo(kind, spec.target, False)
        node.meta["autopar"] = info
    record_graph_info(gm, batch=batch)
    accepts = _acceptor(ep) if dynamic else None
    return Captured(gm, in_spec, ep.call_spec.out_spec, tuple(user_leaves), dict(ep.constants), accepts)


def _drop_export_asserts(gm: fx.GraphModule) -> bool:
    """Removes export's dtype/device assertions (``x.to(torch.float32)`` in a model records one).

    They check the capture's own metadata; under autocast (precision bf16/fp16) an input that was
    float32 at capture is bf16 at run time, and the assertion would fail on a correct program. Recompiles
    the submodules it changed; returns whether it changed ``gm``'s own graph (its caller recompiles it).
    """
    changed = False
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        dead = [n for n in sub.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
        for n in dead:
            sub.graph.erase_node(n)
        if dead and sub is gm:
            changed = True
        elif dead:
            sub.recompile()
    return changed


def without_stack_traces() -> contextlib.AbstractContextManager:
    """Captures inside record no source line per node: for graphs that are only analysed (the trace and the
    plan search), where they cost a sixth of a capture (a no-op on a torch without the switch, 2.11-2.12).
    Graphs that run keep them: an error inside one names the model's line."""
    return fx_without_stack_traces()


def input_names(args: tuple, kwargs: dict, spec: pytree.TreeSpec | None = None) -> list[int | str]:
    """For each flattened (args, kwargs) leaf, the input it belongs to: a position or a keyword. ``spec``: the
    TreeSpec of ``(args, kwargs)`` flattened, read instead of flattening again (a decode step's cache is
    hundreds of leaves through HF's flatten)."""
    if spec is not None and spec.num_children == 2:
        positional, named = spec.children()
        if positional.type is tuple and named.type is dict:
            out: list[int | str] = [i for i, child in enumerate(positional.children()) for _ in range(child.num_leaves)]
            out += [key for key, child in zip(named.context, named.children()) for _ in range(child.num_leaves)]
            return out
    paths = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
    out = []
    for path, _ in paths:
        top = path[1] if len(path) > 1 else path[0]
        out.append(getattr(top, "idx", getattr(top, "key", None)))
    return out


def batch_leaves(leaves: list[Any], names: Sequence[int | str] | None = None,
                 declared: Mapping[int | str, int | None] | None = None) -> tuple[dict[int, int], int]:
    """The input leaves that hold the batch (leaf index -> its batch dim) and the batch size.

    By default dim 0 of the first tensor input is the batch, and so is dim 0 of every tensor input with
    that size. ``declared`` (``auto_parallelize(batch_dims=...)``) gives inputs, by position or keyword
    (``names[i]`` is leaf i's), their batch dim, or None for an input that holds no batch; the batch size
    is then the first declared input's, and undeclared inputs follow the default rule with it.
    """
    tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.dim() > 0]
    dims: dict[int, int] = {}
    batch = None
    undeclared = []
    for i, x in tensors:
        name = names[i] if names is not None else None
        if declared is not None and name in declared:
            d = declared[name]
            if d is None:
                continue
            if not -x.dim() <= d < x.dim():
                raise InputError(f"batch_dims gives input {name!r} batch dim {d}, but it has shape {tuple(x.shape)}.")
            d %= x.dim()
            if batch is None:
                batch = int(x.shape[d])
            elif x.shape[d] != batch:
                raise InputError(f"batch_dims gives input {name!r} a batch of {x.shape[d]} rows along dim {d}; the "
                                 f"other batch inputs have {batch}.")
            dims[i] = d
        else:
            undeclared.append((i, x))
    if batch is None and undeclared:
        batch = int(undeclared[0][1].shape[0])
    for i, x in undeclared:
        if x.shape[0] == batch:
            dims[i] = 0
    return dims, batch or 0


def split_batch_leaves(leaves: list[Any], num_shards: int, names: Sequence[int | str] | None = None,
                       declared: Mapping[int | str, int | None] | None = None,
                       found: tuple[dict[int, int], int] | None = None) -> tuple[dict[int, int], int]:
    """Which input leaves are split as the global batch (``batch_leaves``, or ``found``: its result), and
    its size.

    Nothing is split when ``num_shards`` is 1.
    """
    split, batch = found if found is not None else batch_leaves(leaves, names, declared)
    if num_shards == 1 or not split:
        return {}, 0
    if batch < num_shards:
        first = min(split)
        what = f"input {names[first]!r}" if names is not None else "the first input"
        raise InputError(
            f"global batch of {batch} rows ({what}, dim {split[first]}, shape {tuple(leaves[first].shape)}) is smaller "
            f"than data*depth = {num_shards}: every data and depth rank needs at least one row. Use a batch of at "
            f"least {num_shards} rows or lower data/depth. If that dim is not a batch (one packed sequence of "
            "tokens), declare where the batch is with auto_parallelize(batch_dims={name: dim or None}), feed each "
            "rank its own sequences (batch='per-rank'), or use data=1 and depth=1.")
    return split, batch


def microbatch_leaves(leaves: list[Any], config: Any, microbatches: int, names: Sequence[int | str] | None = None,
                      declared: Mapping[int | str, int | None] | None = None
                      ) -> tuple[dict[int, int], int, tuple[int, ...]]:
    """A pipeline's batch: (batch leaves, global batch, rows of each batch shard), checked to divide
    into ``microbatches`` (cut even with one batch shard)."""
    split, batch = batch_leaves(leaves, names, declared)
    if not split:
        raise InputError("a pipeline needs a batch: a tensor input whose dim 0 is the batch (it is cut into "
                         "micro-batches).")
    if any(d != 0 for d in split.values()):
        raise InputError("a pipeline cuts the batch into micro-batches along dim 0, but batch_dims puts it in "
                         f"another dim ({sorted(set(split.values()))}). Use pipeline=1, or inputs with the batch first.")
    sizes = config.batch_sizes(batch)
    if any(s % microbatches for s in sizes) or min(sizes) == 0:
        raise InputError(f"the global batch of {batch} rows gives batch shards of {sizes} rows (data x depth = "
                         f"{config.num_batch_shards}), which do not divide into microbatches={microbatches}. "
                         f"Use a global batch that is a multiple of {config.num_batch_shards * microbatches}.")
    return split, batch, sizes


def capture_shard(shadow: nn.Module, leaves: list[Any], spec: pytree.TreeSpec, split: Mapping[int, int],
                  sizes: tuple[int, ...], index: int, *, requires_grad: dict[str, bool],
                  segments: tuple[int, ...] = (), device: torch.device | str = "cpu",
                  dynamic: Mapping[int, dict[int, Any]] | None = None,
                  arrived: Mapping[int, Sharding] | None = None) -> Captured:
    """Captures the graph batch shard ``index`` runs: split leaves cut to ``sizes[index]`` rows along their
    batch dim (``segments``: per-rank batches, the rows each member of the shard fed).

    Where the batch analysis finds ops it cannot follow the rows through (it gathers them, or runs them on
    each rank's rows) in a graph of static sizes, the call is captured again with twice the rows and each op's
    sizes compared (``passes.analysis.row_extents``): what holds rows is then known of every value."""

    def rows_of(n: int, mask_elements: int = MAX_ELEMENTS) -> Captured:
        local = []
        for i, x in enumerate(leaves):
            if i in split:
                shape = list(x.shape)
                shape[split[i]] = n
                x = torch.empty(shape, dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)
            local.append(x)
        args, kwargs = pytree.tree_unflatten(local, spec)
        batch = BatchInfo(sum(sizes), sizes, index, segments) if split else None
        return capture(shadow, args, kwargs, requires_grad=requires_grad, batch=batch, split=split, device=device,
                       dynamic=dynamic, arrived=arrived, mask_elements=mask_elements)

    captured = rows_of(sizes[index] if split else 0)
    if not split or not sizes[index] or RowExtents(captured.gm).known:
        return captured
    facts = analyze_batch(captured.gm)
    if not facts.gathers and not facts.local_starts:
        return captured
    try:
        # (its masks are the first capture's at twice the rows: the same ones turn causal, or the graphs differ)
        twice = rows_of(2 * sizes[index], 2 * MAX_ELEMENTS)
    except CaptureError as e:
        twice, why = None, f"a capture with twice the rows failed ({e})"
    else:
        why = "" if compare_rows(captured.gm, twice.gm) else "its graph changes with the number of rows"
    if why and facts.local_starts:  # (without it, nothing says where such a region's results hold the rows)
        raise CaptureError(f"{type(shadow).__name__} runs ops on each rank's rows that autopar cannot split ("
                           f"{'; '.join(facts.notes()[-1:])}), and {why}, so autopar cannot tell where their "
                           "results hold the rows")
    return dataclasses.replace(captured, twice=twice.gm if twice is not None else None)


# Per-block attributes that name the block's position, not its behaviour.
_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "block_idx"})


def _signature(block: nn.Module) -> tuple:
    """What makes two blocks behave alike: module types, plain attributes, parameter and buffer shapes."""
    out = []
    for name, m in block.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in _INDEX_ATTRS
                             and isinstance(v, (bool, int, float, str, type(None), tuple))))
        tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                        for n, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)))
        out.append((name, type(m).__qualname__, attrs, tensors))
    return tuple(out)


def repeated_blocks(model: nn.Module, *, min_count: int = 5) -> list[tuple[str, int, int]]:
    """ModuleLists of alike blocks, outermost only: (FQN, first index from which all blocks are alike, count)."""
    found: list[tuple[str, int, int]] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < min_count:
            continue
        if any(name.startswith(f + ".") for f, _, _ in found):
            continue
        signatures = [_signature(b) for b in m]
        start = next((i for i in range(len(m)) if all(s == signatures[i] for s in signatures[i:])), len(m))
        if len(m) - start >= min_count:
            found.append((name, start, len(m)))
    return found


@contextlib.contextmanager
def truncated_blocks(model: nn.Module, lists: list[tuple[str, int, int]]) -> Iterator[None]:
    """``model`` with each listed ModuleList cut after three alike blocks (``start + 3``); always restored.

    Three, because the first block may still differ in layout (its input comes from the embedding):
    the second and third must agree for the third to stand for the rest.
    """
    saved = []
    try:
        for name, start, _ in lists:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            full = getattr(parent, attr)
            saved.append((parent, attr, full))
            setattr(parent, attr, nn.ModuleList(list(full)[:start + 3]))
        yield
    finally:
        for parent, attr, full in reversed(saved):
            setattr(parent, attr, full)
