"""When a session's pages leave the device for a user's absence, and when they start back.

One policy for the live planner (``planner.py``, on its wall clock) and the
offline evaluation (``rayturn.replay.idle_eval``, in users' seconds from the
turn end): pure functions of the idle predictor's answers and the cost of a
move, so that what the evaluation measures is what the planner does::

    look at t ── idle left <= break-even ──────────────────────────────> keep the pages
       │ idle left > break-even
       v
    plan the prewarm: reload + lead before the predicted "back by";
    a prediction from that moment says later (by a step or more)? move it there, and again,
    until it lies past the horizon
       │
       ├─ the pages would be off for min_off_s or less ──────────────────> keep the pages
       └─ longer: offload now, prewarm at the planned start

A prewarm timer that fires asks once more (``moves_later``): the pages are
off already, so a later start costs nothing.

One set of constants serves both sides. ``MAX_REPLANS`` only bounds a
predictor that keeps moving the prewarm: a live look stops at its horizon
(``MoveCosts.horizon_s``, seconds ahead), and the offline replay follows the
timer through the whole gap, which for hours-long gaps takes hundreds of
steps (a bound of 50 stops it early and changes the figures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# A replan must move the prewarm start at least this far (users' seconds), or the start stays.
REPLAN_MIN_STEP_S = 1.0
# Most moves of a prewarm start one plan makes.
MAX_REPLANS = 1000


@dataclass(frozen=True, slots=True)
class MoveCosts:
    """What moving a session's pages out and back costs, in seconds of the caller's clock."""

    break_even_s: float  # the idle time past which an offload pays for itself
    reload_s: float  # bringing the pages back
    lead_s: float = 0.0  # a prewarm starts this much earlier than the reload alone needs

    @property
    def min_off_s(self) -> float:
        """The least time off the device that pays for an offload: break-even less the reload inside it,
        and never less than a reload."""
        return max(self.reload_s, self.break_even_s - self.reload_s)

    def prewarm_start_s(self, back_by_s: float) -> float:
        """When a prewarm starts for pages wanted back on the device by ``back_by_s``."""
        return back_by_s - self.reload_s - self.lead_s

    def horizon_s(self, now_s: float, min_step_s: float = REPLAN_MIN_STEP_S) -> float:
        """How far a plan made at ``now_s`` looks: a prewarm start past it keeps the pages off long enough."""
        return now_s + self.min_off_s + min_step_s


def moves_later(start_s: float, later_s: float, min_step_s: float = REPLAN_MIN_STEP_S) -> bool:
    """A new prediction moves a prewarm planned for ``start_s`` to ``later_s``."""
    return later_s >= start_s + min_step_s


def plan_prewarm_s(
    now_s: float,
    back_by_s: float,
    back_by_at: Callable[[float], float],
    costs: MoveCosts,
    horizon_s: float,
    min_step_s: float = REPLAN_MIN_STEP_S,
    max_replans: int = MAX_REPLANS,
) -> float:
    """When the prewarm starts if the user stays away: for ``back_by_s`` (predicted at ``now_s``), moved
    later while ``back_by_at(t)``, predicted from the idle time at ``t``, says so. Past ``horizon_s`` the
    exact start no longer matters to the caller."""
    start_s = max(now_s, costs.prewarm_start_s(back_by_s))
    for _ in range(max_replans):
        if start_s >= horizon_s:
            break
        later_s = costs.prewarm_start_s(back_by_at(start_s))
        if not moves_later(start_s, later_s, min_step_s):
            break
        start_s = later_s
    return start_s


def offload_until_s(
    now_s: float,
    idle_left_s: float,
    back_by_s: float,
    back_by_at: Callable[[float], float],
    costs: MoveCosts,
    horizon_s: float,
    min_step_s: float = REPLAN_MIN_STEP_S,
    max_replans: int = MAX_REPLANS,
) -> float | None:
    """The planned prewarm start when the pages should leave the device at ``now_s``; None when they stay.

    Offload when the predicted idle left exceeds break-even and the pages would stay off long enough to
    pay for the move (``MoveCosts.min_off_s``).
    """
    if idle_left_s <= costs.break_even_s:
        return None
    start_s = plan_prewarm_s(now_s, back_by_s, back_by_at, costs, horizon_s, min_step_s, max_replans)
    return start_s if start_s - now_s > costs.min_off_s else None
