"""Deferred background work runs in predicted idle windows, and never starves (unit tests, fake clock)."""

from __future__ import annotations

import asyncio
import math

import pytest

from rayturn.decode.idle_work import DeferredJob, IdleWork


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(next_activity_s: float) -> tuple[IdleWork, Clock, list[float], dict[str, float]]:
    clock = Clock()
    ran_at: list[float] = []
    activity = {"next_s": next_activity_s}

    async def job() -> None:
        ran_at.append(clock.now_s)

    work = IdleWork(lambda: activity["next_s"], clock=clock)
    work.add(DeferredJob("snapshot", job, every_s=5.0, duration_s=1.0, max_delay_s=20.0))
    return work, clock, ran_at, activity


def test_a_due_job_runs_only_in_a_window_long_enough() -> None:
    work, clock, ran_at, activity = make(next_activity_s=math.inf)
    assert asyncio.run(work.run_due()) == []  # not due yet: added at 100 s, due at 105 s
    clock.now_s = 105.0
    activity["next_s"] = 105.5  # a session is back in half a second: the job needs a second
    assert asyncio.run(work.run_due()) == []
    activity["next_s"] = -math.inf  # a call is in flight
    assert asyncio.run(work.run_due()) == []
    activity["next_s"] = 107.0
    assert asyncio.run(work.run_due()) == ["snapshot"]
    assert ran_at == [105.0]
    assert work.stats() == {"snapshot": {"runs": 1, "forced_runs": 0, "failures": 0}}
    clock.now_s = 109.0  # due again only at 110 s
    assert asyncio.run(work.run_due()) == []


def test_a_job_that_finds_no_window_runs_anyway_after_its_max_delay() -> None:
    work, clock, ran_at, _ = make(next_activity_s=-math.inf)  # always busy
    clock.now_s = 124.0
    assert asyncio.run(work.run_due()) == []
    clock.now_s = 125.0  # due at 105 s + 20 s of delay
    assert asyncio.run(work.run_due()) == ["snapshot"]
    assert ran_at == [125.0]
    assert work.stats()["snapshot"]["forced_runs"] == 1


def test_a_failing_job_is_counted_and_rescheduled() -> None:
    clock = Clock()

    async def broken() -> None:
        raise RuntimeError("master unreachable")

    work = IdleWork(lambda: math.inf, clock=clock)
    work.add(DeferredJob("snapshot", broken, every_s=5.0, duration_s=0.0, max_delay_s=0.0))
    clock.now_s = 105.0
    assert asyncio.run(work.run_due()) == ["snapshot"]
    assert work.stats()["snapshot"] == {"runs": 1, "forced_runs": 0, "failures": 1}
    assert work.jobs[0].last_run_s == 105.0


def test_bad_job_settings() -> None:
    async def job() -> None:
        return None

    with pytest.raises(ValueError, match="every_s > 0"):
        DeferredJob("x", job, every_s=0.0, duration_s=1.0, max_delay_s=1.0)
