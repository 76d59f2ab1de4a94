"""A real Prometheus for tests: Debian's ``prometheus`` package, unpacked once into a user cache, run on a free port.

Installed without root: ``apt-get download`` fetches the package and ``dpkg -x``
unpacks it under ``$RAYTURN_PROMETHEUS_DIR``, else ``prometheus`` in the
user's ``$RAYTURN_CACHE_DIR`` (as set before the test session replaced it with
its private preset cache), else in ``~/.cache/rayturn``: outside the
repository, kept across runs. A ``prometheus`` already on the ``PATH`` is
used as it is. ``prometheus_binary`` returns None, with the reason,
where neither works (no apt, no package index, no network).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

READY_TIMEOUT_S = 30.0

# Read when pytest collects the tests, before the session fixture points RAYTURN_CACHE_DIR at a temporary folder.
_USER_CACHE_DIR = os.environ.get("RAYTURN_CACHE_DIR")


def install_dir() -> Path:
    if "RAYTURN_PROMETHEUS_DIR" in os.environ:
        return Path(os.environ["RAYTURN_PROMETHEUS_DIR"])
    cache = Path(_USER_CACHE_DIR) if _USER_CACHE_DIR else Path.home() / ".cache" / "rayturn"
    return cache / "prometheus"


def prometheus_binary() -> tuple[Path | None, str]:
    """The ``prometheus`` executable, installing Debian's package on first use; else None and why."""
    on_path = shutil.which("prometheus")
    if on_path:
        return Path(on_path), ""
    target = install_dir()
    binary = target / "usr" / "bin" / "prometheus"
    if binary.exists():
        return binary, ""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        return None, "Prometheus is not installed and there is no apt-get/dpkg to install Debian's package"
    with tempfile.TemporaryDirectory() as download_dir:
        fetched = _download(Path(download_dir))
        if isinstance(fetched, str):
            return None, fetched
        # Unpacked beside the target, then renamed into place: a concurrent run sees all of it or none.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="prometheus-", dir=target.parent))
        unpacked = subprocess.run(["dpkg", "-x", str(fetched), str(staging)], capture_output=True, text=True)
        if unpacked.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            return None, f"dpkg -x of {fetched.name} failed: {unpacked.stderr.strip()[-300:]}"
        try:
            staging.rename(target)
        except OSError:  # another run got there first
            shutil.rmtree(staging, ignore_errors=True)
    return (binary, "") if binary.exists() else (None, f"no {binary} after unpacking {fetched.name}")


def _download(directory: Path) -> Path | str:
    """Debian's ``prometheus`` package in ``directory``; a reason string when apt cannot fetch it."""

    def download() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["apt-get", "download", "prometheus"], cwd=directory, capture_output=True, text=True, timeout=300
        )

    result = download()
    if result.returncode != 0 and os.geteuid() == 0:
        # A fresh image has no package index; only root may fetch one.
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, timeout=300)
        result = download()
    packages = sorted(directory.glob("prometheus_*.deb"))
    if result.returncode != 0 or not packages:
        return f"apt-get download prometheus failed: {result.stderr.strip()[-300:]}"
    return packages[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape_config(committed: dict[str, Any], targets: dict[str, str], interval_s: float) -> dict[str, Any]:
    """The committed config's jobs (names, paths) pointed at ``targets`` (job name -> host:port) by static
    targets instead of their service discovery, scraped every ``interval_s``."""
    jobs = []
    for job in committed["scrape_configs"]:
        jobs.append(
            {
                "job_name": job["job_name"],
                "metrics_path": job.get("metrics_path", "/metrics"),
                "scrape_interval": f"{interval_s:g}s",
                "static_configs": [{"targets": [targets[job["job_name"]]]}],
            }
        )
    return {"global": {"scrape_interval": f"{interval_s:g}s"}, "scrape_configs": jobs}


class Prometheus:
    """A running Prometheus server's HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (``/api/v1/query``); raises on a query error."""
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(address, timeout=30) as response:
            body = json.load(response)
        if body["status"] != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def targets_up(self) -> dict[str, bool]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=30) as response:
            active = json.load(response)["data"]["activeTargets"]
        return {target["labels"]["job"]: target["health"] == "up" for target in active}


@contextmanager
def running_prometheus(binary: Path, config: dict[str, Any]) -> Iterator[Prometheus]:
    """Prometheus on a free port with ``config``, its data in a temporary folder; stopped by its process id."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rayturn-prometheus-") as work:
        config_path = Path(work) / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        log = open(Path(work) / "prometheus.log", "w")  # noqa: SIM115 - closed below, after the process
        process = subprocess.Popen(
            [
                str(binary),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={Path(work) / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            server = Prometheus(f"http://127.0.0.1:{port}")
            _wait_ready(server, process, Path(log.name))
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


def _wait_ready(server: Prometheus, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"prometheus not ready after {READY_TIMEOUT_S} s: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)
