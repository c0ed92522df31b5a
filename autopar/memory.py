"""Peak memory of a block of code: CUDA allocator statistics, or glibc's heap sampled after every op on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.compat import TorchDispatchMode, pytree


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _load_libc() -> Any:
    try:
        path = ctypes.util.find_library("c")
        return ctypes.CDLL(path, use_errno=True) if path else None
    except OSError:
        return None


LIBC = _load_libc()
"""The C library (None where there is none to load): glibc's heap statistics, malloc_trim, madvise."""


def release_freed_memory() -> None:
    """Hands freed heap pages back to the system (glibc's malloc_trim; nothing elsewhere). A whole tensor
    freed while smaller long-lived ones (pieces, recorded states) were allocated after it leaves a hole
    glibc keeps resident: replaying GPT-2 (774 MiB) kept 1.3 GiB resident per rank without this."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _heap_reader() -> Any:
    fn = getattr(LIBC, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2

    def read() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)  # bytes in use: heap chunks + mmapped blocks
    return read


def bytes_in_use(device: torch.device) -> int:
    """What PeakMemory reads: the CUDA allocator's bytes in use, or glibc's heap in use on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    read = _heap_reader()
    if read is None:
        raise RuntimeError("reading memory on CPU needs glibc's mallinfo2 (glibc >= 2.33).")
    return read()


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as m: ...`` then ``m.peak_bytes``: the most bytes in use above the start.

    On CPU it samples glibc's ``mallinfo2`` after every ATen op (tensor memory comes from malloc),
    which includes tensors autograd saves for backward; on CUDA it reads the allocator's peak.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self._read = _heap_reader() if self.device.type == "cpu" else None
        if self.device.type == "cpu" and self._read is None:
            raise RuntimeError("PeakMemory on CPU needs glibc's mallinfo2 (glibc >= 2.33).")
        self.start = self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = self.peak = torch.cuda.memory_allocated(self.device)
        else:
            self.start = self.peak = self._read()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._read is not None:
            self.peak = max(self.peak, self._read())
        return out

    @property
    def peak_bytes(self) -> int:
        return self.peak - self.start


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...`` then ``m.peak_bytes()``: exact live bytes of tensors created inside.

    Every storage an ATen op allocates is tracked until it is freed (a weak reference to the storage
    expires), on any device, meta included. An output sharing an input's storage (a view) allocates
    nothing and is not counted, nor are storages made before the block (parameters and their views). Unlike
    ``PeakMemory`` it does not see the allocator, so it is exact and noise-free, and
    ``peak_bytes(exclude=...)`` can leave out storages that outlive the block on purpose
    (parameter gradients).
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # cdata -> (ref, bytes, event index)
        self.events: list[tuple[int, int]] = []
        """(storage cdata, +bytes at allocation / -bytes when found freed), in order."""
        self.ops: set[Any] = set()
        """Every ATen op that ran (which kernels a model took, e.g. fused or math attention)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.add(func)
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for key, (ref, nbytes, _) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.events.append((key, -nbytes))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self._live and ref.cdata not in inputs:  # views allocate nothing
                    self._live[ref.cdata] = (ref, storage.nbytes(), len(self.events))
                    self.events.append((ref.cdata, storage.nbytes()))
        return out

    def peak_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """The most bytes live at once, leaving out the storages of ``exclude`` (still alive at the end)."""
        keys = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
        skip = {self._live[k][2] for k in keys if k in self._live}  # their (still live) allocation events
        live = peak = 0
        for i, (_, delta) in enumerate(self.events):
            if i in skip:
                continue
            live += delta
            peak = max(peak, live)
        return peak


def device_budget(device: torch.device, ranks: int) -> int:
    """checkpoint="auto"'s budget per rank: the GPU's memory, or on CPU the machine's physical memory
    shared by its ranks (``LOCAL_WORLD_SIZE`` from torchrun, else ``ranks``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1)


def half_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a MemoryConfig precision: None for fp32."""
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
