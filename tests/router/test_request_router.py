"""KVAwareRequestRouter's own logic, without a cluster: hints, weights, ranks."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from rayturn.engine.sampling_params import SamplingParams
from rayturn.messages import Call
from rayturn.router.replica_stats import ReplicaStats, page_hash_key
from rayturn.router.request_router import KVAwareRequestRouter, RoutingHints
from rayturn.router.scoring import ScoringWeights, preferred_replica, session_key

DEPLOYMENT = DeploymentID(name="decode", app_name="test")
PAGES = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(4)]


@dataclass
class FakeReplica:
    """The two attributes of a RunningReplica the router reads."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)


def replica(
    name: str,
    held: list[str] | None = None,
    running_seqs: int = 0,
    sessions: dict[str, float] | None = None,
    kv_store: bool = False,
) -> FakeReplica:
    stats = ReplicaStats(
        replica_id=name,
        queued_prompt_tokens=0,
        running_seqs=running_seqs,
        max_num_seqs=8,
        free_pages=1000,
        total_pages=1000,
        cached_page_hashes=frozenset(page_hash_key(h) for h in held or []),
        sessions={session_key(session_id): seen_s for session_id, seen_s in (sessions or {}).items()},
        kv_store=kv_store,
    )
    return FakeReplica(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), stats.to_dict())


def router(**kwargs: Any) -> KVAwareRequestRouter:
    instance = KVAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    instance.initialize_state(**kwargs)
    return instance


def pending(*args: Any, session_id: str = "", **kwargs: Any) -> PendingRequest:
    """A pending request; build it inside an event loop (it makes a future on the current one)."""
    metadata = RequestMetadata(request_id="r", internal_request_id="ir", session_id=session_id)
    return PendingRequest(args=list(args), kwargs=kwargs, metadata=metadata)


def hints_of(*args: Any, **kwargs: Any) -> RoutingHints:
    async def build() -> RoutingHints:
        return RoutingHints.from_pending_request(pending(*args, **kwargs))

    return asyncio.run(build())


def choose(instance: KVAwareRequestRouter, replicas: list[FakeReplica], *args: Any, **kwargs: Any) -> list[list[str]]:
    async def run() -> list[list[str]]:
        ranks = await instance.choose_replicas(replicas, pending(*args, **kwargs))  # type: ignore[arg-type]
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    return asyncio.run(run())


# --- routing hints --------------------------------------------------------------------------


def test_hints_come_from_the_first_positional_mapping_with_page_hashes_cut_to_keys() -> None:
    request = {"session_id": "s", "page_hashes": PAGES, "prompt_tokens": 70, "messages": []}
    assert hints_of(request) == RoutingHints("s", tuple(h[:16] for h in PAGES), 70)


def test_hints_come_from_the_request_keyword() -> None:
    request = {"page_hashes": PAGES[:1], "prompt_tokens": 20, "store_prefix_pages": 1}
    assert hints_of(request=request) == RoutingHints(None, (PAGES[0][:16],), 20, 1)


def test_handle_session_id_fills_in_a_missing_one() -> None:
    assert hints_of({"prompt_tokens": 1}, session_id="h").session_id == "h"
    assert hints_of({"session_id": "r"}, session_id="h").session_id == "r"
    assert hints_of("not a mapping", session_id="h") == RoutingHints("h")


@pytest.mark.parametrize(
    "request_",
    [
        {"page_hashes": "abc"},
        {"page_hashes": [1, 2]},
        {"prompt_tokens": -1},
        {"prompt_tokens": True},
        {"prompt_tokens": 1.5},
        {"session_id": 7},
        {"store_prefix_pages": "2"},
    ],
)
def test_malformed_hints_are_dropped_not_raised(request_: dict[str, Any]) -> None:
    assert RoutingHints.from_request(request_) == RoutingHints()


# --- weights --------------------------------------------------------------------------------


def test_weights_come_from_router_kwargs() -> None:
    assert router().weights == ScoringWeights()
    assert router(load=2, affinity=0.0).weights == ScoringWeights(kv_overlap=1.0, load=2.0, affinity=0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"loads": 1.0}, "'loads'"), ({"load": -1.0}, "'load'"), ({"affinity": True}, "'affinity'")],
)
def test_bad_router_kwargs_name_the_key(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        router(**kwargs)


# --- ranks ----------------------------------------------------------------------------------


def test_holder_ranks_first_and_ties_share_a_rank() -> None:
    replicas = [replica("a"), replica("holder", held=PAGES), replica("b")]
    request = {"page_hashes": PAGES, "prompt_tokens": 64}
    ranks = choose(router(), replicas, request)
    assert ranks[0] == ["holder"]
    assert sorted(ranks[1]) == ["a", "b"]
    assert len(ranks) == 2


def test_session_preference_gets_its_own_rank() -> None:
    replicas = [replica("a"), replica("b"), replica("c")]
    preferred = preferred_replica("s-1", ["a", "b", "c"])
    ranks = choose(router(), replicas, {"session_id": "s-1", "prompt_tokens": 8})
    assert ranks[0] == [preferred]
    assert sorted(ranks[1]) == sorted({"a", "b", "c"} - {preferred})


def test_an_announcement_goes_where_its_session_was_seen_last() -> None:
    names = ["a", "b", "c"]
    preferred = preferred_replica("s-1", names)
    stale, follower = [name for name in names if name != preferred]
    seen = {stale: {"s-1": 100.0}, follower: {"s-1": 200.0}}
    replicas = [replica(name, sessions=seen.get(name)) for name in names]
    # An announcement carries the session and no pages: the replicas following the session first, the
    # one that saw it last before one it has left, whatever the session's rendezvous choice.
    announcement = {"session_id": "s-1", "page_hashes": [], "prompt_tokens": 0, "prewarm": True}
    ranks = choose(router(), replicas, announcement)
    assert ranks[:3] == [[follower], [stale], [preferred]]
    # A call, even one without pages, has its affinity where the session was seen last, not its rendezvous
    # replica: the session's pages are there.
    assert choose(router(), replicas, {"session_id": "s-1", "prompt_tokens": 8})[0] == [follower]
    holder = next(name for name in names if name != follower)
    replicas = [replica(name, held=PAGES if name == holder else None, sessions=seen.get(name)) for name in names]
    assert choose(router(), replicas, {"session_id": "s-1", "page_hashes": PAGES, "prompt_tokens": 64})[0] == [holder]
    # A malformed flag drops the hints, as any malformed hint does.
    assert hints_of({"session_id": "s-1", "prewarm": "yes"}) == RoutingHints()


def routed(instance: KVAwareRequestRouter, request: dict[str, Any], replica_id: str) -> None:
    """Serve reports that it sent ``request`` to ``replica_id``."""

    async def run() -> None:
        target = ReplicaID(unique_id=replica_id, deployment_id=DEPLOYMENT)
        instance.on_request_routed(pending(request), target, None)  # type: ignore[arg-type]

    asyncio.run(run())


def test_a_sessions_next_call_follows_its_last_one_before_any_report_lists_its_pages() -> None:
    prompt = [hashlib.sha256(f"prompt-{i}".encode()).hexdigest() for i in range(8)]
    session_id = next(f"s{i}" for i in range(100) if preferred_replica(f"s{i}", ["a", "b"]) == "a")
    instance = router()
    # "a" has reported nothing yet; "b" reports the shared system prompt (3 pages) that other sessions cached.
    replicas = [replica("a"), replica("b", held=prompt[:3])]
    first = {"session_id": session_id, "page_hashes": prompt[:5], "prompt_tokens": 80}
    assert choose(instance, replicas, first)[0] == ["b"]  # 3 of 5 pages cached outweigh the rendezvous replica
    routed(instance, first, "b")
    # The next call extends the prompt while the reports still say the same: it stays with its pages.
    second = {"session_id": session_id, "page_hashes": prompt[:7], "prompt_tokens": 112}
    assert choose(instance, replicas, second)[0] == ["b"]
    assert choose(router(), replicas, second)[0] == ["a"]  # a router that did not route the first call
    # A report of a later call of the session elsewhere (another router sent it) moves its home there.
    replicas = [replica("a", held=prompt[:5], sessions={session_id: time.time() + 60}), replicas[1]]
    assert choose(instance, replicas, second)[0] == ["a"]
    # An announcement is no call: it leaves the trail alone.
    routed(instance, {"session_id": session_id, "prewarm": True}, "a")
    routed(instance, {"page_hashes": prompt[:7], "prompt_tokens": 112}, "a")
    assert choose(instance, [replica("a"), replica("b", held=prompt[:3])], second)[0] == ["b"]


def test_with_a_shared_store_a_prefix_one_replica_holds_does_not_pull_new_sessions_to_it() -> None:
    prompt = [hashlib.sha256(f"prompt-{i}".encode()).hexdigest() for i in range(8)]
    session_id = next(f"s{i}" for i in range(100) if preferred_replica(f"s{i}", ["a", "b"]) == "a")
    first = {"session_id": session_id, "page_hashes": prompt[:4], "prompt_tokens": 64}
    # "b" alone holds the system prompt every session shares (3 of the 4 pages).
    alone = [replica("a"), replica("b", held=prompt[:3])]
    assert choose(router(), alone, first)[0] == ["b"]  # without a store, "a" would recompute them
    # With a store, "a" loads them instead: the new session goes to its rendezvous replica.
    shared = [replica("a", kv_store=True), replica("b", held=prompt[:3], kv_store=True)]
    assert choose(router(), shared, first)[0] == ["a"]
    # A call without a session still goes to the holder.
    assert choose(router(), shared, {"page_hashes": prompt[:4], "prompt_tokens": 64})[0] == ["b"]


def test_replicas_that_refused_the_call_for_capacity_rank_last_together() -> None:
    replicas = [replica("a"), replica("holder", held=PAGES), replica("b")]
    request = {"page_hashes": PAGES, "prompt_tokens": 64, "refused_by": ["holder"]}
    ranks = choose(router(), replicas, request)
    assert sorted(ranks[0]) == ["a", "b"] and ranks[1:] == [["holder"]]
    # Every replica refused: the call still has them all, in one rank.
    everyone = {"page_hashes": PAGES, "prompt_tokens": 64, "refused_by": ["a", "b", "holder"]}
    assert [sorted(rank) for rank in choose(router(), replicas, everyone)] == [["a", "b", "holder"]]
    # rayturn's own calls carry it typed.
    call = Call("r", (1, 2, 3), SamplingParams(), session_id="s-1", refused_by=("a",))
    assert hints_of(call).refused_by == frozenset({"a"})
    assert hints_of({"session_id": "s-1", "refused_by": [7]}) == RoutingHints()


def test_busier_replicas_rank_later() -> None:
    replicas = [replica("a", running_seqs=6), replica("b", running_seqs=2), replica("c", running_seqs=4)]
    assert choose(router(), replicas, {"prompt_tokens": 8}) == [["b"], ["c"], ["a"]]


def test_bad_stats_count_as_none(caplog: pytest.LogCaptureFixture) -> None:
    broken = FakeReplica(ReplicaID(unique_id="broken", deployment_id=DEPLOYMENT), {"running_seqs": "many"})
    silent = FakeReplica(ReplicaID(unique_id="silent", deployment_id=DEPLOYMENT))
    with caplog.at_level(logging.WARNING, logger="rayturn.router.request_router"):
        ranks = choose(router(), [broken, silent, replica("idle")], {"prompt_tokens": 8})
    assert ranks[0] == ["idle"]
    assert sorted(ranks[1]) == ["broken", "silent"]
    assert "broken" in caplog.text


def test_new_stats_replace_cached_ones() -> None:
    instance = router()
    a, b = replica("a"), replica("b", running_seqs=1)
    assert choose(instance, [a, b], {"prompt_tokens": 8}) == [["a"], ["b"]]
    a.routing_stats = replica("a", running_seqs=4).routing_stats
    assert choose(instance, [a, b], {"prompt_tokens": 8}) == [["b"], ["a"]]


def test_a_report_is_parsed_once_when_serve_delivers_it_and_a_replica_that_left_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    instance = router()
    a, b = replica("a", held=PAGES), replica("b")
    parsed: list[str] = []
    original = ReplicaStats.from_dict

    def counting(data: dict[str, Any], replica_id: str | None = None) -> ReplicaStats:
        parsed.append(str(replica_id))
        return original(data, replica_id=replica_id)

    monkeypatch.setattr(ReplicaStats, "from_dict", counting)
    instance.refresh_stats([a, b])  # type: ignore[list-item]
    assert parsed == ["a", "b"]
    request = {"page_hashes": PAGES, "prompt_tokens": 64}
    assert choose(instance, [a, b], request) == [["a"], ["b"]]
    assert choose(instance, [a, b], request) == [["a"], ["b"]]
    assert parsed == ["a", "b"]  # deciding parses nothing
    a.routing_stats = replica("a").routing_stats
    b.routing_stats = replica("b", held=PAGES).routing_stats
    instance.refresh_stats([a, b])  # type: ignore[list-item]
    assert parsed == ["a", "b", "a", "b"]
    assert choose(instance, [a, b], request) == [["b"], ["a"]]
    instance.refresh_stats([a])  # type: ignore[list-item]
    assert "b" not in instance._pages
    assert choose(instance, [a], request) == [["a"]]


def test_no_candidates_and_no_request() -> None:
    instance = router()

    async def run() -> tuple[Any, Any]:
        replicas: Any = [replica("a"), replica("b")]
        return await instance.choose_replicas([], None), await instance.choose_replicas(replicas, None)

    empty, unranked = asyncio.run(run())
    assert empty == []
    assert [[r.replica_id.unique_id for r in rank] for rank in unranked] == [["a", "b"]]
