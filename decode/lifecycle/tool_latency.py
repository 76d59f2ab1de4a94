"""How long an agent's tools run: the pin a session's KV gets while it waits on one.

When a call ends in tool calls, the agent runs the tools and calls again, in
seconds usually and minutes sometimes. The decode replica keeps the session's
pages pinned for a high quantile of the expected tool latency: long enough
for most tools, short enough that a session whose agent died does not hold
pages for long. Latencies are log-normal around a centre that starts at a
global prior and moves, per session, toward that session's own history
(exponentially weighted, shrunk toward the prior while it has few samples).

The prior is that of the real Claude Code sessions (``traces/README.md``): a
tool-result call follows its predecessor by a median 9 s, 90% within 72 s.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from statistics import NormalDist

PRIOR_MEDIAN_S = 9.0
PRIOR_LOG_STD = math.log(72.0 / 9.0) / NormalDist().inv_cdf(0.9)
MIN_LATENCY_S = 0.1


@dataclass(slots=True)
class _History:
    weight: float = 0.0
    log_sum: float = 0.0


class ToolLatencyModel:
    """Per-session tool-latency quantiles, in the users' seconds."""

    def __init__(
        self,
        quantile: float = 0.9,
        half_life_samples: float = 8.0,
        shrinkage_samples: float = 2.0,
        max_sessions: int = 100_000,
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must lie in (0, 1), got {quantile}")
        self._z = NormalDist().inv_cdf(quantile)
        self._decay = 0.5 ** (1.0 / half_life_samples)
        self._shrinkage = shrinkage_samples
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, _History] = OrderedDict()

    def observe(self, session_id: str, latency_s: float) -> None:
        history = self._sessions.pop(session_id, None) or _History()
        self._sessions[session_id] = history  # most recently observed last
        if len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        history.weight = self._decay * history.weight + 1.0
        history.log_sum = self._decay * history.log_sum + math.log(max(latency_s, MIN_LATENCY_S))

    def quantile_s(self, session_id: str) -> float:
        """The latency this session's tools stay under with the model's quantile."""
        centre = math.log(PRIOR_MEDIAN_S)
        history = self._sessions.get(session_id)
        if history is not None:
            # A weighted mean of the prior centre (``shrinkage`` pseudo-samples) and the session's samples.
            centre = (self._shrinkage * centre + history.log_sum) / (self._shrinkage + history.weight)
        return math.exp(centre + self._z * PRIOR_LOG_STD)
