"""The ``rayturn`` command as the tests run it: the console script installed beside this interpreter, else the
module (a checkout run without installing); and ``rayturn serve`` run for a test module (``serve_process``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 90.0


def rayturn_command() -> list[str]:
    script = Path(sys.executable).with_name("rayturn")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rayturn.cli"]


@contextlib.contextmanager
def serve_process(args: Sequence[str], directory: Path, base: str) -> Iterator[str]:
    """``rayturn serve ARGS`` (its output in ``directory/serve.log``) until ``base``'s ``/health`` says ok; yields
    ``base``, then stops it as Ctrl-C would (SIGTERM; its whole process group killed if it hangs)."""
    log = directory / "serve.log"
    with log.open("wb") as output:
        command = [*rayturn_command(), "serve", *args]
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(base):
            assert process.poll() is None, f"rayturn serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"rayturn serve did not start:\n{log.read_text()}"
            time.sleep(0.5)
        yield base
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
            return response.status == 200 and json.load(response)["status"] == "ok"
    except (OSError, ValueError):  # refused, timed out, an error status (HTTPError), a body that is not JSON
        return False
