"""``bench/agent_clients.py --quick``: Claude Code and the Anthropic SDK, two calls of a session each, against a
real ``rayturn serve``; its last line is one JSON object whose continued calls read their prompt from the cache.

Speed is the benchmark's to report (BENCHMARKS.md), not this test's: it checks the figures are there and the
cache served the continued calls, which holds on any machine.
"""

from __future__ import annotations

from bench_script import run_bench


def test_agent_clients_quick_reports_cached_continuations() -> None:
    result = run_bench("agent_clients.py", "--quick")
    assert result["bench"] == "agent_clients" and result["quick"] is True
    assert result["sdk_prompt_tokens"] > 4000 and result["sdk_cached_fraction"] >= 0.9
    assert result["sdk_cold_ttft_s"] > 0 and result["sdk_continue_ttft_s"] > 0
    if result["claude_code_skipped"] is None:  # npm present: Claude Code itself ran
        assert result["claude_code_calls"] >= 2 and result["claude_code_cold_prompt_tokens"] > 5000
        assert result["claude_code_cached_fraction"] >= 0.9
        assert result["claude_code_continue_over_cold_ttft"] > 0
