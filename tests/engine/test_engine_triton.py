"""The whole engine on the Triton backend gives the torch backend's greedy tokens on the tiny preset.

Without a GPU the Triton kernels run under the interpreter, which must be switched
on (``TRITON_INTERPRET=1``) before the backend module is imported; a subprocess
keeps that setting away from every other test in this process. The subprocess
picks the backend the way a deployment does, from ``$RAYTURN_KERNEL_BACKEND``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE_SIZE = 16
MAX_BATCHED_TOKENS = 16
PROMPTS = [
    [(7 * i + 3) % 256 for i in range(37)],  # 3 pages; prefilled in 16-token chunks
    [10, 20, 30, 40, 50],
    list(range(100, 112)),
]

# Runs in both processes: greedy tokens plus the per-step schedule, as JSON.
SCRIPT = textwrap.dedent(
    f"""
    import json, logging, sys

    from rayturn.engine import LLMEngine, SamplingParams

    def run(backend=None):
        engine = LLMEngine.from_pretrained(
            "tiny",
            backend=backend,
            dtype="float32",
            page_size={PAGE_SIZE},
            num_pages=16,
            max_num_batched_tokens={MAX_BATCHED_TOKENS},
            device={DEVICE!r},
        )
        steps = []
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            steps.append([[int(chunk.seq.request_id), chunk.num_tokens] for chunk in out.chunks])
            return out

        engine.scheduler.schedule = recording_schedule
        outs = engine.generate({PROMPTS!r}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        return {{
            "backend": engine.backend.name,
            "tokens": [list(out.token_ids) for out in outs],
            "steps": [step for step in steps if step],
        }}

    if __name__ == "__main__":
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        print(json.dumps(run()))
    """
)


def run_torch_in_process() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "engine_triton_script"}
    exec(compile(SCRIPT, "<engine-triton-script>", "exec"), namespace)
    result: dict[str, Any] = namespace["run"]("torch")
    return result


def run_triton_in_subprocess() -> tuple[dict[str, Any], str]:
    env = {**os.environ, "RAYTURN_KERNEL_BACKEND": "triton"}  # RAYTURN_CACHE_DIR comes along: same preset
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # compile the kernels natively
    script = SCRIPT + textwrap.dedent(
        """
        from rayturn.kernels import triton_kernels
        kernel = type(triton_kernels.rms_norm_kernel).__name__
        print(json.dumps({"kernel": kernel}), file=sys.stderr)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_triton_backend_matches_torch_end_to_end() -> None:
    expected = run_torch_in_process()  # also builds the preset, so the subprocess only reads it
    assert expected["backend"] == "torch"
    assert [len(tokens) for tokens in expected["tokens"]] == [6, 6, 6]
    assert all(sum(n for _, n in step) <= MAX_BATCHED_TOKENS for step in expected["steps"])
    long_prompt_chunks = [n for step in expected["steps"] for request, n in step if request == 0 and n > 1]
    assert sum(long_prompt_chunks) == len(PROMPTS[0]) and len(long_prompt_chunks) >= 3  # chunked prefill

    got, log = run_triton_in_subprocess()
    assert got["backend"] == "triton"
    assert "rayturn kernel backend: triton (from $RAYTURN_KERNEL_BACKEND" in log
    kernel = json.loads(log.strip().splitlines()[-1])["kernel"]
    assert (kernel == "InterpretedFunction") == (DEVICE == "cpu")
    assert got["steps"] == expected["steps"]  # same schedule, so the same chunks and pages were exercised
    assert got["tokens"] == expected["tokens"]
