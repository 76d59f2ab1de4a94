"""User idle-time prediction at turn end, and its offline evaluation on traces.

When a turn ends the user reads, thinks and types for seconds to hours. The
KV-residency planner asks an ``IdlePredictor`` how long, conditioned on how
long the user has been away already, and acts on the answer:

  turn ends ──> LOOK (predict from the idle time so far)
                 ├─ idle left <= break-even, or the pages would be off too briefly to pay:
                 │    ON DEVICE, pinned ──(hold_s passes, user still away)──> LOOK
                 └─ otherwise:
                      OFFLOADED ──(prewarm timer fires)──> PREWARMING ──> ON DEVICE
                      │   ^                 │
                      │   └─────────────────┘ a new prediction says later: the timer moves
                      └──(user back first)──> on-demand load

Pages back on the device are pinned like those of a fresh turn end. A
prediction's ``lower_s`` says when the pages should be back on the device; the
prewarm timer is set ``reload_s`` before it. When it fires and the user is
still away, a prediction from the idle time so far may move it later (the
pages are off already, so waiting costs nothing).

Both models work on log seconds around a prior: fitted offline
(``fit_prior``), it gives a log-linear centre from turn-end features and a
spread; without traces, a log-normal from the public Claude Code figures. A
slow global mean of the residuals follows drift of the whole population.

- ``HazardIdlePredictor`` (the default) mixes the prior's log-normal with a
  kernel density over the session's own latest gaps and keeps the pages on
  the device while the return hazard is worth it (see the class); one gap
  may hold, offload, prewarm and offload again.
- ``SessionIdlePredictor`` moves the log-normal's centre by an exponentially
  weighted mean of the session's residuals (shrunk toward zero while it has
  few gaps); ``lower_s`` is a low quantile of the return, conditioned on the
  idle time so far, and it stays once the chance that the user returns within
  a reload time reaches that quantile's share.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any, Protocol

import numpy as np

from .traces import Conversation, Gap, load_traces

# Idle gaps are recorded to the second; shorter ones count as one second in log space.
MIN_GAP_S = 1.0

# A normal-theory fallback for when no trace is at hand: the real Claude Code set
# (traces/README.md) waits a median 127 s before a new user message, 30% over
# five minutes, so log sigma = ln(300 / 127) / z(0.7).
FALLBACK_MEDIAN_GAP_S = 127.0
FALLBACK_LOG_STD = math.log(300.0 / 127.0) / NormalDist().inv_cdf(0.7)

# Production idle predictors keep session KV off the device for this share of user idle time.
PRODUCTION_CAPTURE = (0.86, 0.90)

# A session's log spread never drops below this (a factor of about 1.2 either way).
MIN_LOG_STD = 0.2

_STANDARD_NORMAL = NormalDist()
_MAX_QUANTILE = 1.0 - 1e-9


@dataclass(frozen=True, slots=True)
class TurnEndFeatures:
    """What the router knows about a session when one of its turns ends."""

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


@dataclass(slots=True)
class _SessionState:
    """Exponentially decayed sums over a session's log residuals."""

    weight: float = 0.0
    residual_sum: float = 0.0
    square_sum: float = 0.0


class SessionIdlePredictor:
    """The default predictor: prior + per-session and global exponentially weighted log residuals."""

    def __init__(self, prior: IdlePrior | None = None, max_sessions: int = 100_000, learn_sessions: bool = True):
        self.prior = prior or IdlePrior()
        config = self.prior.config
        self._decay = 0.5 ** (1.0 / config.session_half_life_gaps)
        self._z_point = _STANDARD_NORMAL.inv_cdf(config.point_quantile)
        self._z_lower = _STANDARD_NORMAL.inv_cdf(config.lower_quantile)
        self._max_sessions = max_sessions
        self._learn_sessions = learn_sessions
        self._global_bias = 0.0
        # Least recently observed first, so the oldest session is the one dropped.
        self._sessions: OrderedDict[str, _SessionState] = OrderedDict()

    def observe_gap(self, session_id: str, features: TurnEndFeatures, gap_s: float) -> None:
        residual = math.log(max(gap_s, MIN_GAP_S)) - self.prior.centre(features) - self._global_bias
        self._global_bias += self.prior.config.global_rate * residual
        if not self._learn_sessions:
            return
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = _SessionState()
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        state.weight = self._decay * state.weight + 1.0
        state.residual_sum = self._decay * state.residual_sum + residual
        state.square_sum = self._decay * state.square_sum + residual * residual

    def location(self, session_id: str, features: TurnEndFeatures) -> tuple[float, float]:
        """The session's log-seconds centre and spread, each shrunk toward the prior while the session is young."""
        centre = self.prior.centre(features) + self._global_bias
        sigma = self.prior.log_std
        state = self._sessions.get(session_id)
        if state is None:
            return centre, sigma
        config = self.prior.config
        mean = state.residual_sum / state.weight
        variance = max(0.0, state.square_sum / state.weight - mean * mean)
        centre += state.residual_sum / (state.weight + config.shrinkage_gaps)
        spread_weight = config.spread_shrinkage_gaps
        sigma = math.sqrt((spread_weight * sigma * sigma + state.weight * variance) / (spread_weight + state.weight))
        return centre, max(sigma, MIN_LOG_STD)

    def predict(self, session_id: str, features: TurnEndFeatures) -> IdlePrediction:
        centre, sigma = self.location(session_id, features)
        if features.idle_so_far_s <= 0.0:
            return IdlePrediction(math.exp(centre + self._z_point * sigma), math.exp(centre + self._z_lower * sigma))
        # Condition the log-normal on "not back yet": quantile q of what is left is
        # quantile u0 + q (1 - u0) of the whole, u0 the share already past.
        elapsed = features.idle_so_far_s
        passed = _STANDARD_NORMAL.cdf((math.log(max(elapsed, MIN_GAP_S)) - centre) / sigma)
        config = self.prior.config
        point_q = min(passed + config.point_quantile * (1.0 - passed), _MAX_QUANTILE)
        lower_q = min(passed + config.lower_quantile * (1.0 - passed), _MAX_QUANTILE)
        point = math.exp(centre + sigma * _STANDARD_NORMAL.inv_cdf(point_q))
        lower = math.exp(centre + sigma * _STANDARD_NORMAL.inv_cdf(lower_q))
        return IdlePrediction(max(point, elapsed), max(lower, elapsed))


# The return-time grid of ``HazardIdlePredictor``: log seconds from 1 s to about two days. Grid
# point k stands for the cell of log seconds within half a step of it; the first cell also holds
# returns within a second, and what lies past the last cell is kept as a tail of its own.
_HAZARD_GRID_POINTS = 256
_LOG_GRID = np.linspace(0.0, math.log(2.0e5), _HAZARD_GRID_POINTS)
_GRID_S = np.exp(_LOG_GRID)
_LOG_STEP = float(_LOG_GRID[1] - _LOG_GRID[0])
_GRID_END = float(_LOG_GRID[-1] + 0.5 * _LOG_STEP)
# A cell's mass over this is its mean density per second.
_PER_SECOND = 1.0 / (_LOG_STEP * _GRID_S)
# A session's return-time density remembers this many of its latest gaps.
HAZARD_HISTORY_GAPS = 32
# Sessions whose schedule (and own return-time mass) is kept for the next look within the same gap.
HAZARD_CACHE_ENTRIES = 4096
# The log-normal's centre is taken to this step (log seconds), so that a schedule and the prior's
# mass serve until the centre has moved a step (the global drift term moves it a little with every
# gap any session ends).
HAZARD_CENTRE_STEP = 0.01
# The announced share is taken to this step, for the same reason.
HAZARD_SHARE_STEP = 0.01
# Prior masses kept, one per centre step in use.
HAZARD_PRIOR_ENTRIES = 256
# Past this share of the mass still to come, the density says nothing more: no return is planned for.
HAZARD_MIN_AWAY = 1e-9


@dataclass(frozen=True, slots=True)
class _Schedule:
    """One gap's plan on the grid: where the pages belong on the device, and the return-time CDF."""

    on: np.ndarray  # bool per grid point: the return hazard there is worth the residency
    cdf: np.ndarray  # the share of returns before each grid point (cell midpoints)


class HazardIdlePredictor:
    """Return-hazard predictor: pages on the device exactly while a return is likely enough.

    At a turn end the session's return time gets a density over log seconds:
    the prior's log-normal (centre from the turn-end features plus a slow
    global drift) mixed with Laplace kernels on the session's own latest gaps,
    which gain weight as the session shows more of them. Its hazard (the
    chance per second that a user who is still away returns now) decides: the
    pages belong on the device while the hazard is at least
    ``1 / warm_return_worth_s``, the worth scaled by ``1 - announced_share``
    (a return the client announces is warm without residency). The hazard of
    real think times falls, rises again near the gaps a session keeps
    repeating, and falls after them (a
    Laplace kernel's tail, unlike a normal one's, does not say "late, so surely
    back any second"), so one gap may hold, offload, prewarm before a likely
    return, and offload again when the user does not come. ``lower_s`` is when
    the pages should be back on the device (the idle time so far while they
    belong there, ``inf`` when no return is worth waiting for), ``point_s``
    the conditional median of the return.
    """

    def __init__(self, prior: IdlePrior | None = None, max_sessions: int = 100_000):
        self.prior = prior or IdlePrior()
        config = self.prior.config
        self._decay = 0.5 ** (1.0 / config.session_half_life_gaps)
        self._worth_s = config.warm_return_worth_s
        # A Laplace kernel on the grid, out to where it has fallen below a millionth.
        self._reach = math.ceil(14.0 * config.gap_kernel_log_width / _LOG_STEP)
        offsets = np.arange(-self._reach, self._reach + 1)
        kernel = np.exp(-np.abs(offsets) * _LOG_STEP / config.gap_kernel_log_width)
        self._kernel = kernel / kernel.sum()  # one unit of mass per gap
        self._max_sessions = max_sessions
        self._global_bias = 0.0
        # Each session's latest log gaps, oldest first; least recently observed session first.
        self._sessions: OrderedDict[str, list[float]] = OrderedDict()
        # Each recent session's last schedule, under the centre and announced-share steps it was computed for.
        self._schedules: OrderedDict[str, tuple[tuple[int, int], _Schedule]] = OrderedDict()
        # Each recent session's own return-time masses (grid, past the grid) and their share of the mix.
        self._own: OrderedDict[str, tuple[np.ndarray, float, float]] = OrderedDict()
        # The prior's masses (grid, past the grid) by centre step.
        self._prior_masses: OrderedDict[int, tuple[np.ndarray, float]] = OrderedDict()

    def observe_gap(self, session_id: str, features: TurnEndFeatures, gap_s: float) -> None:
        if not math.isfinite(gap_s):
            return
        log_gap = math.log(max(gap_s, MIN_GAP_S))
        self._global_bias += self.prior.config.global_rate * (log_gap - self.prior.centre(features) - self._global_bias)
        gaps = self._sessions.pop(session_id, None) or []
        gaps.append(log_gap)
        del gaps[:-HAZARD_HISTORY_GAPS]
        self._sessions[session_id] = gaps
        self._forget(session_id)
        if len(self._sessions) > self._max_sessions:
            dropped, _ = self._sessions.popitem(last=False)
            self._forget(dropped)

    def _forget(self, session_id: str) -> None:
        """Drop what was derived from a session's gaps."""
        self._schedules.pop(session_id, None)
        self._own.pop(session_id, None)

    def masses(self, session_id: str, features: TurnEndFeatures) -> tuple[np.ndarray, float]:
        """The session's return-time distribution: the mass of each grid cell, and the mass past the grid."""
        return self._masses(session_id, self._centre_step(features))

    def _centre_step(self, features: TurnEndFeatures) -> int:
        return round((self.prior.centre(features) + self._global_bias) / HAZARD_CENTRE_STEP)

    def _masses(self, session_id: str, centre_step: int) -> tuple[np.ndarray, float]:
        mass, beyond = self._prior(centre_step)
        own = self._own_masses(session_id)
        if own is None:
            return mass, beyond
        own_mass, own_beyond, share = own
        return share * own_mass + (1.0 - share) * mass, share * own_beyond + (1.0 - share) * beyond

    def _prior(self, centre_step: int) -> tuple[np.ndarray, float]:
        """The prior's log-normal around the centre step, as masses."""
        cached = self._prior_masses.get(centre_step)
        if cached is not None:
            return cached
        centre, sigma = centre_step * HAZARD_CENTRE_STEP, self.prior.log_std
        mass = np.exp(-0.5 * ((_LOG_GRID - centre) / sigma) ** 2) * (_LOG_STEP / (sigma * math.sqrt(2.0 * math.pi)))
        mass[0] += _STANDARD_NORMAL.cdf((-0.5 * _LOG_STEP - centre) / sigma)  # back within the first second
        beyond = 1.0 - _STANDARD_NORMAL.cdf((_GRID_END - centre) / sigma)
        self._prior_masses[centre_step] = (mass, beyond)
        if len(self._prior_masses) > HAZARD_PRIOR_ENTRIES:
            self._prior_masses.popitem(last=False)
        return mass, beyond

    def _own_masses(self, session_id: str) -> tuple[np.ndarray, float, float] | None:
        """The session's own return-time masses from its gaps, and their share of the mix (None: no gaps)."""
        cached = self._own.get(session_id)
        if cached is not None:
            self._own.move_to_end(session_id)
            return cached
        gaps = self._sessions.get(session_id)
        if not gaps:
            return None
        weights = self._decay ** np.arange(len(gaps) - 1, -1, -1, dtype=np.float64)
        total = float(weights.sum())
        # Spread each gap over its two neighbouring grid points, then lay the kernel over them.
        far = _HAZARD_GRID_POINTS + self._reach  # a gap beyond this adds nothing to the grid
        position = np.minimum(np.asarray(gaps) / _LOG_STEP, float(far))
        below = position.astype(np.int64)
        above_share = position - below
        points = np.bincount(below, weights * (1.0 - above_share), minlength=far + 2)
        points += np.bincount(below + 1, weights * above_share, minlength=far + 2)
        spread = np.convolve(points, self._kernel) / total  # index reach + k is grid point k
        own = spread[self._reach : self._reach + _HAZARD_GRID_POINTS].copy()
        own[0] += spread[: self._reach].sum()
        own_beyond = float(spread[self._reach + _HAZARD_GRID_POINTS :].sum())
        share = total / (total + self.prior.config.shrinkage_gaps)
        self._own[session_id] = (own, own_beyond, share)
        if len(self._own) > HAZARD_CACHE_ENTRIES:
            self._own.popitem(last=False)
        return own, own_beyond, share

    def _schedule(self, session_id: str, features: TurnEndFeatures) -> _Schedule:
        centre_step = self._centre_step(features)
        share_step = round(min(max(features.announced_share, 0.0), 1.0) / HAZARD_SHARE_STEP)
        key = (centre_step, share_step)
        cached = self._schedules.get(session_id)
        if cached is not None and cached[0] == key:
            self._schedules.move_to_end(session_id)
            return cached[1]
        mass, beyond = self._masses(session_id, centre_step)
        # Residency one warm return is worth: less the share of returns that come announced anyway.
        worth_s = self._worth_s * max(1.0 - share_step * HAZARD_SHARE_STEP, 0.0)
        # Still away on reaching a grid point: the mass from that point on, summed from the far end
        # so that a thin tail keeps its size.
        away = np.cumsum(mass[::-1])[::-1] + beyond
        total = max(float(away[0]), 1e-300)
        # The hazard per second, mass / (cell width in seconds) / away, against the threshold.
        on = (mass * _PER_SECOND * worth_s >= away) & (away > HAZARD_MIN_AWAY * total)
        schedule = _Schedule(on, 1.0 - (away - 0.5 * mass) / total)
        self._schedules.pop(session_id, None)
        self._schedules[session_id] = (key, schedule)
        if len(self._schedules) > HAZARD_CACHE_ENTRIES:
            self._schedules.popitem(last=False)
        return schedule

    def predict(self, session_id: str, features: TurnEndFeatures) -> IdlePrediction:
        schedule = self._schedule(session_id, features)
        elapsed = features.idle_so_far_s
        log_elapsed = math.log(max(elapsed, MIN_GAP_S))
        index = min(round(log_elapsed / _LOG_STEP), _HAZARD_GRID_POINTS - 1)
        ahead = np.flatnonzero(schedule.on[index:])
        if ahead.size == 0:
            back_by_s = math.inf
        else:
            back_by_s = max(elapsed, float(_GRID_S[index + int(ahead[0])]) * math.exp(-0.5 * _LOG_STEP))
        passed = float(np.interp(log_elapsed, _LOG_GRID, schedule.cdf)) if elapsed > 0 else 0.0
        median_index = int(np.searchsorted(schedule.cdf, passed + 0.5 * (1.0 - passed)))
        point_s = float(_GRID_S[median_index]) if median_index < _HAZARD_GRID_POINTS else math.exp(_GRID_END)
        return IdlePrediction(max(point_s, elapsed), back_by_s)


PREDICTORS: dict[str, Callable[[IdlePrior], IdlePredictor]] = {
    "hazard": lambda prior: HazardIdlePredictor(prior),
    "session": lambda prior: SessionIdlePredictor(prior),
    "prior": lambda prior: SessionIdlePredictor(prior, learn_sessions=False),
}


def turn_end_samples(conversation: Conversation) -> list[tuple[TurnEndFeatures, Gap]]:
    """Each turn end of a conversation with what the router knew then, and the gap that followed."""
    samples = []
    past: tuple[float, ...] = ()
    turns = conversation.turns()
    for turn, gap in zip(turns, conversation.think_gaps()):
        last = next(call for call in reversed(turn.calls) if call.subagent_id is None)
        time_of_day_s = None
        if conversation.start_epoch_s is not None:
            time_of_day_s = (conversation.start_epoch_s + gap.start_s) % 86_400.0
        features = TurnEndFeatures(
            past_gaps_s=past,
            turn_duration_s=turn.duration_s,
            calls_in_turn=len(turn.calls),
            last_output_tokens=last.output_tokens,
            finish_reason=last.finish_reason,
            prompt_tokens=last.input_tokens,
            time_of_day_s=time_of_day_s,
        )
        samples.append((features, gap))
        past = (*past, gap.duration_s)
    return samples


def fit_prior(conversations: Iterable[Conversation], config: IdleModelConfig | None = None) -> IdlePrior:
    """Fit the prior on training conversations: ridge regression in log seconds, then the online residual spread."""
    config = config or IdleModelConfig()
    sessions = [turn_end_samples(conversation) for conversation in conversations]
    samples = [sample for session in sessions for sample in session]
    if len(samples) < 2:
        return IdlePrior(config=config, num_gaps=len(samples))
    x = np.array([[FEATURES[name](f) for name in config.features] for f, _ in samples]).reshape(len(samples), -1)
    y = np.array([math.log(max(gap.duration_s, MIN_GAP_S)) for _, gap in samples])
    # Centre the features so the ridge penalty leaves the intercept alone.
    mean_x = x.mean(axis=0)
    xc = x - mean_x
    weights = np.linalg.solve(xc.T @ xc + config.ridge * np.eye(x.shape[1]), xc.T @ (y - y.mean()))
    intercept = float(y.mean() - mean_x @ weights)
    prior = IdlePrior(intercept, tuple(float(w) for w in weights), FALLBACK_LOG_STD, config, len(samples))
    # The spread the predictor will face: residuals after the online session offset, replayed honestly.
    learner = SessionIdlePredictor(replace(prior, config=replace(config, global_rate=0.0)))
    residuals = []
    for index, session in enumerate(sessions):
        for features, gap in session:
            centre = learner.location(str(index), features)[0]
            residuals.append(math.log(max(gap.duration_s, MIN_GAP_S)) - centre)
            learner.observe_gap(str(index), features, gap.duration_s)
    return replace(prior, log_std=max(float(np.std(residuals)), 0.1))


@dataclass(slots=True)
class _Tally:
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

    def add(self, other: _Tally) -> None:
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
class _Costs:
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
    def min_off_s(self) -> float:
        return min_off_s(self.break_even_s, self.reload_s)


def min_off_s(break_even_s: float, reload_s: float) -> float:
    """The least time off the device that pays for an offload: break-even less the reload inside it,
    and never less than a reload."""
    return max(reload_s, break_even_s - reload_s)


# Bounds on the second looks one gap may take: looks at the whole gap, moves of one prewarm timer.
MAX_LOOKS = 1000
MAX_REPLANS = 1000
# The least a second look must move the prewarm timer.
REPLAN_MIN_STEP_S = 1.0


def _prewarm_start(
    now_s: float,
    prediction: IdlePrediction,
    again: Callable[[float], IdlePrediction],
    costs: _Costs,
    replan: bool,
    horizon_s: float,
) -> float:
    """When the prewarm starts if the user stays away: ``reload_s`` before ``lower_s``, moved
    later while a prediction from the idle time at that moment says so. Past ``horizon_s`` the exact
    time no longer matters to the caller."""
    start_s = max(now_s, prediction.lower_s - costs.reload_s)
    for _ in range(MAX_REPLANS if replan else 0):
        if start_s >= horizon_s:
            break
        later_s = again(start_s).lower_s - costs.reload_s
        if later_s < start_s + REPLAN_MIN_STEP_S:
            break
        start_s = later_s
    return start_s


def _predictor_gap(
    tally: _Tally,
    gap_s: float,
    first: IdlePrediction,
    again: Callable[[float], IdlePrediction],
    costs: _Costs,
    second_looks: bool,
) -> None:
    """One gap under the predictor's policy (see ``evaluate``); ``again(t)`` predicts after ``t`` seconds of idle."""
    tally.begin(gap_s)
    now_s, prediction, offloaded = 0.0, first, False
    announced_at_s = costs.announced_at_s(gap_s)
    for _ in range(MAX_LOOKS if second_looks else 1):
        if now_s >= announced_at_s:
            break  # the call is announced: the pages on the device wait for it
        if prediction.point_s - now_s > costs.break_even_s:
            # Once the user is back and the offload is decided, a later prewarm changes nothing.
            # Looking that far tells whether the pages would stay off long enough, whatever the gap.
            horizon_s = max(gap_s, now_s + costs.min_off_s + REPLAN_MIN_STEP_S)
            prewarm_at_s = _prewarm_start(now_s, prediction, again, costs, second_looks, horizon_s)
            # Offload only when the pages would stay off long enough to pay for the move.
            if prewarm_at_s - now_s > costs.min_off_s:
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


def _timeout_gap(tally: _Tally, gap_s: float, costs: _Costs) -> None:
    tally.begin(gap_s)
    if gap_s > costs.timeout_s:
        tally.offload(gap_s, costs.timeout_s, costs.break_even_s)
        tally.cold_return(gap_s, costs.timeout_s, None, costs.reload_s)


def _oracle_gap(tally: _Tally, gap_s: float, costs: _Costs) -> None:
    tally.begin(gap_s)
    if gap_s > costs.break_even_s:
        tally.offload(gap_s, 0.0, costs.break_even_s)
        tally.captured_s += max(0.0, gap_s - costs.reload_s)
        tally.offloaded_gaps += 1
        tally.prewarm_hits += 1


POLICIES = ("predictor", "single_shot", "timeout", "oracle")


@dataclass(slots=True)
class _Replay:
    tallies: dict[str, _Tally] = field(default_factory=lambda: {name: _Tally() for name in POLICIES})
    prediction_ns: list[int] = field(default_factory=list)
    # Turn-end prediction quality: summed |log(gap / point)|, and gaps at or above the lower quantile.
    log_error_sum: float = 0.0
    lower_covered: int = 0

    def add(self, other: _Replay) -> None:
        for name, tally in self.tallies.items():
            tally.add(other.tallies[name])
        self.prediction_ns.extend(other.prediction_ns)
        self.log_error_sum += other.log_error_sum
        self.lower_covered += other.lower_covered


def _replay(conversations: Sequence[Conversation], predictor: IdlePredictor, costs: _Costs) -> _Replay:
    result = _Replay()

    def timed(session_id: str, features: TurnEndFeatures) -> IdlePrediction:
        start = time.perf_counter_ns()
        prediction = predictor.predict(session_id, features)
        result.prediction_ns.append(time.perf_counter_ns() - start)
        return prediction

    # Returns announced, and returns, so far: the replica's share and each session's (as the planner keeps them).
    announced, returns = 0, 0
    for conversation in conversations:
        session_id = conversation.conversation_id
        for index, (features, gap) in enumerate(turn_end_samples(conversation)):
            if costs.announce_lead_s is not None:
                # Every return of this replay is announced, in time to bring the pages back when the lead
                # covers a reload; the share is the planner's estimate of that.
                in_time = costs.announce_lead_s >= costs.reload_s
                replica_share = announced / returns if returns else 0.0
                features = replace(features, announced_share=(index * in_time + replica_share) / (index + 1))
                announced += in_time
            returns += 1
            first = timed(session_id, features)
            gap_log_s = math.log(max(gap.duration_s, MIN_GAP_S))
            result.log_error_sum += abs(gap_log_s - math.log(max(first.point_s, MIN_GAP_S)))
            result.lower_covered += int(gap.duration_s >= first.lower_s)

            def again(
                idle_s: float, session_id: str = session_id, features: TurnEndFeatures = features
            ) -> IdlePrediction:
                return timed(session_id, replace(features, idle_so_far_s=idle_s))

            _predictor_gap(result.tallies["predictor"], gap.duration_s, first, again, costs, second_looks=True)
            _predictor_gap(result.tallies["single_shot"], gap.duration_s, first, again, costs, second_looks=False)
            _timeout_gap(result.tallies["timeout"], gap.duration_s, costs)
            _oracle_gap(result.tallies["oracle"], gap.duration_s, costs)
            predictor.observe_gap(session_id, features, gap.duration_s)
    return result


def _summary(result: _Replay, costs: _Costs) -> dict[str, Any]:
    times_us = sorted(ns / 1000.0 for ns in result.prediction_ns)
    reports = {name: tally.report() for name, tally in result.tallies.items()}
    oracle_capture = reports["oracle"]["idle_capture"]
    gaps = result.tallies["oracle"].gaps
    return {
        **asdict(costs),
        "gaps": gaps,
        "idle_s": result.tallies["oracle"].idle_s,
        **reports,
        "capture_vs_oracle": reports["predictor"]["idle_capture"] / oracle_capture if oracle_capture else 0.0,
        "log_abs_error": result.log_error_sum / gaps if gaps else 0.0,
        "lower_coverage": result.lower_covered / gaps if gaps else 0.0,
        "production_capture": list(PRODUCTION_CAPTURE),
        "predictions": len(times_us),
        "prediction_us_mean": sum(times_us) / len(times_us) if times_us else 0.0,
        "prediction_us_p50": times_us[len(times_us) // 2] if times_us else 0.0,
        "prediction_us_p99": times_us[min(len(times_us) - 1, int(0.99 * len(times_us)))] if times_us else 0.0,
    }


def _costs(
    break_even_s: float,
    reload_s: float,
    timeout_s: float | None,
    hold_s: float | None,
    announce_lead_s: float | None = None,
) -> _Costs:
    if min(break_even_s, reload_s) < 0 or reload_s > break_even_s:
        raise ValueError(f"need 0 <= reload_s <= break_even_s, got {reload_s} and {break_even_s}")
    if announce_lead_s is not None and not announce_lead_s >= 0:
        raise ValueError(f"announce_lead_s must be >= 0, got {announce_lead_s}")
    return _Costs(
        break_even_s,
        reload_s,
        break_even_s if timeout_s is None else timeout_s,
        break_even_s if hold_s is None else hold_s,
        announce_lead_s,
    )


def evaluate(
    conversations: Sequence[Conversation],
    predictor_factory: Callable[[], IdlePredictor],
    break_even_s: float,
    reload_s: float,
    *,
    timeout_s: float | None = None,
    hold_s: float | None = None,
    announce_lead_s: float | None = None,
) -> dict[str, Any]:
    """Replay every think gap of ``conversations`` in time order (one predictor, sessions in turn).

    Policies: ``predictor`` follows the module's state diagram: at turn end
    and after every ``hold_s`` (default: break-even) the user stays away with
    the pages on the device, it offloads when the predicted idle left exceeds
    ``break_even_s`` and the pages would stay off long enough to pay for the
    move (``min_off_s``); the prewarm starts ``reload_s`` before ``lower_s``,
    moved later by predictions from the idle time so far. ``single_shot`` is
    the plain rule: one look at turn end, the same offload test, prewarm at
    the first ``lower_s`` minus ``reload_s``. ``timeout``
    offloads every gap after ``timeout_s`` (default: break-even) and loads on
    demand. ``oracle`` offloads exactly the gaps longer than break-even and
    prewarms just in time.

    Per policy: ``idle_capture`` (share of all idle time the pages spend off
    the device, from offload to prewarm start or the user's return),
    ``prewarm_hit_rate`` (share of offloaded gaps whose pages were back before
    the user), ``wrong_offloads`` (offloads the user returned from within
    break-even), ``early_returns`` (on-demand loads) and their mean stall.

    ``announce_lead_s``: the client announces every return this long before
    the call (the user starts typing; at the turn end when the gap is
    shorter); the predictor policies (``predictor``, ``single_shot``) then
    start a prewarm at once or keep pages on the device until the call (the
    planner's ``composing_hold_s`` is assumed long enough), and the predictor
    sees the session's announced share (``TurnEndFeatures``). ``timeout`` and
    ``oracle`` ignore announcements.
    """
    costs = _costs(break_even_s, reload_s, timeout_s, hold_s, announce_lead_s)
    return _summary(_replay(conversations, predictor_factory(), costs), costs)


def cross_validate(
    conversations: Sequence[Conversation],
    folds: int,
    break_even_s: float,
    reload_s: float,
    *,
    predictor: str = "hazard",
    config: IdleModelConfig | None = None,
    timeout_s: float | None = None,
    hold_s: float | None = None,
    announce_lead_s: float | None = None,
) -> dict[str, Any]:
    """``evaluate`` with the prior fitted on the other folds (conversations dealt round-robin)."""
    if folds < 2 or len(conversations) < folds:
        raise ValueError(f"need at least 2 folds and a conversation per fold, got {folds} for {len(conversations)}")
    factory = PREDICTORS[predictor]
    costs = _costs(break_even_s, reload_s, timeout_s, hold_s, announce_lead_s)
    total = _Replay()
    for fold in range(folds):
        training = [c for index, c in enumerate(conversations) if index % folds != fold]
        total.add(_replay(conversations[fold::folds], factory(fit_prior(training, config)), costs))
    summary = _summary(total, costs)
    summary.update(folds=folds, predictor_name=predictor, config=asdict(config or IdleModelConfig()))
    return summary


def keep_or_offload_capture(gaps_s: Sequence[float], warm_share: float) -> float:
    """The most idle capture any policy without prewarms can have with ``warm_share`` of returns warm,
    even one that knows every gap: without a prewarm a warm return keeps the pages on the device for
    its whole gap, so it keeps them through the shortest gaps and offloads every other at once. More
    capture at that share takes prewarms that land inside a user's absence."""
    ordered = sorted(gaps_s)
    total = sum(ordered)
    if not ordered or total <= 0.0:
        return 0.0
    return 1.0 - sum(ordered[: keep_or_offload_kept(len(ordered), warm_share)]) / total


def keep_or_offload_kept(num_gaps: int, warm_share: float) -> int:
    """How many of ``num_gaps`` gaps ``keep_or_offload_capture`` keeps the pages through: ``warm_share`` of them,
    rounded up."""
    return min(num_gaps, math.ceil(warm_share * num_gaps - 1e-9))


def format_table(summary: dict[str, Any]) -> str:
    """The evaluation as a text table, one row per policy."""
    lines = [
        f"{summary['gaps']} think gaps, {summary['idle_s'] / 3600:.1f} h of user idle; "
        f"break-even {summary['break_even_s']:g} s, reload {summary['reload_s']:g} s, "
        f"timeout {summary['timeout_s']:g} s, hold {summary['hold_s']:g} s",
        f"{'policy':<12}{'capture':>8}{'prewarm hit':>12}{'warm':>6}{'offloaded':>10}{'offloads':>9}{'wrong':>6}"
        f"{'early':>6}{'stall s':>8}",
    ]
    for name in POLICIES:
        r = summary[name]
        lines.append(
            f"{name:<12}{r['idle_capture']:>8.3f}{r['prewarm_hit_rate']:>12.3f}{r['warm_return_rate']:>6.2f}"
            f"{r['offloaded_gaps']:>10d}"
            f"{r['offloads']:>9d}{r['wrong_offloads']:>6d}{r['early_returns']:>6d}{r['mean_stall_s']:>8.2f}"
        )
    low, high = summary["production_capture"]
    lines.append(
        f"predictor capture is {summary['capture_vs_oracle']:.1%} of the oracle's; "
        f"production predictors capture {low:.0%}-{high:.0%} of user idle time"
    )
    lines.append(
        f"{summary['predictions']} predictions: mean {summary['prediction_us_mean']:.1f} us, "
        f"median {summary['prediction_us_p50']:.1f} us, p99 {summary['prediction_us_p99']:.1f} us"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    defaults = IdleModelConfig()
    parser = argparse.ArgumentParser(prog="python -m rayturn.router.idle", description=__doc__.split("\n")[0])
    parser.add_argument("--traces", nargs="+", required=True, type=Path, help="trace files or folders")
    parser.add_argument("--break-even-s", type=float, default=30.0, help="idle time past which an offload pays")
    parser.add_argument("--reload-s", type=float, default=5.0, help="time to bring a session's KV back")
    parser.add_argument("--timeout-s", type=float, help="offload timeout of the baseline (default: break-even)")
    parser.add_argument(
        "--hold-s", type=float, help="pages on the device wait this long before a second look (default: break-even)"
    )
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds over conversations")
    parser.add_argument("--predictor", choices=sorted(PREDICTORS), default="hazard")
    parser.add_argument("--features", default=",".join(defaults.features), help=f"comma list of {sorted(FEATURES)}")
    parser.add_argument(
        "--lower-quantile", type=float, default=defaults.lower_quantile, help="session, prior: the prewarm quantile"
    )
    parser.add_argument(
        "--warm-return-worth-s",
        type=float,
        default=defaults.warm_return_worth_s,
        help="hazard: seconds of device residency one warm return is worth",
    )
    parser.add_argument(
        "--announce-lead-s",
        type=float,
        default=None,
        help="the client announces every return this long before the call (default: never)",
    )
    args = parser.parse_args(argv)
    features = tuple(name for name in args.features.split(",") if name)
    config = replace(
        defaults,
        features=features,
        lower_quantile=args.lower_quantile,
        warm_return_worth_s=args.warm_return_worth_s,
    )
    conversations = [c for c in load_traces(args.traces) if c.think_gaps()]
    summary = cross_validate(
        conversations,
        min(args.folds, len(conversations)),
        args.break_even_s,
        args.reload_s,
        predictor=args.predictor,
        config=config,
        timeout_s=args.timeout_s,
        hold_s=args.hold_s,
        announce_lead_s=args.announce_lead_s,
    )
    print(format_table(summary))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
