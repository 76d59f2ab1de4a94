"""User idle-time prediction at turn end, and its offline evaluation on traces.

When a turn ends the user reads, thinks and types for seconds to hours. The
KV-residency planner asks an ``IdlePredictor`` how long, conditioned on how
long the user has been away already, and acts on the answer:

  turn ends ──> LOOK (predict from the idle time so far)
                 ├─ idle left <= break-even, or prewarm due within a reload time:
                 │    ON DEVICE, pinned ──(hold_s passes, user still away)──> LOOK
                 └─ otherwise:
                      OFFLOADED ──(prewarm timer fires)──> PREWARMING ──> ON DEVICE
                      │   ^                 │
                      │   └─────────────────┘ a new prediction says later: the timer moves
                      └──(user back first)──> on-demand load

Pages back on the device are pinned like those of a fresh turn end. The
prewarm timer is set ``reload_s`` before the predicted lower quantile.
When it fires and the user is still away, a prediction from the idle time so
far may move it later (the pages are off already, so waiting costs nothing);
it stays once the chance that the user returns within a reload time reaches
the lower quantile's share.

The default model (``SessionIdlePredictor``) works on log seconds. A prior
fitted offline (``fit_prior``) gives a log-linear centre from turn-end features
and the spread of what is left; online, an exponentially weighted mean of each
session's residuals, shrunk toward zero while it has few gaps, moves the centre
per session, and a slow global mean follows drift of the whole population.
Quantiles are those of a log-normal around that centre, conditioned on the
idle time so far.
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


@dataclass(frozen=True, slots=True)
class IdlePrediction:
    """Predicted idle time: a point estimate and a lower quantile for the prewarm lead."""

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

    def __post_init__(self) -> None:
        unknown = [name for name in self.features if name not in FEATURES]
        if unknown:
            raise ValueError(f"unknown idle features {unknown}; known: {sorted(FEATURES)}")
        if not 0.0 < self.lower_quantile <= self.point_quantile < 1.0:
            raise ValueError("need 0 < lower_quantile <= point_quantile < 1")


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


PREDICTORS: dict[str, Callable[[IdlePrior], IdlePredictor]] = {
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
    """When the prewarm starts if the user stays away: ``reload_s`` before the lower quantile, moved
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
    for _ in range(MAX_LOOKS if second_looks else 1):
        if prediction.point_s - now_s > costs.break_even_s:
            # Once the user is back and the offload is decided, a later prewarm changes nothing.
            horizon_s = max(gap_s, now_s + costs.reload_s + REPLAN_MIN_STEP_S)
            prewarm_at_s = _prewarm_start(now_s, prediction, again, costs, second_looks, horizon_s)
            # With second looks, offload only when the pages would stay off longer than a reload takes.
            if not second_looks or prewarm_at_s - now_s > costs.reload_s:
                offloaded = True
                tally.offload(gap_s, now_s, costs.break_even_s)
                if gap_s < prewarm_at_s + costs.reload_s:
                    tally.cold_return(gap_s, now_s, prewarm_at_s, costs.reload_s)
                    return
                tally.captured_s += prewarm_at_s - now_s
                now_s = prewarm_at_s + costs.reload_s
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

    for conversation in conversations:
        session_id = conversation.conversation_id
        for features, gap in turn_end_samples(conversation):
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


def _costs(break_even_s: float, reload_s: float, timeout_s: float | None, hold_s: float | None) -> _Costs:
    if min(break_even_s, reload_s) < 0 or reload_s > break_even_s:
        raise ValueError(f"need 0 <= reload_s <= break_even_s, got {reload_s} and {break_even_s}")
    return _Costs(
        break_even_s,
        reload_s,
        break_even_s if timeout_s is None else timeout_s,
        break_even_s if hold_s is None else hold_s,
    )


def evaluate(
    conversations: Sequence[Conversation],
    predictor_factory: Callable[[], IdlePredictor],
    break_even_s: float,
    reload_s: float,
    *,
    timeout_s: float | None = None,
    hold_s: float | None = None,
) -> dict[str, Any]:
    """Replay every think gap of ``conversations`` in time order (one predictor, sessions in turn).

    Policies: ``predictor`` follows the module's state diagram: at turn end
    and after every ``hold_s`` (default: break-even) the user stays away with
    the pages on the device, it offloads when the predicted idle left exceeds
    ``break_even_s`` and the prewarm would start more than ``reload_s`` later;
    the prewarm starts ``reload_s`` before the lower quantile, moved later by
    predictions from the idle time so far. ``single_shot`` is the plain rule:
    one look at turn end, offload when the point estimate exceeds break-even,
    prewarm at the first lower quantile minus ``reload_s``. ``timeout``
    offloads every gap after ``timeout_s`` (default: break-even) and loads on
    demand. ``oracle`` offloads exactly the gaps longer than break-even and
    prewarms just in time.

    Per policy: ``idle_capture`` (share of all idle time the pages spend off
    the device, from offload to prewarm start or the user's return),
    ``prewarm_hit_rate`` (share of offloaded gaps whose pages were back before
    the user), ``wrong_offloads`` (offloads the user returned from within
    break-even), ``early_returns`` (on-demand loads) and their mean stall.
    """
    costs = _costs(break_even_s, reload_s, timeout_s, hold_s)
    return _summary(_replay(conversations, predictor_factory(), costs), costs)


def cross_validate(
    conversations: Sequence[Conversation],
    folds: int,
    break_even_s: float,
    reload_s: float,
    *,
    predictor: str = "session",
    config: IdleModelConfig | None = None,
    timeout_s: float | None = None,
    hold_s: float | None = None,
) -> dict[str, Any]:
    """``evaluate`` with the prior fitted on the other folds (conversations dealt round-robin)."""
    if folds < 2 or len(conversations) < folds:
        raise ValueError(f"need at least 2 folds and a conversation per fold, got {folds} for {len(conversations)}")
    factory = PREDICTORS[predictor]
    costs = _costs(break_even_s, reload_s, timeout_s, hold_s)
    total = _Replay()
    for fold in range(folds):
        training = [c for index, c in enumerate(conversations) if index % folds != fold]
        total.add(_replay(conversations[fold::folds], factory(fit_prior(training, config)), costs))
    summary = _summary(total, costs)
    summary.update(folds=folds, predictor_name=predictor, config=asdict(config or IdleModelConfig()))
    return summary


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
    parser.add_argument("--predictor", choices=sorted(PREDICTORS), default="session")
    parser.add_argument("--features", default=",".join(defaults.features), help=f"comma list of {sorted(FEATURES)}")
    parser.add_argument("--lower-quantile", type=float, default=defaults.lower_quantile)
    args = parser.parse_args(argv)
    features = tuple(name for name in args.features.split(",") if name)
    config = replace(defaults, features=features, lower_quantile=args.lower_quantile)
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
    )
    print(format_table(summary))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
