"""What a replica tells Prometheus: its load, KV pages, sessions and pool latencies, through Ray's metrics agent.

Every decode and prefill replica owns one ``ReplicaMetrics``, tagged with its
pool and Serve replica id, so one scrape of a node's Ray metrics export port
sees every replica on that node. Ray's exporter adds the ``ray_`` namespace:
``rayturn_kv_free_pages`` is scraped as ``ray_rayturn_kv_free_pages``.

Two rates, neither per token:

- ``publish`` sets the gauges and advances the counters that mirror the
  engine's and the session planner's running totals; the replicas call it
  from ``record_routing_stats``, which Serve asks for every
  ``router.stats_period_s`` (1 s by default);
- ``finish_call`` records one call's latencies and where its prompt's KV came
  from, once per call, from a ``CallClock`` that only reads the clock per step.
  Tiers: ``device`` (cached here), ``store`` (loaded from the KV store; its
  reads tell host, node and remote apart: ``rayturn_kv_pages_read_total``),
  ``computed``.

A replica that stops stops exporting: Ray drops its gauges within two report
intervals, so ``count by (pool) (ray_rayturn_replica_up)`` is the live
replicas per pool.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.util import metrics

from .replica_stats import UNSERVED_REPLICA_ID

_TAGS = ("pool", "replica")

# engine stats key -> (gauge name, description)
_ENGINE_GAUGES = {
    "running_seqs": ("rayturn_running_seqs", "Sequences in the replica's running batch"),
    "waiting_seqs": ("rayturn_waiting_seqs", "Sequences waiting for the replica's batch"),
    "queued_prompt_tokens": ("rayturn_queued_prompt_tokens", "Prompt tokens admitted and not yet computed"),
    "free_pages": ("rayturn_kv_free_pages", "KV cache pages free for new tokens (cached pages included)"),
    "held_sessions": ("rayturn_held_sessions", "Sessions whose pages the replica holds between calls"),
    "held_pages": ("rayturn_held_pages", "KV pages held for sessions between calls"),
    "pinned_pages": ("rayturn_pinned_pages", "KV pages pinned by clients' cache retention contracts"),
}

# engine running total -> (counter name, description)
_ENGINE_TOTALS = {
    "offloaded_pages": ("rayturn_offloaded_pages_total", "Session KV pages moved off the device between turns"),
    "prewarmed_pages": ("rayturn_prewarmed_pages_total", "Session KV pages brought back before the user returned"),
}

# The session planner's phases (``rayturn.decode.lifecycle.session.Phase``), each exported even when empty.
SESSION_PHASES = ("new", "active", "held", "released", "offloaded", "prewarming", "prewarmed")

_TTFT_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]
_ITL_BUCKETS_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2]
_E2E_BUCKETS_S = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]


@dataclass(slots=True)
class CallClock:
    """One call's times on a replica: started when the call arrives, ``step()`` at every step it yields."""

    started_s: float = field(default_factory=time.perf_counter)
    first_step_s: float | None = None
    last_step_s: float | None = None
    num_steps: int = 0

    def step(self) -> None:
        now = time.perf_counter()
        if self.first_step_s is None:
            self.first_step_s = now
        self.last_step_s = now
        self.num_steps += 1


@dataclass(frozen=True, slots=True)
class PromptSources:
    """Where one call's prompt KV came from on this replica's engine, in tokens."""

    prompt_tokens: int
    cached_tokens: int  # on the device or loaded from the store
    loaded_tokens: int  # of the cached ones, loaded from the store

    def tiers(self) -> dict[str, int]:
        return {
            "device": max(self.cached_tokens - self.loaded_tokens, 0),
            "store": self.loaded_tokens,
            "computed": max(self.prompt_tokens - self.cached_tokens, 0),
        }


class ReplicaMetrics:
    """One replica's gauges, mirrored counters and per-call histograms, tagged ``pool`` and ``replica``."""

    def __init__(self, pool: str, replica_id: str | None, metric_types: Any = metrics) -> None:
        """``metric_types``: where ``Gauge``, ``Counter`` and ``Histogram`` come from (Ray's, or a test double)."""
        self.tags = {"pool": pool, "replica": replica_id or UNSERVED_REPLICA_ID}
        self._gauges = {
            key: metric_types.Gauge(name, description=text, tag_keys=_TAGS)
            for key, (name, text) in _ENGINE_GAUGES.items()
        }
        self._used_pages = metric_types.Gauge(
            "rayturn_kv_used_pages",
            description="KV cache pages in use: live sequences', held sessions' and pinned prefixes'",
            tag_keys=_TAGS,
        )
        self._up = metric_types.Gauge("rayturn_replica_up", description="1 while the replica runs", tag_keys=_TAGS)
        self._sessions = metric_types.Gauge(
            "rayturn_sessions",
            description="Sessions the replica follows, by life-cycle phase",
            tag_keys=(*_TAGS, "phase"),
        )
        self._totals = {
            key: metric_types.Counter(name, description=text, tag_keys=_TAGS)
            for key, (name, text) in _ENGINE_TOTALS.items()
        }
        self._idle = metric_types.Counter(
            "rayturn_user_idle_seconds_total",
            description="User idle time before returning turns (kv=any), and the part spent off the device",
            tag_keys=(*_TAGS, "kv"),
        )
        self._last_totals: dict[str, float] = {}
        self._ttft = metric_types.Histogram(
            "rayturn_pool_time_to_first_token_seconds",
            description="A call's arrival at the replica to its first token there",
            boundaries=_TTFT_BUCKETS_S,
            tag_keys=_TAGS,
        )
        self._itl = metric_types.Histogram(
            "rayturn_pool_inter_token_latency_seconds",
            description="A call's mean time between the steps it streamed",
            boundaries=_ITL_BUCKETS_S,
            tag_keys=_TAGS,
        )
        self._e2e = metric_types.Histogram(
            "rayturn_pool_request_latency_seconds",
            description="A call's arrival at the replica to its last step there",
            boundaries=_E2E_BUCKETS_S,
            tag_keys=_TAGS,
        )
        self._prompt_tokens = metric_types.Counter(
            "rayturn_pool_prompt_tokens_total",
            description="Prompt tokens by where the replica's engine found their KV: device, store or computed",
            tag_keys=(*_TAGS, "tier"),
        )

    def publish(self, engine_stats: Mapping[str, Any], lifecycle_stats: Mapping[str, Any] | None = None) -> None:
        """Refresh from the engine's figures (``AsyncEngine.stats``) and the planner's (``SessionPlanner.stats``)."""
        tags = self.tags
        self._up.set(1, tags=tags)
        for key, gauge in self._gauges.items():
            gauge.set(engine_stats[key], tags=tags)
        self._used_pages.set(engine_stats["total_pages"] - engine_stats["free_pages"], tags=tags)
        for key, counter in self._totals.items():
            self._advance(key, engine_stats[key], counter, tags)
        if lifecycle_stats is None:
            return
        phases = lifecycle_stats["phases"]
        for phase in SESSION_PHASES:
            self._sessions.set(phases.get(phase, 0), tags={**tags, "phase": phase})
        self._advance("idle_s", lifecycle_stats["idle_s"], self._idle, {**tags, "kv": "any"})
        self._advance("off_device_s", lifecycle_stats["off_device_s"], self._idle, {**tags, "kv": "off_device"})

    def _advance(self, key: str, total: float, counter: Any, tags: dict[str, str]) -> None:
        delta = total - self._last_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta, tags=tags)
        self._last_totals[key] = total

    def finish_call(self, clock: CallClock, sources: PromptSources | None) -> None:
        """Record a call that streamed at least one step (others have no latency to tell)."""
        if clock.first_step_s is None or clock.last_step_s is None:
            return
        tags = self.tags
        self._ttft.observe(clock.first_step_s - clock.started_s, tags=tags)
        self._e2e.observe(clock.last_step_s - clock.started_s, tags=tags)
        if clock.num_steps > 1:
            self._itl.observe((clock.last_step_s - clock.first_step_s) / (clock.num_steps - 1), tags=tags)
        if sources is not None:
            for tier, num_tokens in sources.tiers().items():
                if num_tokens:
                    self._prompt_tokens.inc(num_tokens, tags={**tags, "tier": tier})
