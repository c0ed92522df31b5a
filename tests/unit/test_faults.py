"""The fault guards' pieces that need no second rank: how a failed collective is told, the torchrun store trap,
finding the newest complete checkpoint, and the options' checks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from autopar.checkpoints import checkpoint_path, latest_checkpoint, save_checkpoint
from autopar.config import InputConfig
from autopar.errors import ConfigError, InputError
from autopar.runtime.comm import faults
from autopar.runtime.comm import mesh


def test_backend_failures_are_told_and_mistakes_are_not():
    assert faults.is_comm_failure(RuntimeError("[unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation"))
    assert faults.is_comm_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:22402"))
    assert faults.is_comm_failure(dist.DistBackendError("NCCL error in: ..."))
    assert not faults.is_comm_failure(RuntimeError("size of tensor a (64) must match the size of tensor b (32)"))
    assert not faults.is_comm_failure(InputError("timed out"))  # (autopar's own errors pass through)


def test_the_message_names_who_raised_who_waited_and_who_was_silent():
    posts = {1: faults.Post(1, 3, "training", "raised OutOfMemoryError: injected", 1e18),
             2: faults.Post(2, 3, "training", "waited in a collective of the forward", 1e18),
             4: faults.Post(4, 2, "training", f"waited in dist.barrier (the script's), {faults.OUTSIDE}", 1e18)}
    text = faults._message(0, "its training call 3", "waited in a collective of the forward", "Timed out", posts, 5,
                           None)
    assert "Rank 0 waited in a collective of the forward (its training call 3; the collective failed: Timed out)" in text
    assert "Rank 1's training call 3 raised OutOfMemoryError: injected and the script went on" in text
    assert "Rank(s) 2 waited in a collective of the forward (call 3)" in text
    assert "Rank(s) 4 waited in dist.barrier (the script's), outside the model's calls (after call 2)" in text
    assert "Rank(s) 3 sent no account" in text
    post = faults.Post(2, 7, "evaluation", "waited in a | b", 12.5)
    assert faults.Post.parse(2, post.line()) == post and faults.Post.parse(2, "garbage") is None


def test_torchruns_shared_store_with_gloo_and_restarts_is_named_once(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(mesh, "_warned_store", [])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert mesh.shared_store_trap() is None  # (no restart: nothing to warn about)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in mesh.shared_store_trap()
    assert mesh.shared_store_trap() is None  # once
    monkeypatch.setattr(mesh, "_warned_store", [])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert mesh.shared_store_trap() is None


def test_the_newest_complete_checkpoint_skips_partial_and_unfinished_saves(tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    for step, metadata in ((2, True), (10, True), (12, False)):
        path = checkpoint_path(tmp_path, step)
        path.mkdir()
        if metadata:
            (path / ".metadata").write_bytes(b"")
    partial = tmp_path / "step-000000014.partial"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 10)


@pytest.mark.parametrize("kwargs", [{"step": -1}, {"step": True}, {"step": 3, "keep": 0}])
def test_save_checkpoint_refuses_bad_steps_and_keeps(kwargs, tmp_path):
    with pytest.raises(ConfigError):
        save_checkpoint({}, tmp_path, **kwargs)


def test_check_inputs_takes_a_bool():
    with pytest.raises(ConfigError, match="check_inputs"):
        InputConfig(check_inputs="yes")
