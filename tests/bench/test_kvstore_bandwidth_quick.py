"""``bench/kvstore_bandwidth.py --quick --peer none`` runs, and its one-page get comes with where its time goes."""

from __future__ import annotations

from bench_script import run_bench


def test_quick_run_reports_the_lookup_and_the_bare_ucx_exchange_beside_the_get() -> None:
    report = run_bench("kvstore_bandwidth.py", "--quick", "--peer", "none")
    assert "mooncake" not in report and "mooncake_skipped" not in report
    for path in ("same_node", "ucx", "ucx_tcp", "ucx_ucxx"):
        figures = report[path]
        assert figures["gbps"] > 0 and figures["list_gbps"] > 0
        for name in ("get_1", "get_256", "lookup_1", "prefix_load_8", "prefix_load_8_two_lookups"):
            assert 0 < figures[f"{name}_p50_ms"] <= figures[f"{name}_p99_ms"], (path, name)
    for path, ratio in report["prefix_load_8_p50_over_two_lookups"].items():
        figures = report[path]
        expected = figures["prefix_load_8_p50_ms"] / figures["prefix_load_8_two_lookups_p50_ms"]
        assert abs(ratio - expected) <= 0.01 * expected + 0.001, path
    # The TCP reader's process ran UCX on TCP alone: its context has no other transport to pick.
    assert "UCX_TLS=tcp,self; transports available: self, tcp (" in report["ucx_tcp_transports"]
    ucx, floor = report["ucx"], report["ucx_floor"]
    # A get over UCX is a lookup and then an exchange with the owner: its lookup alone takes less.
    assert ucx["lookup_1_p50_ms"] < ucx["get_1_p50_ms"]
    assert set(floor) == {f"{mode}_{q}_ms" for mode in ("owner_on_loop", "owner_polling") for q in ("p50", "p99")}
    for mode in ("owner_on_loop", "owner_polling"):
        assert 0 < floor[f"{mode}_p50_ms"] <= floor[f"{mode}_p99_ms"]
    ratio = ucx["get_1_p50_ms"] / floor["owner_on_loop_p50_ms"]
    assert abs(report["ucx_get_1_p50_over_floor"] - ratio) <= 0.01 * ratio
    # The same reader with the native reader turned off in its process, in the same run, and the ratios.
    ucxx = report["ucx_ucxx"]
    for figure, ratio in report["ucx_over_ucxx_path"].items():
        expected = ucx[f"{figure}_ms"] / ucxx[f"{figure}_ms"]
        assert abs(ratio - expected) <= 0.01 * expected + 0.001, figure
    assert set(report["ucx_over_ucxx_path"]) >= {"get_1_p50", "prefix_load_8_p50"}
    target = report["targets"]["ucx_get_1_p50_ms_max"]
    assert target == 0.3
    assert report["targets_met"]["ucx_get_1_p50"] is (ucx["get_1_p50_ms"] <= target)
    # Without the peer there is no Mooncake figure to hold the 256-page p99 against, and no verdict on it.
    assert report["targets"]["get_256_p99_over_mooncake_tcp_max"] == 1.0
    assert set(report["targets_met"]) == {"ucx_get_1_p50"}
