"""vLLM as a peer of the engine benchmarks: its OpenAI server in its own virtual environment.

``bench/peers/setup_vllm.sh`` builds that environment outside the repository
(``$RAYTURN_PEERS_DIR/vllm``, default ``~/.cache/rayturn/peers/vllm``); rayturn
never imports vLLM. ``VllmServer`` runs ``vllm.entrypoints.openai.api_server``
on 127.0.0.1 over the same Hugging Face directory rayturn loads (weights,
config and tokenizer), in float32 so that greedy tokens can be compared token
for token, with its OpenMP threads bound to every core of this host.

    stopped --start()--> starting --/health answers--> ready --stop()--> stopped
                              \\--process exits or timeout--> RuntimeError (process killed)
    ready --pause()--> paused (SIGSTOP) --resume() or complete()--> ready

An idle vLLM server is not idle on the CPU: its worker process, bound to
the first core, keeps ``gloo`` threads (seven or more) that each wake about
100 times a second. An engine timed beside it shares that core with
hundreds of wake-ups a second, and its OpenMP threads wait for the one
preempted at each barrier: rayturn's cached-prefix TTFT measured 8% slower
beside an idle vLLM server than alone (157 against 145 ms, median of 6,
Intel Xeon with 2 vCPUs). So a benchmark pauses the server while it times anything
else, and its requests resume it.

Requests carry token ids and ask for token ids back, so neither side's
tokenizer is on the measured path.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

SETUP_SCRIPT = Path(__file__).with_name("setup_vllm.sh")
KV_CACHE_SPACE_GIB = 4
START_TIMEOUT_S = 900.0


def peer_python() -> Path:
    base = os.environ.get("RAYTURN_PEERS_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "rayturn" / "peers"
    return root / "vllm" / "bin" / "python"


def peer_available() -> bool:
    return peer_python().exists()


@dataclass(frozen=True, slots=True)
class Completion:
    token_ids: list[int]
    elapsed_s: float  # request sent -> whole response read


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmServer:
    """One vLLM OpenAI server process (and its workers, in their own process group)."""

    def __init__(self, model_dir: str, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.extra_args = extra_args
        self.port = _free_port()
        self.served_name = "peer"
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        python = peer_python()
        if not python.exists():
            raise RuntimeError(f"no vLLM peer at {python.parent.parent}: run `bash {SETUP_SCRIPT}` first")
        num_cpus = os.cpu_count() or 1
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_SPACE_GIB),
            VLLM_CPU_OMP_THREADS_BIND=f"0-{num_cpus - 1}",
            OMP_NUM_THREADS=str(num_cpus),
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
        )
        env.pop("PYTHONPATH", None)
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--served-model-name", self.served_name, "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args,
        ]  # fmt: skip
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                env=env,
                cwd=self.log_path.parent,  # not the repository: ``python -m`` puts the cwd first on sys.path
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"vLLM server exited during start-up; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        self.stop()
        raise RuntimeError(f"vLLM server not ready after {START_TIMEOUT_S:.0f} s; see {self.log_path}")

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP to its process group) until ``resume`` or the next request."""
        if self.process is not None and not self.paused and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGSTOP)
            self.paused = True
            self._wait_until_stopped()

    def _wait_until_stopped(self, timeout_s: float = 1.0) -> None:
        """Until every process of the server has taken its SIGSTOP (delivered asynchronously)."""
        import psutil

        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(self.process.pid)
                if all(p.status() == psutil.STATUS_STOPPED for p in (root, *root.children(recursive=True))):
                    return
            time.sleep(0.001)

    def resume(self) -> None:
        """Continue a paused server, and wait until what it does on waking (its threads' missed wake-ups) is
        done, so that its next request is timed on a quiet host."""
        if self.process is not None and self.paused:
            os.killpg(self.process.pid, signal.SIGCONT)
            self.paused = False
            self.wait_idle()

    def stop(self) -> None:
        if self.process is None:
            return
        if self.paused:  # a stopped process acts on SIGTERM only once continued
            os.killpg(self.process.pid, signal.SIGCONT)
            self.paused = False
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def complete(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> Completion:
        """One greedy completion of ``prompt`` (token ids); its output token ids. Resumes a paused server first."""
        self.resume()
        body = {
            "model": self.served_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
            "detokenize": False,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            payload = json.loads(response.read())
        elapsed_s = time.perf_counter() - start
        return Completion(list(payload["choices"][0]["token_ids"]), elapsed_s)

    def wait_idle(self, timeout_s: float = 10.0, window_s: float = 0.2, busy_share: float = 0.05) -> float:
        """Wait until the server's processes use under ``busy_share`` of a core over ``window_s``; the seconds
        waited. After each request vLLM's OpenMP threads keep spinning for about a second (a core's worth on
        this host): whatever runs next would share the cores with them, so a measurement waits first."""
        import psutil

        assert self.process is not None
        root = psutil.Process(self.process.pid)
        start = time.perf_counter()

        def cpu_s() -> float:
            total = 0.0
            for process in (root, *root.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    total += times.user + times.system
            return total

        before = cpu_s()
        while time.perf_counter() - start < timeout_s:
            time.sleep(window_s)
            now = cpu_s()
            if now - before < busy_share * window_s:
                break
            before = now
        return time.perf_counter() - start

    def complete_all(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], float]:
        """Send every request at once (the server batches them); outputs in order and the wall time. Resumes a
        paused server first, outside the timing."""
        self.resume()
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            done = list(pool.map(self.complete, prompts, max_tokens))
        return [c.token_ids for c in done], time.perf_counter() - start
