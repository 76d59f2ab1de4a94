"""The Triton backend reads sliding layers from window slots as the torch backend does: same greedy tokens.

A GPT-OSS with a 20-token window runs with so few window slots that parked
ones are taken; the torch backend runs in this process, the Triton one in a
subprocess (under ``TRITON_INTERPRET=1`` without a GPU, switched on before the
backend is imported; see ``test_engine_triton.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_models import make_moe_checkpoint

pytest.importorskip("triton")
pytest.importorskip("transformers")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[(7 * i + 3) % 256 for i in range(45)], [10, 20, 30, 40, 50], list(range(100, 130))]

SCRIPT = textwrap.dedent(
    f"""
    import json, sys

    from rayturn.engine import LLMEngine, SamplingParams

    def run(path, backend=None):
        engine = LLMEngine.from_pretrained(
            path, backend=backend, dtype="float32", page_size=16, num_pages=32, num_window_slots=6,
            max_num_batched_tokens=16, device={DEVICE!r},
        )
        outs = engine.generate({PROMPTS!r}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        pages = engine.kv_cache.pool.pages
        return {{
            "backend": engine.backend.name,
            "tokens": [list(out.token_ids) for out in outs],
            "slots_taken": sum(page.page_hash is not None and page.window_slot < 0 for page in pages),
        }}

    if __name__ == "__main__":
        print(json.dumps(run(sys.argv[1])))
    """
)


def test_triton_reads_window_slots_as_torch_does(tmp_path: Path) -> None:
    _, path = make_moe_checkpoint("gptoss-e4-top2-window20", tmp_path / "gptoss")
    namespace: dict[str, Any] = {"__name__": "window_slots_triton_script"}
    exec(compile(SCRIPT, "<window-slots-triton-script>", "exec"), namespace)
    expected = namespace["run"](str(path), "torch")
    assert expected["slots_taken"] > 0  # pages lost their sliding layers' slots on the way

    env = {**os.environ, "RAYTURN_KERNEL_BACKEND": "triton"}
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["backend"] == "triton"
    assert got["tokens"] == expected["tokens"]
    assert got["slots_taken"] == expected["slots_taken"]
