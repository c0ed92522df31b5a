"""The AxoNN tutorial's FC_Net, unchanged: the model of the README's main job.

At num_layers=4, hidden=2048, image_size=64 it has 142,686,218 parameters. For
``python -m autopar.trace`` this file defines ``build_model()`` and ``example_inputs()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FC_Net(nn.Module):
    def __init__(self, num_layers: int, hidden: int, image_size: int, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(image_size**2, hidden)
        self.layers = nn.ModuleList([Block(hidden) for _ in range(num_layers)])
        self.clf = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1)  # (B, 1, S, S) -> (B, S*S)
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.clf(x)


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


#: The tutorial's configuration.
TUTORIAL = dict(num_layers=4, hidden=2048, image_size=64)


def build_model() -> FC_Net:
    return FC_Net(**TUTORIAL)


def example_inputs(batch_size: int = 32) -> tuple[torch.Tensor]:
    s = TUTORIAL["image_size"]
    return (torch.randn(batch_size, 1, s, s),)


def synthetic_mnist(num_batches: int, batch_size: int, image_size: int, seed: int = 0):
    """Deterministic MNIST-shaped batches: (images (B, 1, S, S), labels (B,)). Same on every rank.

    Labels are a fixed random linear function of the image, so the loss can go down.
    """
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(image_size * image_size, 10, generator=g)
    for _ in range(num_batches):
        x = torch.randn(batch_size, 1, image_size, image_size, generator=g)
        yield x, (x.flatten(1) @ teacher).argmax(1)
