"""Replica scoring: KV overlap, load, soft session affinity, rendezvous hashing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from rayturn.router.replica_stats import PAGE_HASH_PREFIX_CHARS, ReplicaStats, page_hash_key, routing_report
from rayturn.router.scoring import (
    HOST_PAGE_CREDIT,
    NEUTRAL_LOAD,
    QUEUED_TOKEN_BUDGET,
    STORE_PAGE_CREDIT,
    ScoringWeights,
    affinity,
    following_replicas,
    kv_overlap,
    least_followed_replica,
    load_penalty,
    preferred_replica,
    rank_replicas,
    score,
    scored_by_residency,
    scored_replicas,
    session_home,
    session_key,
    store_prefix_estimate,
)
from rayturn.router.session_trails import ACTIVE_SESSION_S

WEIGHTS = ScoringWeights()
PAGES = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(8)]


def stats(
    replica_id: str,
    *,
    device: list[str] | tuple[str, ...] = (),
    host: list[str] | tuple[str, ...] = (),
    queued_prompt_tokens: int = 0,
    running_seqs: int = 0,
    max_num_seqs: int = 8,
    free_pages: int = 1000,
    total_pages: int = 1000,
) -> ReplicaStats:
    return ReplicaStats(
        replica_id=replica_id,
        queued_prompt_tokens=queued_prompt_tokens,
        running_seqs=running_seqs,
        max_num_seqs=max_num_seqs,
        free_pages=free_pages,
        total_pages=total_pages,
        cached_page_hashes=frozenset(page_hash_key(h) for h in device),
        host_page_hashes=frozenset(page_hash_key(h) for h in host),
    )


def session_preferring(replica_id: str, replica_ids: list[str]) -> str:
    return next(f"s{i}" for i in range(1000) if preferred_replica(f"s{i}", replica_ids) == replica_id)


# --- page hashes and stats messages ---------------------------------------------------------


def test_page_hash_key_is_a_hex_prefix_of_bytes_or_hex() -> None:
    digest = hashlib.sha256(b"x").digest()
    assert page_hash_key(digest) == digest.hex()[:PAGE_HASH_PREFIX_CHARS]
    assert page_hash_key(digest.hex()) == page_hash_key(digest)
    assert page_hash_key("abc") == "abc"


def test_stats_round_trip_through_a_plain_dict() -> None:
    original = stats("r1", device=PAGES[:2], host=PAGES[2:3], queued_prompt_tokens=5, running_seqs=1)
    data = original.to_dict()
    assert isinstance(data["cached_page_hashes"], list)
    assert ReplicaStats.from_dict(data) == original


def test_from_dict_takes_serves_replica_id_and_cuts_full_hashes() -> None:
    data = stats("claimed").to_dict() | {"cached_page_hashes": PAGES[:1]}
    parsed = ReplicaStats.from_dict(data, replica_id="serve-id")
    assert parsed.replica_id == "serve-id"
    assert parsed.cached_page_hashes == frozenset({PAGES[0][:PAGE_HASH_PREFIX_CHARS]})
    assert parsed.host_page_hashes == frozenset()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"free_pages": None}, "'free_pages'"),
        ({"running_seqs": "3"}, "'running_seqs'"),
        ({"cached_page_hashes": "abc"}, "'cached_page_hashes'"),
        ({"host_page_hashes": [1, 2]}, "'host_page_hashes'"),
        ({"total_pages": -1}, "total_pages"),
        ({"replica_id": ""}, "'replica_id'"),
    ],
)
def test_from_dict_names_the_bad_key(change: dict[str, object], message: str) -> None:
    data = stats("r1").to_dict() | change
    with pytest.raises(ValueError, match=message):
        ReplicaStats.from_dict(data)


def test_from_dict_names_a_missing_key() -> None:
    data = stats("r1").to_dict()
    del data["max_num_seqs"]
    with pytest.raises(ValueError, match="'max_num_seqs'"):
        ReplicaStats.from_dict(data)


# --- KV overlap -----------------------------------------------------------------------------


def test_overlap_counts_device_prefix_then_host_prefix() -> None:
    replica = stats("r", device=PAGES[:2], host=PAGES[2:4])
    assert kv_overlap(PAGES, replica) == pytest.approx((2 + 2 * HOST_PAGE_CREDIT) / 8)


def test_overlap_stops_at_the_first_missing_page() -> None:
    replica = stats("r", device=[PAGES[0], *PAGES[2:]])
    assert kv_overlap(PAGES, replica) == pytest.approx(1 / 8)
    assert kv_overlap(PAGES, stats("r", device=PAGES[1:])) == 0.0


def test_overlap_credits_store_pages_after_the_resident_prefix() -> None:
    replica = stats("r", device=PAGES[:2])
    assert kv_overlap(PAGES, replica, store_prefix_pages=6) == pytest.approx((2 + 4 * STORE_PAGE_CREDIT) / 8)
    # A store prefix shorter than the resident one adds nothing.
    assert kv_overlap(PAGES, replica, store_prefix_pages=1) == pytest.approx(2 / 8)
    assert kv_overlap(PAGES, None, store_prefix_pages=8) == pytest.approx(STORE_PAGE_CREDIT)


def test_overlap_of_an_unhashed_prompt_is_zero() -> None:
    assert kv_overlap([], stats("r", device=PAGES)) == 0.0


def test_full_device_hit_is_one() -> None:
    assert kv_overlap(PAGES, stats("r", device=PAGES)) == 1.0


# --- load -----------------------------------------------------------------------------------


def test_load_is_the_most_exhausted_resource() -> None:
    replica = stats(
        "r", queued_prompt_tokens=QUEUED_TOKEN_BUDGET // 2, running_seqs=6, free_pages=600, total_pages=1000
    )
    assert load_penalty(replica, prompt_tokens=0) == pytest.approx(0.75)
    # 160 tokens need 10 pages of 16: occupancy (400 + 10) / 1000.
    assert load_penalty(stats("r", free_pages=600), prompt_tokens=160) == pytest.approx(0.41)
    # Pages the prompt already has on the device need no new ones.
    assert load_penalty(stats("r", free_pages=600), prompt_tokens=160, resident_pages=10) == pytest.approx(0.4)
    assert load_penalty(stats("r", queued_prompt_tokens=QUEUED_TOKEN_BUDGET // 4), prompt_tokens=0) == 0.25


def test_load_is_capped_at_one() -> None:
    assert load_penalty(stats("r", queued_prompt_tokens=10 * QUEUED_TOKEN_BUDGET), prompt_tokens=0) == 1.0
    assert load_penalty(stats("r", free_pages=5), prompt_tokens=100_000) == 1.0
    assert load_penalty(stats("r", max_num_seqs=0, total_pages=0, free_pages=0), prompt_tokens=0) == 1.0


def test_load_without_stats_is_neutral() -> None:
    assert load_penalty(None, prompt_tokens=10_000) == NEUTRAL_LOAD


# --- affinity -------------------------------------------------------------------------------


def test_affinity_marks_exactly_the_preferred_replica() -> None:
    replica_ids = ["a", "b", "c"]
    for session_id in ("s1", "s2", "s3", "s4"):
        values = {replica_id: affinity(session_id, replica_id, replica_ids) for replica_id in replica_ids}
        assert sorted(values.values()) == [0.0, 0.0, 1.0]
        assert values[preferred_replica(session_id, replica_ids) or ""] == 1.0


def test_no_session_has_no_affinity() -> None:
    assert preferred_replica(None, ["a", "b"]) is None
    assert preferred_replica("", ["a", "b"]) is None
    assert affinity(None, "a", ["a", "b"]) == 0.0
    assert preferred_replica("s", []) is None


def test_preference_ignores_replica_order() -> None:
    assert all(
        preferred_replica(f"s{i}", ["a", "b", "c"]) == preferred_replica(f"s{i}", ["c", "a", "b"]) for i in range(50)
    )


def test_adding_a_replica_moves_about_one_in_n_sessions_all_to_it() -> None:
    sessions = [f"session-{i}" for i in range(4000)]
    before = {s: preferred_replica(s, ["r0", "r1", "r2", "r3"]) for s in sessions}
    after = {s: preferred_replica(s, ["r0", "r1", "r2", "r3", "r4"]) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert 0.17 < len(moved) / len(sessions) < 0.23
    assert {after[s] for s in moved} == {"r4"}


def test_removing_a_replica_moves_only_its_sessions() -> None:
    sessions = [f"session-{i}" for i in range(2000)]
    before = {s: preferred_replica(s, ["r0", "r1", "r2", "r3"]) for s in sessions}
    after = {s: preferred_replica(s, ["r0", "r1", "r3"]) for s in sessions}
    assert {s for s in sessions if before[s] != after[s]} == {s for s in sessions if before[s] == "r2"}


def test_sessions_spread_evenly() -> None:
    replica_ids = ["r0", "r1", "r2", "r3"]
    counts = {replica_id: 0 for replica_id in replica_ids}
    for i in range(4000):
        counts[preferred_replica(f"session-{i}", replica_ids) or ""] += 1
    assert all(900 < count < 1100 for count in counts.values())


def test_preference_is_the_same_in_another_process() -> None:
    # Python's own str hash is salted per process; the preference must not be.
    code = (
        "from rayturn.router.scoring import preferred_replica as p\n"
        "print([p(f's{i}', ['a', 'b', 'c']) for i in range(20)])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    output = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert output.strip() == str([preferred_replica(f"s{i}", ["a", "b", "c"]) for i in range(20)])


# --- score and ranking ----------------------------------------------------------------------


def test_score_sums_weighted_terms() -> None:
    replica = stats("r", device=PAGES[:4], running_seqs=2)
    weights = ScoringWeights(kv_overlap=2.0, load=0.5, affinity=0.25)
    assert score(PAGES, replica, 0, 1.0, weights) == pytest.approx(2.0 * 0.5 - 0.5 * 0.25 + 0.25)


def test_score_drops_affinity_of_an_overloaded_replica() -> None:
    saturated = stats("r", running_seqs=8)
    assert score([], saturated, 0, 1.0, WEIGHTS) == score([], saturated, 0, 0.0, WEIGHTS) == -1.0


def test_overlap_beats_load_up_to_a_point() -> None:
    idle = stats("idle")
    busy_holder = stats("holder", device=PAGES, running_seqs=4)
    assert rank_replicas(PAGES, None, 128, {"idle": idle, "holder": busy_holder}, WEIGHTS) == ["holder", "idle"]
    # Holding only half the prompt does not pay for a saturated replica.
    saturated_half_holder = stats("holder", device=PAGES[:4], running_seqs=8)
    assert rank_replicas(PAGES, None, 128, {"idle": idle, "holder": saturated_half_holder}, WEIGHTS) == [
        "idle",
        "holder",
    ]


def test_load_decides_between_equal_holders() -> None:
    replicas = {
        "a": stats("a", device=PAGES, running_seqs=5),
        "b": stats("b", device=PAGES, running_seqs=1),
        "c": stats("c", device=PAGES, running_seqs=3),
    }
    assert rank_replicas(PAGES, None, 128, replicas, WEIGHTS) == ["b", "c", "a"]


def test_affinity_breaks_ties() -> None:
    replica_ids = ["a", "b", "c"]
    for i in range(20):
        session_id = f"session-{i}"
        replicas = {replica_id: stats(replica_id) for replica_id in replica_ids}
        assert rank_replicas([], session_id, 64, replicas, WEIGHTS)[0] == preferred_replica(session_id, replica_ids)


def test_affinity_is_soft_against_moderate_load() -> None:
    session_id = session_preferring("a", ["a", "b"])
    replicas = {"a": stats("a", running_seqs=4), "b": stats("b", running_seqs=2)}
    assert rank_replicas([], session_id, 64, replicas, WEIGHTS) == ["a", "b"]


@pytest.mark.parametrize(
    "overload",
    [{"running_seqs": 8}, {"queued_prompt_tokens": 2 * QUEUED_TOKEN_BUDGET}, {"free_pages": 10}],
    ids=["running-at-max", "queue-over-budget", "pages-exhausted"],
)
def test_overloaded_preferred_replica_is_avoided(overload: dict[str, Any]) -> None:
    session_id = session_preferring("a", ["a", "b"])
    replicas = {"a": replace(stats("a"), **overload), "b": stats("b", running_seqs=6)}
    assert rank_replicas([], session_id, 1024, replicas, WEIGHTS) == ["b", "a"]


def test_replicas_without_stats_rank_with_neutral_terms() -> None:
    replicas: dict[str, ReplicaStats | None] = {
        "new": None,
        "busy": stats("busy", running_seqs=7),
        "idle": stats("idle"),
    }
    assert rank_replicas([], None, 64, replicas, WEIGHTS) == ["idle", "new", "busy"]
    scores = dict(scored_replicas([], None, 64, replicas, WEIGHTS))
    assert scores["new"] == -NEUTRAL_LOAD


def test_session_sticks_before_any_stats_arrive() -> None:
    replica_ids = ["a", "b", "c"]
    session_id = session_preferring("c", replica_ids)
    replicas: dict[str, ReplicaStats | None] = dict.fromkeys(replica_ids)
    assert rank_replicas(PAGES, session_id, 128, replicas, WEIGHTS)[0] == "c"


def test_a_sessions_home_is_where_its_last_call_went() -> None:
    session_id = session_preferring("a", ["a", "b", "c"])
    key = session_key(session_id)
    seen = {
        "a": stats("a"),
        "b": replace(stats("b"), sessions={key: 100.0}),
        "c": replace(stats("c"), sessions={key: 200.0}),
    }
    assert session_home(session_id, seen) == "c"  # the replica that saw it last
    assert session_home(session_id, seen, last_routed=("b", 300.0)) == "b"  # this router sent a later call
    assert session_home(session_id, seen, last_routed=("a", 150.0)) == "c"
    # Only candidates count; a session nobody saw goes, all else equal, to its rendezvous replica.
    assert session_home(session_id, {"a": seen["a"], "b": seen["b"]}, last_routed=("c", 300.0)) == "b"
    assert session_home(session_id, {"a": seen["a"], "none": None}) == "a"
    assert session_home(None, seen) is None and session_home("", seen) is None


def test_a_new_session_goes_to_the_replica_following_the_fewest_active_sessions() -> None:
    session_id = session_preferring("a", ["a", "b", "c"])
    now_s = 1_000.0
    recent, old = now_s - 10.0, now_s - ACTIVE_SESSION_S - 1.0
    replicas = {
        "a": replace(stats("a"), sessions={"s1": recent, "s2": recent, "s3": old}),
        "b": replace(stats("b"), sessions={"s4": recent, "s5": old, "s6": old}),
        "c": replace(stats("c"), sessions={"s7": recent, "s8": recent}),
    }
    assert replicas["a"].sessions_seen_since(now_s - ACTIVE_SESSION_S) == 2
    assert session_home(session_id, replicas, now_s=now_s) == "b"  # one active; the others' old ones do not count
    # This router's own recent placements count when the reports have not caught up with them.
    assert session_home(session_id, replicas, routed_recently={"b": 3}, now_s=now_s) == "a"
    assert least_followed_replica(session_id, replicas, {"b": 3, "a": 3}, now_s) == "c"
    # Equal counts: the rendezvous replica, as every router computes it.
    assert least_followed_replica(session_id, dict.fromkeys(["a", "b", "c"]), {}, now_s) == "a"
    assert least_followed_replica(session_id, {}, {}, now_s) is None
    # A session some replica saw keeps its home, however busy.
    key = session_key(session_id)
    seen = {**replicas, "a": replace(replicas["a"], sessions={**replicas["a"].sessions, key: recent})}
    assert session_home(session_id, seen, routed_recently={"b": 0}, now_s=now_s) == "a"


def test_the_home_takes_the_affinity_bonus_from_the_rendezvous_replica() -> None:
    session_id = session_preferring("a", ["a", "b"])
    replicas = {"a": stats("a"), "b": stats("b")}
    resident = {"a": (0, 0), "b": (0, 0)}
    assert scored_by_residency(0, resident, session_id, 0, replicas, WEIGHTS)[0] == ("a", WEIGHTS.affinity)
    assert scored_by_residency(0, resident, session_id, 0, replicas, WEIGHTS, home="b")[0] == (
        "b",
        WEIGHTS.affinity,
    )
    # A home that is no candidate (it left) leaves the bonus to the rendezvous replica.
    assert scored_by_residency(0, resident, session_id, 0, replicas, WEIGHTS, home="gone")[0][0] == "a"
    # A session that moved stays where its pages are, though its rendezvous replica holds the shared prefix.
    holding = {"a": (3, 0), "b": (5, 0)}
    assert scored_by_residency(8, holding, session_id, 128, replicas, WEIGHTS, home="b")[0][0] == "b"


def test_a_shared_store_holds_at_least_the_longest_resident_prefix() -> None:
    resident = {"a": (0, 0), "b": (3, 2), "c": (1, 0)}
    alone = {"a": stats("a"), "b": stats("b"), "c": None}
    assert store_prefix_estimate(resident, alone, 0) == 0
    assert store_prefix_estimate(resident, alone, 4) == 4  # what the call says
    shared = {name: replace(stats(name), kv_store=True) for name in ("a", "b")}
    assert store_prefix_estimate(resident, {**shared, "c": None}, 0) == 5
    assert store_prefix_estimate(resident, shared, 7) == 7
    assert store_prefix_estimate({}, shared, 0) == 0


def test_a_replica_with_a_store_says_so_in_its_report() -> None:
    engine_stats = {**stats("r").to_dict(), "page_size": 16, "held_pages": 3}
    assert ReplicaStats.from_dict(routing_report(engine_stats, "r", kv_store=True)).kv_store
    assert not ReplicaStats.from_dict(routing_report(engine_stats, "r")).kv_store


def test_ranking_is_deterministic_and_independent_of_input_order() -> None:
    replicas = {f"r{i}": stats(f"r{i}", device=PAGES[: i % 3], running_seqs=i % 4) for i in range(8)}
    reversed_replicas = dict(reversed(list(replicas.items())))
    first = rank_replicas(PAGES, "session-x", 256, replicas, WEIGHTS)
    assert sorted(first) == sorted(replicas)
    for _ in range(3):
        assert rank_replicas(PAGES, "session-x", 256, replicas, WEIGHTS) == first
        assert rank_replicas(PAGES, "session-x", 256, reversed_replicas, WEIGHTS) == first


def test_exact_ties_have_equal_rounded_scores() -> None:
    replicas = {"a": stats("a", running_seqs=1), "b": stats("b", running_seqs=1)}
    (_, first), (_, second) = scored_replicas([], None, 64, replicas, WEIGHTS)
    assert first == second


def test_sessions_travel_in_the_stats_as_short_keys() -> None:
    key = session_key("a session id that may be long / and private")
    assert len(key) == PAGE_HASH_PREFIX_CHARS and key == session_key("a session id that may be long / and private")
    stats = ReplicaStats("r", 0, 0, 8, 10, 10, frozenset(), sessions={key: 1700000000.5})
    again = ReplicaStats.from_dict(stats.to_dict())
    assert again == stats
    assert ReplicaStats.from_dict({**stats.to_dict(), "sessions": {}}).sessions == {}
    assert ReplicaStats.from_dict({**stats.to_dict(), "kv_store": True}).kv_store
    assert not ReplicaStats.from_dict({k: v for k, v in stats.to_dict().items() if k != "kv_store"}).kv_store
    with pytest.raises(ValueError, match="kv_store"):
        ReplicaStats.from_dict({**stats.to_dict(), "kv_store": "yes"})
    assert "sessions" not in ReplicaStats.from_dict({**stats.to_dict(), "sessions": {}}).to_dict()["sessions"]
    older = ReplicaStats("q", 0, 0, 8, 10, 10, frozenset(), sessions={key: 1600000000.0})
    by_replica = {"q": older, "r": stats, "s": ReplicaStats("s", 0, 0, 8, 10, 10, frozenset()), "none": None}
    # Both follow the session; the one that saw it last comes first.
    assert following_replicas("a session id that may be long / and private", by_replica) == ["r", "q"]
    assert following_replicas("someone else", by_replica) == [] and following_replicas(None, by_replica) == []
    for bad in ("abc", ["abc"], {"abc": "yesterday"}, {"abc": True}):
        with pytest.raises(ValueError, match="sessions"):
            ReplicaStats.from_dict({**stats.to_dict(), "sessions": bad})
