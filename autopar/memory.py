"""Peak memory of a block of code: CUDA allocator statistics, or glibc's heap sampled after every op on CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_reader() -> Any:
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    fn = getattr(libc, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2

    def read() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)  # bytes in use: heap chunks + mmapped blocks
    return read


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
