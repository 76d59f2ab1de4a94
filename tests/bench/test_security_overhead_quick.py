"""``bench/security_overhead.py --quick`` runs, and prints one JSON object whose parts add up."""

from __future__ import annotations

from bench_script import run_bench


def test_quick_run_reports_each_check_and_its_share() -> None:
    report = run_bench("security_overhead.py", "--quick")
    ingress, store = report["ingress_checks_us"], report["store_checks_us"]
    assert set(ingress) == {"api_key", "body_limit", "prompt_bound", "thread_hop"}
    assert ingress["thread_hop"] == 0.0 and report["large_body_ingress_checks_us"]["thread_hop"] > 0
    per_call = sum(ingress.values()) + store["read_grant"] + store["write_grant"]
    assert abs(report["per_call_us"] - per_call) < 0.5
    assert report["cached_ttft_ms_median"] > 0 and report["prompt_tokens"] > 3000
    expected = report["per_call_us"] / 1e3 / report["cached_ttft_ms_median"]
    assert abs(report["overhead_fraction_of_ttft"] - expected) < 1e-4
    assert report["target_fraction"] == 0.01
