"""find_expert_layers: the routed-experts layers of every grouped-matmul MoE family, and where one cannot split."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture, meta_shadow
from autopar.examples import moe_zoo
from passes.analysis.experts import find_expert_layers

aten = torch.ops.aten


def _captured(name: str):
    torch.manual_seed(0)
    model = moe_zoo.build_model(name)
    (ids,) = moe_zoo.example_inputs(name, batch=8, seq=16)
    return capture(meta_shadow(model), (ids,), {"use_cache": False},
                   requires_grad={n: True for n, _ in model.named_parameters()}, batch=None).gm


@pytest.mark.parametrize("name", [n for n in ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3") if n in moe_zoo.NAMES])
def test_every_grouped_matmul_family_has_splittable_expert_layers(name):
    layers = find_expert_layers(_captured(name))
    dense_first = name == "deepseek_v3"  # (its first layer is dense)
    assert len(layers) == 2 - dense_first
    for layer in layers:
        assert not layer.why_whole, layer.why_whole
        assert layer.experts == 4 and len(layer.matmuls) == 2
        assert {w.rsplit(".", 1)[1] for w in layer.weights} == {"gate_up_proj", "down_proj"}
        assert layer.output is layer.matmuls[-1] and layer.matmuls[0] in layer.region
        assert int(layer.rows.meta["val"].shape[0]) == 8 * 16 * 2  # every token once per pick (top 2)
        # gpt-oss adds an expert bias taken by row between the matmuls: it travels with the rows
        assert len(layer.inputs) == (name == "gpt_oss")
        assert not any(n.target is aten.transpose.int for n in layer.region)  # weights are read, not moved


def test_a_layer_reducing_over_its_rows_is_not_split():
    """Mutation: the activation between the grouped matmuls made a softmax over the rows (dim 0): each row's result
    would depend on the others, which other ranks hold."""
    gm = _captured("mixtral")
    layer = find_expert_layers(gm)[0]
    silu = next(n for n in layer.region if n.target is aten.silu.default)
    silu.target, silu.args = aten._softmax.default, (silu.args[0], 0, False)
    assert "is not row-wise" in find_expert_layers(gm)[0].why_whole
