"""The engine's session moves as the planner asks for them, and what they cost.

Each move runs on the engine thread (``AsyncEngine.call``). A failed move is
logged and counted and comes back as None: a move is never worth an error,
the pages just stay where they are. Each move that went through is counted
and measures the KV store's bandwidth, and the bandwidth prices the next
decision: a session's break-even time is its bytes out and back at the
bandwidth seen so far (seeded from settings), plus a margin.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rayturn.engine import LLMEngine, SessionMove
from rayturn.engine.async_engine import AsyncEngine

from .counters import LifecycleCounters
from .policy import MoveCosts

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A bandwidth estimate moves this far toward each new measurement.
BANDWIDTH_RATE = 0.2


@dataclass(slots=True)
class StoreBandwidth:
    bytes_per_s: float  # the configured guess until a move is measured
    measured: int = 0

    def update(self, move: SessionMove) -> None:
        if move.bytes_moved > 0 and move.seconds > 0:
            sample = move.bytes_moved / move.seconds
            # The first measurement replaces the configured guess; later ones move the average.
            rate = BANDWIDTH_RATE if self.measured else 1.0
            self.bytes_per_s += rate * (sample - self.bytes_per_s)
            self.measured += 1


class SessionMoves:
    """Holds, offloads and prewarms of session pages on one engine, counted and measured."""

    def __init__(self, engine: AsyncEngine, counters: LifecycleCounters, bandwidth_bytes_s: float) -> None:
        self.engine = engine
        self.counters = counters
        self.out_bandwidth = StoreBandwidth(bandwidth_bytes_s)
        self.in_bandwidth = StoreBandwidth(bandwidth_bytes_s)

    def costs(self, num_bytes: int, margin_s: float, lead_s: float) -> MoveCosts:
        """Wall seconds of moving ``num_bytes`` out and back at the bandwidth measured so far."""
        reload_s = num_bytes / self.in_bandwidth.bytes_per_s
        offload_s = num_bytes / self.out_bandwidth.bytes_per_s
        return MoveCosts(offload_s + reload_s + margin_s, reload_s, lead_s=lead_s)

    async def hold(self, session_id: str, ttl_s: float, kind: str) -> None:
        await self._run(lambda engine: engine.hold_session(session_id, ttl_s, kind))

    async def offload(self, session_id: str) -> SessionMove | None:
        move = await self._run(lambda engine: engine.offload_session(session_id))
        if move is not None:
            self.out_bandwidth.update(move)
            self.counters.offloads += 1
            self.counters.offloaded_pages += move.pages
        return move

    async def prewarm(self, session_id: str, ttl_s: float, announced: bool) -> SessionMove | None:
        move = await self._run(lambda engine: engine.prewarm_session(session_id, ttl_s, announced=announced))
        if move is not None:
            self.in_bandwidth.update(move)
            self.counters.prewarms += 1
            self.counters.prewarmed_pages += move.pages
        return move

    async def _run(self, fn: Callable[[LLMEngine], T]) -> T | None:
        try:
            return await asyncio.wrap_future(self.engine.call(fn))
        except Exception as err:
            self.counters.failed_moves += 1
            logger.warning("session KV move failed: %s", err)
            return None
