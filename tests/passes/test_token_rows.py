"""``passes.analysis.token_rows``: a routed-experts module computes each token from that token alone, so under
context parallelism it runs on this rank's tokens. On a routing written as transformers writes it (sort by expert,
rows taken at the sort's positions ``// k``, put back by the sort's inverse), the subset's rows equal the whole's;
routings that would not (positions from an ``arange`` of the whole, a statistic over the rows, positions divided by
what is not the picks per token) are refused with the op named. On the captured MoE families, every grouped-matmul
experts module runs on this rank's tokens under ``split_context`` (no gather of the sequence), with whole experts,
experts split over data, or each split over a tensor axis; Llama 4's batched experts read the tokens whole, with a
note."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import passes.ir as ir
from autopar.capture import capture_shard, meta_shadow, split_batch_leaves
from autopar.compat import pytree
from autopar.config import ParallelConfig
from autopar.examples import moe_zoo
from autopar.planning.planner import PlanOptions, decide_plan
from autopar.runtime.execution.builder import PASSES
from passes.analysis.graph_facts import module_of
from passes.analysis.token_rows import ExpertBlock, LocalBlock, expert_blocks, local_rows
from passes.runner import run_passes

TOKENS, K = 8, 2


def hf_routing(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' grouped-matmul experts' moves of rows, with a row-wise op in place of the grouped matmuls."""
    vals, perm = ids.reshape(-1).sort()
    y = x[perm // K] * 2 + vals.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return y[inv].view(x.shape[0], K, -1).sum(1)


def by_arange(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # row i takes row i // 2 of the whole
    return x[torch.arange(x.shape[0]) // 2] + ids[:, :1]


def centered(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # a statistic over the rows
    return x - x.mean(0) + ids[:, :1]


def wrong_grain(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # picks' positions // 3 with 2 per token
    _, perm = ids.reshape(-1).sort()
    return x[perm // 3]


def _block(fn):
    x, ids = torch.randn(TOKENS, 4), torch.randint(0, 3, (TOKENS, K))
    gm = make_fx(fn)(x, ids)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    block = ExpertBlock("experts", tuple(n for n in gm.graph.nodes if n.op == "call_function"))
    return gm, local_rows(block, {inputs[0]: 1, inputs[1]: 1}, TOKENS), (x, ids)


def test_transformers_routing_gives_a_subset_of_tokens_the_wholes_rows():
    gm, found, (x, ids) = _block(hf_routing)
    assert isinstance(found, LocalBlock), found
    assert list(found.exits.values()) == [1]
    assert sorted(n.target.__name__ for n in found.sized) == ["arange.default", "view.default"]
    whole = gm(x, ids)
    for n in found.sized:  # (as split_context makes them: this half's sizes)
        if n.target is torch.ops.aten.arange.default:
            n.args = (n.args[0] // 2, *n.args[1:])
        else:
            n.args = (n.args[0], [n.args[1][0] // 2, *n.args[1][1:]], *n.args[2:])
    gm.recompile()
    for half in (slice(0, TOKENS // 2), slice(TOKENS // 2, TOKENS)):
        assert torch.equal(gm(x[half], ids[half]), whole[half])


@pytest.mark.parametrize("fn, why", [(by_arange, "divides something other than positions"),
                                     (centered, "sums over the rows"),
                                     (wrong_grain, "divides something other than positions")])
def test_routings_a_subset_would_change_are_refused(fn, why):
    _, found, _ = _block(fn)
    assert isinstance(found, str) and why in found, found


def _emitted(name: str, config: ParallelConfig):
    torch.manual_seed(0)
    model = moe_zoo.build_model(name)
    (ids,) = moe_zoo.example_inputs(name, batch=4, seq=16)
    leaves, spec = pytree.tree_flatten(((ids,), {"labels": ids, "use_cache": False}))
    split, batch = split_batch_leaves(leaves, config.num_batch_shards)
    cap = capture_shard(meta_shadow(model), leaves, spec, split, config.batch_sizes(batch) if split else (), 0,
                        requires_grad={n: True for n, _ in model.named_parameters()})
    blocks = expert_blocks(cap.gm)
    plan = decide_plan(cap.gm, config, PlanOptions(checkpoint="none"))
    gm, records = run_passes(cap.gm, plan, PASSES)
    found = Counter(n.target for n in gm.graph.nodes)
    # (what reads the whole sequence: attention written out (gpt-oss's sinks, DeepSeek's MLA), outputs)
    whole = {module_of(n.args[0]) for n in gm.graph.nodes if n.target is ir.context_gather}
    return blocks, found, [n for r in records if r.name == "split_context" for n in r.notes], whole


GROUPED = [n for n in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "olmoe", "granitemoe", "glm4_moe",
                       "deepseek_v3") if n in moe_zoo.NAMES]


@pytest.mark.parametrize("name", GROUPED)
def test_every_grouped_matmul_family_routes_this_ranks_tokens(name):
    blocks, _, notes, whole = _emitted(name, ParallelConfig(context=2))
    assert blocks and all("self_attn reads the whole sequence" in n for n in notes), notes
    assert all(m.endswith("self_attn") for m in whole), whole  # (no experts, no router read the whole sequence)
    # (what does is said: gpt-oss's attention with sinks written out as matmuls, DeepSeek's MLA)
    assert bool(notes) == bool(whole), (notes, whole)


@pytest.mark.parametrize("grid", [dict(data=2, context=2, expert_parallel=True),
                                  dict(context=2, row=2), dict(context=2, row=2, expert_parallel="data+tensor")])
def test_split_experts_route_this_ranks_tokens(grid):
    _, found, notes, whole = _emitted("mixtral", ParallelConfig(**grid))
    assert not notes and whole <= {""}, (notes, whole)  # (at data=2, the logits gathered for the output)
    if grid.get("expert_parallel"):
        assert found[ir.expert_dispatch] == found[ir.expert_combine] == 2


@pytest.mark.skipif("llama4" not in moe_zoo.NAMES, reason="this transformers has no Llama 4")
def test_batched_experts_split_op_by_op_and_read_every_token_for_an_exchange():
    """Llama 4's batched experts (``[experts, tokens, hidden]`` blocks: ``repeat`` of the tokens, ``bmm`` by
    whole weights) and its complex rotary split op by op: nothing reads the whole sequence, no note. Split over
    data, the exchange of the blocks reads every token (exact, C times the experts' work; before 2026-12-05 it
    was refused), said in a note per layer."""
    _, _, notes, whole = _emitted("llama4", ParallelConfig(context=2))
    assert not notes and not whole, (notes, whole)
    _, found, notes, whole = _emitted("llama4", ParallelConfig(data=2, context=2, expert_parallel=True))
    assert sum("feed_forward.experts computes the tokens of every context rank" in n for n in notes) == 2, notes
    assert whole - {""} and all(m.endswith("feed_forward.experts") for m in whole - {""}), whole  # ("": outputs)
    assert found[ir.expert_dispatch] == found[ir.expert_combine] == 2


def test_modules_that_read_the_whole_sequence_are_said_once_per_kind():
    """JetMoE (its routers sort the tokens, its attention's queries come from experts by index): one note per
    kind of module, the repeated layers' indices as ``*``."""
    if "jetmoe" not in moe_zoo.NAMES:
        pytest.skip("this transformers has no JetMoE")
    _, _, notes, whole = _emitted("jetmoe", ParallelConfig(context=2))
    assert any(n.startswith("context=2: model.layers.*.mlp.router reads the whole sequence (")
               for n in notes), notes
    assert len(notes) == len({module.replace(".0.", ".*.").replace(".1.", ".*.") for module in whole}), (notes, whole)
