"""deploy/monitoring against a real Prometheus scraping a real cluster.

The committed scrape config's job (Ray's metrics export port, where every
replica's series arrive, the two ingress replicas' included) is pointed at a
running cluster (the tests' small cluster with 2 ingress replicas, Ray's
export port fixed, its report interval cut to 1 s) and scraped by
Debian's ``prometheus`` (installed on first use, ``prometheus_server``) while
a short load runs through the official ``openai`` client: disaggregated and
local prefills, stored twice (bytes move between segments), and a session
whose turn ends, whose pages go off the device and come back before its user
returns. Then every PromQL expression of the Grafana dashboard must return at
least one series through Prometheus' HTTP API, and the ingress's call count
summed over its replicas must be every call the load made, whichever replica
Serve's proxy gave it to. The committed files are also checked on their own
(their shape, the names the dashboard reads).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
yaml = pytest.importorskip("yaml")

from prometheus_server import Prometheus, free_port, prometheus_binary, running_prometheus, scrape_config  # noqa: E402
from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.config import load_config  # noqa: E402

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
HTTP_PORT, GRPC_PORT = 28661, 29661
SCRAPE_INTERVAL_S = 1.0
# Ray's own config name (case-sensitive): how often every process hands its metrics to the node's agent.
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
RATE_WINDOW = "1m"  # stands in for Grafana's $__rate_interval
OVERRIDES = small_cluster(
    HTTP_PORT,
    GRPC_PORT,
    threshold=48,
    **{
        "kvstore.replicas": 2,  # every page lands in a second segment too: bytes move between workers
        "server.ingress_replicas": 2,  # the ingress's series are the sum of its replicas'
        # A session's pages leave the device as soon as its turn ends and come back about two seconds later
        # (as in test_session_lifecycle): the offload, prewarm and idle series get their first samples.
        "lifecycle.predictor": "session",
        "lifecycle.break_even_margin_s": 1.0,
        "lifecycle.prewarm_lead_s": 2.0,
        "lifecycle.turn_hold_s": 1000.0,
    },
)


def committed_scrape_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    return config


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_the_committed_files_hold_together() -> None:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert dashboard["schemaVersion"] >= 36
    assert [variable["type"] for variable in dashboard["templating"]["list"]] == ["datasource"]
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
    # Laid out without overlaps: Grafana would otherwise move panels out of their rows.
    boxes = [(panel["title"], panel["gridPos"]) for panel in dashboard["panels"]]
    for index, (title, box) in enumerate(boxes):
        assert box["x"] + box["w"] <= 24, title
        for other, then in boxes[index + 1 :]:
            apart = (
                box["x"] + box["w"] <= then["x"]
                or then["x"] + then["w"] <= box["x"]
                or box["y"] + box["h"] <= then["y"]
                or then["y"] + then["h"] <= box["y"]
            )
            assert apart, f"{title} overlaps {other}"
    # Every series the dashboard reads comes through Ray's agent (which prefixes names with ray_), the ingress's
    # too: one replica's /metrics is not the cluster's.
    names = {name for expr in dashboard_exprs() for name in re.findall(r"\b(?:ray_)?rayturn_\w+", expr)}
    assert names and all(name.startswith("ray_rayturn_") for name in names), sorted(names)
    jobs = [job["job_name"] for job in committed_scrape_config()["scrape_configs"]]
    assert jobs == ["ray"]
    monitors = list(yaml.safe_load_all((MONITORING / "podmonitor.yaml").read_text()))
    assert [monitor["kind"] for monitor in monitors] == ["PodMonitor"]
    ports = [endpoint["port"] for monitor in monitors for endpoint in monitor["spec"]["podMetricsEndpoints"]]
    assert ports == ["metrics"]


@pytest.fixture(scope="module")
def prometheus_path() -> Path:
    binary, reason = prometheus_binary()
    if binary is None:
        pytest.skip(f"no Prometheus to test against: {reason}")
    return binary


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def cluster(prometheus_path: Path, metrics_port: int) -> Iterator[str]:
    # Ray's processes read the report interval from the environment when they start.
    previous = os.environ.get(REPORT_INTERVAL_ENV)
    os.environ[REPORT_INTERVAL_ENV] = "1000"
    try:
        with serving(load_config(**OVERRIDES), _metrics_export_port=metrics_port) as url:
            yield url
    finally:
        if previous is None:
            os.environ.pop(REPORT_INTERVAL_ENV, None)
        else:
            os.environ[REPORT_INTERVAL_ENV] = previous


@pytest.fixture(scope="module")
def prometheus(prometheus_path: Path, cluster: str, metrics_port: int) -> Iterator[Prometheus]:
    targets = {"ray": f"127.0.0.1:{metrics_port}"}
    config = scrape_config(committed_scrape_config(), targets, SCRAPE_INTERVAL_S)
    with running_prometheus(prometheus_path, config) as server:
        yield server


def lifecycle(cluster: str) -> dict[str, Any]:
    stats: dict[str, Any] = requests.get(f"{cluster}/health", timeout=30).json()["details"]["decode.lifecycle"]
    return stats


def chat(client: openai.OpenAI, content: str, headers: dict[str, str] | None = None) -> None:
    messages = [{"role": "user", "content": content}]
    client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_headers=headers,  # type: ignore[arg-type]
    )


def session_turns(client: openai.OpenAI, cluster: str) -> None:
    """A session whose turn ends, whose pages leave the device and come back before its user's next turn."""
    session = {"x-session-id": "watched", "x-rayturn-call": "user", "x-rayturn-after": "user"}
    question = "Explain this code: " + "x = [i * i for i in range(10)]\n" * 20
    before = lifecycle(cluster)
    chat(client, question, session)
    deadline = time.monotonic() + 30
    while lifecycle(cluster)["prewarms"] <= before["prewarms"]:
        assert time.monotonic() < deadline, f"no prewarm: {lifecycle(cluster)}"
        time.sleep(0.2)
    chat(client, question + "Why?", session)
    assert lifecycle(cluster)["returns"] > before["returns"]


def wait_for(prometheus: Prometheus, exprs: list[str], timeout_s: float) -> list[str]:
    """Ask until every query returns a series (Prometheus has scraped what replicas exported); the empty ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        empty = [expr for expr in exprs if not prometheus.query(expr)]
        if not empty or time.monotonic() > deadline:
            return empty
        time.sleep(SCRAPE_INTERVAL_S)


def finite(prometheus: Prometheus, expr: str) -> list[float]:
    return [value for row in prometheus.query(expr) if math.isfinite(value := float(row["value"][1]))]


def test_every_dashboard_query_returns_series(prometheus: Prometheus, cluster: str) -> None:
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)
    code = "Refactor this module: " + "def f(x): return x + 1\n" * 8
    # A first round creates the series; rates need a second round after Prometheus has scraped the first.
    chat(client, "hi")
    chat(client, code)
    first_seen = [
        'ray_rayturn_pool_time_to_first_token_seconds_count{pool="prefill"}',
        'ray_rayturn_pool_time_to_first_token_seconds_count{pool="decode"}',
        "ray_rayturn_time_to_first_token_seconds_count",
    ]
    assert wait_for(prometheus, first_seen, timeout_s=30) == []
    chat(client, "hello")
    chat(client, code + "# and again\n")
    session_turns(client, cluster)

    exprs = [expr.replace("$__rate_interval", RATE_WINDOW) for expr in dashboard_exprs()]
    # Replicas export every second and Prometheus scrapes every second: the load's series arrive within a few
    # seconds; a query still empty well past that reads a name or label the cluster never exports.
    empty = wait_for(prometheus, exprs, timeout_s=30)
    assert prometheus.targets_up() == {"ray": True}
    assert empty == [], "dashboard queries without a series:\n" + "\n".join(empty)
    for expr in (expr for expr in exprs if "time_to_first_token" in expr):  # per pool, and at the ingress
        assert finite(prometheus, expr), f"no latency from {expr}"
    live = prometheus.query("count by (pool) (ray_rayturn_replica_up)")
    assert {row["metric"]["pool"]: float(row["value"][1]) for row in live} == {
        "ingress": 2.0,
        "decode": 1.0,
        "prefill": 1.0,
    }
    # 6 chat calls, each counted once by the ingress replica that served it: their sum is the cluster's count.
    calls = 'sum(ray_rayturn_requests_total{api="chat"})'
    assert wait_for(prometheus, [f"{calls} == 6"], timeout_s=30) == [], prometheus.query(calls)
    idle_capture = finite(prometheus, next(expr for expr in exprs if "user_idle" in expr))
    assert len(idle_capture) == 1 and 0 < idle_capture[0] <= 1
