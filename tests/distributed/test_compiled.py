"""``compile=True``: the per-rank program under torch.compile (Inductor) gives eager autopar's numbers.

One spawned run per world size trains each case twice, eagerly and compiled (same seed, same data), and
compares losses, first-step gradients, final parameters and ``comm_stats()`` bytes per step, and (for
FC_Net) the serial model's numbers too. Every case must have run compiled: a graph that fell back to
eager (``CompiledGraph.failed``) fails the test, so the comparison cannot pass by comparing eager with
eager. Cases: tensor (row x col), depth with data, col x depth, pipeline stages (plain calls and
``train_step``), full checkpointing, per-rank batches (DDP semantics), clipping, and nanoGPT's loss
inside forward with a vocabulary-parallel cross-entropy, GPT-2 with a vocabulary split unevenly
(64+63), and GPT-2 in two pipeline stages (its tied embedding and head on different stages: the stages'
parameter leaves, not the compiled graph's one-node read, must collect their gradients). On the depth
grids the compiled code launches fewer all-gathers and reduce-scatters than its graphs hold (Inductor's
bucketing: 13 and 6 a step become 2 and 1 at depth 2), with the same bytes. Ranks whose compiles fail or
differ (injected on one rank) all run eagerly, with eager's numbers (``test_ranks_whose_compiles_differ_...``).
Compiling on 2 CPU cores is slow: marked slow.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.examples.fc_net import FC_Net
from autopar.examples.nanogpt import GPTConfig, NanoGPT
from autopar.parallel_model import runtime_of
from tests.distributed.test_uneven import build_model as uneven_model
from tests.helpers import SMALL, rel_err

TOL = 1e-5
NANO = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32)

pytestmark = pytest.mark.slow


def _train(kind: str, options: dict, compiled: bool, how: str, steps: int = 3,
           counted: dict[int, tuple[int, ...]] | None = None) -> dict:
    """``counted``: rank -> its steps that run under a FLOP counter (a TorchDispatchMode); ``flops``: what the
    counter counted at each of those steps."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    per_rank = options.get("batch") == "per-rank"
    with autopar.auto_parallelize(compile=compiled, **options):
        model = FC_Net(**SMALL) if kind == "fc" else NanoGPT(GPTConfig(**NANO)) if kind == "nano" else \
            uneven_model("gpt2")
    # the LMs: SGD, as tests/distributed/test_loss_in_forward.py does (Adam turns gradients that are zero in
    # exact arithmetic, ~1e-9 here, into full steps of noise)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if kind == "fc" else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(dist.get_rank() if per_rank else 0)
    losses, comm, grads, flops = [], [], None, {}
    for step in range(steps):
        autopar.reset_comm_stats()
        if kind == "fc":
            x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
            if how == "train_step":
                loss = autopar.train_step(model, x, y, F.cross_entropy)
            elif how == "no_sync":  # two halves accumulated, the first kept local (DDP's no_sync)
                with model.no_sync():
                    (F.cross_entropy(model(x[:4]), y[:4]) / 2).backward()
                loss = F.cross_entropy(model(x[4:]), y[4:]) / 2
                loss.backward()
            else:
                counter = FlopCounterMode(display=False) if step in (counted or {}).get(dist.get_rank(), ()) \
                    else None
                with counter or nullcontext():
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                if counter is not None:
                    flops[step] = counter.get_total_flops()
        elif kind == "nano":
            x = torch.randint(0, 128, (4, 16), generator=g)
            y = torch.randint(0, 128, (4, 16), generator=g)
            y[1, 8:] = -1  # ignored targets
            loss = model(x, y)[1]
            loss.backward()
        else:  # GPT-2 with a vocabulary of 127: split unevenly (tests/distributed/test_uneven.py)
            x = torch.randint(0, 127, (4, 16), generator=g)
            loss = model(x, labels=x, use_cache=False).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        comm.append(autopar.comm_stats()["total"])
        if step == 0:
            grads = {k: v for k, v in runtime_of(model).full_grads().items() if v is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    runs = sum(c.compiled_runs for c in runtime_of(model).compiled_graphs())
    evaluated = None
    if kind == "fc" and how != "train_step":  # the training graph called without gradients (same signature)
        with torch.no_grad():
            evaluated = model(x)
    graphs = runtime_of(model).compiled_graphs()
    held, launched = {}, {}  # collectives of each kind the compiled graphs hold, and those their code launches
    for c in graphs:
        for h, got in c.launches:
            for total, counts in ((held, h), (launched, got)):
                for kind, n in counts.items():
                    total[kind] = total.get(kind, 0) + n
    return {"losses": losses, "comm": comm, "grads": grads, "params": autopar.full_state_dict(model),
            "compiled_runs": runs, "failed": [c.failed for c in graphs if c.failed],
            "launches": (held, launched), "pieces": sum(c.name.startswith("piece ") for c in graphs),
            "evaluated": evaluated, "flops": flops}


def _serial_fc(steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = FC_Net(**SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _compare(cases: list[tuple]) -> dict:
    out = {}
    serial = _serial_fc()
    for name, kind, options, how in cases:
        eager = _train(kind, options, False, how)
        comp = _train(kind, options, True, how)
        errs = {"loss": max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(eager["losses"], comp["losses"])),
                "grads": max(rel_err(eager["grads"][k], comp["grads"][k]) for k in eager["grads"]),
                "params": max(rel_err(eager["params"][k], comp["params"][k]) for k in eager["params"])}
        if eager["evaluated"] is not None:
            errs["no_grad"] = rel_err(eager["evaluated"], comp["evaluated"])
        if kind == "fc" and options.get("batch") != "per-rank" and how != "no_sync":
            errs["serial"] = max(rel_err(serial["params"][k], comp["params"][k]) for k in serial["params"])
            errs["serial_loss"] = max(abs(a - b) for a, b in zip(serial["losses"], comp["losses"]))
        out[name] = {"errs": errs, "comm": (eager["comm"], comp["comm"]), "runs": comp["compiled_runs"],
                     "failed": comp["failed"], "launches": comp["launches"], "pieces": comp["pieces"]}
    return out


CASES = {
    2: [("t2x1x1", "fc", {"tensor": (2, 1, 1)}, "call"),
        ("t1x2x1", "fc", {"tensor": (1, 2, 1)}, "call"),
        ("p2", "fc", {"pipeline": 2}, "call"),
        ("p2 train_step", "fc", {"pipeline": 2}, "train_step"),
        ("nanogpt t2x1x1 loss in forward", "nano", {"tensor": (2, 1, 1)}, "call"),
        ("gpt2 vocab 127 t2x1x1 (64+63)", "gpt2", {"tensor": (2, 1, 1)}, "call"),
        ("gpt2 p2 (wte tied to lm_head across stages)", "gpt2", {"pipeline": 2}, "call")],
    4: [("t2x2x1", "fc", {"tensor": (2, 2, 1)}, "call"),
        ("t1x1x2 d2", "fc", {"tensor": (1, 1, 2), "data": 2}, "call"),
        ("t1x2x2 checkpoint full", "fc", {"tensor": (1, 2, 2), "checkpoint": "full"}, "call"),
        ("t2x1x1 d2 per-rank", "fc", {"tensor": (2, 1, 1), "data": 2, "batch": "per-rank"}, "call"),
        ("t2x1x1 d2 shard_optimizer (gradients reduce-scattered)", "fc",
         {"tensor": (2, 1, 1), "data": 2, "shard_optimizer": True}, "call")],
}


DEPTH = {"t1x1x2 d2", "t1x2x2 checkpoint full"}


@pytest.mark.parametrize("world", sorted(CASES))
def test_compiled_matches_eager_and_serial(world, distributed, caplog):
    results = distributed(_compare, world, CASES[world], timeout=900)
    for rank, got in enumerate(results):
        for name, r in got.items():
            assert not r["failed"], f"rank {rank} {name}: fell back to eager: {r['failed']}"
            assert r["runs"] >= 3, f"rank {rank} {name}: {r['runs']} compiled runs in 3 steps"
            for what, err in r["errs"].items():
                assert err < TOL, f"rank {rank} {name}: {what} differ by {err:.2e}"
            eager, comp = r["comm"]
            if "checkpoint" in name:  # compiled, a recomputed block issues again only what backward reads: not
                # the collective that makes its output, which the next block keeps (docs/guide/compile.md)
                assert all(c < e for c, e in zip(comp, eager)), f"rank {rank} {name}: bytes {eager} vs {comp}"
            else:
                assert eager == comp, f"rank {rank} {name}: bytes per step eager {eager} != compiled {comp}"
            held, launched = r["launches"]
            if name in DEPTH:  # depth 2: Inductor buckets the weights' gathers and their gradients'
                # reduce-scatters (compat.inductor_bucketing_options); col's activation gathers depend on each other
                for kind in ("all_gather", "reduce_scatter"):
                    assert 0 < launched.get(kind, 0) < held[kind], f"rank {rank} {name}: {kind} {held} -> {launched}"



def _gpt2_depth_loss_in_forward() -> dict:
    from autopar.examples import zoo

    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=(1, 1, 4), compile=compiled):
            model = zoo.build_model("gpt2")
        x = zoo.example_inputs("gpt2", batch=8, seq=32)[0]
        loss = model(x, labels=x, use_cache=False).loss
        loss.backward()
        rt = runtime_of(model)
        out[compiled] = (loss.item(), {k: v for k, v in rt.full_grads().items() if v is not None},
                         sum(c.compiled_runs for c in rt.compiled_graphs()))
    return out


def test_compiled_gpt2_at_depth_with_labels_does_not_hang(distributed):
    """The batch ranks' compiled graphs issue the same collectives in the same order. Before the fix, the loss
    output's backward (``ops.rows.OnOneRank``) made zeros without the gradient on ranks but batch rank 0, and
    AOTAutograd's partitioner moved the all-reduce after them into those ranks' forward: rank 0's forward held
    one all-reduce fewer, and every rank waited forever. Mutation (the zeros back): the ranks' compile agreement
    (``autopar.runtime.compiled.agreement``) now finds the forwards differ, every rank runs eagerly, and the test
    fails on the compiled runs (0) instead of timing out."""
    for rank, got in enumerate(distributed(_gpt2_depth_loss_in_forward, 4, timeout=300)):
        (eager, eager_grads, _), (comp, comp_grads, runs) = got[False], got[True]
        assert runs >= 1, f"rank {rank}: the forward did not run compiled"
        assert abs(eager - comp) / abs(eager) < TOL, f"rank {rank}: loss {comp} against eager {eager}"
        for k in eager_grads:
            assert rel_err(eager_grads[k], comp_grads[k]) < TOL, f"rank {rank}: gradient of {k}"


def _diverging(case: str) -> dict:
    """FC_Net trained 2 steps eagerly, then compiled with rank 1's (or every rank's) compile made to differ:
    rank 1's Inductor fails; rank 1 does not bucket (its code launches other collectives than rank 0's);
    every rank's backward does not lower."""
    import autopar.compat as inductor
    import autopar.runtime.compiled.graph as compiled

    real = inductor.inductor_compile_graph
    rank = dist.get_rank()

    def fails(gm, inputs, *args, **kwargs):
        raise RuntimeError("injected: this rank's Inductor fails")

    def backward_fails(gm, inputs, *args, **kwargs):
        if kwargs.get("is_backward"):
            raise RuntimeError("injected: the backward does not lower")
        return real(gm, inputs, *args, **kwargs)

    grid = {"tensor": (1, 1, 2)} if case == "unbucketed" else {"tensor": (2, 1, 1)}
    out = {"eager": _train("fc", grid, False, "call", steps=2)}
    patches = {"fails": (inductor, "inductor_compile_graph", fails) if rank == 1 else None,
               "unbucketed": (compiled, "inductor_bucketing_options", lambda size: {}) if rank == 1 else None,
               "backward fails": (inductor, "inductor_compile_graph", backward_fails)}[case]
    if patches is not None:
        module, name, value = patches
        saved = getattr(module, name)
        setattr(module, name, value)
    try:
        out["compiled"] = _train("fc", grid, True, "call", steps=2)
    finally:
        if patches is not None:
            setattr(module, name, saved)
    return out


@pytest.mark.parametrize("case", ["fails", "unbucketed", "backward fails"])
def test_ranks_whose_compiles_differ_all_run_eagerly(case, distributed):
    """Every rank runs a graph compiled, or every rank runs it eagerly (``autopar.runtime.compiled.agreement``):
    a rank whose compile fails or differs turns them all eager, with serial's numbers and no hang. Mutations:
    without the agreement, rank 0 runs compiled beside rank 1's eager graph ('fails': the test fails on
    rank 0's verdict; 'unbucketed': rank 0's two bucketed all-gathers meet rank 1's thirteen, and the ranks
    wait on each other until the test's timeout); with the backward lowered lazily, 'backward fails' raises
    in the first backward."""
    for rank, got in enumerate(distributed(_diverging, 2, case, timeout=600)):
        eager, comp = got["eager"], got["compiled"]
        assert comp["failed"], f"rank {rank}: ran compiled beside a rank that runs eagerly"
        why = comp["failed"][0]
        expected = {"fails": "rank 1 could not compile it" if rank == 0 else "injected: this rank's Inductor fails",
                    "unbucketed": "rank 1's compiled code issues other collectives over ranks [0, 1] than rank 0's",
                    "backward fails": "injected: the backward does not lower"}[case]
        assert expected in why, f"rank {rank}: {why}"
        assert comp["compiled_runs"] == 0, f"rank {rank}: {comp['compiled_runs']} compiled runs"
        assert eager["losses"] == comp["losses"], f"rank {rank}: {eager['losses']} != {comp['losses']}"
        for k in eager["grads"]:
            assert torch.equal(eager["grads"][k], comp["grads"][k]), f"rank {rank}: gradient of {k}"


def _counted_first_steps(counted: dict[int, int], options: dict) -> dict:
    import autopar.config as settings
    from autopar.runtime.compiled import pieces as compiled_pieces

    settings.COMPILE_AGREEMENT_TIMEOUT = 60
    compiled_pieces.PIECE_BYTES = 2**12  # (data 2: the graph in pieces, each agreed on by itself)
    start = time.perf_counter()
    out = _train("fc", options, True, "call", steps=3, counted=counted)
    return {**out, "seconds": time.perf_counter() - start,
            "eager": _train("fc", options, False, "call", counted=counted)}


@pytest.mark.parametrize("options", [{"tensor": (2, 1, 1)}, {"data": 2}], ids=["t2x1x1", "d2 in pieces"])
@pytest.mark.parametrize("counted", [{1: (0,)}, {0: (0, 1), 1: (0, 1)}],
                         ids=["rank 1, one step", "every rank, two steps"])
def test_a_flop_counter_on_one_rank_at_the_first_step_neither_hangs_nor_splits_the_ranks(counted, options,
                                                                                         distributed):
    """Rank 1 counts FLOPs in its first step (a TorchDispatchMode, under which torch.compile does not run), while
    rank 0 compiles and waits to hear from rank 1. Rank 1 tells it to run that call eagerly too, and both compile
    at the next: two compiled runs each (of each piece, at data 2), eager's losses. Every rank counting its first
    two steps compiles at the third. Mutations: rank 1 silent: rank 0 waited out the agreement's timeout (60 s
    here, 30 minutes by default), then ran eagerly for good beside a compiled rank 1; a second such call making
    the graph eager for good: no compiled run in the second case."""
    for rank, got in enumerate(distributed(_counted_first_steps, 2, counted, options, timeout=600)):
        assert not got["failed"], f"rank {rank}: {got['failed']}"
        assert (got["pieces"] > 1) == ("data" in options), f"rank {rank}: {got['pieces']} pieces"
        assert got["compiled_runs"] == (3 - max(map(len, counted.values()))) * max(got["pieces"], 1), \
            f"rank {rank}: {got['compiled_runs']} compiled runs"
        assert got["seconds"] < 55, f"rank {rank}: {got['seconds']:.0f} s"
        for a, b in zip(got["eager"]["losses"], got["losses"]):
            assert abs(a - b) / abs(a) < TOL, f"rank {rank}: {got['eager']['losses']} != {got['losses']}"


@pytest.mark.parametrize("counted", [{1: (1,)}, {0: (1,), 1: (1,)}], ids=["rank 1", "every rank"])
def test_a_flop_counter_at_a_later_step_runs_the_compiled_code_on_every_rank(counted, distributed):
    """At depth 2 the compiled code gathers the weights in 2 bucketed all-gathers where the eager graph issues
    13. A FLOP counter entered at the second step, on rank 1 or on both: the graph runs compiled there too, the
    counter set aside for torch.compile's entry and on again around the compiled code, so every rank issues
    the same collectives; the counter counts the matmuls the compiled code dispatches: eager's FLOPs. Eager's
    losses; three compiled runs each. Mutation: running such a call eagerly (as before 2026-11-29): rank 1's
    13 all-gathers met rank 0's 2, and gloo aborted rank 1 (NCCL may wait for good); on every rank, two
    compiled runs."""
    for rank, got in enumerate(distributed(_counted_first_steps, 2, counted, {"tensor": (1, 1, 2)}, timeout=600)):
        assert not got["failed"], f"rank {rank}: {got['failed']}"
        assert got["compiled_runs"] == 3, f"rank {rank}: {got['compiled_runs']} compiled runs"
        assert got["seconds"] < 55, f"rank {rank}: {got['seconds']:.0f} s"
        assert got["flops"] == got["eager"]["flops"], f"rank {rank}: {got['flops']} != {got['eager']['flops']}"
        assert all(got["flops"].values()), f"rank {rank}: {got['flops']}"
        for a, b in zip(got["eager"]["losses"], got["losses"]):
            assert abs(a - b) / abs(a) < TOL, f"rank {rank}: {got['eager']['losses']} != {got['losses']}"


PIECES = [("d4", "fc", {"data": 4}, "call"),
          ("d4 no_sync accumulation", "fc", {"data": 4}, "no_sync"),
          ("t2x1x1 d2 per-rank", "fc", {"tensor": (2, 1, 1), "data": 2, "batch": "per-rank"}, "call"),
          ("t2x1x1 d2 shard_optimizer", "fc", {"tensor": (2, 1, 1), "data": 2, "shard_optimizer": True}, "call"),
          ("t1x1x2 d2", "fc", {"tensor": (1, 1, 2), "data": 2}, "call"),
          ("t1x2x1 d2 checkpoint full", "fc", {"tensor": (1, 2, 1), "data": 2, "checkpoint": "full"}, "call"),
          ("nanogpt t2x1x1 d2 loss in forward (tied head)", "nano", {"tensor": (2, 1, 1), "data": 2}, "call"),
          ("gpt2 vocab 127 d4 (tied head)", "gpt2", {"data": 4}, "call"),
          ("gpt2 vocab 127 t2x1x1 d2 sequence parallel", "gpt2",
           {"tensor": (2, 1, 1), "data": 2, "sequence_parallel": True}, "call")]



def _pieces_compare(cases: list[tuple]) -> dict:
    from autopar.runtime.compiled import pieces as compiled_pieces
    compiled_pieces.PIECE_BYTES = 2**12  # (tiny models: pieces of 4 KiB of synced gradients)
    return _compare(cases)


def test_a_graph_compiled_in_pieces_matches_eager_and_serial(distributed):
    """Where data-parallel ranks sum gradients during backward, a compiled training graph is cut in pieces
    holding a bucket's worth of those gradients each (``autopar.runtime.compiled.pieces``): the same numbers
    as eager autopar (and serial, FC_Net) on data, tensor x data, depth x data, checkpointed, shard_optimizer,
    per-rank batches, accumulation under no_sync, sequence parallelism, and tied-head LMs (a weight read by the
    first piece and the last)."""
    for rank, got in enumerate(distributed(_pieces_compare, 4, PIECES, timeout=900)):
        for name, r in got.items():
            assert not r["failed"], f"rank {rank} {name}: fell back to eager: {r['failed']}"
            assert r["pieces"] >= 3, f"rank {rank} {name}: {r['pieces']} pieces"
            assert r["runs"] >= 3 * r["pieces"], f"rank {rank} {name}: {r['runs']} compiled runs"
            for what, err in r["errs"].items():
                assert err < TOL, f"rank {rank} {name}: {what} differ by {err:.2e}"
            eager, comp = r["comm"]
            if "checkpoint" in name or "sequence" in name:  # (compiled, they keep what eager sends again)
                assert all(c <= e for c, e in zip(comp, eager)), f"rank {rank} {name}: bytes {eager} vs {comp}"
            else:
                assert eager == comp, f"rank {rank} {name}: bytes per step eager {eager} != compiled {comp}"


def _arrivals(piece_bytes: int) -> dict:
    """When one compiled backward delivers each layer's gradients (a post-accumulate-grad hook of the script's):
    how many compiled pieces had run backward by then (a hook on each compiled node of the autograd graph), on
    four data ranks (plain parameters) and on depth x data (DTensors), each with shard_optimizer or without."""
    from torch import nn

    from autopar.runtime.compiled import pieces as compiled_pieces
    compiled_pieces.PIECE_BYTES = piece_bytes

    def nodes(t: torch.Tensor) -> set:
        seen, todo = set(), [t.grad_fn]
        while todo:
            n = todo.pop()
            if n is not None and n not in seen:
                seen.add(n)
                todo.extend(f for f, _ in n.next_functions)
        return seen

    out = {}
    for options in ({"data": 4}, {"data": 4, "shard_optimizer": True}, {"tensor": (1, 1, 2), "data": 2},
                    {"tensor": (1, 1, 2), "data": 2, "shard_optimizer": True}):
        torch.manual_seed(0)
        with autopar.auto_parallelize(compile=True, **options):
            model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
        model(x).sum().backward()  # (the first call builds the parameters and compiles)
        model.zero_grad()
        ran, seen = [0], {}
        handles = [p.register_post_accumulate_grad_hook(
            lambda _, n=name.split(".")[0]: (seen.setdefault(n, ran[0]), None)[1]) for name, p in model.named_parameters()]
        loss = model(x).sum()
        for node in nodes(loss):
            if "CompiledFunction" in node.name():
                node.register_hook(lambda *_: (ran.__setitem__(0, ran[0] + 1), None)[1])
        loss.backward()
        for h in handles:
            h.remove()
        out[str(options)] = {**seen, "total": ran[0]}
    return out


def test_a_graph_compiled_in_pieces_delivers_each_pieces_gradients_as_its_backward_ends(distributed):
    """Cut in one piece per layer (pieces of 4 KiB of gradients here, a layer's 4.1), each layer's gradients reach
    ``p.grad`` and their data-parallel bucket as soon as its piece ran backward, as eagerly: the sync overlaps
    the rest of backward, and under shard_optimizer a piece's whole gradients go before the next piece's come.
    Mutation (pieces as large as the graph: one piece, the graph compiled whole): every gradient arrives once
    all of backward has run, and the test fails."""
    for rank, got in enumerate(distributed(_arrivals, 4, 2**12, timeout=600)):
        for grid, seen in got.items():
            assert seen == {"3": 1, "2": 2, "1": 3, "0": 4, "total": 4}, (rank, grid, seen)


def _recompute_saved(cases: list[tuple[bool, str, bool]]) -> dict:
    """Bytes a step keeps for backward (the storages autograd saves, parameters aside: a saved-tensors hook sees
    what a compiled graph saves too) and the plan's activations, for a tiny Llama at tensor (2, 1, 1):
    (compiled, checkpoint, collectives kept) for each case; ``collectives kept``: the mutation, a policy that
    tells torch's partitioner to keep every collective's output from forward."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    import passes.insert_checkpoints as inserted
    from autopar.examples import zoo
    from autopar.parallel_model import plan_of

    def keep_collectives(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if getattr(op, "namespace", None) == "_c10d_functional"
                else CheckpointPolicy.PREFER_RECOMPUTE)

    proper = inserted.RECOMPUTE_COLLECTIVES
    ids = torch.randint(0, zoo.VOCAB, (8, zoo.POSITIONS), generator=torch.Generator().manual_seed(3))
    out = {}
    for compiled, checkpoint, kept in cases:
        inserted.RECOMPUTE_COLLECTIVES = (functools.partial(create_selective_checkpoint_contexts, keep_collectives)
                                          if kept else proper)
        torch.manual_seed(0)
        with autopar.auto_parallelize(tensor=(2, 1, 1), checkpoint=checkpoint, compile=compiled):
            model = zoo.build_model("llama", layers=4)
        model(ids, labels=ids, use_cache=False).loss.backward()  # (the parameters exist after the first call)
        params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                  for p in model.parameters()}
        sizes = []
        for _ in range(2):
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in params:
                    seen[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            sizes.append(sum(seen.values()))
        runtime = runtime_of(model)
        failed = [g.failed for g in runtime.compiled_graphs() if g.failed] if compiled else []
        out[(compiled, checkpoint, kept)] = {"saved": sizes[-1], "plan": plan_of(model).memory.activation_bytes,
                                             "failed": failed}
    inserted.RECOMPUTE_COLLECTIVES = proper
    return out


def test_compiled_recompute_issues_collectives_again_and_keeps_only_block_inputs(distributed):
    """Under compile=True a block checkpointed by the plan keeps what eager's checkpoint keeps, not its
    collectives' outputs: ``passes.insert_checkpoints.recomputed`` marks them for recomputation, which torch's
    partitioner otherwise never does. Full recompute cuts the compiled step's saved bytes as much as the eager
    step's, and the plan counts the same activations compiled or eager. Mutation: a policy that keeps the
    collectives' outputs saves more than eager's checkpoint (each block's all-reduced attention output)."""
    cases = [(False, "full", False), (True, "none", False), (True, "full", False), (True, "full", True)]
    for got in distributed(_recompute_saved, 2, cases, timeout=900):
        for case, r in got.items():
            assert not r["failed"], (case, r)
        eager, none, full, kept = (got[c] for c in cases)
        assert full["saved"] <= eager["saved"] and full["saved"] < none["saved"] / 2, got
        assert full["plan"] == eager["plan"] < none["plan"], got
        assert kept["saved"] > eager["saved"], got
