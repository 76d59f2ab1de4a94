"""The idle predictors' prior, fitted offline on recorded traces.

``turn_end_samples`` reads each turn end of a conversation as the planner
would have seen it (``TurnEndFeatures``) with the think gap that followed;
``fit_prior`` fits the log-linear centre on those samples by ridge
regression and the spread from the residuals an online session learner
leaves, replayed in order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from rayturn.decode.lifecycle.lognormal import SessionIdlePredictor
from rayturn.decode.lifecycle.predictors import (
    FALLBACK_LOG_STD,
    FEATURES,
    MIN_GAP_S,
    IdleModelConfig,
    IdlePrior,
    TurnEndFeatures,
)

from .traces import Conversation, Gap


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
