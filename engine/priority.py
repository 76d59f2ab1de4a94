"""Request classes: what the schedulers serve first when there is not room for everything.

An agent's calls are not equally urgent. A call inside a turn (a tool's
result coming back) holds up an agent loop that is already running; a call
that starts a user's turn has a person waiting for its first token;
background work (batch jobs, evaluations, summaries nobody watches) can wait
for room. The scheduler admits waiting work and spends each step's token
budget in class order, oldest first within a class, and preempts the newest
sequence of the lowest class when pages run out::

    continuation (rank 0)  >  interactive (rank 1)  >  background (rank 2)

A request's class comes from the request (a header or body field at the
API, a per-key default), else from the call's kind: a continuation when it
continues a turn, interactive otherwise.
"""

from __future__ import annotations

import enum


class Priority(enum.Enum):
    CONTINUATION = "continuation"
    INTERACTIVE = "interactive"
    BACKGROUND = "background"

    @property
    def rank(self) -> int:
        """Lower is served first."""
        return _RANKS[self]

    @classmethod
    def parse(cls, value: str) -> Priority:
        """The class named ``value`` (``"batch"`` is background); ValueError naming the classes otherwise."""
        name = value.strip().lower() if isinstance(value, str) else value
        if name == "batch":
            return cls.BACKGROUND
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"priority must be one of {', '.join(PRIORITY_NAMES)}; got {value!r}") from None


_RANKS = {Priority.CONTINUATION: 0, Priority.INTERACTIVE: 1, Priority.BACKGROUND: 2}
PRIORITY_NAMES = (*(priority.value for priority in Priority), "batch")


def resolve_priority(priority: Priority | str | None, continues_turn: bool) -> Priority:
    """The class a request runs in: the one it names, else by its call kind."""
    if priority is not None:
        return priority if isinstance(priority, Priority) else Priority.parse(priority)
    return Priority.CONTINUATION if continues_turn else Priority.INTERACTIVE
