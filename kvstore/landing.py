"""Where a read lands: the caller's buffers as addresses and sizes, and coalesced copies out of mapped segments.

A read of a thousand pages must cost a few Python-level steps, not a
thousand: ``Targets`` takes each destination's address the cheapest way its
kind allows (a tensor's ``data_ptr``, a ctypes view of a numpy array, one
base address for a whole 2-D batch), and ``copy_out`` moves runs of pages
that sit back to back on both sides as one ``memmove`` each.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .bytes_view import as_writable_view
from .segment import Segment

_PARALLEL_COPY_BYTES = 4 << 20  # runs at least this long are split across two threads
_copy_pool: ThreadPoolExecutor | None = None


def _memmove_parallel(dst: int, src: int, num_bytes: int) -> None:
    """memmove, with long runs split in two halves on two threads (``ctypes.memmove`` drops the GIL)."""
    global _copy_pool
    if num_bytes < _PARALLEL_COPY_BYTES or (os.cpu_count() or 1) < 2:
        ctypes.memmove(dst, src, num_bytes)
        return
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")
    half = num_bytes // 2
    second = _copy_pool.submit(ctypes.memmove, dst + half, src + half, num_bytes - half)
    ctypes.memmove(dst, src, half)
    second.result()


def copy_out(segment: Segment, ranges: np.ndarray, addresses: np.ndarray) -> None:
    """Copy ``ranges`` ([n, 2] offset, num_bytes) of a mapped segment to destination ``addresses``.

    Pages written in one batch sit back to back in the segment, and callers
    often land them in consecutive rows of one array: such runs become one
    ``memmove`` each (found with numpy), which moves bytes at memcpy speed
    instead of paying a per-page call.
    """
    if not len(ranges):
        return
    source = segment.array
    base, capacity = source.ctypes.data, source.size
    if len(ranges) == 1:  # one page (a decode step's arrival load is a few): no numpy calls to find runs
        ((offset, num_bytes),) = ranges.tolist()
        if offset < 0 or num_bytes < 0 or offset + num_bytes > capacity:
            raise ValueError(f"range {offset}+{num_bytes} does not fit segment {segment.name}")
        _memmove_parallel(int(addresses[0]), base + offset, num_bytes)
        return
    offsets, sizes = ranges[:, 0], ranges[:, 1]
    outside = np.flatnonzero((offsets < 0) | (sizes < 0) | (offsets + sizes > capacity))
    if outside.size:
        i = int(outside[0])
        raise ValueError(f"range {offsets[i]}+{sizes[i]} does not fit segment {segment.name}")
    ends = offsets + sizes
    continues = (offsets[1:] == ends[:-1]) & (addresses[1:] == addresses[:-1] + sizes[:-1])
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    run_bytes = np.add.reduceat(sizes, starts)
    for start, num_bytes in zip(starts.tolist(), run_bytes.tolist()):
        _memmove_parallel(int(addresses[start]), base + int(offsets[start]), num_bytes)


class Targets:
    """Where a read lands each key: addresses and sizes up front, arrays (for UCX) on demand.

    Addresses come the cheapest way each kind of buffer allows (a tensor's
    ``data_ptr``, a ctypes view of a numpy array's buffer, one base address
    for a whole 2-D batch): at a thousand pages a call, per-buffer overhead
    would cost as much as the copy.
    """

    def __init__(self, buffers: Any, count: int) -> None:
        self.buffers = buffers
        self.batched = _is_batch_array(buffers, count)
        if self.batched:
            self._batch = _flat_rows(buffers, count)
            row_bytes = self._batch.shape[1] if count else 0
            self.addresses = self._batch.ctypes.data + row_bytes * np.arange(count, dtype=np.int64)
            self.sizes = np.full(count, row_bytes, dtype=np.int64)
            return
        if len(buffers) != count:
            raise ValueError(f"{count} keys but {len(buffers)} buffers")
        pairs = [_address(buffer) for buffer in buffers]
        self.addresses = np.array([address for address, _ in pairs], dtype=np.int64)
        self.sizes = np.array([size for _, size in pairs], dtype=np.int64)

    def array(self, i: int) -> np.ndarray:
        """Target ``i`` as a flat writable uint8 array (no copy)."""
        return self._batch[i] if self.batched else _flat_destination(self.buffers[i])


def _is_batch_array(buffers: Any, count: int) -> bool:
    shape = getattr(buffers, "shape", None)
    return shape is not None and len(shape) >= 2 and shape[0] == count


def _flat_rows(buffers: Any, count: int) -> np.ndarray:
    """A C-contiguous array or CPU tensor [count, ...] as a writable uint8 [count, row bytes] view."""
    flat = _flat_destination(buffers)
    return flat.reshape(count, flat.size // count if count else 0)


def _address(buffer: Any) -> tuple[int, int]:
    """(address, size) of a writable, C-contiguous buffer, with the checks ``_flat_destination`` makes."""
    if isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous and buffer.flags.writeable and buffer.nbytes:
        view = ctypes.c_char.from_buffer(buffer)  # type: ignore[arg-type]  # also checks it is writable
        return ctypes.addressof(view), buffer.nbytes
    if callable(getattr(buffer, "data_ptr", None)) and getattr(buffer, "is_cpu", False) and buffer.is_contiguous():
        return buffer.data_ptr(), buffer.nbytes
    flat = _flat_destination(buffer)  # raises a clear error for what cannot be a destination
    return flat.ctypes.data, flat.nbytes


def _flat_destination(buffer: Any) -> np.ndarray:
    """A flat writable uint8 view of a caller's buffer (no copy)."""
    if (
        isinstance(buffer, np.ndarray)
        and buffer.dtype == np.uint8
        and buffer.ndim == 1
        and buffer.flags.c_contiguous
        and buffer.flags.writeable
    ):
        return buffer
    return np.frombuffer(as_writable_view(buffer), dtype=np.uint8)
