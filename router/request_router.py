"""A Ray Serve request router that sends each call where its KV already lives.

Plugging it in (on the decode deployment, or any deployment whose replicas
report ``ReplicaStats``)::

    from ray.serve.config import RequestRouterConfig

    @serve.deployment(
        request_router_config=RequestRouterConfig(
            request_router_class="rayturn.router.request_router.KVAwareRequestRouter",
            request_router_kwargs={"kv_overlap": 1.0, "load": 1.0, "affinity": 0.5},
            request_routing_stats_period_s=1.0,
        ),
    )
    class DecodeServer:
        def record_routing_stats(self) -> dict:  # called by Serve every period
            return ReplicaStats(...).to_dict()

Routing hints. rayturn's own calls carry them typed: the first positional
argument (or the keyword ``request``) is a ``rayturn.messages.Call`` (its
session, page hashes and prompt length) or a ``SessionAnnouncement`` (a
prewarm). Other deployments may pass one mapping instead, e.g.
``handle.generate.remote(request)``:

    session_id: str | None    the session (see ``rayturn.api.session``); when
                              absent, the handle's own session id is used
                              (``handle.options(session_id=...)``, or the
                              ``x-session-id`` header of a call that came in
                              through Serve's HTTP proxy)
    page_hashes: list[str]    hex chained hashes of the prompt's full pages, in
                              prompt order (full digests or ``page_hash_key``
                              prefixes); may be empty
    prompt_tokens: int        prompt length in tokens
    store_prefix_pages: int   optional: leading pages the KV store holds
    prewarm: bool             optional: an announcement of the session's next
                              call; it goes first to the replicas whose stats
                              list the session, the one that saw it last first
    refused_by: list[str]     optional: replica ids that refused the call for
                              capacity; they are ranked last, after every other

Any other keys are the callee's business. Missing or malformed hints make the
call route on load alone; they never fail it.

Replica stats. Each replica's ``record_routing_stats`` returns a dict that
``ReplicaStats.from_dict`` reads (``ReplicaStats.to_dict`` writes one). Serve's
own replica id is used for the replica, whatever the dict says.

Consistency across routing processes. Every process that holds a handle (each
ingress replica, each proxy, a driver) runs its own instance of this router;
there is no shared session table. They agree without talking because:

- a session's affinity goes to the replica that saw its last call, as the
  replicas report the sessions they follow; a session no replica reports is
  placed by rendezvous hashing over the replica ids that the Serve controller
  broadcasts to every router, so the same ids give the same answer in every
  process, and a replica joining or leaving moves only ~1/N new sessions;
- the KV and load terms come from the stats each replica reports to the
  controller every ``request_routing_stats_period_s``, broadcast the same way.

Routers disagree only while a broadcast is in flight, and a wrong choice costs
a recompute, never a wrong answer. Stats lag by up to a period, so a router
does not see the load it adds itself between reports; replicas whose scores
tie therefore share one rank, and Serve's live queue-length probe picks the
shortest queue among them. Nor would it see where its own last call of a
session went, and a session's calls come faster than reports: so each router
keeps the session's trail (``rayturn.router.session_trails``), which counts
the pages of that call's prompt as resident on its replica and makes that
replica the session's home until a report shows a later call elsewhere.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from ray import serve
from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from rayturn.messages import Call, SessionAnnouncement
from rayturn.router.page_index import PageIndex
from rayturn.router.replica_stats import ReplicaStats, page_hash_key
from rayturn.router.scoring import (
    ScoringWeights,
    following_replicas,
    scored_by_residency,
    session_home,
    store_prefix_estimate,
)
from rayturn.router.session_trails import SessionTrails, with_trail

logger = logging.getLogger(__name__)

REQUEST_KEYWORD = "request"


@dataclass(frozen=True, slots=True)
class RoutingHints:
    """What a call tells the router about itself (see the module docstring)."""

    session_id: str | None = None
    # The prompt's pages as ``page_hash_key`` prefixes, what replica stats list.
    page_keys: tuple[str, ...] = ()
    prompt_tokens: int = 0
    store_prefix_pages: int = 0
    prewarm: bool = False
    # Replicas that refused the call for capacity (``Call.refused_by``): tried last.
    refused_by: frozenset[str] = frozenset()

    @classmethod
    def from_pending_request(cls, pending_request: PendingRequest) -> RoutingHints:
        """The hints of a pending call; empty hints when it carries none or bad ones."""
        request: object = (
            pending_request.args[0] if pending_request.args else pending_request.kwargs.get(REQUEST_KEYWORD)
        )
        if isinstance(request, Call):
            hints = cls.from_call(request)
        elif isinstance(request, SessionAnnouncement):
            hints = cls(session_id=request.session_id, prewarm=True)
        else:
            hints = cls.from_request(request) if isinstance(request, Mapping) else cls()
        if hints.session_id is None and pending_request.metadata.session_id:
            hints = replace(hints, session_id=pending_request.metadata.session_id)
        return hints

    @classmethod
    def from_call(cls, call: Call) -> RoutingHints:
        return cls(call.session_id, call.page_keys, call.prompt_tokens, refused_by=frozenset(call.refused_by))

    @classmethod
    def from_request(cls, request: Mapping[str, Any]) -> RoutingHints:
        session_id = request.get("session_id")
        page_hashes = request.get("page_hashes") or ()
        prompt_tokens = request.get("prompt_tokens", 0)
        store_prefix_pages = request.get("store_prefix_pages", 0)
        prewarm = request.get("prewarm", False)
        refused_by = request.get("refused_by") or ()
        if (
            (session_id is not None and not isinstance(session_id, str))
            or not isinstance(prewarm, bool)
            or not isinstance(page_hashes, list | tuple)
            or not all(isinstance(page_hash, str) for page_hash in page_hashes)
            or not isinstance(refused_by, list | tuple)
            or not all(isinstance(replica_id, str) for replica_id in refused_by)
            or not _is_count(prompt_tokens)
            or not _is_count(store_prefix_pages)
        ):
            # The request itself is not logged: it carries the user's prompt.
            logger.debug("Ignoring malformed routing hints (keys: %s).", sorted(map(str, request)))
            return cls()
        page_keys = tuple(page_hash_key(page_hash) for page_hash in page_hashes)
        return cls(session_id or None, page_keys, prompt_tokens, store_prefix_pages, prewarm, frozenset(refused_by))


def serve_replica_id() -> str | None:
    """This process's Serve replica id (what routers rank replicas by), or None outside a replica."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def last_if_refused(ranks: list[list[RunningReplica]], refused_by: frozenset[str]) -> list[list[RunningReplica]]:
    """The ranks with the replicas that refused the call for capacity taken out and put last, in one rank:
    a replica with room comes first, and a call every replica refused still has somewhere to go."""
    if not refused_by:
        return ranks
    kept = [[replica for replica in rank if replica.replica_id.unique_id not in refused_by] for rank in ranks]
    refused = [replica for rank in ranks for replica in rank if replica.replica_id.unique_id in refused_by]
    return [rank for rank in kept if rank] + ([refused] if refused else [])


class KVAwareRequestRouter(RequestRouter):
    """Ranks replicas for every call as ``rayturn.router.scoring.scored_replicas`` does, with the replicas'
    pages looked up in a ``PageIndex`` kept up to date as their reports arrive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._weights = ScoringWeights()
        # Parsed stats per replica id, with the reported dict they came from:
        # Serve replaces that dict when new stats arrive, so identity tells
        # whether to parse again.
        self._parsed_stats: dict[str, tuple[dict[str, Any], ReplicaStats | None]] = {}
        self._pages = PageIndex()
        self._trails = SessionTrails()

    def initialize_state(self, **kwargs: Any) -> None:
        """Take ``ScoringWeights`` fields from ``request_router_kwargs``."""
        known = {f.name for f in fields(ScoringWeights)}
        for name, value in kwargs.items():
            if name not in known:
                raise ValueError(f"request_router_kwargs: unknown key {name!r} (known: {', '.join(sorted(known))})")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"request_router_kwargs: {name!r} must be a finite number >= 0, got {value!r}")
        self._weights = ScoringWeights(**{name: float(value) for name, value in kwargs.items()})

    @property
    def weights(self) -> ScoringWeights:
        return self._weights

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Candidates best first; each rank holds the replicas whose scores tie."""
        if not candidate_replicas:
            return []
        if pending_request is None:
            return [candidate_replicas]
        # Every rank is returned at once, so once they are all tried, Serve
        # should back off before asking again.
        pending_request.routing_context.should_backoff = True

        hints = RoutingHints.from_pending_request(pending_request)
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        stats = {replica_id: self._stats(replica) for replica_id, replica in by_id.items()}
        ranks: list[list[RunningReplica]] = []
        if hints.prewarm:
            # A session's announcement, nothing to match pages against: the replica that saw the
            # session last comes first.
            following = following_replicas(hints.session_id, stats)
            ranks = [[by_id[replica_id]] for replica_id in following]
            for replica_id in following:
                del stats[replica_id]
        trail = self._trails.get(hints.session_id)
        resident = with_trail(self._pages.resident_prefixes(hints.page_keys, stats), trail, hints.page_keys)
        now_s = time.time()
        last_routed = (trail.replica_id, trail.routed_at_s) if trail is not None else None
        # Only a session this router has not routed may be new: counting the others' sessions costs a walk.
        routed_recently = self._trails.recent_sessions(now_s) if trail is None else None
        scored = scored_by_residency(
            len(hints.page_keys),
            resident,
            hints.session_id,
            hints.prompt_tokens,
            stats,
            self._weights,
            store_prefix_estimate(resident, stats, hints.store_prefix_pages),
            home=session_home(hints.session_id, stats, last_routed, routed_recently, now_s),
        )
        last_score: float | None = None
        for replica_id, replica_score in scored:
            if replica_score != last_score:
                ranks.append([])
                last_score = replica_score
            ranks[-1].append(by_id[replica_id])
        return last_if_refused(ranks, hints.refused_by)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """Serve sent the call to ``replica_id`` (the replica accepted it): its session's trail leads there now."""
        hints = RoutingHints.from_pending_request(pending_request)
        if hints.session_id and not hints.prewarm:
            self._trails.record(hints.session_id, replica_id.unique_id, hints.page_keys, time.time())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.refresh_stats(replicas)

    def refresh_stats(self, replicas: Sequence[RunningReplica]) -> None:
        """Parse the reports that changed and forget replicas that left.

        Serve calls ``update_replicas`` with every broadcast of replica infos,
        new routing stats included, so parsing here keeps it off the path of
        a routing decision.
        """
        live = {replica.replica_id.unique_id for replica in replicas}
        left = self._parsed_stats.keys() - live
        for replica_id in left:
            del self._parsed_stats[replica_id]
            self._pages.remove(replica_id)
        if left:
            self._trails.forget_replicas(live)
        for replica in replicas:
            self._stats(replica)

    def _stats(self, replica: RunningReplica) -> ReplicaStats | None:
        """The replica's last reported stats, or None before its first report or after a bad one."""
        replica_id = replica.replica_id.unique_id
        reported = replica.routing_stats
        cached = self._parsed_stats.get(replica_id)
        if cached is not None and cached[0] is reported:
            return cached[1]
        stats: ReplicaStats | None = None
        if reported:
            try:
                stats = ReplicaStats.from_dict(reported, replica_id=replica_id)
            except ValueError as error:
                logger.warning("Replica %s reported unusable routing stats: %s", replica_id, error)
        self._parsed_stats[replica_id] = (reported, stats)
        self._pages.update(replica_id, stats)
        return stats


class RoundRobinRequestRouter(RequestRouter):
    """Replicas in turn, blind to cached pages, load and sessions: the baseline rayturn's router is measured against.

    Each calling process keeps its own turn counter (nothing is shared), so
    with several callers the rotation is per caller.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turn = 0

    def initialize_state(self, **kwargs: Any) -> None:
        """Scoring weights may be passed (one config serves both routers); they are ignored."""
        unknown = set(kwargs) - {f.name for f in fields(ScoringWeights)}
        if unknown:
            raise ValueError(f"unknown router option(s): {', '.join(sorted(unknown))}")

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        start = self._turn % len(ordered)
        self._turn += 1
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        return [[replica] for replica in ordered[start:] + ordered[:start]]
