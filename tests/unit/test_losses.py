"""``runtime.losses.vocab_parallel_sum`` where every class is on this rank (no split): torch's cross-entropy
(two kernels each way) in place of the split path's ~15, with the same sum, count and gradients as the
split path on one rank and as serial's ``F.cross_entropy(..., reduction="sum")``, ignored targets included. Mutations: the ignore index
not passed to torch (-100 used), or counted among the valid targets: fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.runtime.ops.vocabulary import vocab_parallel_sum
from autopar.runtime.ops.vocabulary import vocab_parallel_losses


class _OneRank:
    """A mesh of one rank on every axis (what the split path reads)."""

    def size(self, axis: str) -> int:
        return 1

    def index(self, axis: str) -> int:
        return 0


@pytest.mark.parametrize("shape", [(6, 10), (2, 5, 17)], ids=["classes", "tokens"])
def test_an_unsplit_cross_entropy_matches_the_split_path_and_serial(shape):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    targets.view(-1)[::3] = -1  # ignored
    total, count = vocab_parallel_sum(_OneRank(), logits, None, targets, -1)
    (grad,) = torch.autograd.grad(total, logits)

    per_row, valid = vocab_parallel_losses(_OneRank(), "", logits, targets, -1)
    split_total = per_row.sum()
    (split_grad,) = torch.autograd.grad(split_total, logits)
    serial = F.cross_entropy(logits.reshape(-1, shape[-1]).float(), targets.reshape(-1), ignore_index=-1,
                             reduction="sum")

    assert count.item() == valid.sum().item() == (targets != -1).sum().item()
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, serial)
    torch.testing.assert_close(total.double(), split_total.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, split_grad, rtol=1e-5, atol=1e-6)
    assert grad.reshape(-1, shape[-1])[::3].abs().sum() == 0  # ignored rows get no gradient
