"""The page identity digest: the same bytes give the same digest whatever holds them, and another page's bytes,
whole or in part, give another."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayturn.kvstore import digest
from rayturn.kvstore.digest import SAMPLED_WORDS, buffer_digests, page_digest, page_digests

PAGE = 32 << 10


def pages(count: int, size: int = PAGE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def unaligned_copy(page: np.ndarray) -> np.ndarray:
    """The same bytes at an address that is not a multiple of 8."""
    backing = np.zeros(page.size + 1, dtype=np.uint8)
    copy = backing[1:]
    copy[:] = page
    assert copy.ctypes.data % 8 == 1
    return copy


def test_a_page_has_one_digest_whatever_holds_its_bytes() -> None:
    page = pages(1)[0]
    expected = page_digest(page)
    assert expected >= 0
    holders = [page.tobytes(), bytearray(page.tobytes()), memoryview(page.tobytes()), unaligned_copy(page)]
    holders += [page.view(np.float32), torch.from_numpy(page.copy())]
    assert [page_digest(holder) for holder in holders] == [expected] * len(holders)


def test_a_batch_digests_as_its_pages_do_one_by_one() -> None:
    batch = pages(300, seed=1)
    addresses = batch.ctypes.data + PAGE * np.arange(len(batch), dtype=np.int64)
    digests = page_digests(addresses, np.full(len(batch), PAGE, dtype=np.int64))
    assert digests.dtype == np.int64 and (digests >= 0).all()
    assert digests.tolist() == [page_digest(page) for page in batch] == buffer_digests(list(batch))
    assert len(set(digests.tolist())) == len(batch)
    # Aligned and unaligned pages of different sizes mixed in one batch.
    mixed = [batch[0], unaligned_copy(batch[1]), batch[2][:1000], b"abc", b""]
    assert buffer_digests(mixed) == [page_digest(buffer) for buffer in mixed]
    assert page_digests(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)).size == 0


@pytest.mark.parametrize("size", [1, 7, 8, 64, 512, 4096, PAGE])
def test_the_size_is_part_of_the_identity(size: int) -> None:
    assert page_digest(bytes(size)) != page_digest(bytes(size + 8))


def test_another_pages_bytes_in_any_stretch_change_the_digest() -> None:
    """An offset reused for another page, or a copy torn by a write into the same place: any stretch of another
    page's bytes longer than the sampling stride is caught."""
    mine, other = pages(2, seed=2)
    expected = page_digest(mine)
    stride = PAGE // (SAMPLED_WORDS - 1) + 8
    for start in range(0, PAGE - stride + 1, 256):
        torn = mine.copy()
        torn[start : start + stride] = other[start : start + stride]
        assert page_digest(torn) != expected, start
    assert page_digest(other) != expected
    assert page_digest(np.concatenate([other[: PAGE // 2], mine[PAGE // 2 :]])) != expected


def test_short_pages_are_digested_from_every_byte() -> None:
    for size in range(1, 9):
        page = pages(1, size=size, seed=size)[0]
        for i in range(size):
            changed = page.copy()
            changed[i] ^= 0xFF
            assert page_digest(changed) != page_digest(page), (size, i)


def test_a_few_pages_digest_as_a_batch_does() -> None:
    """Batches of up to ``_FEW_PAGES`` pages (a one-page get's check) take Python's integers instead of the
    batch path's numpy calls: the same digest for every size and alignment."""
    backing = pages(1, size=48 << 10, seed=3)[0]
    base = backing.ctypes.data
    rng = np.random.default_rng(4)
    for _ in range(400):
        size = int(rng.integers(1, 40 << 10))
        offset = int(rng.integers(0, 8 << 10)) & ~7 | int(rng.integers(0, 2)) * int(rng.integers(1, 8))
        addresses = np.full(digest._FEW_PAGES + 1, base + offset, dtype=np.int64)
        sizes = np.full(digest._FEW_PAGES + 1, size, dtype=np.int64)
        batch = page_digests(addresses, sizes).tolist()  # one more than the few: the batch path
        assert page_digests(addresses[:1], sizes[:1]).tolist() == batch[:1], (size, offset)
        assert page_digests(addresses[:-1], sizes[:-1]).tolist() == batch[:-1], (size, offset)


def test_the_digest_of_known_bytes_does_not_change() -> None:
    """Writers and readers of different versions share one store: the digest is a format, pinned here on both
    paths (one page, and a batch)."""
    page = np.tile(np.arange(256, dtype=np.uint8), 128)
    sizes = np.array([PAGE, PAGE, 4096, 8, 24], dtype=np.int64)
    expected = [8416825979349620085, 8416825979349620085, 8352561035592089947, 6659313825557896194, 1507779296183026347]
    assert page_digests(np.full(5, page.ctypes.data, dtype=np.int64), sizes).tolist() == expected
    assert [page_digests(np.array([page.ctypes.data]), sizes[i : i + 1])[0] for i in range(5)] == expected
