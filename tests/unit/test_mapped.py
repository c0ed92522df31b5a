"""Memory-mapped checkpoints (autopar/runtime/construction/memory_mapped.py): a tensor still equal to its file is recognized
without reading it, a written one is not, and unmapping the pages a cut touched keeps the values."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from autopar.runtime.construction.memory_mapped import FileMaps, archive_path, file_fingerprint, release_pages

pytestmark = pytest.mark.skipif(not FileMaps().maps, reason="needs Linux's /proc/self/maps")


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile"):
                return int(line.split()[1])
    raise RuntimeError("RssFile")


def _saved(tmp_path, name: str, seed: int) -> str:
    torch.manual_seed(seed)
    (tmp_path / name).mkdir()
    path = str(tmp_path / name / "ckpt.pt")  # (torch.save's zip names its records after the file)
    torch.save({"w": torch.randn(1024, 512), "b": torch.randn(512)}, path)
    return path


def test_a_pristine_mapped_tensor_is_fingerprinted_by_place_and_sample(tmp_path):
    a, same, other = _saved(tmp_path, "a", 0), _saved(tmp_path, "same", 0), _saved(tmp_path, "other", 1)
    sds = [torch.load(p, mmap=True) for p in (a, same, other)]
    maps = FileMaps()
    where = [maps.region(sd["w"]) for sd in sds]
    assert all(w is not None for w in where)
    assert where[0][0].endswith("a/ckpt.pt") and where[0][1] > 0
    prints = [file_fingerprint(sd["w"], w) for sd, w in zip(sds, where)]
    assert torch.equal(prints[0], prints[1])      # the same bytes in another copy of the checkpoint
    assert not torch.equal(prints[0], prints[2])  # another checkpoint of the same shapes
    assert maps.region(sds[0]["w"][:, :10]) is None  # not contiguous
    assert maps.region(torch.randn(8)) is None        # heap memory


def test_a_written_mapped_tensor_is_no_longer_its_file(tmp_path):
    """The mutation: a value changed after loading must be compared by value (pagemap's private pages)."""
    sd = torch.load(_saved(tmp_path, "a", 0), mmap=True)
    assert FileMaps().region(sd["w"]) is not None
    sd["w"][100].add_(1.0)  # one page becomes a private copy
    assert FileMaps().region(sd["w"]) is None
    sd["b"].sum()  # read only: still the file's pages
    assert FileMaps().region(sd["b"]) is not None


def test_releasing_touched_pages_keeps_the_values(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "big.pt")
    want = torch.randn(4096, 1024)  # 16 MiB
    torch.save({"w": want}, path)
    w = torch.load(path, mmap=True)["w"]
    before = _rss_file_kib()
    piece = w[:, :512].clone()  # a column piece touches every row's pages
    touched = _rss_file_kib() - before
    assert touched > 8 * 1024
    release_pages(w, FileMaps())
    assert _rss_file_kib() - before < touched / 4
    assert torch.equal(w, want) and torch.equal(piece, want[:, :512])  # faulted back from the file


def test_a_lazily_loaded_tensor_is_read_only_in_the_piece_cut_from_it(tmp_path):
    """litgpt's load_checkpoint hands the model Lightning's lazy_load tensors (each read whole on use);
    autopar reads one as a view of its file: a rank's row piece maps half the pages, not all of them.
    Mutation: reading through the lazy tensor itself (mapped_record -> None) reads the whole tensor."""
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.load import _lazy_load

    from autopar.runtime.construction.pending import LazyRead

    torch.manual_seed(0)
    path = str(tmp_path / "lit_model.pth")
    want = {"w": torch.randn(8192, 1024), "p": torch.nn.Parameter(torch.randn(8, 8)),
            "half": torch.randn(64, 32).to(torch.bfloat16), "t": torch.randn(16, 8).t()}
    torch.save(want, path)
    other = _lazy_load(_saved(tmp_path, "other", 1))  # another archive open in the process
    lazy = _lazy_load(path)
    assert archive_path(lazy["w"].archiveinfo.file_reader) == path
    assert archive_path(other["w"].archiveinfo.file_reader).endswith("other/ckpt.pt")
    del other
    read = {k: LazyRead(v).read() for k, v in lazy.items()}
    assert all(torch.equal(read[k], want[k].detach()) and read[k].dtype == want[k].dtype for k in want)
    w = LazyRead(lazy["w"]).read()
    assert FileMaps().region(w) is not None  # pages of the file, nothing read yet
    before = _rss_file_kib()
    piece = w[:4096].clone()
    assert 14 * 1024 < _rss_file_kib() - before < 22 * 1024  # half of 32 MiB (and the kernel's fault-around)
    assert torch.equal(piece, want["w"][:4096])
    del w, read
    assert _rss_file_kib() - before < 1024  # the mapping went with its last view
    del lazy
    gc.collect()
    open_fds = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    assert path not in open_fds  # the file closes with the loader's archive (nothing of autopar's keeps it)
