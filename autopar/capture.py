"""Module -> graph: ``torch.export.export(strict=False)`` on a meta-device shadow of the model.

The shadow shares no storage with the model: its parameters and buffers are meta tensors with the
full (serial) shapes, so capture costs no memory and still works after the real model's parameters
were replaced by this rank's shards. Captures are per input signature; each rank captures with its
own local batch shape, so batch sizes in view/reshape ops are this rank's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export.graph_signature import InputKind as ExportInputKind
from torch.export.graph_signature import OutputKind

from autopar.errors import CaptureError, InputError
from passes.ir import BatchInfo, InputInfo, InputKind

log = logging.getLogger(__name__)
_warned = threading.local()

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


def _to_meta(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return torch.empty_like(leaf, device="meta").requires_grad_(leaf.requires_grad)
    return leaf


def capture(shadow: nn.Module, args: tuple, kwargs: dict, *, requires_grad: dict[str, bool],
            batch: BatchInfo | None) -> Captured:
    """Exports ``shadow`` on meta copies of the given (already batch-sliced) inputs.

    Args:
        requires_grad: parameter FQN -> whether the real parameter needs a gradient.
        batch: how the batch was split, recorded on the graph; None when nothing is split.
    """
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    meta_args, meta_kwargs = pytree.tree_unflatten([_to_meta(x) for x in leaves], in_spec)
    try:
        with cache_outputs(shadow, "use_cache" in meta_kwargs):
            ep = torch.export.export(shadow, tuple(meta_args), dict(meta_kwargs), strict=False)
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
    _drop_export_asserts(gm)
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
            split = is_tensor and batch is not None and leaf.dim() > 0
            info = InputInfo(kind, str(index), bool(is_tensor and leaf.requires_grad), split)
        elif kind is InputKind.PARAMETER:
            info = InputInfo(kind, spec.target, requires_grad.get(spec.target, True))
        else:
            info = InputInfo(kind, spec.target, False)
        node.meta["autopar"] = info
    gm.meta["autopar_batch"] = batch
    return Captured(gm, in_spec, ep.call_spec.out_spec, tuple(user_leaves), dict(ep.constants))


def _drop_export_asserts(gm: fx.GraphModule) -> None:
    """Removes export's dtype/device assertions (``x.to(torch.float32)`` in a model records one).

    They check the capture's own metadata; under autocast (precision bf16/fp16) an input that was
    float32 at capture is bf16 at run time, and the assertion would fail on a correct program.
    """
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        dead = [n for n in sub.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
        for n in dead:
            sub.graph.erase_node(n)
        if dead:
            sub.recompile()


@contextlib.contextmanager
def cache_outputs(shadow: nn.Module, user_chose: bool) -> Iterator[None]:
    """HuggingFace key/value caches in outputs (``use_cache``), handled the way HF itself does.

    Training: the cache is dropped (HF does the same under gradient checkpointing): the shadow's
    ``config.use_cache`` is False while it is captured, and the output's ``past_key_values`` is
    None, with one warning. Eval: HF's cache classes are registered as pytrees (with HF's own
    helper) so the cache comes back as an output, gathered like any other.
    """
    config = getattr(shadow, "config", None)
    if user_chose or not getattr(config, "use_cache", False):
        yield
        return
    if not shadow.training:
        _register_hf_caches(shadow)
        yield
        return
    if not getattr(_warned, "cache", False):
        _warned.cache = True
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            log.warning("autopar: %s returns a key/value cache (use_cache=True); it is not built in training "
                        "(past_key_values is None), as HF does under gradient checkpointing. Pass use_cache= "
                        "explicitly to choose.", type(shadow).__name__)
    # Sub-stacks may hold their own config copies (T5's decoder does).
    configs = {id(c): c for m in shadow.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def _register_hf_caches(model: nn.Module) -> None:
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:  # older transformers: the export then fails with a clear CaptureError
        return
    register_cache_pytrees_for_model(model)


def batch_leaves(leaves: list[Any]) -> tuple[frozenset[int], int]:
    """The input leaves that hold the batch, and its size: dim 0 of the first tensor input, and every
    tensor input with that dim 0."""
    tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        return frozenset(), 0
    batch = tensors[0][1].shape[0]
    return frozenset(i for i, x in tensors if x.shape[0] == batch), batch


def split_batch_leaves(leaves: list[Any], num_shards: int) -> tuple[frozenset[int], int]:
    """Which input leaves are split as the global batch (``batch_leaves``), and its size.

    Nothing is split when ``num_shards`` is 1.
    """
    split, batch = batch_leaves(leaves)
    if num_shards == 1 or not split:
        return frozenset(), 0
    if batch < num_shards:
        raise InputError(f"global batch of {batch} rows is smaller than data*depth = {num_shards}: every "
                         f"data and depth rank needs at least one row. Use a batch of at least "
                         f"{num_shards} rows or lower data/depth.")
    return split, batch


def microbatch_leaves(leaves: list[Any], config: Any, microbatches: int
                      ) -> tuple[frozenset[int], int, tuple[int, ...]]:
    """A pipeline's batch: (batch leaves, global batch, rows of each batch shard), checked to divide
    into ``microbatches`` (cut even with one batch shard)."""
    split, batch = batch_leaves(leaves)
    if not split:
        raise InputError("a pipeline needs a batch: a tensor input whose dim 0 is the batch (it is cut into "
                         "micro-batches).")
    sizes = config.batch_sizes(batch)
    if any(s % microbatches for s in sizes) or min(sizes) == 0:
        raise InputError(f"the global batch of {batch} rows gives batch shards of {sizes} rows (data x depth = "
                         f"{config.num_batch_shards}), which do not divide into microbatches={microbatches}. "
                         f"Use a global batch that is a multiple of {config.num_batch_shards * microbatches}.")
    return split, batch, sizes


def capture_shard(shadow: nn.Module, leaves: list[Any], spec: pytree.TreeSpec, split: frozenset[int],
                  sizes: tuple[int, ...], index: int, *, requires_grad: dict[str, bool],
                  segments: tuple[int, ...] = ()) -> Captured:
    """Captures the graph batch shard ``index`` runs: split leaves cut to ``sizes[index]`` rows
    (``segments``: per-rank batches, the rows each member of the shard fed)."""
    local = []
    for i, x in enumerate(leaves):
        if i in split:
            x = torch.empty((sizes[index], *x.shape[1:]), dtype=x.dtype, device="meta").requires_grad_(
                x.requires_grad)
        local.append(x)
    args, kwargs = pytree.tree_unflatten(local, spec)
    batch = BatchInfo(sum(sizes), sizes, index, segments) if split else None
    return capture(shadow, args, kwargs, requires_grad=requires_grad, batch=batch)


def real_constants(shadow: nn.Module, leaves: list[Any], spec: pytree.TreeSpec, split: frozenset[int],
                   sizes: tuple[int, ...], index: int) -> dict[str, torch.Tensor]:
    """The values of the tensor constants the model makes inside forward (``x[:, [-1]]``,
    ``torch.tensor(..., device=x.device)``), which the meta capture only has as meta tensors.

    The shadow is exported again with fake CPU tensors for its parameters, buffers and inputs (no
    memory, no compute): constants made from Python values are real there. Same inputs, same trace:
    the constants have the same names as in the meta capture.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    fake = FakeTensorMode()
    memo: dict[int, Any] = {}
    with fake:
        for t in list(shadow.parameters()) + list(shadow.buffers()):
            f = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        local = []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                shape = (sizes[index], *x.shape[1:]) if i in split else tuple(x.shape)
                x = torch.empty(shape, dtype=x.dtype, device="cpu").requires_grad_(x.requires_grad)
            local.append(x)
    copy_ = copy.deepcopy(shadow, memo)
    args, kwargs = pytree.tree_unflatten(local, spec)
    try:
        with cache_outputs(copy_, "use_cache" in kwargs):
            ep = torch.export.export(copy_, tuple(args), dict(kwargs), strict=False)
    except Exception:  # the meta capture worked; without values the caller reports the constant
        return {}
    return {k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor)}


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
