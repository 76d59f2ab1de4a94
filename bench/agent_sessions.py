"""Closed-loop coding-agent sessions against a cluster: rayturn vs round-robin without a shared KV store.

Each session is one agent: a user turn is a burst of LLM calls, each prompt the
previous one plus the agent's answer (a tool call) and the tool's result, with
a tool gap between calls and a longer think gap before the next user message.
Every session starts from the same system + tool prefix, so calls reuse KV
within a session and across sessions. Sessions run concurrently, each one
waiting for its call to finish before its next gap (closed loop), and name
themselves in the ``x-session-id`` header.

The shape follows ``../shared/traces/README.md`` (real Claude Code sessions;
whole public set unless noted):

- shared prefix: ``tool_tokens + system_tokens``, ~15k tokens (9.6k-17.6k in
  the 40 stored conversations);
- calls per user turn: mean 6.8, p90 17 -> lognormal, median 6, sigma 0.7
  (mean 7.7, p90 15), cut to 5-20 (quick: 2-4);
- answer: output p50 216 tokens (stored sample p90 ~3.5x p50: sigma 1.0);
- tool result: new prompt tokens per call p50 ~730, of which the answer is
  ~216, so median 514 (stored sample p90 ~6x p50: sigma 1.4);
- tool gap before a tool-result call: p50 9 s, p90 72 s (sigma 1.62), cut at
  120 s; think gap before a user message: p50 127 s, 30% over 5 min
  (sigma 1.64), cut at 600 s; sessions start spread over one median think gap;
- a prompt that would pass 80% of the context is compacted first: the history
  becomes the prefix plus a 2,000-token summary (an assumption; compaction is
  not visible in the traces).

Scaling (both reported in the JSON): token counts x ``token_scale`` =
0.8 x context / 104k (the traces' prompt p50 lands at 80% of the model's
context: ``tiny``, 4,096 tokens -> ~1/32, the README's 64-token block -> 2
tokens); seconds x ``time_scale`` (default 1/100, quick 1/200). The agent's
answers in the history are scripted, not the model's output, so both systems
see byte-identical prompts for a seed; calls are greedy with ``ignore_eos``,
so every call streams exactly ``max_tokens`` tokens.

Systems, one after the other in one Ray session, same workload: rayturn
(``kv_aware`` router, KV store, 2 decode + 1 prefill replica) and the baseline
(``round_robin``, no store, no prefill pool, the same 2 decode replicas). Both
get the same warm-up calls (unrelated prompts) first. ``--url`` drives a
running cluster instead, with no baseline.

    python bench/agent_sessions.py [--quick] [--url http://127.0.0.1:8000]
    rayturn bench [--quick] ...

Per system: TTFT (first content chunk) and inter-token latency p50/p99, output
tokens/s, ``cached_token_fraction`` (``usage.prompt_tokens_details.
cached_tokens`` over prompt tokens: what a replica's cache or the store served;
for a call the prefill pool computed, what the prefill replica found cached;
``prefill_paths`` says how many calls took that path). Results and TTFT samples
go to ``bench/results/agent_sessions.json`` (a TTFT CDF PNG next to it when
matplotlib is installed). The last line of stdout is one JSON object;
``ttft_p99_ratio_vs_baseline`` < 1 means rayturn is better.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import SMALL_MACHINE, Progress, emit, machine, percentile

Message = dict[str, Any]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Lognormal:
    """A trace quantity drawn lognormally: its median, its log-space sigma, cut at ``cap``."""

    median: float
    sigma: float
    cap: float = math.inf

    def draw(self, rng: random.Random) -> float:
        return min(rng.lognormvariate(math.log(self.median), self.sigma), self.cap)


# Trace shape in real tokens and seconds (see the module docstring).
SHARED_PREFIX_TOKENS = 15_000
PROMPT_P50_TOKENS = 104_000
SUMMARY_TOKENS = 2_000
CALLS_PER_TURN = Lognormal(6, 0.7)
ANSWER_TOKENS = Lognormal(216, 1.0, cap=8 * 216)
TOOL_RESULT_TOKENS = Lognormal(514, 1.4, cap=8 * 514)  # user messages are drawn alike
TOOL_GAP_S = Lognormal(9.0, 1.62, cap=120.0)
THINK_GAP_S = Lognormal(127.0, 1.64, cap=600.0)
CONTEXT_FILL = 0.8  # compact before a prompt passes this share of the context

TOOLS = ("read_file", "grep", "bash", "edit_file", "list_dir")
WORDS = ("def", "class", "return", "self", "import", "from", "if", "else", "for", "in", "None", "path", "x", "y")
# ChatML framing around one message, in byte tokens (role markers, role name, newlines, tool-call tags), rounded up.
MESSAGE_OVERHEAD_TOKENS = 48
WARMUP_LONG_TOKENS = 640  # past the default disaggregation threshold (512): the prefill replica warms up too

SYSTEMS: dict[str, dict[str, Any]] = {
    "rayturn": {"router.policy": "kv_aware", "kvstore.enabled": True, "prefill.min_replicas": 1,
                "prefill.max_replicas": 1},
    "baseline": {"router.policy": "round_robin", "kvstore.enabled": False, "prefill.min_replicas": 0,
                 "prefill.max_replicas": 0},
}  # fmt: skip


# -- workload -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """How many sessions, turns and calls; token counts in real units, scaled by ``token_scale``."""

    num_sessions: int
    turns_per_session: int
    calls_per_turn: tuple[int, int]
    max_tokens: int
    token_scale: float
    time_scale: float
    context_tokens: int

    def tokens(self, real_tokens: float) -> int:
        return max(1, round(real_tokens * self.token_scale))

    @property
    def prompt_budget_tokens(self) -> int:
        return int(CONTEXT_FILL * self.context_tokens) - self.max_tokens


@dataclass(frozen=True, slots=True)
class Call:
    session_id: str
    turn: int
    gap_s: float  # idle time before the call: a tool running, or the user thinking
    messages: tuple[Message, ...]
    prompt_tokens: int  # estimated; the server's count is in the usage


def default_token_scale(context_tokens: int) -> float:
    return CONTEXT_FILL * context_tokens / PROMPT_P50_TOKENS


def estimate_tokens(messages: Sequence[Message]) -> int:
    """An upper bound of the prompt's byte tokens under the ChatML template."""
    total = 0
    for message in messages:
        total += MESSAGE_OVERHEAD_TOKENS + len((message.get("content") or "").encode())
        for tool_call in message.get("tool_calls", ()):
            function = tool_call["function"]
            total += len(function["name"]) + len(function["arguments"].encode())
    return total


def _text(rng: random.Random, num_tokens: int) -> str:
    """ASCII text of exactly ``num_tokens`` bytes (one byte token each)."""
    words: list[str] = []
    length = 0
    while length < num_tokens:
        words.append(rng.choice(WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)[:num_tokens]


def system_prompt(shape: Shape, seed: int) -> Message:
    rng = random.Random(f"{seed}-system")
    return {"role": "system", "content": _text(rng, shape.tokens(SHARED_PREFIX_TOKENS))}


def make_session(shape: Shape, seed: int, index: int, system: Message) -> list[Call]:
    """One session's calls; the seed and index alone fix it (not the number of sessions)."""
    rng = random.Random(f"{seed}-session-{index}")
    session_id = f"agent-{seed}-{index}"
    history: list[Message] = [system]
    calls: list[Call] = []
    gap_s = rng.uniform(0, THINK_GAP_S.median * shape.time_scale)
    for turn in range(shape.turns_per_session):
        history.append({"role": "user", "content": _text(rng, shape.tokens(TOOL_RESULT_TOKENS.draw(rng)))})
        low, high = shape.calls_per_turn
        num_calls = min(max(round(CALLS_PER_TURN.draw(rng)), low), high)
        for step in range(num_calls):
            if step or turn:
                gap_s = (TOOL_GAP_S if step else THINK_GAP_S).draw(rng) * shape.time_scale
            if estimate_tokens(history) > shape.prompt_budget_tokens:
                summary = {"role": "user", "content": _text(rng, shape.tokens(SUMMARY_TOKENS))}
                pending = history[-2:] if history[-1]["role"] == "tool" else history[-1:]  # keep a call's pair
                history = [system, summary, *pending]
                if estimate_tokens(history) > shape.prompt_budget_tokens:
                    raise ValueError(
                        f"a {shape.context_tokens}-token context cannot hold the shared prefix, a summary and "
                        "one call's new messages: use a longer context or a smaller --token-scale"
                    )
            calls.append(Call(session_id, turn, gap_s, tuple(history), estimate_tokens(history)))
            answer = _text(rng, shape.tokens(ANSWER_TOKENS.draw(rng)))
            if step == num_calls - 1:
                history.append({"role": "assistant", "content": answer})
                continue
            call_id = f"call_{index}_{len(calls)}"
            function = {"name": rng.choice(TOOLS), "arguments": json.dumps({"arg": answer})}
            tool_call = {"id": call_id, "type": "function", "function": function}
            history.append({"role": "assistant", "tool_calls": [tool_call]})
            result = _text(rng, shape.tokens(TOOL_RESULT_TOKENS.draw(rng)))
            history.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return calls


def make_workload(shape: Shape, seed: int) -> list[list[Call]]:
    system = system_prompt(shape, seed)
    return [make_session(shape, seed, index, system) for index in range(shape.num_sessions)]


# -- the client -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CallSample:
    session_id: str
    ok: bool
    ttft_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str | None = None  # the decode replica, when the server names it
    error: str = ""


async def timed_call(client: Any, model: str, call: Call, max_tokens: int) -> CallSample:
    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=list(call.messages),
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": call.session_id},
        )
        replica = stream.response.headers.get("x-rayturn-replica")
        token_times: list[float] = []
        end = start
        usage = None
        async for chunk in stream:
            end = time.perf_counter()
            usage = chunk.usage or usage
            if any(choice.delta.content or choice.delta.tool_calls for choice in chunk.choices):
                token_times.append(end)
    except Exception as err:  # a failed call is counted; the session goes on, as an agent would retry
        return CallSample(call.session_id, ok=False, error=f"{type(err).__name__}: {err}")
    if usage is None:
        return CallSample(call.session_id, ok=False, error="no usage in the stream")
    details = usage.prompt_tokens_details
    return CallSample(
        call.session_id,
        ok=True,
        ttft_s=(token_times[0] if token_times else end) - start,  # no text at all: the finish chunk
        itl_s=tuple(b - a for a, b in itertools.pairwise(token_times)),
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
        completion_tokens=usage.completion_tokens,
        replica=replica,
    )


async def drive(
    url: str, sessions: Sequence[Sequence[Call]], max_tokens: int, label: str | None = None
) -> tuple[list[CallSample], float]:
    """Run every session concurrently, closed loop; returns the samples and the wall time."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="rayturn", max_retries=0, timeout=300) as client:
        model = (await client.models.list()).data[0].id
        progress = Progress(label, sum(len(calls) for calls in sessions)) if label else None

        async def session(calls: Sequence[Call]) -> list[CallSample]:
            samples = []
            for call in calls:
                await asyncio.sleep(call.gap_s)
                samples.append(await timed_call(client, model, call, max_tokens))
                if progress is not None:
                    progress.advance()
            return samples

        start = time.perf_counter()
        per_session = await asyncio.gather(*(session(calls) for calls in sessions))
        return [sample for samples in per_session for sample in samples], time.perf_counter() - start


def warmup_calls(shape: Shape, seed: int, count: int) -> list[Call]:
    """Unrelated prompts (no workload page in them): short ones, and one long enough for the prefill pool."""
    rng = random.Random(f"{seed}-warmup")
    lengths = [32] * count + [min(WARMUP_LONG_TOKENS, shape.prompt_budget_tokens)]
    calls = []
    for index, length in enumerate(lengths):
        messages = ({"role": "user", "content": _text(rng, length)},)
        calls.append(Call(f"warmup-{index}", 0, 0.0, messages, estimate_tokens(messages)))
    return calls


def prefill_paths(url: str) -> dict[str, float] | None:
    """Calls so far by prefill path (``local`` | ``disaggregated``), from the ingress metrics; None without them."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
    except Exception:
        return None
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rayturn_time_to_first_token_seconds_count":
                counts[sample.labels["path"]] = counts.get(sample.labels["path"], 0) + sample.value
    return counts


# -- the report -----------------------------------------------------------


def _stat(samples: Sequence[float], q: float) -> float | None:
    return round(percentile(samples, q), 5) if samples else None


def summarize(samples: Sequence[CallSample], wall_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttfts = [s.ttft_s for s in ok]
    itls = [gap for s in ok for gap in s.itl_s]
    prompt_tokens = sum(s.prompt_tokens for s in ok)
    cached_tokens = sum(s.cached_tokens for s in ok)
    replicas: dict[str, set[str]] = {}
    for s in ok:
        if s.replica is not None:
            replicas.setdefault(s.session_id, set()).add(s.replica)
    return {
        "calls": len(samples),
        "failures": len(samples) - len(ok),
        "ttft_p50_s": _stat(ttfts, 50),
        "ttft_p99_s": _stat(ttfts, 99),
        "itl_p50_s": _stat(itls, 50),
        "itl_p99_s": _stat(itls, 99),
        "output_tok_s": round(sum(s.completion_tokens for s in ok) / wall_s, 2) if wall_s > 0 else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_token_fraction": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else None,
        "replicas_per_session": round(sum(map(len, replicas.values())) / len(replicas), 2) if replicas else None,
        "wall_s": round(wall_s, 2),
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours is not None and theirs else None


RATIOS = {  # reported ratio -> the per-system figure it divides
    "ttft_p50_ratio_vs_baseline": "ttft_p50_s",
    "ttft_p99_ratio_vs_baseline": "ttft_p99_s",
    "itl_p50_ratio_vs_baseline": "itl_p50_s",
    "itl_p99_ratio_vs_baseline": "itl_p99_s",
    "output_tok_s_ratio_vs_baseline": "output_tok_s",
}


def compare(rayturn: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """rayturn over baseline: latency ratios < 1 and a throughput ratio > 1 favour rayturn."""
    return {name: _ratio(rayturn[key], baseline[key]) for name, key in RATIOS.items()}


def write_plot(ttfts: dict[str, list[float]], title: str, path: Path) -> Path | None:
    """A TTFT CDF per system, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    figure, axes = plt.subplots(figsize=(6, 4))
    for system, samples in ttfts.items():
        ordered = sorted(samples)
        axes.step([t * 1e3 for t in ordered], [(i + 1) / len(ordered) for i in range(len(ordered))], label=system)
    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel("time to first token (ms)")
    axes.set_ylabel("fraction of calls")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# -- running the systems ---------------------------------------------------


def context_tokens(model: str) -> int:
    from rayturn.engine.presets import PRESETS

    if model in PRESETS:
        return PRESETS[model].max_position_embeddings
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory")
    return int(json.loads(config_file.read_text())["max_position_embeddings"])


def cluster_overrides(system: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model.name": args.model,
        **SMALL_MACHINE,
        "server.http_port": args.http_port,
        "server.grpc_port": args.grpc_port,
        **({} if args.disaggregation_threshold is None else {
            "router.disaggregation_threshold_tokens": args.disaggregation_threshold}),
        **SYSTEMS[system],
    }  # fmt: skip


def run_system(
    url: str, sessions: list[list[Call]], shape: Shape, label: str, warmup: Sequence[Call]
) -> tuple[dict[str, Any], list[float]]:
    asyncio.run(drive(url, [[call] for call in warmup], shape.max_tokens))  # all at once
    before = prefill_paths(url)
    samples, wall_s = asyncio.run(drive(url, sessions, shape.max_tokens, label))
    after = prefill_paths(url)
    summary = summarize(samples, wall_s)
    if before is not None and after is not None:
        summary["prefill_paths"] = {path: int(n - before.get(path, 0)) for path, n in after.items()}
    errors = sorted({s.error for s in samples if not s.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary, [s.ttft_s for s in samples if s.ok]


def run_clusters(
    args: argparse.Namespace, sessions: list[list[Call]], shape: Shape, warmup: Sequence[Call]
) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    import ray

    from rayturn.cluster.app import KV_NAMESPACE
    from rayturn.cluster.config import load_config
    from rayturn.cluster.runner import running_cluster

    summaries: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    # "local": a Ray of its own, never one already running on this host (its Serve would be torn down).
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=KV_NAMESPACE)
    try:
        for system in SYSTEMS:
            start = time.perf_counter()
            with running_cluster(load_config(**cluster_overrides(system, args))) as endpoints:
                start_s = time.perf_counter() - start
                summaries[system], ttfts[system] = run_system(endpoints.http, sessions, shape, system, warmup)
                summaries[system]["cluster_start_s"] = round(start_s, 1)
    finally:
        ray.shutdown()
    return summaries, ttfts


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 short sessions: seconds of load per system")
    parser.add_argument("--url", default=None, help="drive this running cluster (no baseline)")
    parser.add_argument("--model", default="tiny", help="preset or model directory (sets the context to scale to)")
    parser.add_argument("--sessions", type=int, default=None, help="concurrent sessions (default 8, quick 4)")
    parser.add_argument("--turns", type=int, default=None, help="user turns per session (default 3, quick 2)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per call (default 16, quick 8)")
    parser.add_argument("--time-scale", type=float, default=None, help="x trace seconds (default 0.01, quick 0.005)")
    parser.add_argument("--token-scale", type=float, default=None, help="x trace tokens (default: from the context)")
    parser.add_argument("--disaggregation-threshold", type=int, default=None, help="router's, in tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http-port", type=int, default=18080)
    parser.add_argument("--grpc-port", type=int, default=19080)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "agent_sessions.json")
    return parser.parse_args(argv)


def make_shape(args: argparse.Namespace) -> Shape:
    context = context_tokens(args.model)
    return Shape(
        num_sessions=args.sessions or (4 if args.quick else 8),
        turns_per_session=args.turns or (2 if args.quick else 3),
        calls_per_turn=(2, 4) if args.quick else (5, 20),
        max_tokens=args.max_tokens or (8 if args.quick else 16),
        token_scale=args.token_scale or default_token_scale(context),
        time_scale=args.time_scale if args.time_scale is not None else (0.005 if args.quick else 0.01),
        context_tokens=context,
    )


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    started = time.perf_counter()
    shape = make_shape(args)
    sessions = make_workload(shape, args.seed)
    warmup = warmup_calls(shape, args.seed, count=4)
    if args.url:
        summary, ttft = run_system(args.url.rstrip("/"), sessions, shape, "cluster", warmup)
        summaries, ttfts = {"cluster": summary}, {"cluster": ttft}
        result: dict[str, Any] = {"cached_token_fraction": summary["cached_token_fraction"]}
    else:
        summaries, ttfts = run_clusters(args, sessions, shape, warmup)
        result = {
            **compare(summaries["rayturn"], summaries["baseline"]),
            "cached_token_fraction": summaries["rayturn"]["cached_token_fraction"],
            "baseline_cached_token_fraction": summaries["baseline"]["cached_token_fraction"],
        }
    result = {
        "bench": "agent_sessions",
        "quick": args.quick,
        "model": args.model,
        "seed": args.seed,
        "shape": {**asdict(shape), "calls": sum(map(len, sessions))},
        **result,
        **summaries,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**result, "ttft_samples_s": ttfts}, indent=1, sort_keys=True))
    title = f"Agent sessions, {args.model}, {shape.num_sessions} sessions: TTFT CDF"
    plot = write_plot(ttfts, title, args.out.with_suffix(".png"))
    emit({**result, "results_file": str(args.out), "plot_file": None if plot is None else str(plot)})
    return 0 if all(s["failures"] == 0 for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
