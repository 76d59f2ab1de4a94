"""``ReplicaMetrics``: the values a replica exports equal its engine's and planner's own figures.

Ray's metric types are replaced by a recorder (``recorded_metrics``) that
refuses what Ray refuses.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from recorded_metrics import RecordedMetrics, Series

from rayturn.decode.lifecycle.session import Phase
from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.async_engine import AsyncEngine
from rayturn.router.replica_metrics import SESSION_PHASES, CallClock, PromptSources, ReplicaMetrics

TAGS = {"pool": "decode", "replica": "r1"}


def series(name: str, **extra: str) -> Series:
    return name, frozenset({**TAGS, **extra}.items())


def test_gauges_equal_the_engines_own_counts() -> None:
    engine = LLMEngine.from_pretrained("tiny", backend="torch", dtype="float32", page_size=4, num_pages=16)
    recorded = RecordedMetrics()
    replica = ReplicaMetrics("decode", "r1", metric_types=recorded)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def serve_then_hold() -> tuple[int, dict[str, Any]]:
        server = AsyncEngine(engine)
        try:
            async for _ in server.generate([5 + i for i in range(18)], params, request_id="a", session_id="s"):
                pass
            held = await asyncio.wrap_future(server.call(lambda e: e.hold_session("s", 60.0)))
            while server.stats()["held_pages"] != held:  # the engine thread refreshes its figures twice a second
                await asyncio.sleep(0.05)
            return held, server.stats()
        finally:
            server.shutdown()

    held, stats = asyncio.run(serve_then_hold())
    replica.publish(stats)

    free = engine.kv_cache.num_free_pages
    assert held == 5  # 18 prompt + 3 answer tokens, the last not yet in the cache: 5 full pages of 4
    assert recorded.gauges[series("rayturn_kv_free_pages")] == free == 16 - held
    assert recorded.gauges[series("rayturn_kv_used_pages")] == 16 - free
    assert recorded.gauges[series("rayturn_held_pages")] == held
    assert recorded.gauges[series("rayturn_held_sessions")] == 1
    assert recorded.gauges[series("rayturn_running_seqs")] == 0
    assert recorded.gauges[series("rayturn_waiting_seqs")] == 0
    assert recorded.gauges[series("rayturn_replica_up")] == 1
    assert recorded.increments == {}  # nothing offloaded or prewarmed, no sessions planned: no counter moved


def engine_figures(offloaded_pages: int, prewarmed_pages: int) -> dict[str, int]:
    figures = dict.fromkeys(("running_seqs", "waiting_seqs", "queued_prompt_tokens", "free_pages"), 0)
    figures.update(held_sessions=0, held_pages=0, pinned_pages=0, total_pages=8)
    return {**figures, "offloaded_pages": offloaded_pages, "prewarmed_pages": prewarmed_pages}


def test_counters_advance_by_what_the_running_totals_gained() -> None:
    recorded = RecordedMetrics()
    replica = ReplicaMetrics("decode", "r1", metric_types=recorded)
    offloaded = {"phases": {"offloaded": 2, "held": 1}, "idle_s": 30.0, "off_device_s": 24.0}
    prewarmed = {**offloaded, "phases": {"prewarmed": 2, "held": 1}}
    replica.publish(engine_figures(5, 0), offloaded)
    replica.publish(engine_figures(5, 4), prewarmed)
    replica.publish(engine_figures(12, 4), {**prewarmed, "idle_s": 40.0})

    assert recorded.increments[series("rayturn_offloaded_pages_total")] == [5, 7]
    assert recorded.increments[series("rayturn_prewarmed_pages_total")] == [4]
    assert recorded.increments[series("rayturn_user_idle_seconds_total", kv="any")] == [30.0, 10.0]
    assert recorded.increments[series("rayturn_user_idle_seconds_total", kv="off_device")] == [24.0]
    # Every phase is a series, the empty ones at 0, so a dashboard sees a phase empty out.
    phases = {phase: recorded.gauges[series("rayturn_sessions", phase=phase)] for phase in SESSION_PHASES}
    assert phases == {phase: {"prewarmed": 2, "held": 1}.get(phase, 0) for phase in SESSION_PHASES}


def test_a_call_is_recorded_once_with_where_its_prompt_came_from() -> None:
    recorded = RecordedMetrics()
    replica = ReplicaMetrics("decode", "r1", metric_types=recorded)
    clock = CallClock(started_s=10.0, first_step_s=10.25, last_step_s=11.25, num_steps=5)
    replica.finish_call(clock, PromptSources(prompt_tokens=100, cached_tokens=64, loaded_tokens=16))

    assert recorded.observations[series("rayturn_pool_time_to_first_token_seconds")] == [0.25]
    assert recorded.observations[series("rayturn_pool_request_latency_seconds")] == [1.25]
    assert recorded.observations[series("rayturn_pool_inter_token_latency_seconds")] == [0.25]
    tiers = {
        tier: recorded.increments[series("rayturn_pool_prompt_tokens_total", tier=tier)]
        for tier in ("device", "store", "computed")
    }
    assert tiers == {"device": [48], "store": [16], "computed": [36]}

    replica.finish_call(CallClock(), PromptSources(prompt_tokens=100, cached_tokens=0, loaded_tokens=0))
    assert len(recorded.observations[series("rayturn_pool_time_to_first_token_seconds")]) == 1  # no step: no call


def test_every_planner_phase_is_exported() -> None:
    assert tuple(phase.value for phase in Phase) == SESSION_PHASES


def test_a_replica_outside_serve_reports_under_the_unserved_id() -> None:
    recorded = RecordedMetrics()
    ReplicaMetrics("prefill", None, metric_types=recorded).publish(engine_figures(0, 0))
    assert recorded.gauges[("rayturn_replica_up", frozenset({"pool": "prefill", "replica": "unserved"}.items()))] == 1


@pytest.mark.parametrize("cached_tokens, loaded_tokens", [(0, 0), (32, 32)])
def test_tiers_never_go_negative(cached_tokens: int, loaded_tokens: int) -> None:
    tiers = PromptSources(prompt_tokens=32, cached_tokens=cached_tokens, loaded_tokens=loaded_tokens).tiers()
    assert all(count >= 0 for count in tiers.values()) and sum(tiers.values()) == 32
