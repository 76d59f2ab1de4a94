"""A ``rayturn serve`` for the coding-agent CLIs: its own process, ports and model, started and stopped as a
user would (Ctrl-C).

The model is a copy of the ``tiny-bpe`` preset (a 128k context and a real
vocabulary, so an agent's 40-50 kB first prompt is ~15k tokens, not 50k bytes)
in which every sixteenth token id also ends the answer. Random weights never
end an answer on their own, and the CLIs need answers that end: Claude Code
treats an answer cut at its output limit as an error (after three continuation
calls), and Codex sends no output limit at all. With one id in sixteen ending
it, an answer is ~16 tokens long and the chance that one runs to
``MAX_OUTPUT_TOKENS`` is about (15/16)^256, 7e-8.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agent_clis import Server

from rayturn.engine.presets import preset_dir

BASE_PRESET = "tiny-bpe"
SERVED_MODEL = "agent-tiny"
END_EVERY_NTH_TOKEN = 16
MAX_OUTPUT_TOKENS = 256
STARTUP_TIMEOUT_S = 180.0
SHUTDOWN_TIMEOUT_S = 90.0


def ending_model(directory: Path) -> Path:
    """A copy of the base preset whose end-of-answer ids include every ``END_EVERY_NTH_TOKEN``-th id."""
    shutil.copytree(preset_dir(BASE_PRESET), directory)
    vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        config["eos_token_id"] = sorted({config["eos_token_id"], *range(0, vocab_size, END_EVERY_NTH_TOKEN)})
        (directory / name).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def server_config(model_dir: Path) -> str:
    # Small pools, as the cluster tests use; room for two agent prompts at once (OpenCode's title call
    # runs beside its turn), and a context that bounds a Codex answer, which comes with no limit.
    return f"""\
model:
  name: {model_dir}
  served_name: {SERVED_MODEL}
  num_pages: 8192
  max_model_len: 65536
prefill:
  num_cpus: 0.25
decode:
  num_cpus: 0.25
kvstore:
  segment_bytes: 128MiB
"""


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=10) as response:
            return response.status == 200 and json.load(response)["status"] == "ok"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def rayturn_command() -> list[str]:
    script = Path(sys.executable).with_name("rayturn")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rayturn.cli"]


@contextmanager
def rayturn_serve(base: Path, http_port: int, grpc_port: int, api_key: str) -> Iterator[Server]:
    """``rayturn serve`` on the ending model, in its own process group under ``base``; stopped with SIGINT."""
    config = base / "rayturn.yaml"
    config.write_text(server_config(ending_model(base / "model")))
    log = base / "serve.log"
    command = [
        *rayturn_command(),
        "serve",
        "--config",
        str(config),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--api-key",
        api_key,
    ]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (healthy(base_url) and "rayturn is serving" in log.read_text()):
            if process.poll() is not None:
                raise RuntimeError(f"rayturn serve exited with {process.returncode}:\n{log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rayturn serve was not serving after {STARTUP_TIMEOUT_S:.0f} s:\n{log.read_text()}")
            time.sleep(0.5)
        yield Server(base_url, api_key, SERVED_MODEL, MAX_OUTPUT_TOKENS)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
