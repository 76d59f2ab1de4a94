"""Session trails: where a router sent each session's last call, and the pages that call left there."""

from __future__ import annotations

import hashlib

import pytest

from rayturn.router.replica_stats import page_hash_key
from rayturn.router.session_trails import SessionTrails, Trail, with_trail

KEYS = [page_hash_key(hashlib.sha256(f"page-{i}".encode()).hexdigest()) for i in range(8)]
OTHER = [page_hash_key(hashlib.sha256(f"other-{i}".encode()).hexdigest()) for i in range(8)]


def test_a_prompt_that_extends_the_last_one_shares_all_its_pages() -> None:
    trail = Trail("a", 1.0, 5, KEYS[4])
    assert trail.shared_pages(KEYS) == 5
    assert trail.shared_pages(KEYS[:5]) == 5
    # Shorter than the last prompt, or on another path (a compacted history): nothing known.
    assert trail.shared_pages(KEYS[:4]) == 0
    assert trail.shared_pages([*KEYS[:4], *OTHER[4:]]) == 0
    assert Trail("a", 1.0, 0, "").shared_pages(KEYS) == 0


def test_the_trail_adds_pages_on_its_replica_only() -> None:
    trail = Trail("a", 1.0, 5, KEYS[4])
    resident = {"a": (0, 0), "b": (3, 0)}
    assert with_trail(resident, trail, KEYS) == {"a": (5, 0), "b": (3, 0)}
    assert resident == {"a": (0, 0), "b": (3, 0)}  # the stats' view is left as it was
    # Stats that already show more win; host pages past the trail's stay host pages.
    assert with_trail({"a": (6, 0)}, trail, KEYS) == {"a": (6, 0)}
    assert with_trail({"a": (2, 5)}, trail, KEYS) == {"a": (5, 2)}
    # No trail, a replica that is no candidate, a prompt on another path: the stats alone.
    assert with_trail(resident, None, KEYS) == resident
    assert with_trail({"b": (3, 0)}, trail, KEYS) == {"b": (3, 0)}
    assert with_trail(resident, trail, OTHER) == resident


def test_record_replaces_the_trail_and_ignores_calls_without_a_session() -> None:
    trails = SessionTrails()
    trails.record("s", "a", KEYS[:3], 10.0)
    trails.record("s", "b", KEYS[:6], 11.0)
    trails.record(None, "c", KEYS, 12.0)
    trails.record("", "c", KEYS, 12.0)
    assert trails.get("s") == Trail("b", 11.0, 6, KEYS[5])
    assert trails.get(None) is None and trails.get("") is None and len(trails) == 1
    trails.record("empty", "a", [], 13.0)
    assert trails.get("empty") == Trail("a", 13.0, 0, "")


def test_trails_are_bounded_most_recently_routed_kept() -> None:
    trails = SessionTrails(max_sessions=2)
    trails.record("s1", "a", KEYS, 1.0)
    trails.record("s2", "a", KEYS, 2.0)
    trails.record("s1", "b", KEYS, 3.0)  # s1 is the most recent again
    trails.record("s3", "a", KEYS, 4.0)
    assert trails.get("s2") is None
    assert trails.get("s1") is not None and trails.get("s3") is not None and len(trails) == 2
    with pytest.raises(ValueError, match="max_sessions"):
        SessionTrails(max_sessions=0)


def test_trails_to_replicas_that_left_are_forgotten() -> None:
    trails = SessionTrails()
    trails.record("s1", "a", KEYS, 1.0)
    trails.record("s2", "b", KEYS, 1.0)
    trails.forget_replicas({"b", "c"})
    assert trails.get("s1") is None and trails.get("s2") is not None


def test_recent_sessions_count_each_session_at_its_last_replica_within_the_window() -> None:
    trails = SessionTrails(max_sessions=3, active_s=100.0)
    trails.record("s1", "a", KEYS, 10.0)
    trails.record("s2", "a", KEYS, 20.0)
    trails.record("s3", "b", KEYS, 30.0)
    assert trails.recent_sessions(50.0) == {"a": 2, "b": 1}
    trails.record("s1", "b", KEYS, 60.0)  # moved: counted at its new replica only
    assert trails.recent_sessions(60.0) == {"a": 1, "b": 2}
    assert trails.recent_sessions(125.0) == {"b": 2}  # s2 (routed at 20) is past the window
    trails.record("s4", "c", KEYS, 126.0)  # four sessions for three trails: the oldest, s2, is evicted
    assert trails.get("s2") is None and trails.recent_sessions(126.0) == {"b": 2, "c": 1}
    trails.forget_replicas({"c"})
    assert trails.recent_sessions(126.0) == {"c": 1}
    assert trails.recent_sessions(1_000.0) == {}
    with pytest.raises(ValueError, match="active_s"):
        SessionTrails(active_s=0.0)
