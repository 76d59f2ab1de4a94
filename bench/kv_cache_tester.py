"""kv-cache-tester's trace replay (a real, third-party load generator) against ``rayturn serve``.

`kv-cache-tester <https://github.com/callanjfox/kv-cache-tester>`_'s
``trace_replay_tester.py`` replays recorded Claude Code conversations (one
JSON file each: per call its prompt and output size, the hash ids of its
64-token blocks, the think time before it) as concurrent users of an
OpenAI-compatible server: it synthesises prompts that grow and share prefixes
as the recorded ones did, streams every call, and ramps users while TTFT
stays under its threshold. Its figures are reported as it prints them (TTFT,
throughput, its *workload* cache hit rate, which it works out from the
traces' hash ids, SLO goodput), with the server's own cache hit rate beside
them (``/metrics``: prompt tokens found on the device or in the KV store over
all prompt tokens of the run).

The tester is not vendored: point ``--tester-dir`` at a checkout (or set
``RAYTURN_KV_CACHE_TESTER``) and ``--tester-python`` at a Python with its
``requirements.txt`` installed (or ``RAYTURN_KV_CACHE_TESTER_PYTHON``;
default ``<tester-dir>/.venv/bin/python``). Without them the JSON line says
``skipped`` and why.

To fit a 2-core CPU and the ``tiny-bpe`` preset (128k context), the traces
(``shared/traces/weka`` by default) are copied with every token count divided
by ``--token-scale`` (default 8: one 64-token block becomes 8 tokens, hash ids
and think times kept; the tester's ``--max-context`` is 128k over the same
factor) and replayed with think times capped at ``--max-delay`` and then
multiplied by ``--time-scale``. Report both factors with any figure.

    python bench/kv_cache_tester.py [--quick] [--tester-dir DIR] [--tester-python PY] [--traces DIR]

This starts ``rayturn serve --model tiny-bpe`` on free ports itself and stops
it with SIGINT. The last line of stdout is one JSON object (also written to
``--out``); the tester's own output goes to stderr and to a log under
``--out``, with its CSV files. ``--quick`` replays 10 s; the run still takes
about 1.5 minutes, most of it the server's start and the tester's own setup
(two 500k-token text pools, before the first call and at the first tool
result).

What the figures are, from the tester's code: TTFT is the time to the first
streamed content; its output token counts re-encode each streamed piece, so a
piece of random-weight output holding U+FFFD (an unfinished UTF-8 byte run)
counts as 3 (``output_over_expected`` ~1.02; ``server_completion_tokens`` is
the exact count); it builds its second text pool synchronously on its event
loop, so calls in flight then (the first period) carry those seconds in their
TTFT. Its model auto-detection needs ``aiohttp``, which its requirements do
not list: without it the model it sends is ``""`` (``model_autodetect_failed``),
which the server takes as the served model.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rayturn.engine.presets import resolve_model_dir
from rayturn.replay.harness import emit, machine, percentile
from rayturn.replay.paths import DEFAULT_TRACES, RESULTS_DIR

TESTER_SCRIPT = "trace_replay_tester.py"
TESTER_IMPORTS = "import openai, transformers, pandas, numpy, plotly"
DEFAULT_CONTEXT = 131072  # for a model whose config names none; the tester's --max-context is it over the scale
STARTUP_TIMEOUT_S = 240.0
SHUTDOWN_TIMEOUT_S = 90.0
TESTER_SETUP_S = 180.0  # tokenizer load and its 2 x 500k-token text pools, plus its 60 s drain of in-flight calls
PROMPT_SOURCES = ("device", "store", "computed")

# The replay's length (s), assessment period (s), users and in-flight cap: the full run and --quick.
FULL = {"duration": 180, "assessment_period": 30, "start_users": 2, "max_users": 4, "max_concurrent": 4}
QUICK = {"duration": 10, "assessment_period": 5, "start_users": 2, "max_users": 2, "max_concurrent": 2}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=10) as response:
            return response.status == 200 and json.load(response).get("status") == "ok"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def rayturn_command() -> list[str]:
    script = Path(sys.executable).with_name("rayturn")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rayturn.cli"]


def start_serve(model: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``rayturn serve --model MODEL`` on free ports in its own process group, once it serves."""
    http_port, grpc_port = free_port(), free_port()
    command = [*rayturn_command(), "serve", "--model", model, "--http-port", str(http_port)]
    command += ["--grpc-port", str(grpc_port)]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ("rayturn is serving" in log.read_text(errors="replace") and healthy(base_url)):
        if process.poll() is not None:
            raise ChildProcessError(f"rayturn serve exited with {process.returncode}; see {log}")
        if time.monotonic() > deadline:
            stop_serve(process)
            raise RuntimeError(f"rayturn serve was not serving after {STARTUP_TIMEOUT_S:.0f} s; see {log}")
        time.sleep(0.5)
    return process, base_url


def stop_serve(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as a user stops it; SIGKILL to its process group past ``SHUTDOWN_TIMEOUT_S``."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def rayturn_serve(model: str, log: Path, tries: int = 2) -> Iterator[str]:
    """A running ``rayturn serve``'s base URL; a start that exits (say, a local Ray that another
    process's start got in the way of) is tried again, its log kept beside with the try's number."""
    for attempt in range(1, tries + 1):
        try:
            process, base_url = start_serve(model, log)
            break
        except ChildProcessError as error:
            if attempt == tries:
                raise
            log.rename(log.with_name(f"{log.name}.{attempt}"))
            print(f"{error}; starting it again", file=sys.stderr)
            time.sleep(5)
    try:
        yield base_url
    finally:
        stop_serve(process)


def server_counters(base_url: str) -> dict[str, float]:
    """The counters of ``/metrics`` this benchmark reads: prompt tokens by source, requests by outcome."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'rayturn_prompt_tokens_total\{source="(\w+)"\} (\S+)$', line)
        if match:
            counters[f"prompt_tokens_{match[1]}"] = float(match[2])
        match = re.match(r'rayturn_requests_total\{api="(\w+)",outcome="(\w+)"\} (\S+)$', line)
        if match:
            counters[f"requests_{match[1]}_{match[2]}"] = float(match[3])
        if line.startswith("rayturn_completion_tokens_total "):
            counters["completion_tokens"] = float(line.split()[1])
    return counters


def scale_requests(requests: list[dict[str, Any]], factor: int) -> None:
    for request in requests:
        if request.get("type") == "subagent":
            for key in ("tool_tokens", "system_tokens"):
                if key in request:
                    request[key] = max(1, round(request[key] / factor))
            scale_requests(request.get("requests", []), factor)
        else:
            request["in"] = max(1, round(request["in"] / factor))
            request["out"] = max(1, round(request["out"] / factor))


def scaled_traces(source: Path, target: Path, factor: int) -> int:
    """Copies of the trace files under ``source`` with every token count (and the block size) over ``factor``."""
    target.mkdir(parents=True, exist_ok=True)
    files = [source] if source.is_file() else sorted(source.glob("*.json"))
    for path in files:
        trace = json.loads(path.read_text())
        trace["block_size"] = max(1, trace.get("block_size", 64) // factor)
        for key in ("tool_tokens", "system_tokens"):
            if key in trace:
                trace[key] = max(1, round(trace[key] / factor))
        scale_requests(trace.get("requests", []), factor)
        (target / path.name).write_text(json.dumps(trace))
    return len(files)


def tester_commit(tester_dir: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(tester_dir), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def missing_tester(tester_dir: Path | None, tester_python: Path | None) -> str | None:
    """Why the tester cannot run here, or None."""
    if tester_dir is None:
        return "no kv-cache-tester checkout: pass --tester-dir or set RAYTURN_KV_CACHE_TESTER"
    if not (tester_dir / TESTER_SCRIPT).is_file():
        return f"no {TESTER_SCRIPT} in {tester_dir}"
    if tester_python is None or not tester_python.exists():
        return f"no tester Python at {tester_python}: pass --tester-python or set RAYTURN_KV_CACHE_TESTER_PYTHON"
    done = subprocess.run([str(tester_python), "-c", TESTER_IMPORTS], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"{tester_python} lacks the tester's requirements ({last}): pip install -r requirements.txt"
    return None


def run_tester(command: list[str], cwd: Path, log: Path, timeout_s: float) -> int:
    """Run the tester, its output copied to stderr and ``log``; its exit status (124 past ``timeout_s``)."""
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

        def copy() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                output.write(line)
                sys.stderr.write(line)

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            copier.join(timeout=10)
            return 124
        copier.join(timeout=10)
        return process.returncode


SUMMARY_PATTERNS: dict[str, str] = {
    "duration_s": r"Duration: ([\d.]+)s",
    "total_requests": r"Total Requests: (\d+)",
    "users_created": r"Total Users Created: (\d+)",
    "peak_concurrent_users": r"Peak Concurrent Users: (\d+)",
    "ttft_avg_s": r"TTFT avg/p50/p95/max: ([\d.]+)s",
    "ttft_p50_s": r"TTFT avg/p50/p95/max: [\d.]+s / ([\d.]+)s",
    "ttft_p95_s": r"TTFT avg/p50/p95/max: [\d.]+s / [\d.]+s / ([\d.]+)s",
    "ttft_max_s": r"TTFT avg/p50/p95/max: [\d.]+s / [\d.]+s / [\d.]+s / ([\d.]+)s",
    "input_tok_per_s": r"Throughput: ([\d,]+) input tok/s",
    "output_tok_per_s": r"\| ([\d,]+) output tok/s",
    "workload_cache_hit_rate": r"Avg Workload Cache Hit Rate: ([\d.]+)%",
    "peak_working_set_tokens": r"Peak Working Set: ([\d,]+) tokens",
    "warm_prefix_tokens": r"Warm Prefix: ([\d,]+) tokens",
    "connection_errors": r"Connection Errors: (\d+)",
    "slo_requests": r"TTFT met:\s+\d+/(\d+)",
    "slo_ttft_met_requests": r"TTFT met:\s+(\d+)/",
    "slo_decode_met_requests": r"Decode met:\s+(\d+)/",
    "goodput_requests": r"Goodput \(both\):\s+(\d+)/",
    "effective_goodput_requests": r"Effective goodput:\s+(\d+)/",
}


def parse_summary(text: str) -> dict[str, float | None]:
    """The figures of the tester's end-of-test summary, as printed (percentages as fractions)."""
    summary_at = text.rfind("Test Complete")
    tail = text[summary_at:] if summary_at >= 0 else ""
    figures: dict[str, float | None] = {}
    for name, pattern in SUMMARY_PATTERNS.items():
        match = re.search(pattern, tail)
        value = float(match[1].replace(",", "")) if match else None
        if value is not None and name == "workload_cache_hit_rate":
            value /= 100
        figures[name] = value
    slo_requests = figures["slo_requests"]
    for name in ("goodput", "effective_goodput"):
        count = figures[f"{name}_requests"]
        figures[name] = count / slo_requests if count is not None and slo_requests else None
    return figures


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    csv.field_size_limit(sys.maxsize)  # per-request token timestamps make long fields
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def request_figures(rows: list[dict[str, str]]) -> dict[str, Any]:
    """Per-request figures from the tester's ``detailed_results.csv``."""
    ok = [row for row in rows if row["success"] == "True"]
    ttfts = [float(row["ttft"]) for row in ok if float(row["ttft"]) > 0]
    hits = sum(int(row["cache_hit_blocks"]) for row in rows)
    blocks = hits + sum(int(row["cache_miss_blocks"]) for row in rows)
    expected = sum(int(row["output_tokens_expected"]) for row in ok)
    return {
        "requests": len(rows),
        "requests_ok": len(ok),
        "requests_failed": len(rows) - len(ok),
        "errors": sorted({row["error_message"] for row in rows if row["success"] != "True"})[:5],
        "csv_ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "csv_ttft_p95_s": percentile(ttfts, 95) if ttfts else None,
        "csv_workload_cache_hit_rate": hits / blocks if blocks else None,
        "input_tokens": sum(int(row["input_tokens"]) for row in ok),
        "output_tokens": sum(int(row["output_tokens_actual"]) for row in ok),
        "output_over_expected": sum(int(row["output_tokens_actual"]) for row in ok) / expected if expected else None,
    }


def lifecycle_counts(rows: list[dict[str, str]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["event_type"]] = counts.get(row["event_type"], 0) + 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"a {QUICK['duration']} s replay, two users")
    env_dir = os.environ.get("RAYTURN_KV_CACHE_TESTER")
    parser.add_argument("--tester-dir", type=Path, default=Path(env_dir) if env_dir else None)
    env_python = os.environ.get("RAYTURN_KV_CACHE_TESTER_PYTHON")
    parser.add_argument("--tester-python", type=Path, default=Path(env_python) if env_python else None)
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="kv-cache-tester trace file or folder")
    parser.add_argument("--model", default="tiny-bpe", help="preset or model directory (its tokenizer too)")
    parser.add_argument("--token-scale", type=int, default=8, help="divide every token count by this")
    parser.add_argument("--time-scale", type=float, default=0.2, help="the tester's --time-scale")
    parser.add_argument("--max-delay", type=float, default=10.0, help="the tester's --max-delay (s, before scaling)")
    parser.add_argument("--duration", type=int, default=None, help="the tester's --test-duration (s)")
    parser.add_argument("--start-users", type=int, default=None)
    parser.add_argument("--max-users", type=int, default=None)
    parser.add_argument("--max-concurrent", type=int, default=None, help="the tester's --max-concurrent-requests")
    parser.add_argument("--max-ttft", type=float, default=2.0, help="the tester's ramp threshold (s)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--graphs", action="store_true", help="let the tester draw its Plotly pages")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    plan = dict(QUICK if args.quick else FULL)
    for name in ("duration", "start_users", "max_users", "max_concurrent"):
        if getattr(args, name) is not None:
            plan[name] = getattr(args, name)
    if args.tester_python is None and args.tester_dir is not None:
        args.tester_python = args.tester_dir / ".venv" / "bin" / "python"
    stem = "kv_cache_tester_quick" if args.quick else "kv_cache_tester"
    result: dict[str, Any] = {
        "bench": "kv_cache_tester",
        "quick": args.quick,
        "model": args.model,
        "token_scale": args.token_scale,
        "time_scale": args.time_scale,
        "max_delay_s": args.max_delay,
        **{key: plan[key] for key in ("duration", "start_users", "max_users", "max_concurrent")},
        "seed": args.seed,
        "machine": machine(),
    }
    skipped = missing_tester(args.tester_dir, args.tester_python)
    if skipped is None and not args.traces.exists():
        skipped = f"no traces at {args.traces}; pass --traces"
    if skipped is not None:
        print(f"kv_cache_tester skipped: {skipped}", file=sys.stderr)
        emit({**result, "skipped": skipped})
        return 0
    assert args.tester_dir is not None and args.tester_python is not None
    tester_dir = args.tester_dir.resolve()
    work = (args.out / stem).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    trace_dir = work / f"traces_over_{args.token_scale}"
    trace_files = scaled_traces(args.traces, trace_dir, args.token_scale)
    model_dir = resolve_model_dir(args.model)  # a preset is built here, before the server wants it
    context = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", DEFAULT_CONTEXT)
    result.update(
        skipped=None,
        tester_commit=tester_commit(tester_dir),
        tester_dir=str(tester_dir),
        traces=str(args.traces),
        trace_files=trace_files,
        max_context=context // args.token_scale,
    )
    results_dir = work / "tester"
    with rayturn_serve(args.model, work / "serve.log") as base_url:
        before = server_counters(base_url)
        command = [str(args.tester_python), TESTER_SCRIPT, "--api-endpoint", base_url]
        command += ["--trace-directory", str(trace_dir), "--output-dir", str(results_dir)]
        command += ["--tokenizer", str(model_dir), "--chunk-size", str(max(1, 64 // args.token_scale))]
        command += ["--max-context", str(context // args.token_scale), "--seed", str(args.seed)]
        command += ["--start-users", str(plan["start_users"]), "--max-users", str(plan["max_users"])]
        command += ["--max-concurrent-requests", str(plan["max_concurrent"]), "--max-ttft", str(args.max_ttft)]
        command += ["--test-duration", str(plan["duration"]), "--assessment-period", str(plan["assessment_period"])]
        command += ["--max-delay", str(args.max_delay), "--time-scale", str(args.time_scale), "--no-color"]
        if not args.graphs:
            command.append("--skip-graphs")
        started = time.perf_counter()
        returncode = run_tester(command, tester_dir, work / "tester.log", plan["duration"] + TESTER_SETUP_S)
        wall_s = time.perf_counter() - started
        try:
            after = server_counters(base_url)
        except (urllib.error.URLError, OSError) as error:  # the server died under the replay
            print(f"no /metrics after the replay: {error}", file=sys.stderr)
            after = {}
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    prompt_total = sum(delta.get(f"prompt_tokens_{source}", 0.0) for source in PROMPT_SOURCES)
    reused = delta.get("prompt_tokens_device", 0.0) + delta.get("prompt_tokens_store", 0.0)
    log_text = (work / "tester.log").read_text(errors="replace")
    metadata_path = results_dir / "test_metadata.json"
    metadata = json.loads(metadata_path.read_text()) if metadata_path.is_file() else {}
    result.update(
        tester_returncode=returncode,
        tester_wall_s=wall_s,
        tester_model=metadata.get("model"),
        model_autodetect_failed="Could not auto-detect model" in log_text,
        **parse_summary(log_text),
        **request_figures(read_csv(results_dir / "detailed_results.csv")),
        lifecycle=lifecycle_counts(read_csv(results_dir / "user_lifecycle.csv")),
        request_failed_lines=len(re.findall(r"Request failed: ", log_text)),
        server_prompt_tokens={source: delta.get(f"prompt_tokens_{source}", 0.0) for source in PROMPT_SOURCES},
        server_cache_hit_rate=reused / prompt_total if prompt_total else None,
        server_completion_tokens=delta.get("completion_tokens"),
        server_requests={key[len("requests_") :]: value for key, value in delta.items() if key.startswith("requests_")},
        out=str(work),
    )
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)
    return 0 if returncode == 0 and result["requests_failed"] == 0 and result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
