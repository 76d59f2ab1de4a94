"""The tool-latency model: the prior's quantile, and a session's own history."""

from __future__ import annotations

import math

import pytest

from rayturn.decode.lifecycle.tool_latency import ToolLatencyModel


def test_tool_latency_model_moves_toward_a_sessions_history() -> None:
    model = ToolLatencyModel()
    prior_s = model.quantile_s("s")
    assert prior_s == pytest.approx(72.0, rel=1e-6)  # the prior's 90th percentile
    for _ in range(20):
        model.observe("s", 2.0)
    fast_s = model.quantile_s("s")
    assert fast_s < prior_s / 3
    assert model.quantile_s("other") == pytest.approx(prior_s)
    assert math.isfinite(fast_s)
    with pytest.raises(ValueError, match="quantile"):
        ToolLatencyModel(quantile=1.0)
