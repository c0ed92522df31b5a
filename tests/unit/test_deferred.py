"""The recording and replay of construction (autopar/runtime/construction/record.py) in one process: every way a
module's init writes its tensors gives serial's values bit for bit, and the generator ends where serial
construction leaves it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.runtime.construction.record import Deferred, DeferredInitError


def _replayed(model: nn.Module, deferred: Deferred) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    deferred.replay(deferred.sinks(model), lambda sink, values: got.update({k: v.clone() for k, v in values.items()}))
    return got


class Inits(nn.Module):
    """Init idioms: views of a parameter, foreach ops, a generator, data-free buffers, tying, re-init."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 6)
        self.emb = nn.Embedding(10, 6, padding_idx=0)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight                                      # tied
        self.scale = nn.Parameter(torch.empty(6))
        g = torch.Generator().manual_seed(7)
        self.register_buffer("noise", torch.randn(3, generator=g))              # an explicit generator
        self.register_buffer("positions", torch.arange(0, 12, 2).float() / 12)  # no randomness
        self.register_buffer("table", torch.tensor([1.0, 2.0, 3.0]))            # from Python data
        with torch.no_grad():
            self.a.weight[:, :3].mul_(0.5)                                      # a view, read and written
            torch._foreach_mul_([self.a.bias, self.b.bias], 2.0)                # foreach over a list
            nn.init.trunc_normal_(self.b.weight, std=0.02)                      # skips meta in torch
            nn.init.orthogonal_(self.scale.view(2, 3))                          # on a view of the storage
            self.emb.weight.normal_()                                           # re-init: the first is dead
            self.emb.weight[self.emb.padding_idx].zero_()


@pytest.mark.parametrize("meta", [False, True])
def test_every_init_idiom_replays_bit_for_bit(meta):
    torch.manual_seed(0)
    serial = Inits()
    after = torch.rand(5)
    torch.manual_seed(0)
    deferred = Deferred()
    with deferred:
        with torch.device("meta") if meta else torch.device("cpu"):
            model = Inits()
    assert all(t.device.type == "meta" for t in model.parameters())
    deferred.roots = lambda: [model]
    deferred.settle_if_kept()  # (auto_parallelize's block end) the model keeps its meta tensors
    assert torch.equal(torch.rand(5), after)  # the generator is where serial construction left it
    got = _replayed(model, deferred)
    want = dict(serial.named_parameters(remove_duplicate=False))
    want.update(serial.named_buffers())
    assert torch.equal(model.table, want.pop("table"))  # torch.tensor(data) stays real: its data is the value
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    before = torch.get_rng_state()
    _replayed(model, deferred)
    assert torch.equal(torch.get_rng_state(), before)  # replay leaves the generator alone


def test_random_ops_serial_runs_on_meta_move_the_generator_only_if_their_tensors_are_kept():
    """A loader (HF from_pretrained) builds on meta and replaces every tensor by a loaded one: serial's
    generator never moves, so the recording's must not either (and no scratch init runs). A model kept
    on meta gets a plain build's values, and a random op on real tensors after it draws what it draws
    after a plain build."""
    torch.manual_seed(2)
    plain = nn.Linear(8, 8)
    after_plain = torch.rand(3)
    torch.manual_seed(2)
    start = torch.get_rng_state()
    deferred = Deferred()
    with deferred:
        with torch.device("meta"):
            loaded = nn.Linear(8, 8)
        loaded.weight = nn.Parameter(torch.ones(8, 8))  # "from the checkpoint", real
        loaded.bias = nn.Parameter(torch.zeros(8))
        deferred.roots = lambda: [loaded]
        deferred.settle_if_kept()
    assert torch.equal(torch.get_rng_state(), start)
    assert deferred.unsettled  # (dead: never replayed)

    torch.manual_seed(2)
    deferred = Deferred()
    with deferred:
        with torch.device("meta"):
            kept = nn.Linear(8, 8)
        deferred.roots = lambda: [kept]
        drawn = torch.tensor([0.0, 0.0, 0.0]).uniform_()  # a real random op: serial's meta inits come first
    assert torch.equal(drawn, after_plain)
    got = _replayed(kept, deferred)
    assert torch.equal(got["weight"], plain.weight) and torch.equal(got["bias"], plain.bias)


def test_two_models_replay_independently_in_any_order():
    torch.manual_seed(1)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    torch.manual_seed(1)
    deferred = Deferred()
    with deferred:
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    got_b, got_a = _replayed(b, deferred), _replayed(a, deferred)
    assert all(torch.equal(got_a[k], v) for k, v in first.state_dict().items())
    assert all(torch.equal(got_b[k], v) for k, v in second.state_dict().items())


def test_dead_inits_are_skipped_and_values_freed_early():
    """A module re-initialized after construction: the first init never runs in the replay."""
    deferred = Deferred()
    with deferred:
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        for m in model:
            nn.init.normal_(m.weight)
    sinks = deferred.sinks(model)
    live = deferred.live_ops(sinks)
    uniform = [i for i in live if deferred.ops[i].func is torch.ops.aten.uniform_.default]
    assert len(uniform) == 4  # the biases' kaiming bounds; the weights' first uniform_ is dead


class ReadsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        if self.lin.weight.sum() > 0:
            self.flip = True


def test_reading_tensor_data_while_building_names_the_module():
    with pytest.raises(DeferredInitError, match=r"ReadsData \(at .*test_deferred\.py:\d+\)"):
        with Deferred():
            ReadsData()
    with pytest.raises(DeferredInitError, match="defer_init=False"):
        with Deferred():
            ReadsData()
