"""Dimensions that do not divide by the tensor degree shard unevenly (``decisions.uneven_split``) instead
of staying replicated: GPT-2 with a vocabulary of 127 (its tied embedding/head over 4 ranks: 32+32+32+31)
and a Llama with 130 (33+33+33+31), trained with HF's ``labels=`` loss (the vocabulary-parallel
cross-entropy on uneven pieces). Oracle: the serial model, same seed and data: losses, first-step
gradients, final parameters, the logits ``model(x)`` returns, greedy ``generate()`` tokens, and the plan's
predicted bytes against ``comm_stats()``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.parallel_model import plan_of, runtime_of
from autopar.planning.planner import plan_model
from tests.helpers import rel_err, train_with_labels

TOL = 1e-5
MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=127, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   bos_token_id=0, eos_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=130, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, tie_word_embeddings=False,
                                                      bos_token_id=0, eos_token_id=0)),
}


def build_model(name: str) -> torch.nn.Module:
    import transformers

    config_cls, model_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    for key, value in list(vars(config).items()):  # no dropout: parallel and serial compare number for number
        if ("drop" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    return getattr(transformers, model_cls)(config)


def _data(name: str, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, MODELS[name][2]["vocab_size"], (4, 16), generator=g) for _ in range(steps)]


def _worker(name: str, tensor: tuple[int, int, int]) -> dict:
    data = _data(name)
    torch.manual_seed(0)
    serial = build_model(name)
    want = train_with_labels(serial, data, lambda m: {n: p.grad.clone() for n, p in m.named_parameters()})
    want_params = {k: v.detach().clone() for k, v in serial.state_dict().items()}
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=tensor, data=dist.get_world_size() // (tensor[0] * tensor[1] * tensor[2])):
        model = build_model(name)
    got = train_with_labels(model, data, lambda m: {k: v for k, v in runtime_of(m).full_grads().items()
                                                    if v is not None})
    final = autopar.full_state_dict(model)
    with torch.device("meta"):
        shadow = build_model(name)
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    _, report = plan_model(shadow, (ids,), runtime_of(model).config, kwargs={"labels": ids, "use_cache": False},
                           rank=dist.get_rank())
    return {
        "loss": max(abs(a - b) for a, b in zip(want["losses"], got["losses"])),
        "grads": max(rel_err(want["grads"][k], got["grads"][k]) for k in got["grads"] if k in want["grads"]),
        "params": max(rel_err(want_params[k], final[k]) for k in final if k in want_params),
        "logits": rel_err(want["logits"], got["logits"]),
        "tokens": torch.equal(want["tokens"], got["tokens"]),
        "summary": plan_of(model).summary(),
        "comm": got["comm"],
        "predicted": float(report.comm_bytes_per_step),
        "rank": dist.get_rank(),
    }


def _dcp_and_train_step_worker() -> dict:
    """GPT-2 (127) at t4x1x1: ``dcp.save(model.state_dict())`` of the uneven pieces loads into t2x2x1 (64+63)
    with serial's values, and ``autopar.train_step`` with F.cross_entropy (the vocabulary-parallel loss on
    uneven logits) gives serial's loss and gradients."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F

    data = _data("gpt2")
    torch.manual_seed(0)
    serial = build_model("gpt2")
    plain = F.cross_entropy(serial(data[0], use_cache=False).logits.reshape(-1, 127), data[0].reshape(-1))
    plain.backward()  # train_step's serial meaning (autopar/train.py)
    want_grads = {n: p.grad.clone() for n, p in serial.named_parameters()}
    torch.manual_seed(0)
    with autopar.auto_parallelize(tensor=(4, 1, 1)):
        model = build_model("gpt2")
    loss = autopar.train_step(model, {"input_ids": data[0], "use_cache": False}, data[0], F.cross_entropy)
    got_grads = {k: v for k, v in runtime_of(model).full_grads().items() if v is not None}
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    dcp.save(model.state_dict(), checkpoint_id=box[0])
    with autopar.auto_parallelize(tensor=(2, 2, 1)):
        other = build_model("gpt2")
    other(data[0], use_cache=False)  # sharded: the load reshards into 64+63
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=box[0])
    other.load_state_dict(sd)
    saved, loaded = autopar.full_state_dict(model), autopar.full_state_dict(other)
    return {"loss": abs(loss.item() - plain.item()),
            "grads": max(rel_err(want_grads[k], got_grads[k]) for k in got_grads if k in want_grads),
            "dcp": all(torch.equal(saved[k], loaded[k]) for k in saved),
            "summary": plan_of(other).summary()}


@pytest.mark.slow
def test_uneven_vocabulary_dcp_reshards_and_train_step_matches_serial(distributed):
    for rank, r in enumerate(distributed(_dcp_and_train_step_worker, 4, timeout=600)):
        assert "split unevenly over row=2: 64+63" in r["summary"], r["summary"]
        assert r["loss"] < TOL and r["grads"] < TOL, f"rank {rank}: {r}"
        assert r["dcp"], f"rank {rank}: DCP across grids changed values"


CASES = [("gpt2", (4, 1, 1)), ("gpt2", (1, 4, 1)), ("llama", (1, 4, 1)), ("gpt2", (2, 2, 1))]


@pytest.mark.slow
@pytest.mark.parametrize("name, tensor", CASES, ids=[f"{n}-t{'x'.join(map(str, t))}" for n, t in CASES])
def test_uneven_vocabulary_matches_serial(name, tensor, distributed):
    results = distributed(_worker, 4, name, tensor, timeout=600)
    for rank, r in enumerate(results):
        assert "split unevenly" in r["summary"], r["summary"]
        for what in ("loss", "grads", "params", "logits"):
            assert r[what] < TOL, f"rank {rank}: {what} differ by {r[what]:.2e}"
        assert r["tokens"], f"rank {rank}: generate() tokens differ"
        assert all(c == r["predicted"] for c in r["comm"]), f"rank {rank}: comm_stats {r['comm']} != {r['predicted']}"
