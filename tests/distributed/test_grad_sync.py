"""Bucketed gradient sync: sums equal per-parameter all-reduces, under accumulation, with unused
parameters and several buckets; autopar's data parallelism under gradient accumulation equals serial."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autopar
from autopar.compat import TorchDispatchMode
from autopar.parallel_model import runtime_of
from autopar.examples.fc_net import FC_Net, synthetic_mnist
from autopar.runtime.comm.collectives import comm_calls
from autopar.runtime.params.absent import Absent
from autopar.runtime.data_parallel.grad_sync import GradSync
from autopar.runtime.params.layout import local_of
from tests.helpers import SMALL, rel_err


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _sync_worker() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = _Net()
    params = list(net.parameters())
    sync = GradSync(params, None, world, bucket_bytes=17 * 16 * 4)  # b.weight and a.bias fill one bucket
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * r + k)) for r in range(world)
          for k in range(2)]
    out = {"buckets": len(sync.buckets)}
    for set_to_none in (True, False):
        net.zero_grad(set_to_none=set_to_none)
        autopar.reset_comm_stats()
        for k in range(2):  # two backward passes before a step: gradients accumulate
            net(xs[2 * rank + k]).square().sum().backward()
        out[f"calls_{set_to_none}"] = comm_calls()["all_reduce"]
        out[f"grads_{set_to_none}"] = {n: None if p.grad is None else p.grad.clone()
                                       for n, p in net.named_parameters()}
    # torch.autograd.grad bypasses the sync, as with DDP: this rank's own gradient
    local = torch.autograd.grad(net(xs[2 * rank]).square().sum(), net.c.weight)[0]
    out["autograd_grad"] = local
    sync.remove()
    return out


def test_buckets_sum_accumulated_gradients_like_one_all_reduce_per_parameter(distributed):
    world = 2
    torch.manual_seed(0)
    net = _Net()
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * r + k)) for r in range(world)
          for k in range(2)]
    for x in xs:
        net(x).square().sum().backward()
    want = {n: p.grad for n, p in net.named_parameters()}
    net.zero_grad()
    net(xs[2]).square().sum().backward()  # rank 1's first batch alone
    own = net.c.weight.grad
    for rank, r in enumerate(distributed(_sync_worker, world)):
        # backward order, within the cap: [unused, c.bias, c.weight, b.bias], [b.weight, a.bias], [a.weight];
        # the first waits for the end of backward (unused never gets a gradient)
        assert r["buckets"] == 3
        for set_to_none in (True, False):
            assert r[f"calls_{set_to_none}"] == 2 * r["buckets"]  # every bucket once per backward
            got = r[f"grads_{set_to_none}"]
            assert got["unused"] is None  # never had a gradient: left alone
            for n, g in want.items():
                if n != "unused":
                    assert rel_err(got[n], g) < 1e-6, (rank, set_to_none, n)
        if rank == 1:
            assert torch.equal(r["autograd_grad"], own)


NET = dict(SMALL, num_layers=3)


def _accumulate_worker() -> dict:
    torch.manual_seed(0)
    with autopar.auto_parallelize(data=2):
        model = FC_Net(**NET)
    (x, y), = synthetic_mnist(1, 16, NET["image_size"], 0)
    for half in (slice(0, 8), slice(8, 16)):  # one step's batch in two backward passes
        (F.cross_entropy(model(x[half]), y[half]) / 2).backward()
    return runtime_of(model).full_grads()  # weights are stored as flat blocks: compare in serial layout


def test_data_parallel_gradient_accumulation_equals_serial(distributed):
    torch.manual_seed(0)
    model = FC_Net(**NET)
    (x, y), = synthetic_mnist(1, 16, NET["image_size"], 0)
    F.cross_entropy(model(x), y).backward()
    for grads in distributed(_accumulate_worker, 2):
        for n, p in model.named_parameters():
            assert rel_err(grads[n], p.grad) < 1e-5, n


TENSOR_GRIDS = [{"tensor": (2, 2, 1)}, {"tensor": (1, 1, 2), "data": 2}, {"tensor": (1, 2, 1), "data": 2}]


def _in_place_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """A script's in-place elementwise work on parameters and gradients: two backwards adding into .grad (each
    half of the batch), the gradients scaled by hand (``div_``), an SGD step, an EMA of the weights
    (``mul_``/``add_`` and ``lerp_``), twice; then the EMA loaded into the model (``copy_``). Returns the
    gradients after the first accumulation."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    with torch.no_grad():
        model(x[:1])  # (autopar lays the parameters out at the first call: the copies below take that layout)
        ema, ema2 = [p.detach().clone() for p in params], [p.detach().clone() for p in params]
    grads = None
    for _ in range(2):
        for half in (slice(0, 8), slice(8, 16)):
            F.cross_entropy(model(x[half]), y[half]).backward()
        with torch.no_grad():
            for p in params:
                p.grad.div_(2)
        grads = grads or _full_grads(model)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, e2, p in zip(ema, ema2, params):
                e.mul_(0.9).add_(p, alpha=0.1)
                e2.lerp_(p, 0.2)
    with torch.no_grad():
        for p, e, e2 in zip(params, ema, ema2):
            p.copy_(e).sub_(e2, alpha=0.5)
    return grads


def _full_grads(model: nn.Module) -> dict:
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return runtime_of(model).full_grads()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _tensor_in_place_worker() -> list[dict]:
    """Per grid: ``_in_place_loop``'s gradients and final parameters, and how many pointwise ops ran on the
    local pieces (``autopar.runtime.interop.pointwise``); on the first grid, the DTensors of partial values too (their
    sharding, DTensor's own, takes seconds to work out on torch 2.13)."""
    from autopar.runtime.interop import pointwise

    calls = []
    real = pointwise.local_tensor

    def counted(t):
        calls.append(1)
        return real(t)
    pointwise.local_tensor = counted
    out = []
    try:
        for grid in TENSOR_GRIDS:
            torch.manual_seed(0)
            with autopar.auto_parallelize(**grid):
                model = FC_Net(**NET)
            (x, y), = synthetic_mnist(1, 16, NET["image_size"], 0)
            calls[:] = []
            grads = _in_place_loop(model, x, y)
            out.append({"grads": grads, "params": autopar.full_state_dict(model), "on pieces": len(calls),
                        "partials": _partials(next(iter(model.parameters()))) if not out else {}})
    finally:
        pointwise.local_tensor = real
    return out


def _partials(like: torch.Tensor) -> dict[str, float]:
    """In-place ops on DTensors of partial values on a parameter's mesh: what DTensor computes (torch 2.11's
    refuses those that would reduce the partial values in place), not the op on the local pieces, where that
    differs: the sum of partial maxima, the product of partial sums, a clamp of a partial sum; the sums and
    scalings of partial sums, which the pieces do give. Each case's largest error."""
    from torch.distributed.tensor import Partial

    mesh = like.device_mesh
    g = torch.Generator().manual_seed(dist.get_rank())

    def make(kind: str) -> DTensor:
        return DTensor.from_local(torch.randn(3, generator=g), mesh, [Partial(kind)] * mesh.ndim, run_check=False)

    cases = {"max + max": ("max", lambda a, b: a.add_(b), lambda a, b: a + b),
             "sum * sum": ("sum", lambda a, b: a.mul_(b), lambda a, b: a * b),
             "clamp(sum)": ("sum", lambda a, b: a.clamp_(-0.1, 0.1), lambda a, b: a.clamp(-0.1, 0.1)),
             "sum + sum": ("sum", lambda a, b: a.add_(b, alpha=0.5), lambda a, b: a + 0.5 * b),
             "3 * sum": ("sum", lambda a, b: a.mul_(3), lambda a, b: 3 * a)}
    out = {}
    for name, (kind, op, want_of) in cases.items():
        a, b = make(kind), make(kind)
        want = want_of(a.full_tensor(), b.full_tensor())
        try:
            op(a, b)
        except RuntimeError as e:
            if "placement" not in str(e):
                raise
            out[name] = 0.0
            continue
        out[name] = float((a.full_tensor() - want).abs().max())
    return out


def test_in_place_pointwise_ops_on_tensor_grids_equal_serial(distributed):
    """On tensor grids the parameters and gradients are DTensors on a 4-dimensional mesh. In-place pointwise
    ops on them (accumulation into .grad, div_, an EMA's mul_/add_/lerp_, copy_, sub_) run on the local
    pieces (torch 2.13's DTensor took 0.3-1.3 s the first time to work out each one's sharding: 3.6 s at the
    first accumulating step of a tiny Llama). Gradients and parameters equal serial's on row x col, depth x
    data and col x data, the ops counted on the pieces; on partial values, DTensor's results. Mutations:
    accumulation adding the new gradient twice or not at all, or any op on the pieces whatever the partials:
    fails."""
    torch.manual_seed(0)
    model = FC_Net(**NET)
    (x, y), = synthetic_mnist(1, 16, NET["image_size"], 0)
    grads = _in_place_loop(model, x, y)
    for rank, results in enumerate(distributed(_tensor_in_place_worker, 4)):
        for grid, r in zip(TENSOR_GRIDS, results):
            assert r["on pieces"] >= 10 * len(grads), (rank, grid, r["on pieces"])
            assert all(err < 1e-6 for err in r["partials"].values()), (rank, grid, r["partials"])
            for n, p in model.named_parameters():
                assert rel_err(r["grads"][n], grads[n]) < 1e-5, (rank, grid, n)
                assert rel_err(r["params"][n], p.detach()) < 1e-5, (rank, grid, n)


def _pipeline_accumulate_worker() -> dict:
    """pipeline 2 x data 2: two train_steps (and two plain calls) before one optimizer step add up."""
    torch.manual_seed(0)
    with autopar.auto_parallelize(pipeline=2, data=2):
        model = FC_Net(**NET)
    (x, y), = synthetic_mnist(1, 16, NET["image_size"], 0)
    out = {}
    for how in ("train_step", "plain"):
        model.zero_grad()
        for half in (slice(0, 8), slice(8, 16)):
            if how == "train_step":
                autopar.train_step(model, x[half], y[half], lambda out, t: F.cross_entropy(out, t) / 2)
            else:
                (F.cross_entropy(model(x[half]), y[half]) / 2).backward()
        out[how] = runtime_of(model).full_grads()
    return out


def test_pipeline_gradient_accumulation_equals_serial(distributed):
    """Each step's gradients are summed over data before they are added to .grad: summing .grad itself
    would count the earlier steps' (already summed) gradients again."""
    torch.manual_seed(0)
    model = FC_Net(**NET)
    (x, y), = synthetic_mnist(1, 16, NET["image_size"], 0)
    F.cross_entropy(model(x), y).backward()
    for r in distributed(_pipeline_accumulate_worker, 4):
        for how, grads in r.items():
            for n, p in model.named_parameters():
                assert rel_err(grads[n], p.grad) < 1e-5, (how, n)


def _hooked_worker(tensor: tuple[int, int, int], data: int, pipeline: int = 1) -> dict:
    """A script's own tensor hook on a parameter (here: halve the gradient) shapes what is summed, as under
    DDP, whose reducer runs after the hooks; under a pipeline too, whose stages read plain leaves."""
    from autopar.examples.nanogpt import GPTConfig, NanoGPT

    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)
    config = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32, bias=False)
    torch.manual_seed(0)
    serial = NanoGPT(config)
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, data=data, pipeline=pipeline):
        model = NanoGPT(config)
    model(x, y)[1].backward()  # the first call builds the parameters
    for m in (serial, model):
        m.zero_grad()
        m.transformer.h[0].mlp.c_fc.weight.register_hook(lambda grad: grad * 0.5)
        m(x, y)[1].backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    grads = {n: None if g is not None and isinstance(local_of(g), Absent) else g for n, g in grads.items()}
    return {n: rel_err(grads[n], p.grad) for n, p in serial.named_parameters()
            if grads[n] is not None}  # (under a pipeline: this rank's stages' parameters)


def test_a_scripts_parameter_hook_shapes_the_summed_gradient(distributed):
    for tensor, data, pipeline, world in (((1, 1, 1), 2, 1, 2), ((2, 1, 1), 2, 1, 4), ((1, 1, 1), 1, 2, 2)):
        for errors in distributed(_hooked_worker, world, tensor, data, pipeline):
            assert max(errors.values()) < 1e-5, (tensor, data, pipeline, errors)



def _arrival_worker(grids: list[tuple[tuple[int, int, int], int, bool]]) -> dict:
    """When one backward delivers each layer's gradients (a post-accumulate-grad hook of the script's): how many
    matmuls backward had run by then, for serial and for each grid (tensor, data, shard_optimizer)."""
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def arrivals(model: nn.Module) -> dict[str, int]:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
        model(x).sum().backward()  # (the first call builds the parameters)
        model.zero_grad()
        ran, seen = [0], {}

        def arrived(name: str) -> Callable[[torch.Tensor], None]:
            def hook(_: torch.Tensor) -> None:
                seen.setdefault(name.split(".")[0], ran[0])
            return hook

        handles = [p.register_post_accumulate_grad_hook(arrived(n)) for n, p in model.named_parameters()]

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                ran[0] += func in matmuls
                return func(*args, **(kwargs or {}))

        loss = model(x).sum()
        with Count():
            loss.backward()
        for h in handles:
            h.remove()
        return {**seen, "total": ran[0]}

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])

    out = {"serial": arrivals(build())}
    for tensor, data, shard in grids:
        with autopar.auto_parallelize(tensor=tensor, data=data, shard_optimizer=shard, compile=False):
            model = build()
        out[f"{tensor} data {data} shard {shard}"] = arrivals(model)
    return out


def test_each_gradient_arrives_when_its_layer_ran_backward(distributed):
    """As in serial (and under DDP), a parameter's gradient reaches ``p.grad``, and its data-parallel bucket, as
    soon as its layer's backward ran, not once all of backward did: buckets are reduced while backward goes on,
    and under shard_optimizer the whole gradients do not all live at once. Autograd runs a node after every node
    made later in forward; where parameters are DTensors (shard_optimizer, tensor and depth grids) their local
    pieces were read before the graph ran, and every gradient arrived once all of backward's matmuls had run
    (the mutation)."""
    grids = [((1, 1, 1), 4, True), ((1, 1, 1), 4, False), ((2, 1, 1), 2, False), ((1, 2, 1), 2, True),
             ((1, 1, 2), 2, False)]
    for r in distributed(_arrival_worker, 4, grids):
        serial = r.pop("serial")
        assert serial["3"] < serial["2"] < serial["1"] < serial["0"] <= serial["total"], serial
        for grid, seen in r.items():
            assert seen["3"] < seen["2"] < seen["1"] < seen["0"] <= seen["total"], (grid, seen)
