"""Pure replica scoring: KV overlap, load and soft session affinity.

A call is a long cached prefix plus a short new suffix, so where its prefix
already lives matters most; load decides between replicas that hold it
equally, and session affinity breaks what is left. Every input is a value
(no Ray, no clocks, no randomness), so any number of routing processes rank
the same replicas the same way from the same stats:

    score = kv_overlap * w.kv_overlap - load_penalty * w.load + affinity * w.affinity

The affinity bonus goes to the session's home (``session_home``): the
replica its last call went to, as the routing process remembers it or the
replicas report it; a session never seen goes to the replica following the
fewest active sessions, by its rendezvous order among equals. A
session that once moved therefore stays where its pages now are, instead of
being pulled back to its rendezvous replica call after call. Affinity is
soft: an overloaded replica loses its bonus, so a hot session spills over to
other replicas instead of saturating its home.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .replica_stats import PAGE_HASH_PREFIX_CHARS, ReplicaStats, page_hash_key
from .session_trails import ACTIVE_SESSION_S

# Credit per prompt page by where the replica finds it, relative to a page it
# must recompute (0). A page in device memory is free; one in the replica's host
# segment costs a host->device copy, far cheaper than recomputing it; one only
# the store holds costs a transfer from another worker first.
DEVICE_PAGE_CREDIT = 1.0
HOST_PAGE_CREDIT = 0.8
STORE_PAGE_CREDIT = 0.5

# Prompt tokens waiting for prefill on a replica that count as a full queue:
# about a second of prefill on one accelerator, past which the new call's
# time to first token is lost anyway.
QUEUED_TOKEN_BUDGET = 16_384

# A replica whose load penalty reaches this is overloaded: it keeps its KV
# overlap credit but loses its session-affinity bonus.
OVERLOAD_THRESHOLD = 0.9

# Load assumed for a replica that has not reported stats yet: neither favoured
# as idle nor avoided as busy.
NEUTRAL_LOAD = 0.5

# Scores are compared at this many decimals, so sums that differ only by float
# rounding count as equal.
SCORE_DECIMALS = 9


@dataclass(frozen=True, slots=True)
class ScoringWeights:
    """How much each term counts; `request_router_kwargs` may override them."""

    kv_overlap: float = 1.0
    load: float = 1.0
    affinity: float = 0.5


def resident_prefix_pages(page_hashes: Sequence[str], stats: ReplicaStats) -> tuple[int, int]:
    """(device pages, host pages) of the longest prefix of the prompt the replica holds.

    Hashes are chained, so a page is usable only when every page before it is
    too: the walk stops at the first page held in neither tier.
    """
    return _resident_prefix([page_hash_key(h) for h in page_hashes], stats)


def _resident_prefix(page_keys: Sequence[str], stats: ReplicaStats) -> tuple[int, int]:
    device_pages = host_pages = 0
    for key in page_keys:
        if key in stats.cached_page_hashes:
            device_pages += 1
        elif key in stats.host_page_hashes:
            host_pages += 1
        else:
            break
    return device_pages, host_pages


def kv_overlap(page_hashes: Sequence[str], stats: ReplicaStats | None, store_prefix_pages: int = 0) -> float:
    """The fraction of the prompt's pages the replica serves without recompute, in [0, 1].

    Its resident prefix counts at device or host credit; the pages after it up
    to ``store_prefix_pages`` (the leading pages the store holds) at store credit.
    """
    device_pages, host_pages = resident_prefix_pages(page_hashes, stats) if stats is not None else (0, 0)
    return _overlap(len(page_hashes), device_pages, host_pages, store_prefix_pages)


def _overlap(num_pages: int, device_pages: int, host_pages: int, store_prefix_pages: int) -> float:
    if num_pages == 0:
        return 0.0
    store_pages = max(0, min(store_prefix_pages, num_pages) - device_pages - host_pages)
    credit = device_pages * DEVICE_PAGE_CREDIT + host_pages * HOST_PAGE_CREDIT + store_pages * STORE_PAGE_CREDIT
    return credit / num_pages


def load_penalty(stats: ReplicaStats | None, prompt_tokens: int, resident_pages: int = 0) -> float:
    """How busy the replica is for this call, in [0, 1]; ``NEUTRAL_LOAD`` without stats.

    The call waits on whichever resource runs out first, so the penalty is the
    largest of: queued prompt tokens against ``QUEUED_TOKEN_BUDGET``, running
    sequences against the replica's maximum, and page occupancy once the pages
    this prompt needs (less ``resident_pages`` already on the device) are taken.
    """
    if stats is None:
        return NEUTRAL_LOAD
    queue = stats.queued_prompt_tokens / QUEUED_TOKEN_BUDGET
    seqs = stats.running_seqs / stats.max_num_seqs if stats.max_num_seqs > 0 else 1.0
    if stats.total_pages > 0:
        needed_pages = max(0, -(-prompt_tokens // stats.page_size) - resident_pages)
        pages = (stats.total_pages - stats.free_pages + needed_pages) / stats.total_pages
    else:
        pages = 1.0
    return min(1.0, max(queue, seqs, pages))


def store_prefix_estimate(
    resident: Mapping[str, tuple[int, int]],
    stats_by_replica: Mapping[str, ReplicaStats | None],
    store_prefix_pages: int,
) -> int:
    """Leading pages of the prompt the KV store holds, at least: ``store_prefix_pages`` (what the call says),
    or, where replicas report a shared store (they publish every page they compute to it), the longest
    prefix any of them holds. So a prefix cached on one replica (a system prompt every session shares)
    counts as a store load on the others, not a recompute, and does not outweigh a session's affinity."""
    if not any(stats is not None and stats.kv_store for stats in stats_by_replica.values()):
        return store_prefix_pages
    return max(store_prefix_pages, max((sum(pages) for pages in resident.values()), default=0))


def session_key(session_id: str) -> str:
    """The short hex form of a session id that replica stats carry (ids themselves may be long or private)."""
    return hashlib.blake2b(session_id.encode(), digest_size=PAGE_HASH_PREFIX_CHARS // 2).hexdigest()


def following_replicas(session_id: str | None, stats_by_replica: Mapping[str, ReplicaStats | None]) -> list[str]:
    """The replicas that report following the session, the one that saw it last first (usually one, or none)."""
    if not session_id:
        return []
    key = session_key(session_id)
    seen = {
        replica_id: stats.sessions[key]
        for replica_id, stats in stats_by_replica.items()
        if stats is not None and key in stats.sessions
    }
    return sorted(seen, key=lambda replica_id: (-seen[replica_id], -rendezvous_weight(session_id, replica_id)))


def rendezvous_weight(session_id: str, replica_id: str) -> int:
    """A stable 64-bit weight of a (session, replica) pair, equal in every process."""
    digest = hashlib.blake2b(f"{session_id}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred_replica(session_id: str | None, replica_ids: Iterable[str]) -> str | None:
    """The session's replica by rendezvous (highest-random-weight) hashing.

    Each router computes it alone and all agree. When a replica joins, only
    the sessions it now wins (about 1/N) move to it; when one leaves, only its
    own sessions move.
    """
    if not session_id:
        return None
    return max(
        replica_ids, key=lambda replica_id: (rendezvous_weight(session_id, replica_id), replica_id), default=None
    )


def session_home(
    session_id: str | None,
    stats_by_replica: Mapping[str, ReplicaStats | None],
    last_routed: tuple[str, float] | None = None,
    routed_recently: Mapping[str, int] | None = None,
    now_s: float = 0.0,
) -> str | None:
    """The replica that saw the session's last call, among ``stats_by_replica``; for a session none of them
    saw, the one following the fewest active sessions (``least_followed_replica``).

    Two witnesses, the most recent wins (epoch seconds): ``last_routed``, the (replica, time) this routing
    process sent the session's last call to, and the sessions each replica reports following (reports
    lag, but they also show the calls other routing processes sent).
    """
    if not session_id:
        return None
    key = session_key(session_id)
    sightings = [
        (seen_s, replica_id)
        for replica_id, stats in stats_by_replica.items()
        if stats is not None and (seen_s := stats.sessions.get(key)) is not None
    ]
    if last_routed is not None and last_routed[0] in stats_by_replica:
        sightings.append((last_routed[1], last_routed[0]))
    if sightings:
        return max(sightings)[1]
    return least_followed_replica(session_id, stats_by_replica, routed_recently or {}, now_s)


def least_followed_replica(
    session_id: str,
    stats_by_replica: Mapping[str, ReplicaStats | None],
    routed_recently: Mapping[str, int],
    now_s: float,
    active_s: float = ACTIVE_SESSION_S,
) -> str | None:
    """Where a new session goes: the replica following the fewest sessions active within ``active_s`` of
    ``now_s``; among equals the session's rendezvous replica, so routers that see the same counts agree.

    A replica's count is the larger of two lower bounds: the sessions it reports seen within the window
    (every router's, but a stats period late) and ``routed_recently``, the sessions this routing process
    sent there within it (up to date, but its own only)."""

    def followed(replica_id: str) -> int:
        stats = stats_by_replica[replica_id]
        reported = stats.sessions_seen_since(now_s - active_s) if stats is not None else 0
        return max(reported, routed_recently.get(replica_id, 0))

    return min(
        stats_by_replica,
        key=lambda replica_id: (followed(replica_id), -rendezvous_weight(session_id, replica_id), replica_id),
        default=None,
    )


def affinity(session_id: str | None, replica_id: str, replica_ids: Iterable[str]) -> float:
    """1.0 for the session's preferred replica among ``replica_ids``, else 0.0."""
    return 1.0 if replica_id == preferred_replica(session_id, replica_ids) else 0.0


def score(
    page_hashes: Sequence[str],
    stats: ReplicaStats | None,
    prompt_tokens: int,
    affinity_score: float,
    weights: ScoringWeights,
    store_prefix_pages: int = 0,
) -> float:
    """One replica's score for a call; higher is better.

    ``affinity_score`` comes from ``affinity``; it is dropped when the replica
    is overloaded.
    """
    page_keys = [page_hash_key(h) for h in page_hashes]
    resident = _resident_prefix(page_keys, stats) if stats is not None else (0, 0)
    return _score(len(page_keys), resident, stats, prompt_tokens, affinity_score, weights, store_prefix_pages)


def _score(
    num_pages: int,
    resident: tuple[int, int],
    stats: ReplicaStats | None,
    prompt_tokens: int,
    affinity_score: float,
    weights: ScoringWeights,
    store_prefix_pages: int,
) -> float:
    device_pages, host_pages = resident
    load = load_penalty(stats, prompt_tokens, resident_pages=device_pages)
    if load >= OVERLOAD_THRESHOLD:
        affinity_score = 0.0
    overlap = _overlap(num_pages, device_pages, host_pages, store_prefix_pages)
    return weights.kv_overlap * overlap - weights.load * load + weights.affinity * affinity_score


def scored_replicas(
    page_hashes: Sequence[str],
    session_id: str | None,
    prompt_tokens: int,
    stats_by_replica: Mapping[str, ReplicaStats | None],
    weights: ScoringWeights,
    store_prefix_pages: int = 0,
) -> list[tuple[str, float]]:
    """(replica id, score rounded to ``SCORE_DECIMALS``) pairs, best first.

    Replicas without stats yet (None) are ranked with neutral terms, not left
    out. Equal scores are ordered by the session's rendezvous weights, so the
    order is the same in every process.
    """
    # Keys are cut once here, not once per replica: prompts run to thousands of pages.
    page_keys = [page_hash_key(h) for h in page_hashes]
    resident = {
        replica_id: _resident_prefix(page_keys, stats) if stats is not None else (0, 0)
        for replica_id, stats in stats_by_replica.items()
    }
    return scored_by_residency(
        len(page_keys), resident, session_id, prompt_tokens, stats_by_replica, weights, store_prefix_pages
    )


def scored_by_residency(
    num_pages: int,
    resident: Mapping[str, tuple[int, int]],
    session_id: str | None,
    prompt_tokens: int,
    stats_by_replica: Mapping[str, ReplicaStats | None],
    weights: ScoringWeights,
    store_prefix_pages: int = 0,
    home: str | None = None,
) -> list[tuple[str, float]]:
    """``scored_replicas`` for a prompt of ``num_pages`` pages of which each replica holds the prefix in
    ``resident`` (device pages, host pages), however that was found (``router.page_index`` finds it for all
    replicas in one walk). ``home`` (``session_home``) takes the affinity bonus when it is among the
    replicas; otherwise the session's rendezvous replica does."""
    tie_key = session_id or ""
    # One rendezvous weight per replica serves both the session's preferred replica and the tie order.
    tie_weights = {replica_id: rendezvous_weight(tie_key, replica_id) for replica_id in stats_by_replica}
    if not session_id:
        preferred = None
    elif home in stats_by_replica:
        preferred = home
    else:
        preferred = max(tie_weights, key=lambda replica_id: (tie_weights[replica_id], replica_id), default=None)
    scored = [
        (
            replica_id,
            round(
                _score(
                    num_pages,
                    resident[replica_id],
                    stats,
                    prompt_tokens,
                    1.0 if replica_id == preferred else 0.0,
                    weights,
                    store_prefix_pages,
                ),
                SCORE_DECIMALS,
            ),
        )
        for replica_id, stats in stats_by_replica.items()
    ]
    scored.sort(key=lambda pair: (-pair[1], -tie_weights[pair[0]], pair[0]))
    return scored


def rank_replicas(
    page_hashes: Sequence[str],
    session_id: str | None,
    prompt_tokens: int,
    stats_by_replica: Mapping[str, ReplicaStats | None],
    weights: ScoringWeights,
    store_prefix_pages: int = 0,
) -> list[str]:
    """Replica ids best first (see ``scored_replicas``)."""
    scored = scored_replicas(page_hashes, session_id, prompt_tokens, stats_by_replica, weights, store_prefix_pages)
    return [replica_id for replica_id, _ in scored]
