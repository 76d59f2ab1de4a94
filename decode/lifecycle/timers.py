"""The planner's background work on the event loop: the tasks it spawns and one timer per session."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from .session import SessionRecord

# What a timer runs: a planner step given the session and the epoch the timer was set in.
Action = Callable[[SessionRecord, int], Coroutine[Any, Any, None]]


class Timers:
    """Spawns tasks (kept until done, so none is collected mid-run) and sets each session's one timer."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.running: set[asyncio.Task[None]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def at(self, session: SessionRecord, when_s: float, action: Action) -> None:
        """Run ``action`` for the session at wall time ``when_s``, in the epoch it has now; replaces its timer."""
        session.cancel_timer()
        epoch = session.epoch
        delay_s = max(when_s - self.clock(), 0.0)
        session.timer = asyncio.get_running_loop().call_later(delay_s, lambda: self.spawn(action(session, epoch)))
