"""``bench/soak.py --quick``: agent sessions then an overload burst against an embedded cluster; its last line is
one JSON object in which no request was lost and every process of the cluster has its memory sampled.

Whether memory stays flat is the benchmark's to report over minutes (BENCHMARKS.md), not this test's.
"""

from __future__ import annotations

from pathlib import Path

from bench_script import run_bench


def test_soak_quick_loses_nothing_and_samples_every_process(tmp_path: Path) -> None:
    result = run_bench("soak.py", "--quick", "--out", str(tmp_path))
    assert result["bench"] == "soak" and result["quick"] is True
    requests = result["requests"]
    assert requests["lost"] == 0 and requests["completed"] == requests["sent"] > 0
    overload = result["overload"]
    assert overload["lost"] == 0 and overload["completed"] == overload["sent"] == overload["calls_per_round"]
    processes = {label.split("[")[0] for label in result["rss_by_process"]}
    assert {
        "ingress",
        "decode",
        "prefill",
        "KVMaster",
        "ServeController",
        "ProxyActor",
        "raylet",
        "driver",
    } <= processes
    assert all(entry["start_mb"] > 0 and entry["end_mb"] > 0 for entry in result["rss_by_process"].values())
    assert isinstance(result["rss_flat"], bool) and "2%" in result["rss_flat_rule"]
    private = result["private_rss"]  # RSS less the shared-memory pages (the KV store's segments)
    assert isinstance(private["flat"], bool) and 0 < private["start_mb"] < result["rss_total_mb"]["start"]
    assert Path(result["plot_file"]).stat().st_size > 0 and Path(result["results_file"]).exists()
