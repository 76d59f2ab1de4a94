"""The Mooncake store as the peer of bench/kvstore_bandwidth.py, driven from rayturn's venv.

Mooncake lives in its own venv (bench/peers/setup_mooncake.sh); this module
starts its ``mooncake_master`` on a free loopback port (the client's
P2PHANDSHAKE mode needs no metadata server), a writer process that stores
the pages and keeps its segment, and one reader process per mode, each
running ``mooncake_worker.py`` in that venv and answering one JSON line.
The modes are Mooncake's TCP transport with its local-memcpy shortcut off
(``tcp``) and on (``memcpy``, what it picks on a TCP-only host).

    life cycle: master up -> writer ready -> reader per mode -> writer, master stopped
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

WORKER = Path(__file__).with_name("mooncake_worker.py")
MODES = {"tcp": "0", "memcpy": "1"}  # mode -> MC_STORE_MEMCPY
MASTER_START_TIMEOUT_S = 30.0
WRITER_TIMEOUT_S = 300.0
READER_TIMEOUT_S = 600.0


class PeerMissing(RuntimeError):
    """The peer's venv is not set up."""


def peer_venv() -> Path:
    return Path(os.environ.get("RAYTURN_PEERS_DIR", Path.home() / ".cache/rayturn/peers")) / "mooncake"


def _environment(venv: Path, memcpy: str) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(venv / "syslib"), env.get("LD_LIBRARY_PATH")]))
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    env["MC_STORE_MEMCPY"] = memcpy
    return env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_for_port(port: int, master: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + MASTER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if master.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with status {master.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"mooncake_master did not listen on port {port} within {MASTER_START_TIMEOUT_S} s")


def _answer(stdout: TextIO, what: str) -> dict[str, Any]:
    line = stdout.readline()
    if not line:
        raise RuntimeError(f"the mooncake {what} exited without an answer (its log is in the --out folder)")
    answer: dict[str, Any] = json.loads(line)
    return answer


def measure(config: dict[str, Any], log_dir: Path) -> dict[str, dict[str, float]]:
    """Mooncake's figures per mode for ``config`` (page_bytes, num_pages, repeats, latency_iters, batch_iters)."""
    venv = peer_venv()
    python = venv / "bin" / "python"
    if not python.exists() or not (venv / "bin" / "mooncake_master").exists():
        raise PeerMissing(f"no Mooncake venv at {venv}: run bash bench/peers/setup_mooncake.sh")
    log_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    config = {**config, "master": f"127.0.0.1:{port}", "protocol": "tcp"}
    results: dict[str, dict[str, float]] = {}
    with open(log_dir / "mooncake.log", "w") as log:
        master = subprocess.Popen(
            [str(venv / "bin" / "mooncake_master"), f"--rpc_port={port}", "--rpc_address=127.0.0.1"],
            env=_environment(venv, "1"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for_port(port, master)
            writer = subprocess.Popen(
                [str(python), str(WORKER), "writer", json.dumps(config)],
                env=_environment(venv, "1"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            try:
                assert writer.stdout is not None and writer.stdin is not None
                _answer(writer.stdout, "writer")
                for mode, memcpy in MODES.items():
                    reader = subprocess.run(
                        [str(python), str(WORKER), "reader", json.dumps(config)],
                        env=_environment(venv, memcpy),
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                        timeout=READER_TIMEOUT_S,
                        check=True,
                    )
                    results[mode] = json.loads(reader.stdout.strip().splitlines()[-1])
                writer.stdin.close()
                writer.wait(timeout=WRITER_TIMEOUT_S)
            finally:
                if writer.poll() is None:
                    writer.kill()
                    writer.wait()
        finally:
            master.terminate()
            try:
                master.wait(timeout=10)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait()
    print(f"mooncake peer: {json.dumps(results)}", file=sys.stderr)
    return results
