"""Which machine a plan is priced on: the built-in descriptions (``autopar/hardware/*.json``), a JSON file of
``passes.analysis.machine.Machine``'s fields (what ``python -m autopar.plan --calibrate`` writes), or this
machine as the runtime sees it. The plan search ranks grids on one; the runtime cuts pipeline stages for
the machine it runs on (``local_rates``), and so do the trace and ``plan_model`` unless told another."""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from pathlib import Path

import torch

from autopar.planning.calibrate import cpu_cores
from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.memory import device_budget
from passes.analysis.choose_stages import Hardware
from passes.analysis.machine import Machine

BUILT_IN = ("h100-80gb", "a100-80gb", "cpu")


def load_machine(spec: str, gpus_per_node: int | None = None) -> Machine:
    """A built-in hardware description by name, or a JSON file of ``Machine``'s fields."""
    if spec in BUILT_IN:
        text = resources.files("autopar").joinpath("hardware", f"{spec}.json").read_text()
    elif Path(spec).is_file():
        text = Path(spec).read_text()
    else:
        raise ConfigError(f"unknown hardware {spec!r}: use one of {', '.join(BUILT_IN)} or a JSON file with the "
                          f"fields of passes.analysis.machine.Machine")
    try:
        machine = Machine.from_json(text)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"hardware description {spec!r} is not valid: {e}") from e
    return machine if gpus_per_node is None else dataclasses.replace(machine, gpus_per_node=gpus_per_node)


def device_type_of(machine: Machine) -> str:
    """The device type a machine description's ranks compute on: "cpu" for the built-in CPU and a calibrated
    one (its ``cores``), else "cuda" (what ``auto_parallelize(compile="auto")`` compiles training on)."""
    return "cpu" if machine.cores or machine.name == "cpu" else "cuda"


def compile_arg(text: str) -> bool | str:
    """A CLI's ``--compile`` value as ``auto_parallelize(compile=...)`` takes it."""
    return {"true": True, "false": False}.get(text.lower(), text)


def local_machine(world: int, device: torch.device | None = None) -> Machine:
    """This machine as the search sees it: the built-in description of its GPU (H100, A100; else H100's
    figures) with the device's memory, or the CPU's with its memory shared by the ranks. ``device``: the
    one the ranks compute on (default: the GPU where there is one)."""
    gpu = torch.cuda.is_available() if device is None else device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else ""
    base = load_machine("a100-80gb" if "A100" in name else "h100-80gb" if gpu else "cpu")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return dataclasses.replace(base, memory_bytes=device_budget(device, world), gpus_per_node=max(local, 1),
                               cores=0 if gpu else cpu_cores())


def local_rates(config: ParallelConfig, device: torch.device | None = None) -> Hardware:
    """The rates the runtime cuts ``config``'s pipeline stages with on this machine (``device`` as
    ``local_machine``'s)."""
    return Hardware.of(local_machine(config.world_size, device), config)
