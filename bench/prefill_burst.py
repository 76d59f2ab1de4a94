"""A burst of new sessions with long prompts: the prefill pool balanced with the decode replica, against the pool
taking every long prompt (``router.balance_prefill`` on and off), in one run.

One embedded cluster (one prefill replica, one decode replica, the KV store;
``small`` by default). For each arm, in alternating rounds, the cluster is
redeployed with the arm's setting, one long prompt warms it up (not timed),
then ``--sessions`` new sessions each send one streamed chat call at once, each
with a long prompt of its own (nothing cached). Per arm: each call's time to
first token (p50, p90, max), the burst's wall time, and the decode replica's
counts of where the prompts were computed (``disaggregated``, ``pool_busy``:
computed by the decode replica because the pool was busier, ``failed_prefill``:
remote prefills given up). Ratios are balanced / pool only; below 1 is better.

    python bench/prefill_burst.py [--quick] [--model small] [--sessions 12] [--rounds 2] [--out DIR]

Writes ``prefill_burst.json`` and ``prefill_burst.png`` (each call's TTFT, sorted, per arm) to ``--out``; the
last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import load_average

from rayturn.replay.harness import Progress, add_out_argument, emit, machine, percentile, pyplot, save_figure

ARMS = {"balanced": True, "pool_only": False}
COUNTED = ("disaggregated", "pool_busy", "pool_full", "failed_prefill", "local_prefill")
WORDS = ("def", "return", "self", "value", "index", "result", "items", "None", "for", "in", "if", "else")


def overrides(model: str, balance: bool, http_port: int, grpc_port: int) -> dict[str, Any]:
    return {
        "model.name": model,
        "decode.num_cpus": 0.25,
        "prefill.num_cpus": 0.25,
        "server.ingress_num_cpus": 0.25,
        "kvstore.segment_bytes": "256MiB",
        "router.balance_prefill": balance,
        "server.http_port": http_port,
        "server.grpc_port": grpc_port,
    }


def long_prompt(rng: random.Random, words: int) -> str:
    """Code-like text no other call shares (a fresh random head and body)."""
    return f"# file {rng.random()}\n" + " ".join(rng.choice(WORDS) for _ in range(words))


def decode_counts(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/health", timeout=60) as response:
        details = json.load(response).get("details", {})
    return {name: int(details.get(f"decode.{name}", 0)) for name in COUNTED}


def first_token_s(url: str, model: str, prompt: str, session: str) -> float:
    """One streamed greedy chat call: the seconds to its first text (the rest is read to the end)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": session},
    )
    started = time.perf_counter()
    first: float | None = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if first is None and line.startswith(b"data: {"):
                chunk = json.loads(line[len(b"data: ") :])
                if any(choice["delta"].get("content") for choice in chunk["choices"]):
                    first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"session {session}: the stream ended without text")
    return first


def burst(url: str, model: str, prompts: list[str], tag: str, progress: Progress) -> tuple[list[float], float]:
    ttfts: list[float] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            ttfts.append(first_token_s(url, model, prompts[i], f"{tag}-{i}"))
        except BaseException as err:  # reported after the burst
            errors.append(err)
        progress.advance()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return sorted(ttfts), time.perf_counter() - started


def summary(ttfts: list[float], walls: list[float], counts: dict[str, int]) -> dict[str, Any]:
    return {
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p90_s": round(percentile(ttfts, 90), 3),
        "ttft_max_s": round(max(ttfts), 3),
        "wall_s": round(sum(walls) / len(walls), 3),
        "calls": len(ttfts),
        **counts,
    }


def write_plot(per_arm: dict[str, list[list[float]]], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(8, 5))
    for arm, rounds in per_arm.items():
        for number, ttfts in enumerate(rounds):
            axes.plot(range(1, len(ttfts) + 1), ttfts, marker="o", label=f"{arm} (round {number + 1})")
    axes.set_xlabel("calls of the burst, by time to first token")
    axes.set_ylabel("time to first token (s)")
    axes.set_title("rayturn: a burst of new sessions, prefill pool balanced with the decode replica or not")
    axes.legend(fontsize=8)
    return save_figure(plt, figure, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny, 4 sessions of shorter prompts, one round")
    parser.add_argument("--model", default=None, help="preset or checkpoint (default: small; tiny with --quick)")
    parser.add_argument("--sessions", type=int, default=None, help="calls in each burst (default 12; 4 quick)")
    parser.add_argument("--words", type=int, default=None, help="words per prompt (default 700; 300 quick)")
    parser.add_argument("--rounds", type=int, default=None, help="bursts per arm, alternating (default 2; 1 quick)")
    parser.add_argument("--http-port", type=int, default=28641)
    parser.add_argument("--grpc-port", type=int, default=29641)
    add_out_argument(parser, "prefill_burst")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or ("tiny" if args.quick else "small")
    sessions = args.sessions or (4 if args.quick else 12)
    words = args.words or (300 if args.quick else 700)
    rounds = args.rounds or (1 if args.quick else 2)
    load_before = load_average()
    started = time.perf_counter()
    rng = random.Random(20261207)

    import ray
    from ray import serve

    from rayturn.cluster.app import APP_NAME, KV_NAMESPACE, build_app
    from rayturn.cluster.config import load_config
    from rayturn.cluster.runner import running_cluster

    ttfts: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    counts: dict[str, dict[str, int]] = {arm: dict.fromkeys(COUNTED, 0) for arm in ARMS}
    progress = Progress("prefill burst", len(ARMS) * rounds * (sessions + 1))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=KV_NAMESPACE)
    try:
        first_config = load_config(**overrides(model, True, args.http_port, args.grpc_port))
        with running_cluster(first_config) as endpoints:
            url = endpoints.http
            for number in range(rounds):
                for arm, balance in ARMS.items():
                    config = load_config(**overrides(model, balance, args.http_port, args.grpc_port))
                    serve.run(build_app(config), name=APP_NAME, route_prefix="/")  # the decode replica anew
                    first_token_s(url, model, long_prompt(rng, words), f"warm-{arm}-{number}")
                    progress.advance()
                    before = decode_counts(url)
                    prompts = [long_prompt(rng, words) for _ in range(sessions)]
                    arm_ttfts, wall = burst(url, model, prompts, f"{arm}-{number}", progress)
                    after = decode_counts(url)
                    ttfts[arm].append(arm_ttfts)
                    walls[arm].append(wall)
                    for name in COUNTED:
                        counts[arm][name] += after[name] - before[name]
    finally:
        ray.shutdown()
    arms = {arm: summary([t for run in ttfts[arm] for t in run], walls[arm], counts[arm]) for arm in ARMS}
    balanced, pool_only = arms["balanced"], arms["pool_only"]
    result = {
        "benchmark": "prefill_burst",
        "quick": args.quick,
        "model": model,
        "sessions": sessions,
        "words": words,
        "rounds": rounds,
        "arms": arms,
        "ratio_wall": round(balanced["wall_s"] / pool_only["wall_s"], 3),
        "ratio_ttft_p50": round(balanced["ttft_p50_s"] / pool_only["ttft_p50_s"], 3),
        "ratio_ttft_max": round(balanced["ttft_max_s"] / pool_only["ttft_max_s"], 3),
        "load_before": load_before,
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    plot = write_plot(ttfts, args.out / "prefill_burst.png")
    result["plot"] = str(plot) if plot else None
    (args.out / "prefill_burst.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
