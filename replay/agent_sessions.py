"""Closed-loop coding-agent sessions against a cluster: rayturn vs round-robin without a shared KV store.

The sessions are ``rayturn.replay.agent_workload``'s (the shape of real Claude Code
sessions, scaled to the model's context), driven by ``rayturn.replay.agent_client``.

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
``prefill_paths`` says how many calls took that path), ``replicas_per_session``
(the decode replicas a session's calls landed on, on average: 1.0 when every
session stays on one) and ``largest_replica_share`` (of the calls, and of the
prompt tokens computed for them, the largest share one decode replica
served: 0.5 on two replicas when even). Results and TTFT samples
go to ``agent_sessions.json`` in the folder ``--out`` (default
``bench/results/agent_sessions``), with ``agent_sessions.png``, a TTFT CDF,
when matplotlib is installed. The last line of stdout is one JSON object;
``ttft_p99_ratio_vs_baseline`` < 1 means rayturn is better.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from rayturn.replay.agent_client import drive
from rayturn.replay.agent_report import compare, summarize, write_plot
from rayturn.replay.agent_workload import Call, Shape, default_token_scale, make_workload, warmup_calls
from rayturn.replay.cli_help import plain_help
from rayturn.replay.harness import SMALL_MACHINE, add_out_argument, emit, machine
from rayturn.replay.probes import prefill_paths

# How long a system waits for the previous one's HTTP and gRPC ports to be let go.
PORTS_FREE_TIMEOUT_S = 60.0

SYSTEMS: dict[str, dict[str, Any]] = {
    "rayturn": {"router.policy": "kv_aware", "kvstore.enabled": True, "prefill.min_replicas": 1,
                "prefill.max_replicas": 1},
    "baseline": {"router.policy": "round_robin", "kvstore.enabled": False, "prefill.min_replicas": 0,
                 "prefill.max_replicas": 0},
}  # fmt: skip


def context_tokens(model: str) -> int:
    from rayturn.engine.presets import PRESETS, resolve_model_dir

    if model in PRESETS:
        return PRESETS[model].max_position_embeddings
    return int(json.loads((resolve_model_dir(model) / "config.json").read_text())["max_position_embeddings"])


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


def wait_for_ports(host: str, ports: dict[str, int], timeout_s: float = PORTS_FREE_TIMEOUT_S) -> None:
    """Until ``ports`` are free: the last system's Serve proxy may still hold them for a moment after
    its shutdown returned. Raises ``ListenerError`` past ``timeout_s``."""
    from rayturn.cluster.listeners import ListenerError, check_ports_free

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check_ports_free(host, ports)
            return
        except ListenerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


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
            config = load_config(**cluster_overrides(system, args))
            ports = {"server.http_port": args.http_port, "server.grpc_port": args.grpc_port}
            wait_for_ports(config.server.host, ports)
            start = time.perf_counter()
            with running_cluster(config) as endpoints:
                start_s = time.perf_counter() - start
                summaries[system], ttfts[system] = run_system(endpoints.http, sessions, shape, system, warmup)
                summaries[system]["cluster_start_s"] = round(start_s, 1)
    finally:
        ray.shutdown()
    return summaries, ttfts


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 short sessions: seconds of load per system")
    parser.add_argument("--url", default=None, help="drive this running cluster (no baseline)")
    parser.add_argument(
        "--model",
        default=None,
        help="preset or model directory (sets the context to scale to; default small, where a prefix costs to "
        "recompute about what it would on an accelerator against loading its pages; tiny with --quick or --url, "
        "the model a cluster serves by default)",
    )
    parser.add_argument("--sessions", type=int, default=None, help="concurrent sessions (default 8, quick 4)")
    parser.add_argument("--turns", type=int, default=None, help="user turns per session (default 3, quick 2)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per call (default 16, quick 8)")
    parser.add_argument("--time-scale", type=float, default=None, help="x trace seconds (default 0.01, quick 0.005)")
    parser.add_argument("--token-scale", type=float, default=None, help="x trace tokens (default: from the context)")
    parser.add_argument("--disaggregation-threshold", type=int, default=None, help="router's, in tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http-port", type=int, default=28080)
    parser.add_argument("--grpc-port", type=int, default=29080)
    add_out_argument(parser, "agent_sessions")
    args = parser.parse_args(argv)
    args.model = args.model or ("tiny" if args.quick or args.url else "small")
    if args.out.suffix == ".json":
        parser.error(f"--out is the results folder (agent_sessions.json goes in it), got the file name {args.out}")
    return args


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
        result: dict[str, Any] = {
            "cached_token_fraction": summary["cached_token_fraction"],
            "replicas_per_session": summary["replicas_per_session"],
            "largest_replica_share": summary["largest_replica_share"],
        }
    else:
        summaries, ttfts = run_clusters(args, sessions, shape, warmup)
        result = {
            **compare(summaries["rayturn"], summaries["baseline"]),
            "cached_token_fraction": summaries["rayturn"]["cached_token_fraction"],
            "baseline_cached_token_fraction": summaries["baseline"]["cached_token_fraction"],
            "replicas_per_session": summaries["rayturn"]["replicas_per_session"],
            "baseline_replicas_per_session": summaries["baseline"]["replicas_per_session"],
            "largest_replica_share": summaries["rayturn"]["largest_replica_share"],
            "baseline_largest_replica_share": summaries["baseline"]["largest_replica_share"],
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
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "agent_sessions.json"
    results_file.write_text(json.dumps({**result, "ttft_samples_s": ttfts}, indent=1, sort_keys=True))
    title = f"Agent sessions, {args.model}, {shape.num_sessions} sessions: TTFT CDF"
    plot = write_plot(ttfts, title, args.out / "agent_sessions.png")
    emit({**result, "results_file": str(results_file), "plot_file": None if plot is None else str(plot)})
    return 0 if all(s["failures"] == 0 for s in summaries.values()) else 1
