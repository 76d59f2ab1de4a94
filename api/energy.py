"""Per-call and per-session energy as the APIs report it: the ``energy`` object of every API's usage, and the
ingress's running totals per session and per meter.

The decode replica sends each call's joules so far on every step (its engine's
Shapley share of each step, ``rayturn.engine.energy``, plus the prefill
replica's share when the prefill pool computed the prompt); the ingress
settles a call once, when its last step arrives (or when it ends without
one: what it spent still counts)::

    steps folded (CallResult) --finished step, or the call ends--> settled:
        the call's joules added to its session's total (the most recent
        ``MAX_SESSIONS`` sessions of this ingress replica) and to the
        ``rayturn_energy_joules`` counter of its meter

Every API's usage then carries the same object::

    "energy": {"joules": 0.42, "meter": "rapl", "session_joules": 3.1}

``meter`` names what measured the joules (``nvml``, ``rapl``, or ``model``:
a nominal power model, so estimates; ``+``-joined when a call's replicas
read different ones); ``session_joules`` is null for a call that names no
session. A completions request with several prompts makes one call each:
its usage adds their joules up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from rayturn.engine.energy import joined_meter_names

if TYPE_CHECKING:
    from .call_result import CallResult

MAX_SESSIONS = 4096
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


class SessionEnergy:
    """The joules of each session's calls through this ingress replica, for the most recent ``max_sessions``."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._totals_j: OrderedDict[str, float] = OrderedDict()

    def add(self, session_id: str, energy_j: float) -> float:
        """Add a call's joules to its session; returns the session's total."""
        total_j = self._totals_j.pop(session_id, 0.0) + energy_j
        self._totals_j[session_id] = total_j
        if len(self._totals_j) > self.max_sessions:
            self._totals_j.popitem(last=False)
        return total_j

    def total_j(self, session_id: str) -> float:
        return self._totals_j.get(session_id, 0.0)

    def __len__(self) -> int:
        return len(self._totals_j)


class MeterCounter(Protocol):
    """A counter labelled by meter (the ingress's ``rayturn_energy_joules``, or ``prometheus_client``'s own)."""

    def labels(self, *values: str) -> Any: ...


class EnergyAccounts:
    """Settles each call's energy once: into its session's total and the per-meter counter."""

    def __init__(self, counter: MeterCounter, sessions: SessionEnergy | None = None) -> None:
        self.counter = counter
        self.sessions = sessions or SessionEnergy()

    def settle(self, session_id: str | None, result: CallResult) -> None:
        if result.energy_settled:
            return
        result.energy_settled = True
        if result.energy_meter is not None:
            self.counter.labels(result.energy_meter).inc(max(result.energy_j, 0.0))
        if session_id is not None:
            result.session_energy_j = self.sessions.add(session_id, result.energy_j)
