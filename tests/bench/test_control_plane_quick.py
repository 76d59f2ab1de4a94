"""``bench/control_plane.py --quick`` at reduced sizes: one JSON object with both figures and their baselines."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import run_bench


def test_quick_run_reports_router_and_master_figures_against_their_baselines(tmp_path: Path) -> None:
    sizes = ["--sessions", "2000", "--decisions", "400", "--keys", "20000", "--ops", "2000", "--rounds", "1"]
    report = run_bench("control_plane.py", "--quick", "--out", str(tmp_path), *sizes, "--single-key-ops", "4000")
    assert report == json.loads((tmp_path / "control_plane_quick.json").read_text())
    assert (report["bench"], report["replicas"], report["sessions"], report["decisions"]) == (
        "control_plane",
        16,
        2000,
        400,
    )
    assert 0 < report["router_p50_ms"] <= report["router_p99_ms"] <= report["router_max_ms"]
    assert report["router_cpu_p99_ms"] > 0
    assert 0 < report["baseline_power_of_two_ms"]["p50"] <= report["baseline_power_of_two_ms"]["p99"]
    assert report["stats_refresh_ms"]["p50"] > 0
    # Decisions for sessions whose pages a replica reports go there: the KV term is live.
    assert report["router_kv_hit_share"] > 0
    master = report["master"]
    assert master["keys"] == 20000 and master["objects_after"] > 0 and master["evictions"] > 0
    assert master["bytes_per_key"] > 0 and master["keys_per_s"] > 0
    assert report["master_ops_per_s"] == max(master["ops_per_s_each"]) > 0
    assert report["baseline_dict_ops_per_s"] > 0
    assert report["master_keys_per_s"] == master["keys_per_s"]
    # The same mix, a key a call: master operations on one key each, beside the baseline's on the same calls.
    assert report["single_key_ops_per_s"] == max(master["single_key_ops_per_s_each"]) > 0
    assert report["single_key_ops_per_cpu_s"] == max(master["single_key_ops_per_cpu_s_each"]) > 0
    baseline_cpu = max(master["single_key_baseline_ops_per_cpu_s_each"])
    assert report["single_key_baseline_ops_per_cpu_s"] == baseline_cpu > 0
    assert report["single_key_over_baseline"] == round(report["single_key_ops_per_cpu_s"] / baseline_cpu, 3)
    assert report["router_target_met"] == (report["router_p99_ms"] < report["router_p99_target_ms"] == 1.0)
    target_met = report["single_key_ops_per_cpu_s"] >= report["master_ops_target_per_s"] == 20000
    assert report["master_target_met"] == target_met
