"""Pipeline parallelism against serial: grids mixing data, pipeline and 3D tensor parallelism on 8 ranks.

Each grid trains 3 AdamW steps, through ``autopar.train_step`` (torch's schedules over
micro-batches) or through plain ``model(x)`` + ``loss.backward()`` (stages in order), and compares
losses, every first-step gradient and the final parameters with the serial model. Tolerance: 1e-5
relative, as in test_parity (float32 sums in another order give ~1e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.runtime.params.layout import held_numel
from autopar.parallel_model import runtime_of
from autopar.errors import InputError, PlanError
from autopar.examples import zoo
from autopar.examples.fc_net import FC_Net, synthetic_mnist
from tests import zoo_helpers as Z
from tests.helpers import SMALL, rel_err

TOL = 1e-5
NET = dict(SMALL, num_layers=8)  # 10 segments: enough for 8 stages, or 4 ranks x 2 chunks


def _data() -> list:
    return list(synthetic_mnist(3, 16, NET["image_size"], 0))


def _serial() -> tuple[list[float], dict, dict, torch.Tensor]:
    torch.manual_seed(0)
    model = FC_Net(**NET)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step, (x, y) in enumerate(_data()):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        out = model(_data()[0][0])
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}, out


def _fc_worker(grids: list[tuple]) -> list[dict]:
    s_losses, s_grads, s_state, s_out = _serial()
    out = []
    for pipeline, (row, col, depth), data, how, options in grids:
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=(row, col, depth), data=data, pipeline=pipeline, **options):
            model = FC_Net(**NET)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], {}
        for step, (x, y) in enumerate(_data()):
            if how == "train_step":
                loss = autopar.train_step(model, x, y, F.cross_entropy)
            else:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            if step == 0:
                grads = runtime_of(model).full_grads()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        final = autopar.full_state_dict(model)
        model.load_state_dict(s_state)  # the serial state dict loads into the stages
        with torch.no_grad():
            reloaded = model(_data()[0][0])
        plan = autopar.plan_of(model)
        out.append(dict(
            grid=(pipeline, row, col, depth, data, how, tuple(sorted(options.items()))),
            loss_err=max(abs(a - b) / abs(b) for a, b in zip(losses, s_losses)),
            grad_err=max(rel_err(grads[k], s_grads[k]) for k in s_grads),
            param_err=max(rel_err(final[k], s_state[k]) for k in s_state),
            reload_err=rel_err(reloaded, s_out),
            held=sum(held_numel(p) for p in model.parameters()),
            stage_params=sum(p.local_numel(plan.config) for p in plan.params),
            num_stages=len(plan.pipeline.stages),
        ))
    return out


GRIDS = [  # (pipeline, (row, col, depth), data, how, options): every kind of parallelism with pipeline
    (2, (2, 1, 1), 2, "train_step", {}),
    (2, (1, 2, 2), 1, "plain", {}),
    (4, (1, 1, 2), 1, "train_step", {"schedule": "gpipe"}),
    (2, (1, 1, 1), 4, "train_step", {"schedule": "interleaved"}),
    (4, (2, 1, 1), 1, "train_step", {"schedule": "looped-bfs", "microbatches": 4}),
    (8, (1, 1, 1), 1, "train_step", {"microbatches": 8}),
    (2, (1, 2, 1), 2, "plain", {"schedule": "interleaved"}),
]


@pytest.mark.slow
def test_fc_net_pipeline_grids_match_serial(distributed):
    results = distributed(_fc_worker, 8, GRIDS, timeout=600)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            where = f"grid {r['grid']} rank {rank}"
            assert r["loss_err"] < TOL, f"{where}: losses differ by {r['loss_err']:.2e}"
            assert r["grad_err"] < TOL, f"{where}: gradients differ by {r['grad_err']:.2e}"
            assert r["param_err"] < TOL, f"{where}: final parameters differ by {r['param_err']:.2e}"
            assert r["reload_err"] < TOL, f"{where}: output after loading the serial state differs"
            # each rank materializes only its own stages' parameters
            assert 0 < r["held"] < r["stage_params"], where
    # interleaved and looped BFS hold 2 stages per rank
    assert [r["num_stages"] for r in results[0]] == [2, 2, 4, 4, 8, 8, 4]


ZOO_CASES = [  # name, world, tensor, data, pipeline options, train_step?
    ("gpt2", 8, (2, 1, 1), 2, {"pipeline": 2}, True),  # tied wte / lm_head on stages 0 and 1
    ("gpt2", 8, (1, 1, 2), 2, {"pipeline": 2}, False),
    ("llama", 8, (1, 2, 1), 1, {"pipeline": 4, "schedule": "gpipe"}, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, world, tensor, data, pipe, use_train_step", ZOO_CASES,
                         ids=[f"{c[0]}-p{c[4]['pipeline']}-t{''.join(map(str, c[2]))}-d{c[3]}-"
                              f"{'step' if c[5] else 'plain'}" for c in ZOO_CASES])
def test_zoo_pipeline_matches_serial(name, world, tensor, data, pipe, use_train_step, distributed):
    batches = Z.batches(name, batch=8)
    losses, grads = Z.serial(name, batches, layers=6)
    results = distributed(Z.parallel, world, name, batches, tensor, data, 0, 6, "auto", pipe, use_train_step,
                          timeout=400)
    Z.assert_matches_serial(results, losses, grads, TOL, name)
    plan = results[0]["plan"]
    assert len(plan.pipeline.stages) == pipe["pipeline"]
    # cut for the machine that runs them (mutation: stages_of_chain cutting at H100 rates whatever it is told)
    assert torch.cuda.is_available() or plan.pipeline.rates == "cpu"
    if name == "gpt2":  # the tied weight is read by the first and the last stage: gradients summed
        assert [s for _, s in plan.pipeline.shared] == [(0, pipe["pipeline"] - 1)]


def _errors_worker() -> list[str]:
    seen = []
    torch.manual_seed(0)
    with autopar.auto_parallelize(pipeline=2, microbatches=3):
        model = FC_Net(**NET)
    x, y = _data()[0]
    try:
        autopar.train_step(model, x, y, F.cross_entropy)  # 16 rows do not divide into 3 micro-batches
    except InputError as e:
        seen.append(str(e))
    with autopar.auto_parallelize(pipeline=2, microbatches=2):
        tiny = torch.nn.Linear(4, 4)
    try:
        tiny(torch.randn(4, 4))  # one segment cannot make two stages
    except PlanError as e:
        seen.append(str(e))
    dist.barrier()
    return seen


def test_pipeline_bad_inputs_raise_clear_errors(distributed):
    for seen in distributed(_errors_worker, 2):
        assert len(seen) == 2
        assert "do not divide into microbatches=3" in seen[0]
        assert "fewer than pipeline=2" in seen[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.NAMES)
def test_every_zoo_model_runs_two_pipeline_stages(name, distributed):
    """Every model of the zoo, cut into two stages: train_step where the inputs are one tuple or one
    dict, the plain call otherwise (encoder-decoders take ids and decoder ids)."""
    batches = Z.batches(name, batch=4)
    losses, grads = Z.serial(name, batches)
    use_train_step = not (batches[0][0] and batches[0][1])
    results = distributed(Z.parallel, 2, name, batches, (1, 1, 1), 1, 0, None, "auto", {"pipeline": 2},
                          use_train_step, timeout=300)
    Z.assert_matches_serial(results, losses, grads, TOL, name)
    for r in results:
        assert len(r["plan"].pipeline.stages) == 2


def _precision_worker(precision: str) -> list[list[float]]:
    out = []
    for pipeline in (1, 2):  # the same 2 ranks as data parallelism, then as two stages
        torch.manual_seed(0)
        with autopar.auto_parallelize(pipeline=pipeline, data=2 // pipeline, precision=precision):
            model = FC_Net(**dict(SMALL, num_layers=4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y in synthetic_mnist(3, 16, SMALL["image_size"], 0):
            losses.append(autopar.train_step(model, x, y, F.cross_entropy).item())
            opt.step()
            opt.zero_grad()
        out.append(losses)
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pipeline_stages_run_under_autocast_like_data_parallel(precision, distributed):
    # Each stage runs its ops under autocast as the whole model does: the same roundings, so the
    # losses equal data parallelism's in the same precision to float32 summation noise.
    for data_parallel, pipelined in distributed(_precision_worker, 2, precision):
        for a, b in zip(pipelined, data_parallel, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (pipelined, data_parallel)


def _pipeline_bytes_worker(cases: list[tuple]) -> list[tuple[str, dict, dict]]:
    """Per case: (case, bytes by kind this rank sent in its second train_step, what the trace predicts)."""
    from autopar.planning.planner import plan_model

    out = []
    for name, tensor, data, pipe in cases:
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=tensor, data=data, **pipe):
            model = zoo.build_model(name, layers=6)
        (args, kwargs, target), = Z.batches(name, steps=1, batch=8)
        inputs = (args[0],) if not kwargs else {"input_ids": args[0], **kwargs}
        autopar.train_step(model, inputs, target, F.cross_entropy)  # compiles; records each boundary once
        model.zero_grad()
        autopar.reset_comm_stats()
        autopar.train_step(model, inputs, target, F.cross_entropy)
        measured = {k: v for k, v in autopar.comm_stats().items() if v}
        runtime = runtime_of(model)
        with torch.device("meta"):
            meta = zoo.build_model(name, layers=6)
        _, report = plan_model(meta, args, runtime.config, rank=dist.get_rank(), kwargs=kwargs,
                               pipeline=runtime.config.pipeline, microbatches=runtime.num_microbatches,
                               chunks=runtime.pipe.stages_per_rank)
        predicted = {k: float(v) for k, v in report.comm_bytes_by_kind.items() if v}
        predicted["total"] = float(report.comm_bytes_per_step)
        out.append((f"{name} p{pipe} t{tensor} d{data}", measured, predicted))
    return out


PIPELINE_BYTES_CASES = [  # 4 ranks: every kind of collective a pipeline rank issues
    ("gpt2", (2, 1, 1), 1, {"pipeline": 2}),  # tied weight over the pipeline, vocabulary-parallel loss
    ("llama", (1, 2, 1), 1, {"pipeline": 2, "microbatches": 4}),
    ("llama", (1, 1, 2), 1, {"pipeline": 2, "microbatches": 4}),  # weight gathers once per micro-batch
    ("gpt2", (1, 1, 1), 2, {"pipeline": 2, "schedule": "gpipe"}),  # gradient sync and loss over data
    ("llama", (1, 1, 1), 1, {"pipeline": 4}),  # rotary tables pass through every stage
    ("llama", (1, 1, 1), 2, {"pipeline": 2, "schedule": "interleaved", "microbatches": 4}),
    # this rank's tokens sent between stages (rotary tables whole), the logits gathered over context for the loss
    ("llama", (1, 1, 1), 1, {"pipeline": 2, "context": 2}),
    ("llama", (1, 1, 1), 1, {"pipeline": 2, "context": 2, "schedule": "interleaved", "microbatches": 4}),
]


@pytest.mark.slow
def test_trace_predicts_every_byte_a_pipeline_rank_sends(distributed):
    for rank, per_rank in enumerate(distributed(_pipeline_bytes_worker, 4, PIPELINE_BYTES_CASES, timeout=600)):
        for case, measured, predicted in per_rank:
            assert measured == predicted and predicted["total"] > 0, (rank, case, measured, predicted)


def _budget_worker(budget: int) -> dict:
    from autopar.examples.fc_net import FC_Net

    torch.manual_seed(0)
    with autopar.auto_parallelize(pipeline=2, checkpoint=budget, microbatches=2):
        model = FC_Net(num_layers=4, hidden=256, image_size=16)
    x, y = torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,))
    autopar.train_step(model, x, y, torch.nn.functional.cross_entropy)
    memory = autopar.plan_of(model).memory
    return {"recompute": memory.recompute, "fits": memory.fits}


def test_a_pipeline_rank_recomputes_for_its_own_stages_memory(distributed):
    """A budget the whole model exceeds without recomputation but each pipeline rank's stages fit: no
    block is recomputed (the runtime used to plan every rank against the whole model's memory)."""
    from autopar.config import ParallelConfig
    from autopar.examples.fc_net import FC_Net
    from autopar.planning.planner import plan_model

    with torch.device("meta"):
        model = FC_Net(num_layers=4, hidden=256, image_size=16)
    inputs = (torch.empty(16, 1, 16, 16, device="meta"),)
    whole = plan_model(model, inputs, ParallelConfig(1, 1, 1, 1), checkpoint="none")[0].memory
    staged = plan_model(model, inputs, ParallelConfig(1, 1, 1, 1), pipeline=2, microbatches=2,
                        checkpoint="none")[0].memory
    assert staged.peak_bytes + staged.headroom_bytes < whole.static_bytes, (staged.summary(), whole.summary())
    budget = (staged.peak_bytes + 2 * staged.headroom_bytes + whole.static_bytes) // 2
    for got in distributed(_budget_worker, 2, int(budget)):
        assert got == {"recompute": (), "fits": True}, got
