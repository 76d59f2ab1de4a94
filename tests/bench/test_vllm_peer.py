"""``--peer vllm`` on a host without the peer's environment: the benchmark stops before measuring anything, with
a message naming the script that sets the peer up (the peer is never a dependency of rayturn or its tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["engine_throughput.py", "prefix_ttft.py"])
def test_a_missing_peer_names_its_setup_script(script: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--model", "tiny", "--peer", "vllm"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, RAYTURN_PEERS_DIR=str(tmp_path), PYTHONPATH=""),
    )
    assert done.returncode != 0
    assert "no vLLM peer at" in done.stdout and "setup_vllm.sh" in done.stdout
    assert not (tmp_path / "vllm").exists()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_paused_peer_is_stopped_until_its_next_request_and_stops_cleanly(tmp_path: Path) -> None:
    """``pause`` stops the server's whole process group (an idle vLLM still wakes hundreds of times a second), a request
    (here ``resume``, which ``complete`` calls first) continues it, and ``stop`` ends a paused server too."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from peers.vllm_server import VllmServer
    finally:
        sys.path.remove(str(ROOT / "bench"))
    server = VllmServer("unused", tmp_path / "log")
    # A stand-in for the server: a process group of two, as vLLM's server and its worker are.
    server.process = subprocess.Popen(["sh", "-c", "sleep 60 & exec sleep 60"], start_new_session=True)
    try:
        root = psutil.Process(server.process.pid)
        for _ in range(100):  # until the child is there
            pids = [root.pid, *(child.pid for child in root.children())]
            if len(pids) == 2:
                break
            time.sleep(0.05)
        assert len(pids) == 2
        server.pause()
        assert server.paused and {_state(pid) for pid in pids} == {"T"}
        server.resume()
        assert not server.paused and "T" not in {_state(pid) for pid in pids}
        server.pause()
        server.stop()  # from paused: continued, then terminated
        assert server.process is None and not server.paused
    finally:
        if server.process is not None:
            os.killpg(server.process.pid, 9)
