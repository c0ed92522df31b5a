"""Tensors whose bytes are pages of a file (memory-mapped checkpoints): the ranks' agreement on initial
values does not read them, and cutting a rank's pieces out of them leaves only the pieces resident.

``from_pretrained`` of a safetensors checkpoint (and ``torch.load(path, mmap=True)``) gives parameters
that are views of the file's pages: nothing is read until touched, and each rank's first call touches only
the pages of its own pieces. Fingerprinting every value (``autopar.context``'s agreement check) would read
the whole checkpoint on every rank. A tensor still equal to its file (no page of it written since the
mapping: Linux's ``/proc/self/pagemap`` says which pages are private copies) is fingerprinted by where it
lies in the file (file size, offset, bytes) and a sample of its values (a few pages, spread over it):
ranks that map the same checkpoint agree without reading it; a different or modified file differs in its
size, layout or sampled values, and then every value is compared (and rank 0's broadcast) as before.
Once a rank's piece of such a tensor is copied out, the tensor's pages are unmapped again (``madvise``):
a rank's resident memory holds its pieces plus one whole tensor's pages at a time.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from autopar.memory import LIBC

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_DONTNEED = 4
SAMPLES = 16
"""Windows of one page sampled from a file-backed tensor."""


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    path: str


class FileMaps:
    """This process's file mappings (``/proc/self/maps``) at one moment; empty off Linux."""

    def __init__(self) -> None:
        self.maps: list[Mapping] = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) < 6 or parts[4] == "0" or not parts[5].startswith("/"):
                        continue  # anonymous, heap, stack
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    self.maps.append(Mapping(start, end, int(parts[2], 16), parts[5].rstrip("\n")))
        except OSError:
            return
        self.maps.sort(key=lambda m: m.start)
        self.starts = [m.start for m in self.maps]

    def region(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(file, offset of ``t``'s first byte) if ``t`` is a contiguous CPU tensor lying inside one file
        mapping whose pages were never written by this process; else None."""
        if not self.maps or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0 or ptr + nbytes > self.maps[i].end:
            return None
        m = self.maps[i]
        return (m.path, m.offset + ptr - m.start) if _pristine(ptr, nbytes) else None


def _pristine(ptr: int, nbytes: int) -> bool:
    """No page of [ptr, ptr + nbytes) is a private (written) copy or swapped out: every page present is
    the file's own (pagemap bit 61), the others were never touched."""
    first, last = ptr // PAGE, (ptr + nbytes - 1) // PAGE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    try:
        step = 1 << 16  # pages per read: 512 KiB of entries
        for page in range(first, last + 1, step):
            n = min(step, last + 1 - page)
            raw = os.pread(fd, n * 8, page * 8)
            if len(raw) != n * 8:
                return False
            entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
            present = (entries >> 63) & 1
            swapped = (entries >> 62) & 1
            file_page = (entries >> 61) & 1
            if bool(((present & (1 - file_page)) | swapped).any()):
                return False
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def release_pages(t: torch.Tensor, maps: FileMaps) -> None:
    """Unmaps the resident pages of a file-backed tensor still equal to its file (cutting a piece out of
    it touched them: a column piece touches every row): they stay in the page cache, shared, and a later
    read faults them back from the file. Pages shared with a neighbouring tensor are left alone."""
    madvise = getattr(LIBC, "madvise", None)
    if madvise is None or maps.region(t) is None:
        return
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    start = -(-ptr // PAGE) * PAGE
    end = (ptr + nbytes) // PAGE * PAGE
    if end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


def file_fingerprint(t: torch.Tensor, where: tuple[str, int]) -> torch.Tensor:
    """(1, the layout, a sample's sum, its sum of squares) in float64: equal on ranks that map the same
    bytes of the same checkpoint. ``SAMPLES`` pages of ``t`` are read from the file, not through the
    mapping (touching a mapped page maps its whole page-cache folio: up to 2 MiB of resident memory)."""
    path, offset = where
    nbytes = t.numel() * t.element_size()
    window = max(t.element_size(), PAGE - PAGE % t.element_size())
    windows = min(SAMPLES, -(-nbytes // window))
    stride = (nbytes - window) // max(1, windows - 1) // t.element_size() * t.element_size()
    out = torch.zeros(4, dtype=torch.float64)
    out[0] = 1
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        out[1] = float((size * 1_000_003 + offset * 1_009 + nbytes) % (1 << 50))  # exact in float64
        for k in range(windows):
            start = k * stride
            raw = os.pread(f.fileno(), min(window, nbytes - start), offset + start)
            piece = torch.frombuffer(bytearray(raw), dtype=t.dtype).double()
            out[2] += piece.sum()
            out[3] += piece.square().sum()
    return out


class MappedConversion:
    """A recorded ``.to(dtype/device)`` of a memory-mapped tensor, replayed a chunk at a time: each chunk's
    file pages are unmapped once converted, so a rank holds the converted tensor, not the source too."""

    __name__ = "to (memory-mapped)"
    CHUNK = 1 << 20  # elements

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device

    def __call__(self, source: torch.Tensor) -> torch.Tensor:
        out = torch.empty(source.shape, dtype=self.dtype, device=self.device)
        flat, into = source.reshape(-1), out.view(-1)
        maps = FileMaps()
        for start in range(0, flat.numel(), self.CHUNK):
            chunk = flat[start:start + self.CHUNK]
            into[start:start + self.CHUNK].copy_(chunk)
            release_pages(chunk, maps)
        return out


_archive_paths: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()
"""Per reader (weakly: the reader's file closes with it), the file found."""


def archive_path(reader: Any) -> str | None:
    """The file a ``torch.PyTorchFileReader`` reads (it does not say): the open file of this process
    holding the archive's serialization id where the archive keeps it (one small read per open file; no
    other file is parsed). None off Linux or for an archive without an id (torch < 2.2 wrote none)."""
    if reader in _archive_paths:
        return _archive_paths[reader]
    found = None
    try:
        wanted = reader.serialization_id().encode()
        where = reader.get_record_offset(".data/serialization_id") if wanted else 0
        fds = os.listdir("/proc/self/fd") if wanted else []
    except (OSError, RuntimeError, AttributeError):
        fds = []
    for fd in fds:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if not path.startswith("/") or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                if os.pread(f.fileno(), len(wanted), where) == wanted:
                    found = path
                    break
        except OSError:
            continue
    _archive_paths[reader] = found
    return found


def mapped_record(lazy: Any) -> torch.Tensor | None:
    """A lazily loaded checkpoint tensor (Lightning's ``lazy_load``: it reads its record whole when used)
    as a view of a private mapping of its record's bytes, nothing read yet: cutting a piece out of it reads
    the piece's pages. None when the tensor is not such a one or its file cannot be found (then it is read
    whole). The mapping goes with the last view of it."""
    try:
        reader = lazy.archiveinfo.file_reader
        _, _, key, _, numel = lazy.storageinfo
        storage_offset, size, stride = lazy.rebuild_args[:3]
        dtype = lazy.metatensor.dtype
    except (AttributeError, TypeError, ValueError):
        return None
    if type(lazy.metatensor) is not torch.Tensor or numel == 0 or sys.byteorder != "little":
        return None
    try:
        if reader.has_record("byteorder") and bytes(reader.get_record("byteorder")) != b"little":
            return None
        path = archive_path(reader)
        if path is None:
            return None
        offset = reader.get_record_offset(f"data/{key}")
        nbytes = numel * dtype.itemsize
        start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offset + nbytes:
                return None
            pages = mmap.mmap(f.fileno(), offset + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
    except (OSError, RuntimeError, ValueError):
        return None
    flat = torch.frombuffer(pages, dtype=dtype, count=numel, offset=offset - start)
    return flat.as_strided(size, stride, storage_offset)
