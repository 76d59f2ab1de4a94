"""The ``lifecycle`` section of the cluster config: how the decode replicas follow sessions' KV pages."""

from __future__ import annotations

from dataclasses import dataclass

from rayturn.settings import check, check_above, check_at_least, check_choice

from .predictors import PREDICTORS


@dataclass(frozen=True, slots=True)
class LifecycleSettings:
    """The decode replicas' session KV life cycle (``planner.py``).

    Durations are in the users' seconds; ``time_scale`` converts them (and
    the idle predictor's answers) to wall seconds, for replays that compress
    time.
    """

    enabled: bool = True
    time_scale: float = 1.0
    tool_hold_min_s: float = 5.0
    tool_hold_max_s: float = 120.0
    turn_hold_s: float = 10.0
    break_even_margin_s: float = 5.0
    prewarm_lead_s: float = 0.5
    predictor: str = "hazard"
    warm_return_worth_s: float = 400.0
    store_bandwidth_bytes_s: float = 1e9
    composing_hold_s: float = 120.0

    def __post_init__(self) -> None:
        check_above("time_scale", self.time_scale, 0)
        check_above("tool_hold_min_s", self.tool_hold_min_s, 0)
        check(
            self.tool_hold_max_s >= self.tool_hold_min_s,
            "tool_hold_max_s",
            f"must be >= tool_hold_min_s ({self.tool_hold_min_s}), got {self.tool_hold_max_s}",
        )
        check_above("turn_hold_s", self.turn_hold_s, 0)
        check_at_least("break_even_margin_s", self.break_even_margin_s, 0)
        check_at_least("prewarm_lead_s", self.prewarm_lead_s, 0)
        check_choice("predictor", self.predictor, PREDICTORS)
        check_above("warm_return_worth_s", self.warm_return_worth_s, 0)
        check_above("store_bandwidth_bytes_s", self.store_bandwidth_bytes_s, 0)
        check_above("composing_hold_s", self.composing_hold_s, 0)

    def wall_s(self, user_s: float) -> float:
        return user_s * self.time_scale
