"""What an unchanged script does with the parameters: shapes, counts, weight-decay groups, clipping.

The oracle is the serial model with the same seed, data and clipping. Clipping is active in every
case (max_norm below the gradients' norm), so a norm computed on one rank's pieces only clips by
another factor and the losses and parameters leave serial's within a step; the mutation case runs
such a local norm and the checks must catch it. Replicated pieces (LayerNorm weights, biases over
data, a tied embedding on two pipeline stages) must stay bitwise equal on every rank holding them.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

import autopar
from autopar.examples.fc_net import FC_Net
from autopar.examples.nanogpt import GPT, GPTConfig
from autopar.runtime.params.layout import local_of
from tests.helpers import SMALL, batches, rel_err

TOL = 1e-5  # float32 sums in another order: ~1e-7 per step; a wrong clip factor moves losses by 1e-3 and more
PARAM_TOL = 1e-4
"""Per tensor after 3 AdamW steps: Adam divides each element's update by its own gradient scale, so
roundoff in gradients that are zero in exact arithmetic (attention key biases) gives 2e-5 relative
differences in those tensors; the whole parameter vector must still agree to TOL."""
MAX_NORM = 0.05  # below every step's gradient norm here: the clip is active at every step
STEPS = 3


def _nanogpt() -> GPT:  # lm_head ties transformer.wte: one parameter, two uses (on two pipeline stages)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))


def _token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(STEPS)]


MODELS = {"fc_net": (lambda: FC_Net(**SMALL), lambda: batches(steps=STEPS, batch=16, last=16)),
          "nanogpt": (_nanogpt, _token_batches)}


def _clip(params: list[torch.Tensor], variant: str) -> float | None:
    """The script's own clipping, one torch.nn.utils call per variant."""
    U = torch.nn.utils
    if variant == "value":
        U.clip_grad_value_(params, 0.01)
        return None
    if variant == "total-norm":  # get_total_norm + clip_grads_with_norm_ (torch >= 2.6)
        norm = U.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
        U.clip_grads_with_norm_(params, MAX_NORM, norm)
        return float(norm)
    kind, _, foreach = variant.partition("/")
    norm_type = {"l2": 2.0, "l1": 1.0, "inf": math.inf}[kind]
    return float(U.clip_grad_norm_(params, MAX_NORM / (10 if kind == "inf" else 1), norm_type=norm_type,
                                   foreach={"": None, "foreach": True, "loop": False}[foreach]))


def _train(model: torch.nn.Module, name: str, variant: str, pipeline: int = 1) -> tuple[list[float], list]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for x, y in MODELS[name][1]():
        if pipeline > 1:
            loss = autopar.train_step(model, x, y, F.cross_entropy)
        else:
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
        norms.append(_clip(list(model.parameters()), variant))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def serial(name: str, variant: str) -> tuple[list[float], list, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    losses, norms = _train(model, name, variant)
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def _digests(model: torch.nn.Module) -> dict[tuple, str]:
    """(name, the mesh, this rank's coordinates where the tensor is split) -> hash of its local piece."""
    out = {}
    for name, p in model.named_parameters():
        local = local_of(p)
        if isinstance(p, DTensor):
            if type(local).__name__ == "Absent":
                continue
            coord = p.device_mesh.get_coordinate()
            where = (tuple(p.device_mesh.mesh.flatten().tolist()),
                     tuple(c for c, pl in zip(coord, p.placements) if not isinstance(pl, Replicate)))
        else:
            where = ((), ())
        out[(name, *where)] = hashlib.sha1(local.detach().contiguous().numpy().tobytes()).hexdigest()
    return out


def clip_worker(cases: list[tuple], mutate: bool = False) -> list[dict]:
    if mutate:  # the mutation: every rank clips by the norm of its own pieces only
        from autopar.runtime.interop import norms
        norms._reduce = lambda local, ord: local
    out = []
    for name, variant, tensor, data, pipeline in cases:
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=tensor, data=data, pipeline=pipeline):
            model = MODELS[name][0]()
        losses, norms_ = _train(model, name, variant, pipeline)
        out.append({"losses": losses, "norms": norms_, "params": autopar.full_state_dict(model),
                    "digests": _digests(model)})
    return out


def clip_errors(result: dict, oracle: tuple) -> dict[str, float]:
    s_losses, s_norms, s_params = oracle
    rel = [abs(a - b) / abs(b) for a, b in zip(result["losses"], s_losses)]
    norms = [abs(a - b) / abs(b) for a, b in zip(result["norms"], s_norms) if b is not None]
    got = torch.cat([result["params"][k].flatten() for k in s_params])
    want = torch.cat([v.flatten() for v in s_params.values()])
    return {"loss": max(rel), "norm": max(norms, default=0.0), "params": rel_err(got, want),
            "tensor": max(rel_err(result["params"][k], v) for k, v in s_params.items()) * TOL / PARAM_TOL}


def assert_replicated_pieces_equal(results: list[dict]) -> None:
    seen: dict[tuple, set[str]] = {}
    for r in results:
        for key, digest in r["digests"].items():
            seen.setdefault(key, set()).add(digest)
    unequal = [k for k, d in seen.items() if len(d) > 1]
    assert not unequal, f"pieces that should be bitwise equal differ across ranks: {unequal[:5]}"


# (model, clipping, tensor=(row, col, depth), data, pipeline): every grid kind, every clipping call.
CASES = [
    ("fc_net", "l2", (2, 1, 1), 2, 1),           # row
    ("fc_net", "l1/foreach", (1, 2, 1), 2, 1),   # col
    ("fc_net", "inf/loop", (1, 1, 2), 2, 1),     # depth
    ("fc_net", "l2/loop", (1, 1, 1), 4, 1),      # data only: plain tensors, like DDP
    ("fc_net", "value", (2, 2, 1), 1, 1),        # 3D
    ("fc_net", "total-norm", (2, 1, 2), 1, 1),
    ("fc_net", "l2/foreach", (2, 1, 1), 1, 2),   # pipeline x row
    ("fc_net", "inf", (1, 1, 1), 2, 2),          # pipeline x data
    ("nanogpt", "l2", (2, 1, 1), 2, 1),          # tied embedding, vocabulary-parallel
    ("nanogpt", "l1", (1, 1, 1), 2, 2),          # tied embedding on the first and the last stage
]


@pytest.mark.slow
def test_clipping_matches_serial_on_every_grid_kind(distributed):
    results = distributed(clip_worker, 4, CASES, timeout=600)
    for i, case in enumerate(CASES):
        oracle = serial(case[0], case[1])
        per_rank = [r[i] for r in results]
        for rank, r in enumerate(per_rank):
            err = clip_errors(r, oracle)
            assert max(err.values()) < TOL, (case, rank, err)
        assert_replicated_pieces_equal(per_rank)


def test_a_norm_of_local_pieces_fails_the_checks(distributed):
    cases = [("fc_net", "l2", (2, 2, 1), 1, 1), ("fc_net", "inf/foreach", (1, 1, 1), 2, 2)]
    results = distributed(clip_worker, 4, cases, True)
    for i, case in enumerate(cases):
        assert clip_errors(results[0][i], serial(case[0], case[1]))["norm"] > 1e-2, case


def nonfinite_worker() -> list[str]:
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(2, 2, 1)):
        model = FC_Net(**SMALL)
    x, y = batches(steps=1, batch=16, last=16)[0]
    F.cross_entropy(model(x), y).backward()
    if dist.get_rank() == 3:  # one rank's piece of one weight overflows
        local_of(model.layers[0].fc1.weight.grad)[0, 0] = float("inf")
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    except RuntimeError as e:
        return [str(e)]
    return []


def test_error_if_nonfinite_raises_on_every_rank(distributed):
    for messages in distributed(nonfinite_worker, 4):
        assert messages and "non-finite" in messages[0]


def _decay_groups(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """nanoGPT's configure_optimizers: weight decay for every parameter with 2 or more dims."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return sorted(n for n, p in params.items() if p.dim() >= 2), sorted(n for n, p in params.items() if p.dim() < 2)


def shapes_worker(grids: list[tuple]) -> list[dict]:
    out = []
    for name, tensor, data, pipeline, example in grids:
        torch.manual_seed(0)
        x, y = MODELS[name][1]()[0]
        with autopar.auto_parallelize(tensor=tensor, data=data, pipeline=pipeline,
                                      example_inputs=(x,) if example else None):
            model = MODELS[name][0]()
        if not example:
            model(x)  # the first call shards the parameters
        out.append({"shapes": {n: (tuple(p.shape), p.dim(), p.numel(), p.dtype) for n, p in model.named_parameters()},
                    "count": sum(p.numel() for p in model.parameters()),
                    "local": {n: tuple(local_of(p).shape) for n, p in model.named_parameters()},
                    "groups": _decay_groups(model)})
    return out


def test_parameters_report_serial_shapes_counts_and_weight_decay_groups(distributed):
    grids = [("nanogpt", (2, 2, 1), 1, 1, True), ("fc_net", (1, 1, 2), 2, 1, False),
             ("nanogpt", (2, 1, 1), 1, 2, False), ("fc_net", (1, 1, 1), 4, 1, True)]
    results = distributed(shapes_worker, 4, grids)
    for i, (name, *_rest) in enumerate(grids):
        torch.manual_seed(0)
        model = MODELS[name][0]()
        want = {n: (tuple(p.shape), p.dim(), p.numel(), p.dtype) for n, p in model.named_parameters()}
        for r in results:
            assert r[i]["shapes"] == want, grids[i]
            assert r[i]["count"] == sum(p.numel() for p in model.parameters())
            assert r[i]["groups"] == _decay_groups(model)
        if grids[i][1] != (1, 1, 1):  # the storage is this rank's piece: reporting it would fail the checks above
            assert any(r[i]["local"][n] != want[n][0] for r in results for n in want), grids[i]
