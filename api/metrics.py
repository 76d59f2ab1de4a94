"""The ingress's Prometheus metrics, served at ``/metrics`` (per ingress replica)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

if TYPE_CHECKING:
    from .call_result import CallResult


class IngressMetrics:
    """Per-ingress-replica Prometheus metrics, served at ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rayturn_requests", "Calls by API and outcome", ["api", "outcome"], registry=self.registry
        )
        self.ttft = Histogram(
            "rayturn_time_to_first_token_seconds",
            "Time from arrival to the first token",
            ["path"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry,
        )
        self.itl = Histogram(
            "rayturn_inter_token_latency_seconds",
            "Time between streamed steps of one completion",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
            registry=self.registry,
        )
        self.e2e = Histogram(
            "rayturn_request_latency_seconds",
            "Arrival to last token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "rayturn_prompt_tokens", "Prompt tokens by where their KV came from", ["source"], registry=self.registry
        )
        self.completion_tokens = Counter("rayturn_completion_tokens", "Generated tokens", registry=self.registry)
        # No session or tenant label: a label per session would grow without bound (``energy.SessionEnergy``).
        self.energy_joules = Counter(
            "rayturn_energy_joules",
            "Joules the decode and prefill replicas attributed to calls, by the meter that measured them",
            ["meter"],
            registry=self.registry,
        )
        self.replica_losses = Counter(
            "rayturn_replica_losses",
            "Calls whose decode replica died, by what followed: retried, resumed, finished (nothing lost), failed",
            ["outcome"],
            registry=self.registry,
        )
        self.session_returns = Counter(
            "rayturn_session_returns",
            "Calls that start a new turn of a known session, by the session's KV state at arrival",
            ["state"],
            registry=self.registry,
        )
        self.session_idle = Counter(
            "rayturn_session_idle_seconds",
            "User idle time before returning turns, and the part the session's KV spent off the device",
            ["kv"],
            registry=self.registry,
        )

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
