"""``IngressMetrics``: every ingress series goes through Ray's metrics agent and into the replica's ``/metrics``.

Ray's metric types are replaced by a recorder (``recorded_metrics``) that
refuses what Ray refuses; the local registry is ``prometheus_client``'s own.
Both must tell the same figures, the Ray side tagged with the pool and the
replica so the cluster's figures are its replicas' sum.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from recorded_metrics import RecordedMetrics, Series

from rayturn.api.metrics import IngressMetrics

TAGS = {"pool": "ingress", "replica": "ingress-7"}


def series(name: str, **extra: str) -> Series:
    return name, frozenset({**TAGS, **extra}.items())


def local_value(metrics: IngressMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_each_series_is_told_through_ray_and_at_metrics_alike() -> None:
    recorded = RecordedMetrics()
    metrics = IngressMetrics("ingress-7", metric_types=recorded)
    metrics.requests.labels("chat", "ok").inc()
    metrics.requests.labels("chat", "ok").inc()
    metrics.requests.labels("messages", "invalid").inc()
    metrics.ttft.labels("disaggregated").observe(0.15)
    metrics.itl.observe(0.02)
    metrics.itl.observe(0.03)
    metrics.e2e.observe(1.5)
    metrics.energy_joules.labels("rapl").inc(0.42)
    metrics.replica_losses.labels("resumed").inc()

    assert recorded.increments[series("rayturn_requests_total", api="chat", outcome="ok")] == [1.0, 1.0]
    assert recorded.increments[series("rayturn_requests_total", api="messages", outcome="invalid")] == [1.0]
    assert local_value(metrics, "rayturn_requests_total", api="chat", outcome="ok") == 2.0
    assert local_value(metrics, "rayturn_requests_total", api="messages", outcome="invalid") == 1.0
    assert recorded.observations[series("rayturn_time_to_first_token_seconds", path="disaggregated")] == [0.15]
    assert local_value(metrics, "rayturn_time_to_first_token_seconds_sum", path="disaggregated") == 0.15
    assert recorded.observations[series("rayturn_inter_token_latency_seconds")] == [0.02, 0.03]
    assert local_value(metrics, "rayturn_inter_token_latency_seconds_count") == 2.0
    assert recorded.observations[series("rayturn_request_latency_seconds")] == [1.5]
    assert recorded.increments[series("rayturn_energy_joules_total", meter="rapl")] == [0.42]
    assert local_value(metrics, "rayturn_energy_joules_total", meter="rapl") == 0.42
    assert recorded.increments[series("rayturn_replica_losses_total", outcome="resumed")] == [1.0]
    # The replica counts itself live for Ray's pool count; its own /metrics needs no such line.
    assert recorded.gauges[series("rayturn_replica_up")] == 1
    assert b"replica_up" not in generate_latest(metrics.registry)


def test_a_calls_tokens_and_session_return_skip_what_ray_refuses() -> None:
    recorded = RecordedMetrics()  # refuses an increment <= 0, as Ray's counters do
    metrics = IngressMetrics("ingress-7", metric_types=recorded)
    result = SimpleNamespace(prompt_tokens=100, cached_tokens=96, loaded_tokens=0, completion_tokens=12)
    metrics.count_tokens(result)  # type: ignore[arg-type]
    metrics.count_session({"state": "offloaded", "idle_s": 30.0, "off_device_s": 0.0})
    metrics.count_session({"state": "held", "idle_s": None})  # the session's first call: no return

    assert recorded.increments[series("rayturn_prompt_tokens_total", source="device")] == [96]
    assert recorded.increments[series("rayturn_prompt_tokens_total", source="computed")] == [4]
    assert series("rayturn_prompt_tokens_total", source="store") not in recorded.increments
    assert local_value(metrics, "rayturn_prompt_tokens_total", source="store") == 0.0
    assert recorded.increments[series("rayturn_completion_tokens_total")] == [12]
    assert recorded.increments[series("rayturn_session_returns_total", state="offloaded")] == [1.0]
    assert recorded.increments[series("rayturn_session_idle_seconds_total", kv="any")] == [30.0]
    assert series("rayturn_session_idle_seconds_total", kv="off_device") not in recorded.increments
    assert local_value(metrics, "rayturn_session_idle_seconds_total", kv="off_device") == 0.0


def test_outside_a_serve_replica_the_series_say_so() -> None:
    recorded = RecordedMetrics()
    metrics = IngressMetrics(None, metric_types=recorded)
    metrics.completion_tokens.inc(3)
    unserved = frozenset({"pool": "ingress", "replica": "unserved"}.items())
    assert recorded.increments[("rayturn_completion_tokens_total", unserved)] == [3]


def test_the_wrong_labels_are_refused_before_anything_is_counted() -> None:
    recorded = RecordedMetrics()
    metrics = IngressMetrics("ingress-7", metric_types=recorded)
    with pytest.raises(ValueError, match="api"):
        metrics.requests.labels("chat")
    assert not recorded.increments


def test_the_ray_metric_types_take_every_series() -> None:
    """Ray's own types (no cluster needed to record) accept every name, tag set and increment the ingress makes."""
    metrics = IngressMetrics("ingress-7")
    metrics.requests.labels("chat", "ok").inc()
    metrics.ttft.labels("local").observe(0.1)
    metrics.itl.observe(0.01)
    metrics.e2e.observe(0.5)
    result = SimpleNamespace(prompt_tokens=10, cached_tokens=0, loaded_tokens=0, completion_tokens=2)
    metrics.count_tokens(result)  # type: ignore[arg-type]
    metrics.count_session({"state": "device", "idle_s": 5.0, "off_device_s": 0.0})
    metrics.energy_joules.labels("model").inc(0.0)
    assert local_value(metrics, "rayturn_completion_tokens_total") == 2.0


def test_the_replica_is_counted_up_until_it_stops() -> None:
    """Ray drops a gauge nobody sets within its report interval: the up gauge is set again and again."""
    recorded = RecordedMetrics()
    metrics = IngressMetrics("ingress-7", metric_types=recorded)
    stop = metrics.keep_up(every_s=0.01)
    try:
        for _ in range(3):
            recorded.gauges.clear()
            deadline = time.monotonic() + 10
            while series("rayturn_replica_up") not in recorded.gauges:
                assert time.monotonic() < deadline, "the up gauge was not set again"
                time.sleep(0.005)
            assert recorded.gauges[series("rayturn_replica_up")] == 1
    finally:
        stop.set()
    time.sleep(0.05)  # a beat under way when the event was set ends
    recorded.gauges.clear()
    time.sleep(0.1)
    assert recorded.gauges == {}
