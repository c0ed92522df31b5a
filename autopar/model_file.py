"""The model files the CLIs read (``MODEL.py[:NAME]`` defining ``build_model()`` and ``example_inputs()``),
and meta copies of their inputs at another batch size or sequence length."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.compat import pytree
from autopar.errors import ConfigError


def load_model_file(path: str) -> Any:
    """The module of ``MODEL.py[:NAME]`` (its ``build_model()`` / ``example_inputs()``, NAME passed to both)."""
    path, _, name = path.partition(":")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"model file {path!r} does not exist. Pass a .py file that defines "
                          "build_model() and example_inputs().")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(file.stem, module)
    spec.loader.exec_module(module)
    for fn in ("build_model", "example_inputs"):
        if not callable(getattr(module, fn, None)):
            raise ConfigError(f"{path} does not define {fn}(). It must define build_model() and "
                              "example_inputs().")
    if name:  # model.py:NAME -> build_model(NAME), example_inputs(NAME)
        return _Named(module, name)
    return module


class _Named:
    def __init__(self, module: Any, name: str) -> None:
        self.module, self.name = module, name

    def build_model(self) -> nn.Module:
        return self.module.build_model(self.name)

    def example_inputs(self) -> Any:
        return self.module.example_inputs(self.name)


def meta_inputs(inputs: tuple, batch_size: int | None, seq: int | None = None) -> tuple:
    """Meta copies of ``inputs``; with ``batch_size``, tensors sharing the first tensor's dim 0 get it; with
    ``seq``, tensors of two or more dims sharing its dim 1 (the sequence) get that."""
    leaves, spec = pytree.tree_flatten(inputs)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    first = tensors[0].shape[0] if tensors else None
    length = tensors[0].shape[1] if tensors and tensors[0].dim() > 1 else None
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            shape = list(x.shape)
            if batch_size is not None and x.dim() > 0 and shape[0] == first:
                shape[0] = batch_size
            if seq is not None and x.dim() > 1 and shape[1] == length:
                shape[1] = seq
            x = torch.empty(shape, dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)
        out.append(x)
    return pytree.tree_unflatten(out, spec)
