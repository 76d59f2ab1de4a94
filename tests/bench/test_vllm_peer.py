"""``--peer vllm`` on a host without the peer's environment: the benchmark stops before measuring anything, with
a message naming the script that sets the peer up (the peer is never a dependency of rayturn or its tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
