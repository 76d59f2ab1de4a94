"""SegmentAllocator: exact offsets of both tiers, error cases, and a seeded property test against a model."""

from __future__ import annotations

import random

import pytest

from rayturn.kvstore.allocator import SegmentAllocator


def _allocate_all(allocator: SegmentAllocator, num_bytes: int, count: int) -> list[int]:
    offsets = [allocator.allocate(num_bytes) for _ in range(count)]
    assert all(offset is not None for offset in offsets)
    return [offset for offset in offsets if offset is not None]


@pytest.mark.parametrize(
    ("capacity_bytes", "page_bytes", "alignment"),
    [(0, None, 64), (-64, None, 64), (1024, 0, 64), (1024, -1, 64), (1024, None, 0), (1024, None, 48)],
)
def test_rejects_bad_configuration(capacity_bytes: int, page_bytes: int | None, alignment: int) -> None:
    with pytest.raises(ValueError):
        SegmentAllocator(capacity_bytes, page_bytes, alignment)


def test_fresh_allocator_is_empty() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    assert (allocator.capacity_bytes, allocator.used_bytes, allocator.free_bytes) == (1024, 0, 1024)
    assert (allocator.usage, allocator.num_allocations, allocator.num_free_page_blocks) == (0.0, 0, 0)
    allocator.check_invariants()


def test_pages_are_carved_in_offset_order() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    assert _allocate_all(allocator, 128, 3) == [0, 128, 256]
    assert (allocator.used_bytes, allocator.free_bytes, allocator.num_allocations) == (384, 640, 3)
    assert allocator.usage == pytest.approx(384 / 1024)


def test_freed_pages_are_reused_lifo() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    _allocate_all(allocator, 128, 3)
    allocator.free(0, 128)
    allocator.free(256, 128)
    assert allocator.num_free_page_blocks == 2
    assert allocator.allocate(128) == 256
    assert allocator.allocate(128) == 0
    assert allocator.allocate(128) == 384  # list empty again: carved from the free range
    allocator.check_invariants()


def test_other_sizes_round_up_and_come_from_the_ranges() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    assert allocator.allocate(128) == 0
    allocator.free(0, 128)  # parked on the page list
    assert allocator.allocate(200) == 128  # rounded to 256, first fit in [128, 1024), page block untouched
    assert allocator.used_bytes == 256
    assert allocator.num_free_page_blocks == 1
    allocator.free(128, 200)
    assert allocator.used_bytes == 0
    allocator.check_invariants()


def test_a_size_that_rounds_to_the_page_block_is_a_page() -> None:
    allocator = SegmentAllocator(1024, page_bytes=100, alignment=64)  # page block: 128 bytes
    assert allocator.allocate(100) == 0
    assert allocator.allocate(65) == 128
    allocator.free(128, 65)
    assert allocator.num_free_page_blocks == 1
    assert allocator.allocate(100) == 128


def test_free_merges_neighbouring_ranges() -> None:
    allocator = SegmentAllocator(1024)
    assert _allocate_all(allocator, 256, 4) == [0, 256, 512, 768]
    assert allocator.allocate(64) is None
    allocator.free(0, 256)
    allocator.free(512, 256)
    assert allocator.allocate(512) is None  # 512 bytes free, but in two pieces
    allocator.free(256, 256)  # joins [0, 256) and [512, 768) into one range
    allocator.check_invariants()
    assert allocator.allocate(768) == 0


def test_parked_page_blocks_are_drained_for_a_large_request() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    offsets = _allocate_all(allocator, 128, 8)
    for offset in offsets:
        allocator.free(offset, 128)
    assert allocator.num_free_page_blocks == 8
    assert allocator.allocate(1024) == 0
    assert allocator.num_free_page_blocks == 0
    allocator.check_invariants()


def test_page_request_returns_none_when_full_or_fragmented() -> None:
    allocator = SegmentAllocator(1024, page_bytes=256)
    assert allocator.allocate(192) == 0
    assert _allocate_all(allocator, 256, 3) == [192, 448, 704]
    assert allocator.allocate(256) is None  # only [960, 1024) is left
    allocator.free(0, 192)
    assert allocator.free_bytes == 256
    assert allocator.allocate(256) is None  # 256 bytes free, but as 192 + 64
    assert allocator.allocate(192) == 0


def test_out_of_space_and_oversized_requests_return_none() -> None:
    allocator = SegmentAllocator(1024)
    assert allocator.allocate(2048) is None
    assert allocator.allocate(1024) == 0
    assert allocator.allocate(1) is None
    with pytest.raises(ValueError):
        allocator.allocate(0)


def test_unaligned_capacity_keeps_offsets_aligned() -> None:
    allocator = SegmentAllocator(1000)
    offsets = [offset for offset in iter(lambda: allocator.allocate(40), None)]
    assert offsets == [64 * i for i in range(15)]  # the 40-byte tail cannot hold a 64-byte block
    assert allocator.used_bytes + allocator.free_bytes == 1000
    allocator.check_invariants()


@pytest.mark.parametrize(
    ("offset", "num_bytes", "message"),
    [(64, 128, "no allocation starts"), (0, 256, "128 bytes are allocated"), (0, 0, "positive")],
)
def test_free_rejects_ranges_that_are_not_allocated(offset: int, num_bytes: int, message: str) -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    assert allocator.allocate(128) == 0
    with pytest.raises(ValueError, match=message):
        allocator.free(offset, num_bytes)
    assert allocator.used_bytes == 128


def test_double_free_raises() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    assert allocator.allocate(300) == 0
    allocator.free(0, 300)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(0, 300)
    allocator.check_invariants()


def test_reserve_inside_a_free_range() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    allocator.reserve(256, 128)
    assert _allocate_all(allocator, 128, 3) == [0, 128, 384]
    allocator.free(256, 128)  # reserved page-sized ranges free like pages
    assert allocator.num_free_page_blocks == 1
    allocator.check_invariants()


def test_reserve_a_block_parked_on_the_page_list() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    _allocate_all(allocator, 128, 3)
    allocator.free(128, 128)
    allocator.reserve(128, 128)
    assert (allocator.num_free_page_blocks, allocator.used_bytes) == (0, 384)
    assert allocator.allocate(128) == 384
    allocator.check_invariants()


def test_reserve_across_a_parked_block_and_a_free_range() -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    _allocate_all(allocator, 128, 2)
    allocator.free(128, 128)
    allocator.reserve(128, 256)  # [128, 256) is parked, [256, 384) is in the free range
    assert allocator.used_bytes == 384
    allocator.check_invariants()


@pytest.mark.parametrize(
    ("offset", "num_bytes"),
    [(64, 128), (0, 64), (896, 256), (-64, 64), (1024, 64), (32, 64)],
    ids=["overlaps-first", "inside-first", "past-end", "negative", "at-end", "unaligned"],
)
def test_reserve_rejects_overlaps_and_bad_bounds(offset: int, num_bytes: int) -> None:
    allocator = SegmentAllocator(1024, page_bytes=128)
    assert allocator.allocate(128) == 0
    with pytest.raises(ValueError):
        allocator.reserve(offset, num_bytes)
    assert (allocator.used_bytes, allocator.num_allocations) == (128, 1)
    allocator.check_invariants()


def _largest_gap_bytes(live: dict[int, int], capacity_bytes: int) -> int:
    """The largest run of bytes not covered by a live allocation of the model."""
    largest, cursor = 0, 0
    for offset in sorted(live):
        largest = max(largest, offset - cursor)
        cursor = offset + live[offset]
    return max(largest, capacity_bytes - cursor)


def _overlaps(live: dict[int, int], offset: int, size_bytes: int) -> bool:
    return any(offset < start + size and start < offset + size_bytes for start, size in live.items())


def _round_up(num_bytes: int, alignment: int) -> int:
    return -(-num_bytes // alignment) * alignment


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_against_a_model(seed: int) -> None:
    """Offsets never overlap, used + free == capacity, and a request fails exactly when no gap fits it."""
    rng = random.Random(seed)
    capacity_bytes, page_bytes, alignment = 64 * 1024 + 40, 1000, 64
    allocator = SegmentAllocator(capacity_bytes, page_bytes, alignment)
    live: dict[int, int] = {}  # offset -> rounded size, the model
    requested: dict[int, int] = {}  # offset -> size asked for
    for _ in range(3000):
        action = rng.random()
        if action < 0.55:
            num_bytes = page_bytes if rng.random() < 0.7 else rng.randint(1, 4000)
            size_bytes = _round_up(num_bytes, alignment)
            fits = _largest_gap_bytes(live, capacity_bytes) >= size_bytes
            offset = allocator.allocate(num_bytes)
            assert (offset is not None) == fits
            if offset is not None:
                assert offset % alignment == 0 and offset + size_bytes <= capacity_bytes
                assert not _overlaps(live, offset, size_bytes)
                live[offset], requested[offset] = size_bytes, num_bytes
        elif action < 0.9 and live:
            offset = rng.choice(sorted(live))
            allocator.free(offset, requested.pop(offset))
            del live[offset]
        else:
            offset = rng.randrange(0, capacity_bytes, alignment)
            num_bytes = rng.choice([page_bytes, rng.randint(1, 3000)])
            size_bytes = _round_up(num_bytes, alignment)
            allowed = offset + size_bytes <= capacity_bytes and not _overlaps(live, offset, size_bytes)
            try:
                allocator.reserve(offset, num_bytes)
            except ValueError:
                assert not allowed
            else:
                assert allowed
                live[offset], requested[offset] = size_bytes, num_bytes
        assert allocator.used_bytes == sum(live.values())
        assert allocator.used_bytes + allocator.free_bytes == capacity_bytes
        assert allocator.num_allocations == len(live)
        allocator.check_invariants()
