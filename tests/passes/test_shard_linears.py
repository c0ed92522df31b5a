"""shard_linears and make_plan on captured graphs, in one process (no process groups)."""

from __future__ import annotations

import torch
import torch.nn as nn

from autopar.compat import pytree
from autopar.capture import capture_shard, meta_shadow, split_batch_leaves
from autopar.config import ParallelConfig
from autopar.decisions import Layout, Orientation
from autopar.runtime.ops.layouts import ConvertOp
from autopar.runtime.ops.matmul import MatmulOp
from autopar.runtime.ops.rows import BatchRows, GatherOutputOp
from autopar.examples.fc_net import FC_Net
from passes.analysis.make_plan import make_plan
from passes.ir import REPLICATED, ConvertSpec, Sharding, convert_layout, gather_output, sharded_matmul
from passes.runner import run_passes
from passes.shard_linears import shard_linears
from tests.helpers import SMALL, rel_err

aten = torch.ops.aten


def captured(model: nn.Module, x: torch.Tensor, config: ParallelConfig):
    leaves, spec = pytree.tree_flatten(((x,), {}))
    split, batch = split_batch_leaves(leaves, config.num_batch_shards)
    sizes = config.batch_sizes(batch) if split else ()
    return capture_shard(meta_shadow(model), leaves, spec, split, sizes, 0,
                         requires_grad={n: True for n, _ in model.named_parameters()})


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_fc_net_plan_alternates_orientations_and_converts_only_at_layernorm():
    config = ParallelConfig(data=1, row=2, col=2, depth=1)
    cap = captured(FC_Net(**SMALL), torch.randn(8, 1, 8, 8), config)
    plan = make_plan(cap.gm, config)
    o = {m.weight: m.orientation for m in plan.matmuls}
    for i in range(SMALL["num_layers"]):
        fc1, fc2 = o[f"layers.{i}.fc1.weight"], o[f"layers.{i}.fc2.weight"]
        assert {fc1, fc2} == {Orientation.NORMAL, Orientation.TRANSPOSED}
        assert fc2 is o["embed.weight"], "the residual branch must end in the stream's layout"
    gm, records = run_passes(cap.gm, plan, [shard_linears])
    assert len(calls(gm, sharded_matmul)) == 2 * SMALL["num_layers"] + 2
    assert not calls(gm, aten.linear.default)
    gathers = [n for n in calls(gm, convert_layout) if n.args[1].dst.is_replicated]
    assert [u.target for n in gathers for u in n.users] == [aten.layer_norm.default] * SMALL["num_layers"]
    for add in calls(gm, aten.add.Tensor):
        assert all(a.target is sharded_matmul for a in add.args if a.op == "call_function" and a.target
                   is not aten.add.Tensor), "no re-layout at the residual add"
    assert len(calls(gm, gather_output)) == 1
    assert records[0].name == "shard_linears" and records[0].changed


def test_layer_that_cannot_be_split_stays_replicated_with_reason():
    """10 classes over 8 ranks: even pieces do not exist, and uneven ones (2+2+2+2+2+0+0+0) would leave ranks
    empty."""
    config = ParallelConfig(data=1, row=8, col=8, depth=1)
    cap = captured(FC_Net(**SMALL), torch.randn(4, 1, 8, 8), config)
    plan = make_plan(cap.gm, config)
    clf = plan.matmul("clf.weight")
    assert clf.orientation is Orientation.REPLICATED
    assert "out_features 10 not divisible by row=8" in clf.reason
    assert any("clf.weight stays replicated" in n for n in plan.notes)
    assert "clf.weight" in plan.summary()


def test_a_head_that_does_not_divide_splits_unevenly_and_the_plan_says_so():
    """10 classes over row=4 at (4, 4): the output head splits 3+3+3+1 (DTensor's Shard pieces)."""
    config = ParallelConfig(data=1, row=4, col=4, depth=1)
    cap = captured(FC_Net(**SMALL), torch.randn(4, 1, 8, 8), config)
    plan = make_plan(cap.gm, config)
    clf = plan.matmul("clf.weight")
    assert clf.orientation is Orientation.OUT_ROW and not clf.reason
    assert "split unevenly over row=4: 3+3+3+1" in plan.summary()


def test_addmm_conv1d_and_mm_weights_are_matched():
    class Conv1DLike(nn.Module):  # HF GPT-2 style: weight stored (in, out), addmm
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 32))
            self.bias = nn.Parameter(torch.zeros(32))
            self.proj = nn.Parameter(torch.randn(8, 32))

        def forward(self, x):
            h = torch.addmm(self.bias, x, self.weight)
            return h @ self.proj.t()

    config = ParallelConfig(data=1, row=2, col=2, depth=1)
    cap = captured(Conv1DLike(), torch.randn(4, 16), config)
    plan = make_plan(cap.gm, config)
    by = {m.weight: m for m in plan.matmuls}
    assert by["weight"].op == "addmm" and by["weight"].weight_in_out and by["weight"].bias == "bias"
    assert (by["weight"].in_features, by["weight"].out_features) == (16, 32)
    assert not by["proj"].weight_in_out and (by["proj"].in_features, by["proj"].out_features) == (32, 8)
    assert by["weight"].orientation is not Orientation.REPLICATED
    assert by["proj"].orientation is not by["weight"].orientation, "chained matmuls alternate"


class _OneRank:
    """A mesh of one rank: every group has size 1, so bound ops issue no collective."""

    def size(self, axis):
        return 1

    def index(self, axis):
        return 0

    def group(self, axis):
        return None


def test_identity_at_degree_one_changes_no_number():
    config = ParallelConfig()
    torch.manual_seed(0)
    model = FC_Net(**SMALL)
    x = torch.randn(5, 1, 8, 8)
    cap = captured(model, x, config)
    plan = make_plan(cap.gm, config)
    gm, _ = run_passes(cap.gm, plan, [shard_linears])
    mesh = _OneRank()
    for n in gm.graph.nodes:
        if n.target is sharded_matmul:
            n.target, n.args = MatmulOp(n.args[3], mesh).__call__, n.args[:3]
        elif n.target is convert_layout:
            n.target, n.args = ConvertOp(n.args[1], mesh).__call__, n.args[:1]
        elif n.target is gather_output:
            n.target, n.args = GatherOutputOp(n.args[1], mesh, BatchRows(())).__call__, n.args[:1]
    gm.recompile()
    params = dict(model.named_parameters())
    # The runtime stores a sharded weight as its depth rank's rows of its block; at degree 1, the whole weight.
    local = {pp.name: params[pp.name].detach().clone().requires_grad_() for pp in plan.params}
    flat = [local[n.meta["autopar"].target] if n.meta["autopar"].kind == "parameter" else x
            for n in gm.graph.nodes if n.op == "placeholder"]
    (out,) = gm(*flat)
    expected = model(x)
    assert rel_err(out, expected) < 1e-6
    out.sum().backward()
    expected.sum().backward()
    assert all(rel_err(local[k].grad, p.grad) < 1e-6 for k, p in params.items())


def test_convert_spec_prints_as_code():
    spec = ConvertSpec(Sharding(Layout.ROW, 2, (8, 8)), REPLICATED)
    assert repr(spec) == ("ConvertSpec(src=Sharding(layout=Layout.ROW, dim=2, parts=(8, 8)), "
                          "dst=Sharding(layout=Layout.REPLICATED, dim=-1, parts=()), partial_grad=False)")
    assert eval(repr(spec), {"ConvertSpec": ConvertSpec, "Sharding": Sharding, "Layout": Layout}) == spec
