"""Lightning Fabric strategy: ``Fabric(strategy="autopar")`` or ``Fabric(strategy=AutoparStrategy(tensor=...))``.

A Fabric script runs on autopar's grid with its own loop unchanged (the AxoNN SC'24 tutorial's
``train.py`` with only the strategy's import changed; AxoNN's ``G_intra_r/c/d`` and ``G_intra_x/y/z``
spellings are accepted):

- ``fabric.init_module(empty_init=True)`` is an ``auto_parallelize`` block: the model is recorded on meta
  and each rank builds only its pieces at the first call (serial's init values, or a checkpoint's).
- ``fabric.setup(model, optimizer)`` parallelizes a model built outside ``init_module`` (whole on every
  rank) and points the optimizer at the parallel model's Parameter objects.
- Every rank feeds its own batch (``distributed_sampler_kwargs`` covers all ranks, as under DDP): the
  global batch is the per-device batch times the world size, so ``gbs // acc // world_size`` per device
  means ``gbs``. Ranks that split the model pool their rows; gradients are averaged over all ranks.
- ``fabric.backward``, ``fabric.no_backward_sync`` (accumulation), ``fabric.clip_gradients`` (norm and
  value, serial's numbers), ``fabric.save``/``fabric.load`` (one serial-format file, or a
  ``torch.distributed.checkpoint`` directory that loads at any grid), and the collectives.

Precision: "32-true" (Fabric's default), "bf16-mixed", "16-mixed" (autopar's own autocast; with fp16 an
overflow on any rank is every rank's, so the GradScaler skips the step everywhere) and "bf16-true".
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import (_get_default_process_group_backend_for_device,
                                                    _init_dist_connection, _sync_ddp_if_available)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from torch import nn

import autopar
from autopar.context import parallelize_module
from autopar.parallel_model import runtime_of, unwrapped
from autopar.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

META_FILE = "meta.pt"
"""A sharded checkpoint's file of everything that is not a model or an optimizer (rank 0's)."""


class AutoparStrategy(ParallelStrategy):
    """Data x pipeline x 3D tensor parallelism (autopar) as a Lightning Fabric strategy.

    Args:
        tensor: ``(row, col, depth)`` degrees; AxoNN's ``G_intra_r``/``G_intra_c``/``G_intra_d`` (or
            ``G_intra_x``/``G_intra_y``/``G_intra_z``) give them one by one. Default (1, 1, 1).
        data: data-parallel degree (default: the ranks the other degrees leave).
        pipeline: pipeline ranks (default 1).
        plan: "auto": the degrees not given are chosen by autopar's plan search at the model's first call.
        save_distributed_checkpoint: ``fabric.save`` writes a ``torch.distributed.checkpoint`` directory
            (each rank its pieces; loads at any grid) when True (default), else one serial-format file.
        autopar_options: further ``auto_parallelize`` keywords (``checkpoint``, ``microbatches``, ...).
    """

    def __init__(self, tensor: tuple[int, int, int] | None = None, data: int | None = None,
                 pipeline: int | None = None, plan: str | None = None, *, G_intra_r: int | None = None,
                 G_intra_c: int | None = None, G_intra_d: int | None = None, G_intra_x: int | None = None,
                 G_intra_y: int | None = None, G_intra_z: int | None = None, G_data: int | None = None,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 precision: Precision | None = None, **autopar_options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self.tensor = _tensor_degrees(tensor, (G_intra_r, G_intra_c, G_intra_d), (G_intra_x, G_intra_y, G_intra_z))
        if G_data is not None and data is not None and G_data != data:
            raise ConfigError(f"data={data} and G_data={G_data} disagree: give one of them.")
        self.data = data if data is not None else G_data
        self.pipeline, self.plan = pipeline, plan
        if "batch" in autopar_options:
            raise ConfigError("AutoparStrategy feeds every rank its own batch (batch='per-rank', as Fabric's "
                              "DistributedSampler does); the batch option is not one to set here.")
        self.options = autopar_options
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._backward_sync_control = _NoSync()

    # ---- processes -----------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank draws its own rows (the ranks that split the model pool theirs)."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)

    # ---- the model -----------------------------------------------------------------------------------

    def _context_options(self) -> dict[str, Any]:
        return dict(tensor=self.tensor, data=self.data, pipeline=self.pipeline, plan=self.plan, batch="per-rank",
                    precision=_autopar_precision(self.precision), **self.options)

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """An ``auto_parallelize`` block: modules built inside are parallel when it ends. Their parameters are
        built at the first call, each rank its pieces, with serial's values (or the checkpoint's loaded
        before it), whether or not ``empty_init`` is asked for. Under "bf16-true" they are built in bf16."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(autopar.auto_parallelize(**self._context_options()))
        return stack

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def setup_module(self, module: nn.Module) -> nn.Module:
        """A model built inside ``init_module`` is parallel already; one built outside is parallelized here
        (whole on every rank until its first call keeps each rank's pieces)."""
        if _is_parallel(module):
            return module
        options = {k: v for k, v in self._context_options().items() if k != "defer_init"}  # (built already)
        return parallelize_module(module, **options)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        """As ``setup_module``; optimizers built over the model before it now hold the parallel model's
        Parameter objects (the same ones, when the model was built inside ``init_module``)."""
        before = {name: p for name, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        after = dict(module.named_parameters(remove_duplicate=False))
        swap = {id(p): after[name] for name, p in before.items() if after.get(name) is not p}
        for optimizer in optimizers:
            _repoint(optimizer, swap)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def module_to_device(self, module: nn.Module) -> None:
        pass  # autopar places each rank's pieces on its device

    # ---- collectives ---------------------------------------------------------------------------------

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ---- checkpoints ---------------------------------------------------------------------------------

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``fabric.save``: a ``torch.distributed.checkpoint`` directory (``save_distributed_checkpoint``,
        default; each rank writes its pieces, plus ``meta.pt`` with the rest of ``state`` from rank 0) or
        one file in the serial model's format (``torch.load`` + ``load_state_dict`` in a serial script)."""
        if storage_options is not None:
            raise TypeError("AutoparStrategy.save_checkpoint(..., storage_options=...) is not supported: it does "
                            "not use a CheckpointIO plugin.")
        if filter is not None and self._save_distributed_checkpoint:
            raise NotImplementedError("fabric.save(..., filter=...) writes one file: use AutoparStrategy("
                                      "save_distributed_checkpoint=False) (a sharded checkpoint missing entries "
                                      "would not load back).")
        path = Path(self.broadcast(str(path)))
        model = _the_model(state, "save")
        if self._save_distributed_checkpoint:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
            tensors, meta = {}, {}
            optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
            for key, obj in state.items():
                if obj is model:
                    tensors[key] = get_state_dict(model, [])[0]
                elif key in optimizers:
                    tensors[key] = get_state_dict(model, obj)[1]
                else:
                    meta[key] = obj.state_dict() if hasattr(obj, "state_dict") else obj
            dcp.save(tensors, checkpoint_id=path)
            if self.global_rank == 0:
                torch.save(meta, path / META_FILE)
            self.barrier()
            return
        full: dict[str, Any] = {}
        for key, obj in state.items():
            if obj is model:
                value = autopar.full_state_dict(model)
            elif isinstance(obj, torch.optim.Optimizer):
                value = autopar.full_optimizer_state_dict(model, obj)
            else:
                value = obj.state_dict() if hasattr(obj, "state_dict") else obj
            keep = (filter or {}).get(key)  # Fabric's filter: (name, value) -> whether that entry is saved
            full[key] = {k: v for k, v in value.items() if keep(k, v)} if keep and isinstance(value, dict) else value
        if self.global_rank == 0:
            if path.is_dir():
                shutil.rmtree(path)
            torch.save(full, path)
        self.barrier()

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """``fabric.load``: either kind of ``save_checkpoint``'s checkpoint, saved at any grid (or by a serial
        script: ``{"model": model.state_dict(), ...}`` in one file), into ``state``'s model, optimizers and
        objects in place; returns what ``state`` did not ask for."""
        path = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not state:
            raise ValueError("AutoparStrategy.load_checkpoint needs the objects to load into: "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer, ...}).")
        model = _the_model(state, "load")
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        if path.is_dir():
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

            keys = {k for k, v in state.items() if v is model or k in optimizers}
            tensors = {k: get_state_dict(model, [])[0] if state[k] is model else get_state_dict(model, state[k])[1]
                       for k in keys}
            dcp.load(tensors, checkpoint_id=path)
            for key in keys:
                if state[key] is model:
                    set_state_dict(model, [], model_state_dict=tensors[key], optim_state_dict={},
                                   options=StateDictOptions(strict=strict))
                    continue
                set_state_dict(model, state[key], model_state_dict={}, optim_state_dict=tensors[key])
            rest = torch.load(path / META_FILE, weights_only=weights_only is not False) \
                if (path / META_FILE).exists() else {}
        elif path.is_file():
            rest = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only is not False)
            for key in [k for k, v in state.items() if v is model or k in optimizers]:
                if key not in rest:
                    raise CheckpointError(f"{path} has no {key!r} entry (it has {sorted(rest)}).")
                value = rest.pop(key)
                if state[key] is model:
                    model.load_state_dict(value, strict=strict)
                else:
                    autopar.load_full_optimizer_state_dict(model, state[key], value)
        else:
            raise FileNotFoundError(f"no checkpoint at {path}")
        for key, obj in state.items():
            if obj is model or key in optimizers:
                continue
            if key not in rest:
                if strict:
                    raise KeyError(f"{path} has no {key!r} entry (strict=True; it has {sorted(rest)}).")
                continue
            value = rest.pop(key)
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return rest


def _autopar_precision(plugin: Precision) -> str:
    """autopar's ``precision`` for Fabric's plugin. "bf16-mixed"/"16-mixed": autopar runs the graph under
    autocast itself (outputs fp32) and, with fp16, makes every rank see an overflow any rank had, so the
    plugin's GradScaler skips the step everywhere. "32-true"/"bf16-true": the parameters' own dtype."""
    if type(plugin) is MixedPrecision:
        return {"bf16-mixed": "bf16", "16-mixed": "fp16"}[plugin.precision]
    if type(plugin) in (Precision, HalfPrecision):  # "bf16-true" / "16-true": parameters in that dtype
        return "fp32"
    raise ConfigError(f"AutoparStrategy runs Fabric's precisions 32-true, bf16-mixed, 16-mixed and bf16-true; "
                      f"{type(plugin).__name__} is not one of them.")


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradients stay local (summed into ``.grad``) for accumulation."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return autopar.no_sync(module) if enabled else contextlib.nullcontext()


def _is_parallel(module: nn.Module) -> bool:
    try:
        runtime_of(module)
    except autopar.AutoparError:
        return False
    return True


def _the_model(state: dict[str, Any], what: str) -> nn.Module:
    models = [unwrapped(v) for v in state.values() if isinstance(v, nn.Module) and _is_parallel(v)]
    if len(models) != 1:
        raise CheckpointError(f"fabric.{what} needs exactly one model set up by AutoparStrategy in its state "
                              f"(found {len(models)}): {what} each model under its own path.")
    for key, value in state.items():
        if isinstance(value, nn.Module) and unwrapped(value) is models[0]:
            state[key] = models[0]
    return models[0]


def _repoint(optimizer: torch.optim.Optimizer, swap: dict[int, nn.Parameter]) -> None:
    """Replaces parameters an optimizer holds by their parallel successors (and its state's keys)."""
    if not swap:
        return
    for group in optimizer.param_groups:
        group["params"] = [swap.get(id(p), p) for p in group["params"]]
    for old in [p for p in optimizer.state if id(p) in swap]:
        optimizer.state[swap[id(old)]] = optimizer.state.pop(old)


def _tensor_degrees(tensor: Any, rcd: tuple, xyz: tuple) -> tuple[int, int, int] | None:
    given = [(name, t) for name, t in (("tensor", tensor), ("G_intra_r/c/d", rcd if any(v is not None for v in rcd)
                                       else None), ("G_intra_x/y/z", xyz if any(v is not None for v in xyz)
                                                    else None)) if t is not None]
    if len(given) > 1:
        raise ConfigError(f"the tensor degrees are given twice ({' and '.join(n for n, _ in given)}): give one.")
    if not given:
        return None
    name, value = given[0]
    if name == "tensor":
        return tuple(value)
    return tuple(1 if v is None else int(v) for v in value)


STRATEGY_REGISTRY.register("autopar", AutoparStrategy, description="autopar: data x pipeline x 3D tensor parallelism",
                           override=True)
