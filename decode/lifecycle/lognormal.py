"""The log-normal idle predictor: the prior's centre moved by each session's own residuals.

``SessionIdlePredictor`` moves the log-normal's centre by an exponentially
weighted mean of the session's residuals (shrunk toward zero while it has
few gaps); ``lower_s`` is a low quantile of the return, conditioned on the
idle time so far, and it stays once the chance that the user returns within
a reload time reaches that quantile's share.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from statistics import NormalDist

from .predictors import MIN_GAP_S, IdlePrediction, IdlePrior, TurnEndFeatures

# A session's log spread never drops below this (a factor of about 1.2 either way).
MIN_LOG_STD = 0.2

_STANDARD_NORMAL = NormalDist()
_MAX_QUANTILE = 1.0 - 1e-9


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
