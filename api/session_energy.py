"""``SessionEnergy``: the joules of each session's calls, for the most recent sessions.

An ingress replica keeps one; with several ingress replicas the ``responses``
deployment keeps the one they share (``response_keeper``), so a session's
total counts its calls whichever replica served them. This module imports
nothing heavy, so that deployment starts without the model's libraries.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_SESSIONS = 4096


class SessionEnergy:
    """The joules of each session's calls, for the most recent ``max_sessions``."""

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
