"""The ingress's Prometheus metrics: through Ray's metrics agent for the cluster, and at ``/metrics`` per replica.

Every series is recorded twice, by the same call:

- through Ray's metrics agent (``ray.util.metrics``), tagged ``pool="ingress"``
  and the replica's Serve id, as the decode and prefill replicas export theirs
  (``rayturn.router.replica_metrics``). Ray's exporter adds its ``ray_``
  prefix: ``rayturn_requests_total`` is scraped as ``ray_rayturn_requests_total``
  on every Ray pod's metrics port, and summing over ``replica`` gives the
  cluster's figures however many ingress replicas there are. The dashboard
  reads these. ``rayturn_replica_up{pool="ingress"}`` counts the live replicas:
  Ray drops a gauge nobody set within its report interval, so the ingress
  deployment sets it every second (``keep_up``).
- in this replica's own registry, served at ``/metrics`` (names without
  ``ray_``): a quick look at one process. Serve's proxy picks which replica
  answers a scrape there, so with several ingress replicas it is not the
  cluster's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from ray.util import metrics

from rayturn.router.replica_stats import UNSERVED_REPLICA_ID

if TYPE_CHECKING:
    from .call_result import CallResult

POOL = "ingress"
UP_EVERY_S = 1.0
_TAGS = ("pool", "replica")

_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
_ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Series:
    """One ingress series in both places; ``labels`` narrows it as ``prometheus_client``'s own metrics do."""

    __slots__ = ("_label_names", "_local", "_ray", "_tags")

    def __init__(self, local: Any, ray_metric: Any, label_names: Sequence[str], tags: Mapping[str, str]) -> None:
        self._local, self._ray = local, ray_metric
        self._label_names, self._tags = tuple(label_names), dict(tags)

    def labels(self, *values: str) -> Series:
        if len(values) != len(self._label_names):
            raise ValueError(f"expected labels {self._label_names}, got {values}")
        tags = {**self._tags, **dict(zip(self._label_names, values, strict=True))}
        return Series(self._local.labels(*values), self._ray, (), tags)

    def inc(self, amount: float = 1.0) -> None:
        self._local.inc(amount)
        if amount > 0:  # Ray's counters refuse an increment of 0
            self._ray.inc(amount, tags=self._tags)

    def observe(self, value: float) -> None:
        self._local.observe(value)
        self._ray.observe(value, tags=self._tags)


class IngressMetrics:
    """One ingress replica's series: call outcomes, client-side latencies, tokens, energy, losses, sessions."""

    def __init__(self, replica_id: str | None = None, metric_types: Any = metrics) -> None:
        """``metric_types``: where ``Gauge``, ``Counter`` and ``Histogram`` come from (Ray's, or a test double)."""
        self.registry = CollectorRegistry()
        self.tags = {"pool": POOL, "replica": replica_id or UNSERVED_REPLICA_ID}

        def counter(name: str, text: str, labels: Sequence[str] = ()) -> Series:
            local = Counter(name, text, list(labels), registry=self.registry)
            ray_metric = metric_types.Counter(f"{name}_total", description=text, tag_keys=(*_TAGS, *labels))
            return Series(local, ray_metric, labels, self.tags)

        def histogram(name: str, text: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Series:
            local = Histogram(name, text, list(labels), buckets=buckets, registry=self.registry)
            ray_metric = metric_types.Histogram(
                name, description=text, boundaries=list(buckets), tag_keys=(*_TAGS, *labels)
            )
            return Series(local, ray_metric, labels, self.tags)

        self.requests = counter("rayturn_requests", "Calls by API and outcome", ("api", "outcome"))
        self.ttft = histogram(
            "rayturn_time_to_first_token_seconds", "Time from arrival to the first token", _TTFT_BUCKETS_S, ("path",)
        )
        self.itl = histogram(
            "rayturn_inter_token_latency_seconds", "Time between streamed steps of one completion", _ITL_BUCKETS_S
        )
        self.e2e = histogram("rayturn_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS_S)
        self.prompt_tokens = counter("rayturn_prompt_tokens", "Prompt tokens by where their KV came from", ("source",))
        self.completion_tokens = counter("rayturn_completion_tokens", "Generated tokens")
        # No session or tenant label: a label per session would grow without bound (``energy.SessionEnergy``).
        self.energy_joules = counter(
            "rayturn_energy_joules",
            "Joules the decode and prefill replicas attributed to calls, by the meter that measured them",
            ("meter",),
        )
        self.replica_losses = counter(
            "rayturn_replica_losses",
            "Calls whose decode replica died, by what followed: retried, resumed, finished (nothing lost), failed",
            ("outcome",),
        )
        self.session_returns = counter(
            "rayturn_session_returns",
            "Calls that start a new turn of a known session, by the session's KV state at arrival",
            ("state",),
        )
        self.session_idle = counter(
            "rayturn_session_idle_seconds",
            "User idle time before returning turns, and the part the session's KV spent off the device",
            ("kv",),
        )
        # Through Ray only (this replica's /metrics is this replica): ``count by (pool)`` of it counts the live
        # ingress replicas, as it counts the decode and prefill ones.
        self._up = metric_types.Gauge("rayturn_replica_up", description="1 while the replica runs", tag_keys=_TAGS)
        self._up.set(1, tags=self.tags)

    def keep_up(self, every_s: float = UP_EVERY_S) -> threading.Event:
        """Set the up gauge again every ``every_s`` from a daemon thread, for as long as the process lives or
        until the returned event is set (the decode and prefill replicas set theirs with their routing stats)."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every_s):
                self._up.set(1, tags=self.tags)

        threading.Thread(target=beat, name="rayturn-ingress-up", daemon=True).start()
        return stop

    def count_tokens(self, result: CallResult) -> None:
        """A call's prompt tokens by where their KV came from, and its generated tokens."""
        local = result.cached_tokens - result.loaded_tokens
        self.prompt_tokens.labels("device").inc(max(local, 0))
        self.prompt_tokens.labels("store").inc(result.loaded_tokens)
        self.prompt_tokens.labels("computed").inc(max(result.prompt_tokens - result.cached_tokens, 0))
        self.completion_tokens.inc(result.completion_tokens)

    def count_session(self, session: Mapping[str, Any] | None) -> None:
        if session is None or session.get("idle_s") is None:
            return
        self.session_returns.labels(session["state"]).inc()
        self.session_idle.labels("any").inc(session["idle_s"])
        self.session_idle.labels("off_device").inc(session["off_device_s"])
