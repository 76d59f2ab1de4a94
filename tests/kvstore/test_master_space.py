"""The master's placement and eviction order, and its index of pending puts, with exact expectations."""

from __future__ import annotations

import random

from rayturn.kvstore.master_state import MasterState
from rayturn.kvstore.master_types import MasterConfig

PAGE = 1024


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make(segments: int, **config: object) -> tuple[MasterState, Clock]:
    clock = Clock()
    config.setdefault("heartbeat_timeout_s", 1e9)
    state = MasterState(MasterConfig(**config), clock=clock)  # type: ignore[arg-type]
    add_segments(state, range(segments), 10)
    return state, clock


def add_segments(state: MasterState, indexes: range, pages: int) -> None:
    for i in indexes:
        state.register_segment(f"seg{i}", f"node{i}", f"shm{i}", pages * PAGE, None, PAGE)


def put(state: MasterState, keys: list[bytes], preferred: str | None = None) -> list[str]:
    """Put the keys in one call; the segment each went to."""
    plans = state.put_start(keys, [PAGE] * len(keys), "t", preferred_segment_id=preferred)
    state.put_end(keys)
    return [plan.locations[0].segment_id for plan in plans]


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(count)]


def test_a_puts_pages_spill_to_the_least_used_segment_key_by_key_ties_in_registration_order() -> None:
    state, _ = make(3, high_watermark=0.9, low_watermark=0.5)
    assert put(state, keys("own", 9), "seg0") == ["seg0"] * 9  # at the high watermark: no room for one more
    assert put(state, keys("one", 3), "seg1") == ["seg1"] * 3
    assert put(state, keys("two", 4), "seg2") == ["seg2"] * 4
    # seg1 at 3 pages, seg2 at 4: seg1 until they tie (seg1 first), then whichever holds fewer.
    assert put(state, keys("new", 6), "seg0") == ["seg1", "seg1", "seg2", "seg1", "seg2", "seg1"]
    assert state.counters.evictions == 0


def test_space_freed_during_a_put_is_used_by_its_next_pages() -> None:
    state, clock = make(2, high_watermark=0.9, low_watermark=0.5)
    put(state, keys("a", 9), "seg0")
    put(state, keys("b", 9), "seg1")
    clock.now_s += 1
    # No segment has room: the first page evicts seg0 (the writer's own) down to the low watermark, and the
    # rest go where that freed space is.
    assert put(state, keys("new", 3), "seg0") == ["seg0"] * 3
    assert state.counters.evictions == 5
    assert [key for key in keys("a", 9) if key in state.objects] == keys("a", 9)[5:]


def test_eviction_takes_the_least_recently_used_first() -> None:
    state, clock = make(1, high_watermark=0.9, low_watermark=0.5, lease_ttl_s=1.0)
    written = keys("k", 9)
    for key in written:
        clock.now_s += 1
        put(state, [key])
    clock.now_s += 1
    state.get_locations([written[0]], reader_tenant="t")  # read: used last
    clock.now_s += 1
    assert state.put_start([written[1]], [PAGE], "t")[0].status == "exists"  # a duplicate put uses it too
    clock.now_s += 2  # the read's lease is over
    put(state, [b"new"])
    assert state.counters.evictions == 5
    assert sorted(state.objects) == sorted([written[0], written[1], *written[7:], b"new"])


def test_a_tick_reclaims_overdue_puts_only_and_stats_count_complete_objects() -> None:
    state, clock = make(1, put_timeout_s=5.0)
    state.put_start([b"late"], [PAGE], "t")
    clock.now_s += 3
    state.put_start([b"done", b"pending"], [PAGE, PAGE], "t")
    state.put_end([b"done"])
    clock.now_s += 3
    state.tick()
    assert sorted(state.objects) == [b"done", b"pending"]
    stats = state.stats()
    assert (stats["objects"], stats["complete_objects"], stats["reclaimed_puts"]) == (2, 1, 1)
    assert state.put_end([b"late", b"pending"]) == [False, True]
    assert state.stats()["complete_objects"] == 2
    clock.now_s += 10
    state.tick()
    assert state.stats()["reclaimed_puts"] == 1


def test_a_put_of_many_pages_places_them_as_that_many_puts_of_one_would() -> None:
    """Within one put the master remembers where the last page went; its choices must not differ from
    placing each page afresh, also when quota evictions free space in the middle of a put."""
    rng = random.Random(5)
    config = {"high_watermark": 0.9, "low_watermark": 0.6, "lease_ttl_s": 2.0, "tenant_quota_bytes": {"q": 14 * PAGE}}
    batched, clock = make(4, **config)
    single, single_clock = make(4, **config)
    written: list[bytes] = []
    for step in range(300):
        clock.now_s = single_clock.now_s = 1000.0 + step
        tenant = rng.choice(["q", "o"])
        preferred = rng.choice(["seg0", "seg1", "seg2", "seg3", None])
        new = [f"{step}-{i}".encode() for i in range(rng.randint(1, 8))]
        many = batched.put_start(new, [PAGE] * len(new), tenant, preferred_segment_id=preferred)
        one_by_one = [single.put_start([key], [PAGE], tenant, preferred_segment_id=preferred)[0] for key in new]
        assert many == one_by_one
        batched.put_end(new)
        single.put_end(new)
        written += new
        if rng.random() < 0.3:
            read = rng.sample(written, min(4, len(written)))
            assert batched.get_locations(read, None, tenant) == single.get_locations(read, None, tenant)
        if rng.random() < 0.2:
            gone = rng.sample(written, min(3, len(written)))
            assert batched.remove(gone) == single.remove(gone)
    assert batched.counters == single.counters
    assert batched.counters.evictions > 0


def first_roomy(state: MasterState, preferred: str | None) -> str | None:
    """The segment a single copy of a page goes to by a full scan: the preferred one, then the least used (ties in
    registration order), of those that stay under the high watermark with it."""
    roomy = [
        (segment_id != preferred, segment.allocator.usage, index, segment_id)
        for index, (segment_id, segment) in enumerate(state.segments.items())
        if segment.confirmed
        and segment.allocator.used_bytes + PAGE <= state.config.high_watermark * segment.allocator.capacity_bytes
    ]
    return min(roomy)[3] if roomy else None


def test_a_remembered_placement_is_the_one_a_full_scan_makes_across_puts() -> None:
    """Puts of one page each, from two writers, with removes, reads, leases ending, evictions and a segment that
    leaves and registers again between them: every page goes where a full scan would put it."""
    rng = random.Random(11)
    state, clock = make(0, high_watermark=0.9, low_watermark=0.6, lease_ttl_s=2.0)
    add_segments(state, range(4), 40)
    written: list[bytes] = []
    checked = 0
    for step in range(600):
        clock.now_s = 1000.0 + step / 4
        preferred = rng.choice(["seg0", None])
        expected = first_roomy(state, preferred)
        key = f"{step}".encode()
        plan = state.put_start([key], [PAGE], "t", preferred_segment_id=preferred)[0]
        if expected is not None:
            assert plan.locations[0].segment_id == expected
            checked += 1
        state.put_end([key])
        written.append(key)
        if rng.random() < 0.2:
            state.get_locations(rng.sample(written, min(3, len(written))), None, "t")
        if rng.random() < 0.3:
            state.remove(rng.sample(written, 1))
        if rng.random() < 0.1:
            state.tick()
        if step == 300:
            state.drop_segment("seg2")
        if step == 400:
            add_segments(state, range(2, 3), 40)
    assert checked > 200 and state.counters.evictions > 0


def test_a_segment_that_registers_takes_the_next_page_it_is_first_for() -> None:
    state, _ = make(0, high_watermark=0.9, low_watermark=0.5)
    add_segments(state, range(2), 40)
    assert put(state, keys("own", 36), "seg0") == ["seg0"] * 36  # at the high watermark
    assert put(state, [b"spill"], "seg0") == ["seg1"]
    add_segments(state, range(2, 3), 40)
    assert put(state, [b"next"], "seg0") == ["seg2"]
