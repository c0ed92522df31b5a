"""split_stages on a captured model: stage submodules called in order compute what the graph did."""

from __future__ import annotations

import copy

import torch
from torch import fx

from autopar.compat import pytree
from autopar.capture import capture_shard, meta_shadow
from autopar.config import ParallelConfig
from autopar.examples import zoo
from autopar.runtime.execution.binding import retarget_device
from autopar.planning.planner import plan_model
from passes.ir import InputKind, input_info
from passes.split_stages import split_stages


def _on_cpu(gm: fx.GraphModule) -> fx.GraphModule:
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule):
            for node in sub.graph.nodes:
                node.args = retarget_device(node.args, torch.device("cpu"))
                node.kwargs = retarget_device(node.kwargs, torch.device("cpu"))
            sub.recompile()
    return gm


def _run(gm: fx.GraphModule, model: torch.nn.Module, leaves: list) -> tuple[torch.Tensor, dict]:
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    flat = []
    for node in gm.graph.nodes:
        info = input_info(node)
        if node.op != "placeholder":
            continue
        flat.append({InputKind.PARAMETER: params, InputKind.BUFFER: buffers}.get(info.kind, {}).get(info.target)
                    if info.kind is not InputKind.USER else leaves[int(info.target)])
    out = gm(*flat)[0]
    out.square().mean().backward()
    return out.detach(), {n: p.grad for n, p in params.items() if p.grad is not None}


def test_stages_called_in_order_give_the_outputs_and_gradients_of_the_graph():
    torch.manual_seed(0)
    model = zoo.build_model("llama", layers=6)
    args = zoo.example_inputs("llama", batch=4, seq=16)
    with torch.device("meta"):
        meta = zoo.build_model("llama", layers=6)
    plan = plan_model(meta, args, ParallelConfig(), pipeline=3)[0]
    leaves, spec = pytree.tree_flatten((args, {}))
    shadow = meta_shadow(model)
    captured = capture_shard(shadow, leaves, spec, frozenset(), (), 0,
                             requires_grad={n: True for n, _ in model.named_parameters()})
    whole = _on_cpu(copy.deepcopy(captured.gm))
    result = split_stages(captured.gm, plan)
    assert result.changed
    staged = result.gm
    staged.recompile()
    calls = [n.target for n in staged.graph.nodes if n.op == "call_module"]
    assert calls == ["stage_0", "stage_1", "stage_2"]
    for k, st in enumerate(plan.pipeline.stages):  # each stage holds the linears of its own blocks only
        sub = getattr(staged, f"stage_{k}")
        blocks = {n for n in st.segments if n.startswith("model.layers.")}
        seen = {n.meta["nn_module_stack"] and list(n.meta["nn_module_stack"].values())[-1][0]
                for n in sub.graph.nodes if n.op == "call_function" and n.meta.get("nn_module_stack")}
        assert all(any(m.startswith(b) for b in blocks) for m in seen if m.startswith("model.layers."))
    staged = _on_cpu(staged)
    want, want_grads = _run(whole, model, leaves)
    got, got_grads = _run(staged, model, leaves)
    assert torch.equal(got, want)
    assert want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        # split_stages sinks weight conversions next to their users, which reorders autograd nodes;
        # the embedding's gradient then sums the same contributions in another order (~1e-7).
        err = ((got_grads[name] - g).norm() / g.norm()).item()
        assert err < 1e-6, (name, err)
