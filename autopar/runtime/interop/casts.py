"""What ``nn.Module._apply`` does to a parallel model: casts (``model.to(dtype)``, ``.half()``, ``.bfloat16()``,
``.float()``) and moves (``model.to(device)``), before or after its first call.

``_apply`` keeps every Parameter object, but a DTensor one (or one around a ``Pending`` piece) goes through
``torch.utils.swap_tensors``: the same object gets a new value, whose autograd state holds none of the
tensor hooks registered on the parameter (GradSync's, the script's), even when nothing changed
(``model.float()`` of an fp32 model). Each buffer gets a new tensor. And the capture's meta shadow
(``autopar.capture.meta_shadow``) keeps the dtypes it was copied with, while a captured graph fixes the
dtypes it saw (HF's RMSNorm ends in ``.to(input_dtype)``). So at each call (``Casts.check``): a parameter
with a new value gets its hooks attached again (as ``param.data =``, serial's way, keeps them); after a
cast the shadow and the ParamStore's buffer table follow the model, and the runtime keys its graphs by the
model's dtypes: a cast before or after the first call, and back again, runs a graph captured in the dtypes
the call sees.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.compat import reattach_tensor_hooks
from autopar.errors import ParameterError
from autopar.runtime.params.store import ParamStore
from autopar.runtime.params.layout import local_of


class Casts:
    """The dtypes of one parallel model's parameters and buffers, as its graphs were captured for."""

    def __init__(self, model: nn.Module, shadow: nn.Module, store: ParamStore) -> None:
        self._model, self.shadow, self.store = weakref.ref(model), shadow, store
        self._owners = [(weakref.ref(model.get_submodule(name.rpartition(".")[0])), name.rpartition(".")[2])
                        for name in store.buffers]
        """(module, weakly: the model may go; attribute) of every buffer name: read each call (a cast replaces
        the tensors)."""
        params = store.unique()
        self._swapped = [p for p in params if isinstance(p, DTensor)]
        """The parameters ``_apply`` swaps (a plain one gets ``.data`` set, and keeps its hooks)."""
        self._plain = [p for p in params if not isinstance(p, DTensor)]
        self._values = [weakref.ref(local_of(p)) for p in self._swapped]
        """Their values as last seen (weakly: a cast frees the old one)."""
        self.dtypes = self._dtypes([local_of(p) for p in self._swapped])
        """The dtypes the shadow and the buffer table follow now; part of every graph's key."""

    def _dtypes(self, values: list[torch.Tensor]) -> tuple[torch.dtype, ...]:
        return (*[v.dtype for v in values], *[p.dtype for p in self._plain],
                *[getattr(module(), leaf).dtype for module, leaf in self._owners])

    def check(self) -> tuple[torch.dtype, ...]:
        """The model's dtypes now (called once per call, before its graph is looked up; one pass over the
        parameters); after ``_apply``, hooks are attached again, and after a cast the shadow and the buffer
        table follow it first. Raises ``ParameterError`` for a complex cast."""
        values = [local_of(p) for p in self._swapped]
        if any(map(operator.is_not, values, [ref() for ref in self._values])):  # new values (or pieces: adopt)
            for p in self._swapped:
                reattach_tensor_hooks(p)
            self._values = [weakref.ref(v) for v in values]
        dtypes = self._dtypes(values)
        if dtypes == self.dtypes and any(getattr(module(), leaf) is not self.store.buffers[name]
                                         for (module, leaf), name in zip(self._owners, self.store.buffers)):
            # a move (model.to(device)) gave the buffers new tensors: the table follows (the graph read the
            # old ones, on the old device, and a model that moves them back itself paid a copy per call)
            self.store.buffers.update(dict(self._model().named_buffers(remove_duplicate=False)))
        if dtypes != self.dtypes:
            if any(d.is_complex for d in dtypes):
                raise ParameterError(f"{type(self._model()).__name__} was cast to a complex dtype "
                                     f"({next(d for d in dtypes if d.is_complex)}); autopar runs models in real "
                                     "floating-point dtypes. Cast it to float32, bfloat16, float16 or float64.")
            self._follow()
            self.dtypes = dtypes
        return dtypes

    def _follow(self) -> None:
        model = self._model()
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self.store.buffers.update(buffers)  # (pending buffers: the cast copies, built at the first call)
        real = {**self.store.params, **buffers}
        made: dict[int, torch.Tensor] = {}  # a tied shadow tensor stays one
        for name, t in [*self.shadow.named_parameters(remove_duplicate=False),
                        *self.shadow.named_buffers(remove_duplicate=False)]:
            dtype = real[name].dtype
            if t.dtype == dtype:
                continue
            new = made.get(id(t))
            if new is None:
                meta = torch.empty(t.shape, dtype=dtype, device="meta")
                new = made[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
            owner, _, leaf = name.rpartition(".")
            setattr(self.shadow.get_submodule(owner), leaf, new)
