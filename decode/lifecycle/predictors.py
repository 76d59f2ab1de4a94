"""What the idle-time predictors work with: turn-end features, predictions, the prior, the registry.

When a turn ends the user reads, thinks and types for seconds to hours. The
KV-residency planner asks an ``IdlePredictor`` how long, conditioned on how
long the user has been away already, and acts on the answer (``policy.py``).
A prediction's ``lower_s`` says when the pages should be back on the device;
the prewarm timer is set a reload before it.

Both models work on log seconds around a prior (``IdlePrior``): fitted
offline (``rayturn.replay.idle_fit``), it gives a log-linear centre from
turn-end features and a spread; without traces, a log-normal from the public
Claude Code figures. A slow global mean of the residuals follows drift of the
whole population.

- ``hazard`` (``hazard.py``, the default) mixes the prior's log-normal with a
  kernel density over the session's own latest gaps and keeps the pages on
  the device while the return hazard is worth it; one gap may hold, offload,
  prewarm and offload again.
- ``session`` (``lognormal.py``) moves the log-normal's centre by an
  exponentially weighted mean of the session's residuals; ``prior`` is the
  same without the per-session part.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Protocol

from rayturn.registry import Registry

# Idle gaps are recorded to the second; shorter ones count as one second in log space.
MIN_GAP_S = 1.0

# A normal-theory fallback for when no trace is at hand: the real Claude Code set
# (traces/README.md) waits a median 127 s before a new user message, 30% over
# five minutes, so log sigma = ln(300 / 127) / z(0.7).
FALLBACK_MEDIAN_GAP_S = 127.0
FALLBACK_LOG_STD = math.log(300.0 / 127.0) / NormalDist().inv_cdf(0.7)


@dataclass(frozen=True, slots=True)
class TurnEndFeatures:
    """What the planner knows about a session when one of its turns ends."""

    past_gaps_s: tuple[float, ...] = ()
    turn_duration_s: float = 0.0
    calls_in_turn: int = 1
    last_output_tokens: int = 0
    finish_reason: str | None = "stop"
    prompt_tokens: int = 0
    time_of_day_s: float | None = None
    # The user has already been idle this long: predictions are conditioned on it.
    idle_so_far_s: float = 0.0
    # The chance that the client announces the return (the user started typing) in time to bring the
    # pages back: a warm return then needs no residency, so the hazard predictor holds pages for
    # ``(1 - announced_share) * warm_return_worth_s`` per return.
    announced_share: float = 0.0


@dataclass(frozen=True, slots=True)
class IdlePrediction:
    """Predicted idle time: a point estimate, and when the pages should be back on the device (the
    prewarm timer is set ahead of it; the idle time so far: now; ``inf``: no return worth waiting for)."""

    point_s: float
    lower_s: float


class IdlePredictor(Protocol):
    def observe_gap(self, session_id: str, features: TurnEndFeatures, gap_s: float) -> None: ...

    def predict(self, session_id: str, features: TurnEndFeatures) -> IdlePrediction: ...


def _finish_stop(f: TurnEndFeatures) -> float:
    return 1.0 if f.finish_reason == "stop" else 0.0


def _finish_tool_calls(f: TurnEndFeatures) -> float:
    return 1.0 if f.finish_reason == "tool_calls" else 0.0


def _log_turn_s(f: TurnEndFeatures) -> float:
    return math.log1p(f.turn_duration_s)


def _log_output_tokens(f: TurnEndFeatures) -> float:
    return math.log1p(f.last_output_tokens)


FEATURES: dict[str, Callable[[TurnEndFeatures], float]] = {
    "finish_stop": _finish_stop,
    "finish_tool_calls": _finish_tool_calls,
    "log_turn_s": _log_turn_s,
    "log_output_tokens": _log_output_tokens,
}

# How the turn's last call ended predicts the gap best (a cut-off stream means the user is
# at the keyboard); turn length and output size did not lower the error on the tuning half.
DEFAULT_FEATURES = ("finish_stop", "finish_tool_calls")


@dataclass(frozen=True, slots=True)
class IdleModelConfig:
    """Knobs of the default model, tuned on the first half of the Claude Code traces (cross-validated)."""

    features: tuple[str, ...] = DEFAULT_FEATURES
    session_half_life_gaps: float = 8.0
    # Pseudo-gaps of prior weight: a session's own mean counts fully only after several gaps.
    shrinkage_gaps: float = 2.0
    spread_shrinkage_gaps: float = 3.0
    global_rate: float = 0.02
    point_quantile: float = 0.5
    # The prewarm timer stays once the chance that the user returns within a reload time reaches
    # this share: the most prewarming that kept idle capture at 0.90 or more on the tuning half.
    lower_quantile: float = 0.02
    ridge: float = 1.0
    # The hazard predictor wants the pages on the device while the user's chance of returning
    # within the next second is at least 1 / this: a warm return is worth this many seconds of
    # device residency (the balanced point on the Claude Code traces lies near 400).
    warm_return_worth_s: float = 400.0
    # Each past gap of a session adds a Laplace kernel of this scale (log seconds) to its return times.
    gap_kernel_log_width: float = 0.2

    def __post_init__(self) -> None:
        unknown = [name for name in self.features if name not in FEATURES]
        if unknown:
            raise ValueError(f"unknown idle features {unknown}; known: {sorted(FEATURES)}")
        if not 0.0 < self.lower_quantile <= self.point_quantile < 1.0:
            raise ValueError("need 0 < lower_quantile <= point_quantile < 1")
        if not self.warm_return_worth_s > 0.0:
            raise ValueError(f"warm_return_worth_s must be > 0, got {self.warm_return_worth_s}")
        if not self.gap_kernel_log_width > 0.0:
            raise ValueError(f"gap_kernel_log_width must be > 0, got {self.gap_kernel_log_width}")


@dataclass(frozen=True, slots=True)
class IdlePrior:
    """The offline-fitted part of the default model."""

    intercept: float = math.log(FALLBACK_MEDIAN_GAP_S)
    weights: tuple[float, ...] = ()
    log_std: float = FALLBACK_LOG_STD
    config: IdleModelConfig = field(default_factory=IdleModelConfig)
    num_gaps: int = 0

    def __post_init__(self) -> None:
        if self.weights and len(self.weights) != len(self.config.features):
            raise ValueError(f"{len(self.weights)} weights for {len(self.config.features)} features")

    def centre(self, features: TurnEndFeatures) -> float:
        """The prior's log-seconds centre for a turn end."""
        total = self.intercept
        for name, weight in zip(self.config.features, self.weights):
            total += weight * FEATURES[name](features)
        return total


def _hazard(prior: IdlePrior) -> IdlePredictor:
    from .hazard import HazardIdlePredictor

    return HazardIdlePredictor(prior)


def _session(prior: IdlePrior) -> IdlePredictor:
    from .lognormal import SessionIdlePredictor

    return SessionIdlePredictor(prior)


def _prior_only(prior: IdlePrior) -> IdlePredictor:
    from .lognormal import SessionIdlePredictor

    return SessionIdlePredictor(prior, learn_sessions=False)


# Idle predictors by the name ``lifecycle.predictor`` gives; each factory takes the prior.
PREDICTORS: Registry[IdlePredictor] = Registry("idle predictor")
PREDICTORS.register("hazard", _hazard)
PREDICTORS.register("session", _session)
PREDICTORS.register("prior", _prior_only)
