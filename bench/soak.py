"""Soak: concurrent agent sessions for minutes against an embedded cluster, with every process's memory sampled.

Each of ``--sessions`` clients runs agent sessions back to back for
``--minutes``: turns of several calls whose prompts grow with every tool
result, with scaled think and tool pauses between calls
(``rayturn.replay.agent_workload``; every session a new id, as real users
bring). A call refused with 429 or 503 (or a stream that ends in an error
event) is retried after ``Retry-After``, as an agent's client does; a call
that still fails after ``MAX_ATTEMPTS``, or fails any other way, is lost.

The resident memory (RSS) of every process of the embedded Ray session
(ingress, decode and prefill replicas, KV master, Serve controller and proxy,
raylet, GCS, this driver...) is sampled every ``--sample-every-s``. The
baseline, in the same run, is the same cluster left idle for
``--idle-s`` before the load: how much its memory drifts with nothing to do.
The load's first ``--warmup-s`` warm caches, pools and allocators; memory is
flat when the fitted growth over the rest stays within 2% of the starting
total (``rss_flat``). ``private_rss`` applies the same rule to the RSS less its
shared-memory pages: the KV store's segments fill up to
``kvstore.segment_bytes`` as pages are stored, and count in every process that
maps them. ``--overload-rounds`` then sends rounds of ``--overload-calls``
simultaneous calls (far past the queues' bounds: most get 429) and samples
memory after each, so growth that does or does not level off shows up.

    python bench/soak.py [--quick] [--sessions 8] [--minutes 10] [--out DIR]

Writes ``soak.json`` and ``soak_rss.png`` (RSS over time per process) to
``--out``. The last line of stdout is one JSON object: requests sent,
completed, lost (must be 0), retries and errors by kind, start/end RSS per
process after warm-up, the slopes, ``rss_flat`` with its rule, ``private_rss``, the overload rounds, and
what a decode replica still holds afterwards (no sequence or reservation
outlives its call).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]

from rayturn.replay.agent_workload import Call, Shape, default_token_scale, make_session, system_prompt
from rayturn.replay.harness import SMALL_MACHINE, add_out_argument, emit, machine, pyplot, save_figure

MAX_ATTEMPTS = 30
RETRY_KINDS = (429, 503)
FLAT_GROWTH_FRACTION = 0.02
TINY_CONTEXT_TOKENS = 4096


@dataclass
class Tally:
    """What the clients saw, shared by every session (one event loop)."""

    sent: int = 0
    completed: int = 0
    lost: int = 0
    retries: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    lost_errors: list[str] = field(default_factory=list)


class RSSSampler:
    """Samples the RSS of this process and every process below it (the embedded Ray session) on a thread."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.shared_samples: list[tuple[float, dict[str, float]]] = []  # the shared-memory part of each RSS
        self.started_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> dict[str, float]:
        """RSS in MB by process label, now (also recorded)."""
        me = psutil.Process(os.getpid())
        by_label: dict[str, float] = {}
        shared_by_label: dict[str, float] = {}
        for process in [me, *me.children(recursive=True)]:
            try:
                label = f"{process_label(process, me.pid)}[{process.pid}]"
                rss_mb, shared_mb = process.memory_info().rss / 1e6, shared_rss_mb(process.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
                continue
            by_label[label], shared_by_label[label] = rss_mb, shared_mb
        now_s = time.monotonic() - self.started_at
        self.samples.append((now_s, by_label))
        self.shared_samples.append((now_s, shared_by_label))
        return by_label

    def private_samples(self) -> list[tuple[float, dict[str, float]]]:
        """The samples less their shared-memory pages: what each process holds on its own."""
        return [
            (t, {label: rss_mb - shared.get(label, 0.0) for label, rss_mb in by_label.items()})
            for (t, by_label), (_, shared) in zip(self.samples, self.shared_samples)
        ]

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()


def shared_rss_mb(pid: int) -> float:
    """The shared-memory pages (``RssShmem``: the KV store's segments, UCX's) in a process's RSS, in MB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024 / 1e6
    return 0.0


def process_label(process: psutil.Process, driver_pid: int) -> str:
    """What a process of the session is: a Serve deployment's name, a Ray daemon, or this driver."""
    if process.pid == driver_pid:
        return "driver"
    cmdline = process.cmdline()
    title = cmdline[0] if cmdline else process.name()
    if title.startswith("ray::"):
        # ``ray::<actor>`` or ``ray::<actor>.<method running>``; a Serve replica is ``ServeReplica:<app>:<deployment>``.
        name = title.removeprefix("ray::").split()[0].split(".")[0]
        return name.rsplit(":", 1)[-1]
    scripts = [Path(part).stem for part in cmdline[1:] if part.endswith(".py")]
    return scripts[0] if scripts else Path(title).name


def slope_per_min(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return 0.0
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


def retry_after_s(err: Exception) -> float:
    response = getattr(err, "response", None)
    header = response.headers.get("retry-after") if response is not None else None
    try:
        return float(header) if header is not None else 1.0
    except ValueError:
        return 1.0


async def one_call(client: Any, model: str, call: Call, max_tokens: int, tally: Tally) -> None:
    """A call to completion, retrying 429 / 503 and broken streams; lost when it never completes."""
    import openai

    tally.sent += 1
    for attempt in range(MAX_ATTEMPTS):
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=list(call.messages),
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"x-session-id": call.session_id},
            )
            finish = None
            async for chunk in stream:
                finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
            if finish is None:
                raise RuntimeError("the stream ended without a finish reason")
            tally.completed += 1
            return
        except openai.APIStatusError as err:
            kind, retry, delay_s, detail = (
                str(err.status_code),
                err.status_code in RETRY_KINDS,
                retry_after_s(err),
                err.message,
            )
        except openai.APIError as err:  # an error event in the stream: the server says to retry
            kind, retry, delay_s, detail = "stream_error", True, 1.0, str(err)
        except Exception as err:
            kind, retry, delay_s, detail = type(err).__name__, False, 0.0, str(err)
        tally.errors[kind] += 1
        if not retry or attempt == MAX_ATTEMPTS - 1:
            tally.lost += 1
            tally.lost_errors.append(f"{kind}: {detail}"[:200])
            return
        tally.retries += 1
        await asyncio.sleep(delay_s * random.uniform(0.5, 1.5))


async def soak(url: str, shape: Shape, num_sessions: int, until: float, seed: int, tally: Tally) -> None:
    """``num_sessions`` agents, each running sessions back to back until ``until`` (monotonic seconds)."""
    import openai

    system = system_prompt(shape, seed)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="rayturn", max_retries=0, timeout=300) as client:
        model = (await client.models.list()).data[0].id

        async def agent(agent_index: int) -> None:
            for round_index in itertools.count():
                session = make_session(shape, seed, round_index * num_sessions + agent_index, system)
                for call in session:
                    if time.monotonic() + call.gap_s >= until:
                        return
                    await asyncio.sleep(call.gap_s)
                    await one_call(client, model, call, shape.max_tokens, tally)

        await asyncio.gather(*(agent(index) for index in range(num_sessions)))


async def overload(url: str, num_calls: int, prompt_chars: int, max_tokens: int, tally: Tally, tag: str) -> None:
    """``num_calls`` at once, new turns and continuations of sessions named after ``tag``, retried on 429 like the
    soak's."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="rayturn", max_retries=0, timeout=300) as client:
        model = (await client.models.list()).data[0].id
        calls = []
        for index in range(num_calls):
            text = f"burst {tag} {index} " + "x" * prompt_chars
            messages: tuple[dict[str, Any], ...] = ({"role": "user", "content": text},)
            if index % 2:
                tool_call = {"id": f"c{index}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
                messages += (
                    {"role": "assistant", "tool_calls": [tool_call]},
                    {"role": "tool", "tool_call_id": f"c{index}", "content": "ok"},
                )
            calls.append(Call(f"burst-{tag}-{index}", 0, 0.0, messages, len(text)))
        await asyncio.gather(*(one_call(client, model, call, max_tokens, tally) for call in calls))


def leftovers(url: str) -> dict[str, Any]:
    """What one decode replica still holds once the load is over (``/health``): no sequence runs or waits and
    no reservation is left; pins and session holds last only their TTLs; the sessions the planner follows
    stay, up to ``decode.lifecycle.session.MAX_SESSIONS``."""
    with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
        details = json.loads(response.read()).get("details", {})
    names = ("running_seqs", "waiting_seqs", "reserved_requests", "pinned_prefixes", "held_sessions")
    found = {name: details.get(f"decode.{name}") for name in names}
    lifecycle = details.get("decode.lifecycle") or {}
    return {**found, "followed_sessions": lifecycle.get("sessions")}


def summarize_rss(samples: list[tuple[float, dict[str, float]]], since_s: float) -> dict[str, dict[str, float]]:
    """Per process: RSS at the first sample from ``since_s`` on, at the last, and the slope in between."""
    window = [(t, by_label) for t, by_label in samples if t >= since_s]
    labels = sorted({label for _, by_label in window for label in by_label})
    report = {}
    for label in labels:
        points = [(t, by_label[label]) for t, by_label in window if label in by_label]
        report[label] = {
            "start_mb": round(points[0][1], 1),
            "end_mb": round(points[-1][1], 1),
            "slope_mb_per_min": round(slope_per_min(points), 2),
        }
    return report


def totals(samples: list[tuple[float, dict[str, float]]], since_s: float, until_s: float) -> list[tuple[float, float]]:
    return [(t, sum(by_label.values())) for t, by_label in samples if since_s <= t <= until_s]


def growth(points: list[tuple[float, float]]) -> dict[str, Any]:
    """Total MB at the first and last point, the least-squares slope, the growth it fits, and ``flat``:
    whether that growth stays within ``FLAT_GROWTH_FRACTION`` of the start."""
    slope = slope_per_min(points)
    fitted_mb = slope * (points[-1][0] - points[0][0]) / 60
    return {
        "start_mb": round(points[0][1], 1),
        "end_mb": round(points[-1][1], 1),
        "slope_mb_per_min": round(slope, 2),
        "fitted_growth_mb": round(fitted_mb, 1),
        "flat": abs(fitted_mb) <= FLAT_GROWTH_FRACTION * points[0][1],
    }


def write_plot(samples: list[tuple[float, dict[str, float]]], marks: dict[str, float], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    labels = sorted({label for _, by_label in samples for label in by_label})
    figure, axes = plt.subplots(figsize=(11, 6))
    for label in labels:
        points = [(t, by_label[label]) for t, by_label in samples if label in by_label]
        if max(v for _, v in points) < 50:  # tiny helpers would crowd the legend
            continue
        axes.plot([t / 60 for t, _ in points], [v for _, v in points], label=label)
    for name, at_s in marks.items():
        axes.axvline(at_s / 60, color="grey", linestyle="--", linewidth=0.8)
        axes.text(at_s / 60, axes.get_ylim()[1], f" {name}", fontsize=8, va="top", rotation=90)
    axes.set_xlabel("minutes")
    axes.set_ylabel("RSS (MB)")
    axes.set_title("rayturn soak: resident memory per process")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(plt, figure, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 sessions, 10 s of load, one small overload round")
    parser.add_argument("--sessions", type=int, default=None, help="concurrent agents (default 8, quick 4)")
    parser.add_argument("--minutes", type=float, default=None, help="minutes of load (default 10, quick 1/6)")
    parser.add_argument("--warmup-s", type=float, default=None, help="load before memory counts (default 60, quick 5)")
    parser.add_argument("--idle-s", type=float, default=None, help="idle baseline (default 60, quick 3)")
    parser.add_argument("--sample-every-s", type=float, default=None, help="RSS sampling (default 5, quick 1)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per call")
    parser.add_argument("--time-scale", type=float, default=0.02, help="x real think and tool pauses")
    parser.add_argument("--overload-rounds", type=int, default=None, help="bursts after the soak (default 3, quick 1)")
    parser.add_argument("--overload-calls", type=int, default=None, help="calls per burst (default 200, quick 64)")
    parser.add_argument(
        "--overload-prompt-chars", type=int, default=None, help="characters per burst prompt (default 1000, quick 500)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http-port", type=int, default=28090)
    parser.add_argument("--grpc-port", type=int, default=29090)
    add_out_argument(parser, "soak")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    from rayturn.cluster.app import KV_NAMESPACE
    from rayturn.cluster.config import load_config
    from rayturn.cluster.runner import running_cluster

    started = time.perf_counter()
    num_sessions = args.sessions or (4 if args.quick else 8)
    load_s = 60 * (args.minutes if args.minutes is not None else (1 / 6 if args.quick else 10))
    warmup_s = args.warmup_s if args.warmup_s is not None else (5.0 if args.quick else 60.0)
    idle_s = args.idle_s if args.idle_s is not None else (3.0 if args.quick else 60.0)
    rounds = args.overload_rounds if args.overload_rounds is not None else (1 if args.quick else 3)
    burst_calls = args.overload_calls or (64 if args.quick else 200)
    burst_chars = args.overload_prompt_chars or (500 if args.quick else 1000)
    shape = Shape(
        num_sessions=num_sessions,
        turns_per_session=3,
        calls_per_turn=(2, 6),
        max_tokens=args.max_tokens,
        token_scale=default_token_scale(TINY_CONTEXT_TOKENS) / 2,  # prompts up to ~40% of the context
        time_scale=args.time_scale,
        context_tokens=TINY_CONTEXT_TOKENS,
    )
    overrides = {
        "model.name": "tiny",
        **SMALL_MACHINE,
        "server.http_port": args.http_port,
        "server.grpc_port": args.grpc_port,
    }
    tally, burst_tally = Tally(), Tally()
    sampler = RSSSampler(args.sample_every_s or (1.0 if args.quick else 5.0))
    marks: dict[str, float] = {}
    rounds_rss: list[dict[str, float]] = []
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=KV_NAMESPACE)
    try:
        with running_cluster(load_config(**overrides)) as endpoints:
            url = endpoints.http
            sampler.start()
            marks["idle"] = time.monotonic() - sampler.started_at
            time.sleep(idle_s)
            marks["load"] = time.monotonic() - sampler.started_at
            until = time.monotonic() + load_s
            asyncio.run(soak(url, shape, num_sessions, until, args.seed, tally))
            marks["overload"] = time.monotonic() - sampler.started_at
            before = sampler.sample()
            rounds_rss.append({"total_mb": round(sum(before.values()), 1)})
            for index in range(rounds):
                round_start = time.perf_counter()
                asyncio.run(overload(url, burst_calls, burst_chars, args.max_tokens, burst_tally, str(index)))
                time.sleep(2.0)  # let cancelled work drain before measuring
                after = sampler.sample()
                rounds_rss.append(
                    {
                        "round": index + 1,
                        "total_mb": round(sum(after.values()), 1),
                        "wall_s": round(time.perf_counter() - round_start, 1),
                    }
                )
            sampler.stop()
            marks["end"] = time.monotonic() - sampler.started_at
            time.sleep(5.0)  # past the routing stats period: the replica's counts are current
            left = leftovers(url)
    finally:
        ray.shutdown()

    samples = sampler.samples
    measured_from = marks["load"] + warmup_s
    per_process = summarize_rss(samples, measured_from)
    soak_totals = totals(samples, measured_from, marks["overload"])
    idle_totals = totals(samples, marks["idle"], marks["load"])
    total = growth(soak_totals)
    private = sampler.private_samples()
    result: dict[str, Any] = {
        "bench": "soak",
        "quick": args.quick,
        "sessions": num_sessions,
        "load_minutes": round(load_s / 60, 2),
        "warmup_s": warmup_s,
        "requests": {
            "sent": tally.sent,
            "completed": tally.completed,
            "lost": tally.lost,
            "retries": tally.retries,
        },
        "errors_by_kind": dict(tally.errors),
        "lost_errors": tally.lost_errors[:5],
        "rss_total_mb": {"start": total["start_mb"], "end": total["end_mb"]},
        "rss_slope_mb_per_min": total["slope_mb_per_min"],
        "baseline_idle_rss_slope_mb_per_min": round(slope_per_min(idle_totals), 2),
        "rss_fitted_growth_mb": total["fitted_growth_mb"],
        "rss_flat": total["flat"],
        "rss_flat_rule": (
            "the least-squares growth of the total RSS from the end of warm-up to the end of the load is within "
            f"{FLAT_GROWTH_FRACTION:.0%} of the total at the end of warm-up"
        ),
        # Shared pages (the KV store's segments fill up to kvstore.segment_bytes, and count in every process
        # that maps them) apart: the same rule on what each process holds on its own.
        "private_rss": growth(totals(private, measured_from, marks["overload"])),
        "private_rss_by_process": summarize_rss(private, measured_from),
        "overload": {
            "calls_per_round": burst_calls,
            "sent": burst_tally.sent,
            "completed": burst_tally.completed,
            "lost": burst_tally.lost,
            "errors_by_kind": dict(burst_tally.errors),
            "rss_after_each_round": rounds_rss,
        },
        "decode_replica_after": left,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": machine(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "soak.json"
    series = [{"t_s": round(t, 2), "rss_mb": {k: round(v, 1) for k, v in by.items()}} for t, by in samples]
    results_file.write_text(json.dumps({**result, "rss_by_process": per_process, "samples": series}, indent=1))
    plot = write_plot(samples, marks, args.out / "soak_rss.png")
    emit({**result, "rss_by_process": per_process, "results_file": str(results_file), "plot_file": str(plot)})
    return 0 if tally.lost == 0 and burst_tally.lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
