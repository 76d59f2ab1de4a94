"""Per-call and per-session energy as the APIs report it: the ``energy`` object of every API's usage, and the
ingress's running totals per session and per meter.

The decode replica sends each call's joules so far on every step (its engine's
Shapley share of each step, ``rayturn.engine.energy``, plus the prefill
replica's share when the prefill pool computed the prompt); the ingress
settles a call once, when its last step arrives (or when it ends without
one: what it spent still counts)::

    steps folded (CallResult) --finished step, or the call ends--> settled:
        the call's joules added to its session's total (the most recent
        ``MAX_SESSIONS`` sessions; with several ingress replicas, in the
        ``responses`` deployment they share, so the total counts the
        session's calls on every replica) and to the
        ``rayturn_energy_joules`` counter of its meter

Every API's usage then carries the same object::

    "energy": {"joules": 0.42, "meter": "rapl", "session_joules": 3.1}

``meter`` names what measured the joules (``nvml``, ``rapl``, or ``model``:
a nominal power model, so estimates; ``+``-joined when a call's replicas
read different ones); ``session_joules`` is null for a call that names no
session, and for one whose shared total could not be reached (a warning is
logged: this replica's own count is not the session's). A completions
request with several prompts makes one call each: its usage adds their
joules up.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from rayturn.engine.energy import joined_meter_names

from .session_energy import MAX_SESSIONS, SessionEnergy

if TYPE_CHECKING:
    from .call_result import CallResult

__all__ = ["MAX_SESSIONS", "EnergyAccounts", "SessionEnergy", "energy_usage", "summed_energy_usage"]

logger = logging.getLogger(__name__)
JSON = dict[str, Any]


def energy_usage(joules: float, meter: str | None, session_joules: float | None) -> JSON:
    """The ``energy`` object of a usage: a call's (or request's) joules, their meter, its session's total."""
    return {"joules": joules, "meter": meter, "session_joules": session_joules}


def summed_energy_usage(results: Iterable[CallResult]) -> JSON:
    """The ``energy`` of a request made of several calls (a completions request with several prompts): their
    joules added up, and their session's total after the last of them settled."""
    settled = list(results)
    sessions = [result.session_energy_j for result in settled if result.session_energy_j is not None]
    return energy_usage(
        sum(result.energy_j for result in settled),
        joined_meter_names(*(result.energy_meter for result in settled)),
        max(sessions) if sessions else None,
    )


class MeterCounter(Protocol):
    """A counter labelled by meter (the ingress's ``rayturn_energy_joules``, or ``prometheus_client``'s own)."""

    def labels(self, *values: str) -> Any: ...


class EnergyAccounts:
    """Settles each call's energy once: into its session's total and the per-meter counter."""

    def __init__(self, counter: MeterCounter, sessions: SessionEnergy | None = None, keeper: Any = None) -> None:
        """``keeper``: the ``responses`` deployment's handle, whose session totals every ingress replica shares
        (None: this replica's ``sessions``)."""
        self.counter = counter
        self.sessions = sessions or SessionEnergy()
        self.keeper = keeper
        self._adding: set[asyncio.Task[float | None]] = set()

    def _count(self, result: CallResult) -> bool:
        """Count the call's joules under its meter; False when it was settled already."""
        if result.energy_settled:
            return False
        result.energy_settled = True
        if result.energy_meter is not None:
            self.counter.labels(result.energy_meter).inc(max(result.energy_j, 0.0))
        return True

    async def settle(self, session_id: str | None, result: CallResult) -> None:
        """Settle an answered call, before its usage is made: that carries its session's total."""
        if not self._count(result) or session_id is None:
            return
        if self.keeper is None:
            result.session_energy_j = self.sessions.add(session_id, result.energy_j)
        else:  # added even when the caller goes meanwhile
            result.session_energy_j = await asyncio.shield(self._shared_add(session_id, result.energy_j))

    def settle_unanswered(self, session_id: str | None, result: CallResult) -> None:
        """Settle a call that ended without its answer: nobody waits for its usage, but what it spent counts."""
        if not self._count(result) or session_id is None:
            return
        if self.keeper is None:
            result.session_energy_j = self.sessions.add(session_id, result.energy_j)
        else:
            self._shared_add(session_id, result.energy_j)

    def _shared_add(self, session_id: str, energy_j: float) -> asyncio.Task[float | None]:
        # A context of its own: Serve cancels what a request's context started once its client goes.
        adding = asyncio.get_running_loop().create_task(self._add(session_id, energy_j), context=contextvars.Context())
        self._adding.add(adding)  # held until done: the loop keeps only weak references to tasks
        adding.add_done_callback(self._adding.discard)
        return adding

    async def _add(self, session_id: str, energy_j: float) -> float | None:
        try:
            total_j: float = await self.keeper.add_session_joules.remote(session_id, energy_j)
        except Exception as err:
            logger.warning("session energy not added: %s: %s", type(err).__name__, err)
            return None
        return total_j
