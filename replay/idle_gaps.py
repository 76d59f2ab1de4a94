"""One think gap under each policy of the offline evaluation: where the pages are, and what that costs.

Times are users' seconds from the turn end; the user is back at ``gap_s``.
``predictor_gap`` follows the live planner's life cycle (``rayturn.decode.lifecycle.planner``)
with its decisions (``rayturn.decode.lifecycle.policy``): a look at the turn end and after
every hold the user stays away with the pages on the device, an offload when
the policy says so, the prewarm its plan says, an on-demand load when the user
is back first::

    look ── keep ──> hold_s on the device ── user still away ──> look
      └── offload ──> off the device ──> prewarm (reload_s) ──> on the device ── user still away ──> look
                             └── user back first: on-demand load (a stall of up to reload_s)

``timeout_gap`` and ``oracle_gap`` are the baselines (see ``idle_eval.evaluate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rayturn.decode.lifecycle.policy import MAX_REPLANS, MoveCosts, offload_until_s
from rayturn.decode.lifecycle.predictors import IdlePrediction

POLICIES = ("predictor", "single_shot", "timeout", "oracle")

# Most looks at one gap.
MAX_LOOKS = 1000


@dataclass(slots=True)
class GapTally:
    """Sums over the replayed gaps of one policy."""

    gaps: int = 0
    idle_s: float = 0.0
    captured_s: float = 0.0
    offloaded_gaps: int = 0
    offloads: int = 0
    wrong_offloads: int = 0
    prewarm_hits: int = 0
    early_returns: int = 0
    stall_s: float = 0.0

    def add(self, other: GapTally) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def begin(self, gap_s: float) -> None:
        self.gaps += 1
        self.idle_s += gap_s

    def offload(self, gap_s: float, at_s: float, break_even_s: float) -> None:
        self.offloads += 1
        self.wrong_offloads += int(gap_s - at_s < break_even_s)

    def cold_return(self, gap_s: float, offloaded_at_s: float, prewarm_at_s: float | None, reload_s: float) -> None:
        """The user is back while the pages are off the device or still on their way: an on-demand load."""
        if prewarm_at_s is not None and prewarm_at_s < gap_s:
            back_at_s, stall_s = prewarm_at_s, prewarm_at_s + reload_s - gap_s
        else:
            back_at_s, stall_s = gap_s, reload_s
        self.captured_s += back_at_s - offloaded_at_s
        self.offloaded_gaps += 1
        self.early_returns += 1
        self.stall_s += stall_s

    def report(self) -> dict[str, float]:
        return {
            "idle_capture": self.captured_s / self.idle_s if self.idle_s else 0.0,
            "prewarm_hit_rate": self.prewarm_hits / self.offloaded_gaps if self.offloaded_gaps else 0.0,
            "warm_return_rate": (self.gaps - self.early_returns) / self.gaps if self.gaps else 0.0,
            "offloaded_gaps": self.offloaded_gaps,
            "offloads": self.offloads,
            "wrong_offloads": self.wrong_offloads,
            "early_returns": self.early_returns,
            "mean_stall_s": self.stall_s / self.early_returns if self.early_returns else 0.0,
            "captured_s": self.captured_s,
        }


@dataclass(frozen=True, slots=True)
class GapCosts:
    break_even_s: float
    reload_s: float
    timeout_s: float
    hold_s: float
    # The client announces each return this long before the call (the user starts typing); None: never.
    announce_lead_s: float | None = None

    def announced_at_s(self, gap_s: float) -> float:
        """When the client announces the end of a gap (``inf``: it does not)."""
        return math.inf if self.announce_lead_s is None else max(gap_s - self.announce_lead_s, 0.0)

    @property
    def moves(self) -> MoveCosts:
        """The costs as the life cycle policy weighs them (a prewarm starts a reload ahead, no lead)."""
        return MoveCosts(self.break_even_s, self.reload_s)


def predictor_gap(
    tally: GapTally,
    gap_s: float,
    first: IdlePrediction,
    again: Callable[[float], IdlePrediction],
    costs: GapCosts,
    second_looks: bool,
) -> None:
    """One gap under the predictor's policy (see ``idle_eval.evaluate``); ``again(t)`` predicts after ``t``
    seconds of idle. Without ``second_looks`` (``single_shot``) the first look decides and its prewarm stays."""
    tally.begin(gap_s)
    now_s, prediction, offloaded = 0.0, first, False
    announced_at_s = costs.announced_at_s(gap_s)
    moves = costs.moves
    for _ in range(MAX_LOOKS if second_looks else 1):
        if now_s >= announced_at_s:
            break  # the call is announced: the pages on the device wait for it
        # Once the user is back and the offload is decided, a later prewarm changes nothing.
        # Looking that far tells whether the pages would stay off long enough, whatever the gap.
        prewarm_at_s = offload_until_s(
            now_s,
            prediction.point_s - now_s,
            prediction.lower_s,
            lambda idle_s: again(idle_s).lower_s,
            moves,
            max(gap_s, moves.horizon_s(now_s)),
            max_replans=MAX_REPLANS if second_looks else 0,
        )
        if prewarm_at_s is not None:
            offloaded = True
            tally.offload(gap_s, now_s, costs.break_even_s)
            back_at_s = min(prewarm_at_s, announced_at_s)  # an announcement starts the prewarm at once
            if gap_s < back_at_s + costs.reload_s:
                tally.cold_return(gap_s, now_s, back_at_s, costs.reload_s)
                return
            tally.captured_s += back_at_s - now_s
            now_s = back_at_s + costs.reload_s
            if back_at_s == announced_at_s:
                break
        now_s += costs.hold_s
        if gap_s <= now_s:
            break
        prediction = again(now_s)
    if offloaded:
        tally.offloaded_gaps += 1
        tally.prewarm_hits += 1


def timeout_gap(tally: GapTally, gap_s: float, costs: GapCosts) -> None:
    tally.begin(gap_s)
    if gap_s > costs.timeout_s:
        tally.offload(gap_s, costs.timeout_s, costs.break_even_s)
        tally.cold_return(gap_s, costs.timeout_s, None, costs.reload_s)


def oracle_gap(tally: GapTally, gap_s: float, costs: GapCosts) -> None:
    tally.begin(gap_s)
    if gap_s > costs.break_even_s:
        tally.offload(gap_s, 0.0, costs.break_even_s)
        tally.captured_s += max(0.0, gap_s - costs.reload_s)
        tally.offloaded_gaps += 1
        tally.prewarm_hits += 1
