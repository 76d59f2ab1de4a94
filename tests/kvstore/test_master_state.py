"""Master state machine: two-phase puts, leases, pins, watermark eviction, quotas, restarts."""

from __future__ import annotations

import pytest

from rayturn.kvstore.master_state import MasterState
from rayturn.kvstore.master_types import Location, MasterConfig, ObjectState

PAGE = 1024


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make(capacity: int = 10 * PAGE, segments: int = 1, **config: object) -> tuple[MasterState, Clock]:
    clock = Clock()
    config.setdefault("heartbeat_timeout_s", 1e9)  # tests that move the clock far keep their segments
    state = MasterState(MasterConfig(**config), clock=clock)  # type: ignore[arg-type]
    for i in range(segments):
        state.register_segment(f"seg{i}", f"node{i}", f"shm{i}", capacity, ("127.0.0.1", 9000 + i), PAGE)
    return state, clock


def put(state: MasterState, keys: list[bytes], **kwargs: object) -> list[str]:
    plans = state.put_start(keys, [PAGE] * len(keys), "t", **kwargs)  # type: ignore[arg-type]
    state.put_end([k for k, p in zip(keys, plans) if p.status == "write"])
    return [p.status for p in plans]


def test_two_phase_put_then_get() -> None:
    state, _ = make()
    (plan,) = state.put_start([b"a"], [PAGE], "t")
    assert plan.status == "write" and plan.locations == (Location("seg0", 0, PAGE),)
    assert state.exists([b"a"], "t") == [False]  # pending is not readable
    assert state.get_locations([b"a"], reader_tenant="t") == [None]
    assert state.put_end([b"a"]) == [True]
    assert state.exists([b"a"], "t") == [True]
    assert state.get_locations([b"a"], "node0", "t") == [[Location("seg0", 0, PAGE)]]


def test_duplicate_put_is_a_success_and_writes_nothing() -> None:
    state, _ = make()
    assert put(state, [b"a"]) == ["write"]
    assert put(state, [b"a"]) == ["exists"]
    # Two writers racing on one key: the second is told it exists while the first writes.
    (first,) = state.put_start([b"b"], [PAGE], "t")
    (second,) = state.put_start([b"b"], [PAGE], "t")
    assert (first.status, second.status) == ("write", "exists")
    assert state.put_end([b"b"]) == [True]
    assert state.stats()["objects"] == 2


def test_unfinished_put_is_reclaimed_after_timeout_and_revoke_frees_once_its_grant_is_over() -> None:
    state, clock = make(put_timeout_s=5.0)
    state.put_start([b"a", b"b"], [PAGE, PAGE], "t")
    state.put_revoke([b"b"])
    assert b"b" not in state.objects
    # The writer's grant for "b" lasts half the put timeout: a late write may still land, so the
    # space waits for the put's deadline before anything else may go there.
    assert state.segments["seg0"].allocator.used_bytes == 2 * PAGE
    clock.now_s += 6
    state.tick()
    assert state.objects == {} and state.segments["seg0"].allocator.used_bytes == 0
    assert state.put_end([b"a"]) == [False]  # too late: the writer learns it failed
    assert state.counters.reclaimed_puts == 1
    assert state.counters.lease_expiries == 0  # no reader held a lease on either


def test_watermark_eviction_runs_before_a_put_would_fail() -> None:
    state, clock = make(capacity=10 * PAGE)
    for i in range(10):
        clock.now_s += 1
        put(state, [bytes([i])])
    # Past 90%: the 10th put already brought usage back to the 80% watermark.
    assert state.segments["seg0"].allocator.usage <= 0.8
    assert state.exists([bytes([0]), bytes([1])], "t") == [False, False]  # least recently used went first
    assert all(state.exists([bytes([i]) for i in range(2, 10)], "t"))


def test_leased_and_pinned_objects_are_not_evicted() -> None:
    state, clock = make(capacity=4 * PAGE, high_watermark=0.9, low_watermark=0.5)
    put(state, [b"leased", b"soft", b"hard", b"plain"])
    state.get_locations([b"leased"], reader_tenant="t")  # lease for lease_ttl_s
    state.pin([b"soft"], ttl_s=30.0)
    state.pin([b"hard"], ttl_s=None)
    clock.now_s += 1
    assert put(state, [b"new"]) == ["write"]  # needs room: only "plain" may go
    assert state.exists([b"leased", b"soft", b"hard", b"plain", b"new"], "t") == [True, True, True, False, True]
    clock.now_s += 60  # lease and soft pin over; the hard pin holds
    state.tick()
    assert state.exists([b"hard"], "t") == [True]
    assert put(state, [b"x", b"y"]) == ["write", "write"]
    assert state.exists([b"hard"], "t") == [True]
    state.unpin([b"hard"])
    assert state.segments["seg0"].allocator.used_bytes <= 4 * PAGE


def test_remove_of_a_leased_object_frees_space_when_the_lease_ends() -> None:
    state, clock = make(lease_ttl_s=10.0)
    put(state, [b"a"])
    state.get_locations([b"a"], reader_tenant="t")
    assert state.remove([b"a"]) == 1
    assert state.exists([b"a"], "t") == [False]
    assert state.segments["seg0"].allocator.used_bytes == PAGE  # a reader may still be copying
    clock.now_s += 11
    state.tick()
    assert state.segments["seg0"].allocator.used_bytes == 0
    assert state.counters.lease_expiries == 1


def test_replicas_go_to_different_segments_preferring_other_nodes() -> None:
    state, _ = make(segments=3)
    state.segments["seg1"].node_id = "node0"  # seg0 and seg1 share a node
    (plan,) = state.put_start([b"a"], [PAGE], "t", replicas=2, preferred_segment_id="seg0")
    assert [loc.segment_id for loc in plan.locations] == ["seg0", "seg2"]
    state.put_end([b"a"])
    # A reader on node2 is sent to its own node's replica first.
    (locations,) = state.get_locations([b"a"], "node2", "t")
    assert locations is not None and [loc.segment_id for loc in locations] == ["seg2", "seg0"]


def test_silent_segment_loses_its_replicas() -> None:
    state, clock = make(segments=2, heartbeat_timeout_s=3.0)
    state.put_start([b"a"], [PAGE], "t", replicas=2, preferred_segment_id="seg0")
    state.put_end([b"a"])
    put(state, [b"only"], preferred_segment_id="seg1")
    clock.now_s += 2
    state.heartbeat("seg0")
    clock.now_s += 2
    state.tick()  # seg1 silent for 4 s
    assert "seg1" not in state.segments
    assert state.get_locations([b"a"], reader_tenant="t") == [[Location("seg0", 0, PAGE)]]
    assert state.get_locations([b"only"], reader_tenant="t") == [None]
    assert state.heartbeat("seg1") is None  # the owner is told to register again


def test_tenant_quota_evicts_own_objects_then_refuses() -> None:
    state, clock = make(tenant_quota_bytes={"small": 2 * PAGE})
    for key in (b"a", b"b"):
        clock.now_s += 1
        assert state.put_start([key], [PAGE], "small")[0].status == "write"
        state.put_end([key])
    clock.now_s += 1
    assert state.put_start([b"c"], [PAGE], "small")[0].status == "write"
    state.put_end([b"c"])
    assert state.exists([b"a", b"b", b"c"], "small") == [False, True, True]
    assert state.put_start([b"big"], [3 * PAGE], "small")[0].status == "quota"
    assert state.put_start([b"other"], [PAGE], "unlimited")[0].status == "write"


def test_no_space_when_everything_is_pinned() -> None:
    state, _ = make(capacity=2 * PAGE)
    put(state, [b"a", b"b"])
    state.pin([b"a", b"b"], None)
    assert put(state, [b"c"]) == ["no_space"]
    assert state.counters.put_failures == 1


def test_a_soft_pin_only_extends_and_a_tenants_pin_leaves_other_tenants_objects() -> None:
    state, clock = make()
    put(state, [b"mine"])
    state.put_start([b"theirs"], [PAGE], "other")
    state.put_end([b"theirs"])
    state.pin([b"mine", b"theirs", b"absent"], ttl_s=60.0, tenant="t")
    assert state.objects[b"mine"].pin_until_s == clock.now_s + 60.0
    assert state.objects[b"theirs"].pin_until_s == 0.0  # another tenant's key: left as it was
    clock.now_s += 30.0
    state.pin([b"mine"], ttl_s=10.0, tenant="t")  # a shorter pin: the longer one stands
    assert state.objects[b"mine"].pin_until_s == clock.now_s + 30.0
    state.pin([b"mine"], ttl_s=120.0, tenant="t")
    assert state.objects[b"mine"].pin_until_s == clock.now_s + 120.0


def test_longest_prefix_and_bad_arguments() -> None:
    state, _ = make()
    put(state, [b"k0", b"k1", b"k3"])
    assert state.longest_prefix([b"k0", b"k1", b"k2", b"k3"], "t") == 2
    assert state.longest_prefix([b"k2"], "t") == 0
    with pytest.raises(ValueError, match="2 keys but 1 sizes"):
        state.put_start([b"x", b"y"], [PAGE], "t")
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        state.put_start([b"x"], [PAGE], "t", replicas=0)
    with pytest.raises(ValueError, match="unknown segment 'nope'"):
        state.advertise("nope", [])


def test_snapshot_restore_and_readvertise_after_restart() -> None:
    state, _ = make(segments=2)
    put(state, [b"a", b"b"], preferred_segment_id="seg0")
    pending = state.put_start([b"p"], [PAGE], "t")[0]
    snapshot = state.snapshot()
    restarted, _ = make(segments=0)
    restarted.restore(snapshot)
    assert restarted.epoch != state.epoch
    assert restarted.exists([b"a", b"b", b"p"], "t") == [True, True, False]
    assert restarted.segments["seg0"].allocator.used_bytes == 2 * PAGE  # the pending put's space is free again
    # An owner re-advertises: known objects are kept, an object the snapshot missed is adopted,
    # and a stale entry overlapping space already in use is skipped.
    adopted = restarted.advertise("seg1", [(b"late", "t", 0, PAGE)]) + restarted.advertise(
        "seg0", [(b"a", "t", 0, PAGE), (b"stale", "t", 0, PAGE)]
    )
    assert adopted == 1
    assert restarted.exists([b"late", b"stale"], "t") == [True, False]
    assert pending.status == "write"
    assert restarted.objects[b"a"].state is ObjectState.COMPLETE


def test_a_restored_segment_takes_no_new_objects_until_its_owner_registers_again() -> None:
    state, _ = make(segments=2)
    put(state, [b"a"], preferred_segment_id="seg0")
    restarted, _ = make(segments=0)
    restarted.restore(state.snapshot())
    assert restarted.get_locations([b"a"], reader_tenant="t")[0] is not None  # its objects read as before
    # Grants of the master's previous run may still name free ranges of these segments.
    assert put(restarted, [b"new"]) == ["no_space"]
    restarted.register_segment("seg1", "node1", "shm1", 10 * PAGE, ("127.0.0.1", 9001), PAGE)
    (plan,) = restarted.put_start([b"new"], [PAGE], "t")
    assert plan.status == "write" and plan.locations[0].segment_id == "seg1"


def test_an_owner_cannot_advertise_another_tenants_object_as_its_own() -> None:
    state, _ = make(segments=2)
    state.put_start([b"a"], [PAGE], "alice", preferred_segment_id="seg0")
    state.put_end([b"a"])
    assert state.advertise("seg1", [(b"a", "mallory", 0, PAGE)]) == 0
    assert [segment_id for segment_id, _, _ in state.objects[b"a"].replicas] == ["seg0"]


def test_counters_are_kept_per_tenant() -> None:
    state, clock = make(capacity=2 * PAGE, lease_ttl_s=1.0, high_watermark=1.0, low_watermark=0.5)
    state.put_start([b"a"], [PAGE], "alice")
    state.put_end([b"a"])
    state.put_start([b"b"], [PAGE], "bob")
    state.put_end([b"b"])
    state.get_locations([b"a"], reader_tenant="alice")  # alice's hit (and lease)
    state.get_locations([b"a", b"missing"], reader_tenant="bob")  # two misses: alice's object is not bob's
    state.remove([b"a"])  # leased: its space waits for the lease
    clock.now_s += 2
    state.tick()
    clock.now_s += 1
    assert state.put_start([b"c"], [PAGE], "carol")[0].status == "write"  # takes alice's freed page
    assert state.put_start([b"d"], [PAGE], "carol")[0].status == "write"  # evicts bob's object
    tenants = state.stats()["tenants"]
    assert (tenants["alice"]["hits"], tenants["alice"]["lease_expiries"], tenants["alice"]["puts"]) == (1, 1, 1)
    assert (tenants["bob"]["misses"], tenants["bob"]["evictions"]) == (2, 1)
    assert state.stats()["hits"] == 1 and state.stats()["evictions"] == 1


def test_a_full_writer_spills_to_a_segment_with_room_before_evicting() -> None:
    state, _ = make(capacity=10 * PAGE, segments=2)
    keys = [bytes([i]) for i in range(12)]
    for key in keys:
        put(state, [key], preferred_segment_id="seg0")
    where = {key: state.objects[key].replicas[0][0] for key in keys}
    assert [where[k] for k in keys[:9]] == ["seg0"] * 9  # up to the high watermark at home
    assert [where[k] for k in keys[9:]] == ["seg1"] * 3  # then on the segment with room
    assert state.counters.evictions == 0 and all(state.exists(keys, "t"))


def test_a_tenant_neither_reads_nor_learns_of_nor_overwrites_another_tenants_objects() -> None:
    state, _ = make()
    state.put_start([b"a0", b"a1"], [PAGE, PAGE], "alice")
    state.put_end([b"a0", b"a1"])
    assert state.exists([b"a0", b"a1"], "alice") == [True, True]
    assert state.exists([b"a0", b"a1"], "bob") == [False, False]
    assert (state.longest_prefix([b"a0", b"a1"], "alice"), state.longest_prefix([b"a0", b"a1"], "bob")) == (2, 0)
    assert state.get_locations([b"a0"], reader_tenant="bob") == [None]
    assert state.objects[b"a0"].lease_until_s == 0.0  # bob's miss leased nothing
    assert state.get_locations([b"a0"], reader_tenant="alice") == [[Location("seg0", 0, PAGE)]]
    (plan,) = state.put_start([b"a0"], [PAGE], "bob")
    assert plan.status == "conflict" and state.objects[b"a0"].tenant == "alice"
    assert state.tenant_counters["bob"].put_failures == 1


def test_readvertising_owner_overrides_a_stale_snapshot_at_a_reused_offset() -> None:
    state, _ = make()
    state.put_start([b"old"], [PAGE], "t", digests=[111])
    state.put_end([b"old"])
    snapshot = state.snapshot()  # taken before "old" was removed and its offset reused by "new"
    state.remove([b"old"])
    (plan,) = state.put_start([b"new"], [PAGE], "t", digests=[222])
    assert plan.locations == (Location("seg0", 0, PAGE),)  # the same offset
    restarted, _ = make(segments=0)
    restarted.restore(snapshot)
    assert restarted.objects[b"old"].digest == 111  # digests survive a snapshot
    restarted.register_segment("seg0", "node0", "shm0", 10 * PAGE, ("127.0.0.1", 9000), PAGE)
    # The owner saw "new" land at offset 0: "old" is not there any more, whatever the snapshot says.
    assert restarted.advertise("seg0", [(b"new", "t", 0, PAGE, 222)]) == 1
    assert restarted.exists([b"old", b"new"], "t") == [False, True]
    assert restarted.objects[b"new"].digest == 222
    assert restarted.segments["seg0"].allocator.used_bytes == PAGE


def test_a_replica_elsewhere_outlives_its_stale_copy() -> None:
    state, _ = make(segments=2)
    put(state, [b"a"], replicas=2)
    assert {segment_id for segment_id, _, _ in state.objects[b"a"].replicas} == {"seg0", "seg1"}
    offset = next(offset for segment_id, offset, _ in state.objects[b"a"].replicas if segment_id == "seg1")
    # seg1's owner says the bytes at that offset are now "b"'s: "a" keeps its other replica only.
    assert state.advertise("seg1", [(b"b", "t", offset, PAGE)]) == 1
    assert [segment_id for segment_id, _, _ in state.objects[b"a"].replicas] == ["seg0"]
    assert state.get_locations([b"a", b"b"], reader_tenant="t") == [
        [Location("seg0", 0, PAGE)],
        [Location("seg1", offset, PAGE)],
    ]


def test_put_start_refuses_a_digest_count_that_does_not_match() -> None:
    state, _ = make()
    with pytest.raises(ValueError, match="2 keys but 1 digests"):
        state.put_start([b"x", b"y"], [PAGE, PAGE], "t", digests=[1])
