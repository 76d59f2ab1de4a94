"""A page's identity digest: recorded by its writer, checked by every reader where the page lands.

What the check must catch is a page's bytes that are not its own: an
offset reused while the master's metadata was stale, a read that outlived
its lease, a copy torn by a write into the same place. Each of those changes
the bytes throughout the page, so the digest need not read every byte: it
samples ``SAMPLED_WORDS`` 8-byte words spread evenly over the page (the first
and the last among them; every 512th byte of a 32 KiB page) and hashes them
with the page's size. A checked get then costs a few percent of its copy,
where a CRC of every byte cost as much as the copy itself.

It is an identity check, not an integrity check of every byte: a change
that touches no sampled word (a bit flipped between two of them) goes
unnoticed. Shared memory cannot flip bits in transit, and UCX's transports
carry their own link-level checksums.

``page_digests`` digests a whole batch with a few numpy operations, from
the pages' addresses: a thousand-page batch costs no more Python-level steps
than one page. The hash is a sum of the sampled words times fixed odd
constants, finished by a 64-bit mixer, as a non-negative int64 (the master
keeps -1 for "not known").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .bytes_view import flat_uint8

SAMPLED_WORDS = 64
WORD_BYTES = 8

_MULTIPLIERS = np.random.default_rng(0x6B765F6964).integers(0, 2**63, SAMPLED_WORDS, dtype=np.uint64) * np.uint64(
    2
) + np.uint64(1)
_SIZE_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_NON_NEGATIVE = np.uint64(2**63 - 1)
_J = np.arange(SAMPLED_WORDS, dtype=np.int64)
# The same constants as Python integers, for the few-page path.
_MASK_64 = 2**64 - 1
_SIZE_MULTIPLIER_INT, _MIX_1_INT, _MIX_2_INT, _NON_NEGATIVE_INT = (
    int(constant) for constant in (_SIZE_MULTIPLIER, _MIX_1, _MIX_2, _NON_NEGATIVE)
)
_FEW_PAGES = 4  # batches up to this many pages take ``_digest_one`` per page
_MAX_CACHED_SIZES = 64
_word_positions: dict[int, np.ndarray] = {}  # page size -> word indices of its sampled words


def page_digest(data: Any) -> int:
    """The digest of one contiguous buffer (bytes, a memoryview, a numpy array or row, a CPU tensor)."""
    return buffer_digests([data])[0]


def buffer_digests(buffers: Sequence[Any]) -> list[int]:
    """The digest of each contiguous buffer, in one batch."""
    arrays = [flat_uint8(buffer, writable=False) for buffer in buffers]
    addresses = np.array([array.ctypes.data for array in arrays], dtype=np.int64)
    sizes = np.array([array.size for array in arrays], dtype=np.int64)
    return page_digests(addresses, sizes).tolist()


def page_digests(addresses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The digests ([n] int64) of the ``sizes[i]`` bytes at each of ``addresses`` (live, readable memory)."""
    addresses = np.asarray(addresses, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    if not sizes.size:
        return np.zeros(0, dtype=np.int64)
    if sizes.size <= _FEW_PAGES:
        few = [_digest_one(address, size) for address, size in zip(addresses.tolist(), sizes.tolist(), strict=True)]
        if None not in few:
            return np.array(few, dtype=np.int64)
    aligned = (addresses & (WORD_BYTES - 1) == 0) & (sizes >= WORD_BYTES)
    if aligned.all():
        words = _gather_aligned(addresses, sizes)
    else:
        words = np.zeros((len(sizes), SAMPLED_WORDS), dtype=np.uint64)
        if aligned.any():
            words[aligned] = _gather_aligned(addresses[aligned], sizes[aligned])
        for i in np.flatnonzero(~aligned).tolist():
            words[i] = _gather_one(int(addresses[i]), int(sizes[i]))
    with np.errstate(over="ignore"):
        words *= _MULTIPLIERS
        mixed = words.sum(axis=1, dtype=np.uint64)
        mixed ^= sizes.view(np.uint64) * _SIZE_MULTIPLIER
        for multiplier in (_MIX_1, _MIX_2):
            mixed ^= mixed >> np.uint64(33)
            mixed *= multiplier
        mixed ^= mixed >> np.uint64(33)
    mixed &= _NON_NEGATIVE
    return mixed.view(np.int64)


def _digest_one(address: int, size: int) -> int | None:
    """``page_digests`` of one word-aligned page, with Python's integers where the batch path's fixed cost
    (a dozen numpy calls) would be most of a one-page get's check; None for an unaligned or sub-word page."""
    if address & (WORD_BYTES - 1) or size < WORD_BYTES:
        return None
    positions = _word_positions.get(size)
    if positions is None:
        if len(_word_positions) >= _MAX_CACHED_SIZES:
            _word_positions.clear()
        positions = _word_positions[size] = _offsets(np.array([size], dtype=np.int64))[0] >> 3
    words = np.asarray(_Span(address, size >> 3)).take(positions)
    mixed = int(np.dot(words, _MULTIPLIERS))  # uint64: wraps as the batch path's sum does
    mixed ^= (size * _SIZE_MULTIPLIER_INT) & _MASK_64
    for multiplier in (_MIX_1_INT, _MIX_2_INT):
        mixed ^= mixed >> 33
        mixed = (mixed * multiplier) & _MASK_64
    mixed ^= mixed >> 33
    return mixed & _NON_NEGATIVE_INT


def _offsets(sizes: np.ndarray) -> np.ndarray:
    """[n, SAMPLED_WORDS] byte offsets of the sampled words in each page ([1, ...] when every page has the same
    size): evenly spread, word-aligned, the first at 0 and the last ending at the page's last whole word."""
    if len(sizes) and sizes.min() == sizes.max():
        sizes = sizes[:1]
    last = sizes[:, None] - WORD_BYTES
    return (_J[None, :] * last // (SAMPLED_WORDS - 1)) & ~(WORD_BYTES - 1)


def _gather_aligned(addresses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The sampled words of word-aligned pages, read through one view spanning them all (never touching memory
    outside the pages: only the sampled words are read)."""
    base = int(addresses.min())
    span_words = (int((addresses + sizes).max()) - base) >> 3
    memory = np.asarray(_Span(base, span_words))
    positions = ((addresses - base) >> 3)[:, None] + (_offsets(sizes) >> 3)
    return memory.take(positions)


def _gather_one(address: int, size: int) -> np.ndarray:
    """The sampled words of one page that is not word-aligned or is shorter than a word (zero-padded)."""
    page = np.asarray(_Span(address, size, typestr="|u1"))
    padded = np.zeros(max(size, WORD_BYTES), dtype=np.uint8)
    padded[:size] = page
    offsets = _offsets(np.array([padded.size], dtype=np.int64))[0]
    return padded[offsets[:, None] + np.arange(WORD_BYTES)].view("<u8")[:, 0].astype(np.uint64)


class _Span:
    """Memory at an address as an array (numpy's array interface: no copy, and no ctypes type made per length)."""

    def __init__(self, address: int, length: int, typestr: str = "<u8") -> None:
        self.__array_interface__ = {
            "data": (address, True),
            "shape": (length,),
            "typestr": typestr,
            "version": 3,
        }
