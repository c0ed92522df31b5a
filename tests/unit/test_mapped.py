"""Memory-mapped checkpoints (autopar/runtime/mapped.py): a tensor still equal to its file is recognized
without reading it, a written one is not, and unmapping the pages a cut touched keeps the values."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.mapped import FileMaps, file_fingerprint, release_pages

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
