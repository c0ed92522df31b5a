"""estimate_memory's meta run on graphs eager runs: it sees eager's strides, and an op it cannot run
degrades the estimate with one log line instead of stopping the plan (and the training that needs it)."""

from __future__ import annotations

import logging

import pytest
import torch

from autopar.capture import capture_shard, meta_shadow, split_batch_leaves
from autopar.compat import pytree
from autopar.config import ParallelConfig
from autopar.examples.titan_llama import TitanLlama, TitanLlamaArgs
from passes.analysis import estimate_memory as em
from passes.analysis.batch_dims import analyze_batch
from passes.analysis.make_plan import make_plan

aten = torch.ops.aten
LOGGER = "passes.analysis.estimate_memory"


def _captured(config: ParallelConfig, **args):
    torch.manual_seed(0)
    model = TitanLlama(TitanLlamaArgs(**args))
    leaves, spec = pytree.tree_flatten(((torch.randint(0, 96, (4, 16)),), {}))
    split, batch = split_batch_leaves(leaves, config.num_batch_shards)
    cap = capture_shard(meta_shadow(model), leaves, spec, split, config.batch_sizes(batch) if split else (), 0,
                        requires_grad={n: True for n, _ in model.named_parameters()})
    return cap.gm, make_plan(cap.gm, config)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("args", [{}, {"fuse_qkv": False, "enable_gqa": False, "token_major": True}],
                         ids=["enable_gqa", "repeat_kv"])
def test_estimate_memory_sees_eager_strides_after_attention(args, caplog):
    # The capture keeps SDPA's output in the query's layout (CPU's fused kernel) and drops the model's
    # ``.contiguous()`` before ``.view(bs, seqlen, -1)``; meta's SDPA is contiguous, so the view failed there.
    gm, plan = _captured(ParallelConfig(data=2, row=2), **args)
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert sdpa.meta["val"].transpose(1, 2).is_contiguous()  # eager's layout: (B, L, N, H) in memory
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        profile = em.estimate_memory(gm, plan)
    assert _warnings(caplog) == []  # every op ran: nothing degraded
    blocks = [s for s in profile.segments if s.checkpointable]
    assert len(blocks) == 2 and all(s.saved_bytes > 0 for s in blocks)


def _math_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's math path: contiguous output whatever the query's layout (meta's SDPA before torch picked
    a kernel per device; the estimate ran it for ``enable_gqa``)."""
    return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale,
                                                   enable_gqa=enable_gqa)[0]


def test_an_op_whose_meta_kernel_lays_out_otherwise_gets_eager_strides(caplog):
    gm, plan = _captured(ParallelConfig(data=2, row=2))
    for n in gm.graph.nodes:
        if n.target is aten.scaled_dot_product_attention.default:
            n.target = _math_attention  # its recorded value keeps eager's (query's) layout
    gm.recompile()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        em.estimate_memory(gm, plan)  # the view after it raised on meta before the strides were restored
    assert _warnings(caplog) == []


def _fails_on_meta(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "meta":
        raise NotImplementedError("no meta kernel")
    return torch.nn.functional.silu(x)


def test_a_node_the_estimate_cannot_run_degrades_with_one_log_line(caplog):
    gm, plan = _captured(ParallelConfig(data=1, row=2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        whole = em.estimate_memory(gm, plan)
    silus = [n for n in gm.graph.nodes if n.target is aten.silu.default]
    for n in silus:
        n.target = _fails_on_meta
    gm.recompile()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        degraded = em.estimate_memory(gm, plan)  # raised NotImplementedError before the fallback
    lines = _warnings(caplog)
    assert len(lines) == 1 and silus[0].name in lines[0] and f"of {len(silus)} op(s)" in lines[0], lines
    # The stand-ins carry the recorded shapes and gradients on: only what the silus save goes uncounted.
    saved = [s.saved_bytes for s in whole.segments], [s.saved_bytes for s in degraded.segments]
    assert all(0 < d <= w for w, d in zip(*saved) if w) and saved[0] != saved[1]
    assert degraded.static_bytes == whole.static_bytes


def test_a_graph_the_meta_run_cannot_take_gets_the_shape_only_estimate(caplog, monkeypatch):
    gm, plan = _captured(ParallelConfig(data=1, row=2))

    def broken(_gm):
        raise RuntimeError("cannot make the inputs")
    monkeypatch.setattr(em, "_meta_inputs", broken)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        profile = em.estimate_memory(gm, plan)
    lines = _warnings(caplog)
    assert len(lines) == 1 and "shapes only" in lines[0] and "cannot make the inputs" in lines[0]
    assert all(s.saved_bytes > 0 for s in profile.segments if s.checkpointable)


def test_rotary_complex_views_keep_the_batch_split():
    # view_as_complex / view_as_real of (B, T, N, H/2, 2): rows stay in dim 0; a gather there ran the
    # rest of the attention on the whole batch, against sizes captured for this rank's rows.
    gm, _ = _captured(ParallelConfig(data=2))
    assert not analyze_batch(gm).gathers


@pytest.mark.parametrize("tensor", [(2, 1, 1), (1, 1, 2)], ids=["row", "depth"])
def test_compiled_recompute_keeps_only_each_blocks_inputs(tensor):
    """Under compile=True a recomputed block issues its collectives again, as eagerly
    (``passes.insert_checkpoints.recomputed`` marks them for torch's partitioner): a checkpointed block keeps its
    inputs only, so full recompute plans the same activations compiled or not; only the gradients a compiled
    piece returns at once differ. (Measured: tests/distributed/test_compiled.py, compiled recompute's saved
    bytes.)"""
    from autopar.planning.planner import PlanOptions, choose_memory

    gm, plan = _captured(ParallelConfig(1, *tensor))
    profile = em.estimate_memory(gm, plan)
    compiled = em.compiled_recompute(profile)
    assert compiled.segments == profile.segments
    eager_all = choose_memory(profile, plan, PlanOptions("full"))
    compiled_all = choose_memory(profile, plan, PlanOptions("full", compiled=True))
    assert compiled_all.activation_bytes == eager_all.activation_bytes


def test_compiled_backward_counts_one_pieces_whole_gradients_under_shard_optimizer():
    """Under shard_optimizer the eager sync holds the chunks plus at most three buckets of whole gradients (each
    gradient arrives as its layer's backward ran). A compiled backward is cut in pieces of a bucket's worth of
    gradients (``autopar.runtime.compiled.pieces``), each returning its gradients at once: ``compiled_recompute``
    counts one piece's whole gradients besides, a bucket and one parameter (autograd's copy as it lays one out
    like its parameter). Uncut, every whole gradient lived at once (48 layers of 4 MiB at data 4: 328 MiB of heap
    at the peak measured, 202 in pieces, 170 eagerly). Without the split nothing changes."""
    config = ParallelConfig(data=4, shard_optimizer=True)
    gm, plan = _captured(config, dim=512, n_layers=8)  # (93 MiB of gradients: more than three buckets)
    profile = em.estimate_memory(gm, plan)
    whole = sum(p.local_numel(config) * 4 for p in plan.params)
    chunks = profile.optimizer_bytes // 2
    assert profile.grad_bytes == em.scattered_grad_bytes(chunks, whole) < chunks + whole
    largest = max(p.local_numel(config) * 4 for p in plan.params)
    assert em.compiled_recompute(profile).grad_bytes == profile.grad_bytes + 25 * 2**20 + largest < \
        profile.grad_bytes + whole
    gm, plan = _captured(ParallelConfig(data=4), dim=512, n_layers=8)
    profile = em.estimate_memory(gm, plan)
    assert em.compiled_recompute(profile).grad_bytes == profile.grad_bytes == whole


def test_blocks_that_update_running_statistics_are_never_recomputed():
    """BatchNorm's running statistics and ``num_batches_tracked`` update in place: recomputed, they would
    update twice (and backward saw ``num_batches_tracked`` change under it)."""
    from tests.unlike_models import ResNet

    torch.manual_seed(0)
    model, config = ResNet(), ParallelConfig(2)
    leaves, spec = pytree.tree_flatten(((torch.randn(8, 3, 8, 8),), {}))
    split, batch = split_batch_leaves(leaves, config.num_batch_shards)
    cap = capture_shard(meta_shadow(model), leaves, spec, split, config.batch_sizes(batch), 0,
                        requires_grad={n: True for n, _ in model.named_parameters()})
    profile = em.estimate_memory(cap.gm, make_plan(cap.gm, config))
    blocks = [s for s in profile.segments if s.name.startswith("blocks.")]
    assert [s.name for s in blocks] == ["blocks.0", "blocks.1"] and not any(s.checkpointable for s in blocks)


class _NarrowValues(torch.nn.Module):
    """Attention whose values are narrower than its queries and keys (DeepSeek's MLA: 128 against 192 per head)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Linear(16, 2 * 4 * 12)
        self.v = torch.nn.Linear(16, 4 * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, 2, 4, 12).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(b, s, 4, 4).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_narrower_values_keep_the_scores_on_a_cpu_and_not_on_a_gpu():
    """On a CPU torch runs such an attention on the math path, which keeps the scores (2 x 4 heads x 64 x 64); on a
    GPU its memory-efficient kernel keeps q, k, v, the output and the log-sum-exp only: the memory plan of a GPU
    target counts that (DeepSeek-V3 on H100s planned 8 GiB of scores per layer and sequence before)."""
    model = _NarrowValues()
    leaves, spec = pytree.tree_flatten(((torch.randn(2, 64, 16),), {}))
    cap = capture_shard(meta_shadow(model), leaves, spec, {}, (), 0,
                        requires_grad={n: True for n, _ in model.named_parameters()})
    plan = make_plan(cap.gm, ParallelConfig(1))
    cpu, gpu = (sum(s.saved_bytes for s in em.estimate_memory(cap.gm, plan, device=d).segments) for d in ("cpu", "cuda"))
    scores = 2 * 4 * 64 * 64 * 4
    assert cpu > scores and cpu - gpu > scores // 2, (cpu, gpu)  # (the math path keeps the scores' softmax)
    assert gpu < scores, gpu  # (q, k, v, the output, the log-sum-exp: 75,800 B)


class _WideHead(torch.nn.Module):
    """A small input times a large parameter read through a transpose (a view: nothing allocated)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4096, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.t()).sum(-1)


def test_a_view_of_a_parameter_is_no_transient_of_its_segment():
    """A segment's transient peak counts what its ops allocate: ``w.t()`` of a 256 KiB parameter allocates
    nothing (DeepSeek-V3's transposed 3-D expert weights, 28 GiB whole, made its MoE block's peak 56 GiB).
    Mutation: count the view: the peak is twice the parameter."""
    from autopar.capture import capture

    model = _WideHead()
    gm = capture(meta_shadow(model), (torch.randn(2, 16),), {}, requires_grad={"w": True}, batch=None).gm
    profile = em.estimate_memory(gm, make_plan(gm, ParallelConfig(1)))
    weight = 4096 * 16 * 4
    assert max(s.peak_bytes for s in profile.segments) < weight, profile.segments
