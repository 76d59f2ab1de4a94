"""Background work a decode replica defers to predicted idle windows.

Some work is needed regularly but not at any particular moment: snapshotting
the KV store's metadata, aggregating metrics. Done in the middle of a burst
of agent calls it steals time from them (a master writing a snapshot answers
no lookups meanwhile); done while every session on the replica is away it
costs nobody anything. The KV-residency planner knows when that is: no call
in flight, and no session expected back (a tool result, a prewarm, a
predicted return) within the job's expected duration::

    waiting ──(due: every_s since its last run)──> due
      ^                                             │ window open: nothing in flight and the
      │                                             │ next expected activity after now + duration_s
      │                                             ├──────────────> run (in the window)
      └──────────────── done <──────────────────────┤
                                                    └─ still no window max_delay_s after it fell due:
                                                       run anyway (forced), so no job starves

``next_activity_s`` returns the wall time of the next expected activity
(``-inf`` while a call is in flight, ``inf`` when nothing is expected).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25


@dataclass(slots=True)
class DeferredJob:
    name: str
    run: Callable[[], Awaitable[object]]
    every_s: float
    duration_s: float  # how long the job is expected to take: the window it needs
    max_delay_s: float  # past its due time by this much, it runs even without a window
    last_run_s: float = field(default=-math.inf)
    runs: int = 0
    forced_runs: int = 0
    failures: int = 0

    def __post_init__(self) -> None:
        if self.every_s <= 0 or self.duration_s < 0 or self.max_delay_s < 0:
            raise ValueError(f"job {self.name!r}: need every_s > 0, duration_s >= 0, max_delay_s >= 0")


class IdleWork:
    """Runs deferred jobs in the replica's predicted idle windows."""

    def __init__(
        self,
        next_activity_s: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.next_activity_s = next_activity_s
        self.clock = clock
        self.poll_interval_s = poll_interval_s
        self.jobs: list[DeferredJob] = []

    def add(self, job: DeferredJob) -> None:
        job.last_run_s = self.clock()  # first due one period after it is added
        self.jobs.append(job)

    async def run_due(self) -> list[str]:
        """Run every job that is due and has its window (or waited too long); returns their names."""
        ran = []
        for job in self.jobs:
            now = self.clock()
            due_s = job.last_run_s + job.every_s
            if now < due_s:
                continue
            in_window = self.next_activity_s() > now + job.duration_s
            forced = not in_window and now >= due_s + job.max_delay_s
            if not (in_window or forced):
                continue
            try:
                await job.run()
            except Exception as err:  # background work must never take the replica down
                job.failures += 1
                logger.warning("deferred job %s failed: %s", job.name, err)
            job.last_run_s = self.clock()
            job.runs += 1
            job.forced_runs += int(forced)
            ran.append(job.name)
        return ran

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.run_due()

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            job.name: {"runs": job.runs, "forced_runs": job.forced_runs, "failures": job.failures} for job in self.jobs
        }
