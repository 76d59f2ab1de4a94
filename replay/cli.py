"""Replay recorded agent traces against a rayturn cluster, closed loop: KV reuse, idle capture, prewarm hits, latency.

Reads kv-cache-tester (Claude Code, "weka"), Mooncake and TraceLab traces
(files or folders; default ``../shared/traces/weka`` next to the repository,
or to the current directory outside a checkout (``rayturn.replay.paths``);
when that is absent too, sample conversations it writes under ``--out``
(``rayturn.replay.sample_traces``)), turns each call into exact prompt token
ids at a token scale and each gap into scaled seconds (``rayturn.replay.plans``), and sends
every call to ``/v1/completions`` as token ids, streaming, greedy, with
``ignore_eos`` so it streams exactly its scaled output length. Each
conversation's agents run closed loop: a call goes out once the previous one
finished plus the scaled gap the trace shows; sub-agents run as their own
sessions beside their parent. ``--concurrency`` conversations run at once.

Headers per call: ``x-session-id`` (the conversation, ``<id>/<sub-agent>``
for a sub-agent), ``x-rayturn-call`` (``user`` when the call opens a turn or a
sub-agent, else ``tool``), ``x-rayturn-after`` (``tool`` when the trace's
answer called tools, else ``user``). The answer's ``x-rayturn-session`` header
(the decode replica's view of the session) feeds idle capture and prewarm hits.

Scales: ``--token-scale auto`` is the largest 1/n at which the longest call
(prompt + output) fits 90% of the model's context (``tiny`` and the weka set:
1/64, one token per 64-token block; conversations still too long are cut
before their first call that does not fit). ``--time-scale`` (default 1/60)
compresses every gap; the cluster's lifecycle planner is told the same scale.
``--device-kv-pages auto`` sizes each decode replica so the replayed sessions'
KV demand is 2.5 times the decode pool's, yet a replica's share of the busiest
moment's running calls fits.

Announcements: the traces do not say when a user started typing. With
``--announce-lead-s L`` the replayer posts ``/v1/sessions/{id}/prewarm`` L
trace seconds (scaled like every gap) before each call that opens a user
turn, as a client does when its user starts typing; without it nothing is
announced and the idle predictor alone decides.

Systems: without ``--url`` an embedded cluster per system (``--config``,
default: all defaults with 2 decode replicas). ``--compare`` runs, one after
the other, ``rayturn``, ``no_lifecycle`` and ``round_robin`` and reports each
baseline's figures over rayturn's; ``--systems`` picks any of those and
``lognormal_idle`` (the life cycle with the log-normal idle predictor in place
of the default hazard one).

    python bench/replay.py [TRACES ...] [--quick] [--compare] [--url http://127.0.0.1:8000]
    rayturn replay [args]

Results: the folder ``--out`` (default ``bench/results/replay``, in the checkout or the
current directory) gets ``replay.json`` (summaries and every call),
``replay.md`` and ``replay_*.png``; the last line of stdout is one JSON object
with the first system's headline figures (definitions in
``rayturn.replay.summaries``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from rayturn.replay.cli_help import plain_help
from rayturn.replay.driver import Drive, SystemRun, replay
from rayturn.replay.harness import SMALL_MACHINE, add_out_argument, emit, machine
from rayturn.replay.kv_demand import auto_device_pages, busiest_pages, kv_demand_pages
from rayturn.replay.model import model_vocabulary, with_context
from rayturn.replay.paths import DEFAULT_TRACES, RESULTS_DIR
from rayturn.replay.plans import ConversationPlan, plan_conversation
from rayturn.replay.probes import health_capacity_pages
from rayturn.replay.records import record_dict
from rayturn.replay.report import markdown, write_plots
from rayturn.replay.sample_traces import write_sample_traces
from rayturn.replay.scaling import Scale, auto_token_scale, fit_to_context
from rayturn.replay.summaries import compare, summarize
from rayturn.replay.synthesis import TokenSynthesizer
from rayturn.replay.workload import pick_conversations, read_traces

DEFAULT_TIME_SCALE = 1 / 60
QUICK_CONVERSATIONS = 4
QUICK_DURATION_S = 20.0


SYSTEMS: dict[str, dict[str, Any]] = {
    "rayturn": {},
    "no_lifecycle": {"lifecycle.enabled": False},
    "round_robin": {"router.policy": "round_robin", "kvstore.enabled": False, "prefill.min_replicas": 0,
                    "prefill.max_replicas": 0, "lifecycle.enabled": False},
    "lognormal_idle": {"lifecycle.predictor": "session"},
}  # fmt: skip
# What --compare runs: rayturn and the baselines without its life cycle or its routing and store.
COMPARED = ("rayturn", "no_lifecycle", "round_robin")


def system_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


# -- arguments ----------------------------------------------------------------


def fraction(text: str) -> float:
    """A positive number, or a fraction such as ``1/64``."""
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a number or a fraction like 1/64, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def auto_or(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text == "auto" else kind(text)

    return parse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description=plain_help(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "paths",
        nargs="*",
        type=Path,
        help="trace files or folders (default: ../shared/traces/weka, else generated sample conversations)",
    )
    parser.add_argument("--traces", action="append", type=Path, default=[], help="a trace file or folder (repeatable)")
    parser.add_argument("--quick", action="store_true", help="4 turn-heavy conversations for 20 s: about a minute")
    parser.add_argument("--url", default=None, help="drive this running cluster (one system, no --compare)")
    parser.add_argument("--config", default=None, help="cluster YAML for the embedded clusters (default: defaults)")
    parser.add_argument("--model", default=None, help="preset or model directory (default: the config's, tiny)")
    parser.add_argument(
        "--context", type=positive_int, default=None, help="serve a copy of the preset with this longer context"
    )
    parser.add_argument("--compare", action="store_true", help="also run no_lifecycle and round_robin")
    parser.add_argument(
        "--systems",
        type=system_list,
        default=None,
        help=f"comma list of the systems to run, one after the other ({', '.join(SYSTEMS)}; "
        f"--compare: {', '.join(COMPARED)})",
    )
    parser.add_argument("--concurrency", type=positive_int, default=4, help="conversations at once")
    parser.add_argument("--max-conversations", type=positive_int, default=None, help="default all (quick 4)")
    parser.add_argument("--max-duration-s", type=fraction, default=None, help="stop sending after (quick 20)")
    parser.add_argument("--token-scale", type=auto_or(fraction), default=None, help="x trace tokens, or auto")
    parser.add_argument("--time-scale", type=fraction, default=DEFAULT_TIME_SCALE, help="x trace seconds (1/60)")
    parser.add_argument("--device-kv-pages", type=auto_or(positive_int), default=None, help="per decode replica")
    parser.add_argument(
        "--announce-lead-s",
        type=fraction,
        default=None,
        help="announce each user turn this many trace seconds before its call, as a client does when its "
        "user starts typing (default: never)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http-port", type=int, default=28080)
    parser.add_argument("--grpc-port", type=int, default=29080)
    add_out_argument(parser, "replay")
    args = parser.parse_args(argv)
    if args.url and (args.compare or args.systems):
        parser.error("--compare and --systems start their own clusters: drop --url")
    if args.quick:
        args.max_conversations = args.max_conversations or QUICK_CONVERSATIONS
        args.max_duration_s = args.max_duration_s or QUICK_DURATION_S
    return args


# -- running ------------------------------------------------------------------


def base_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {} if args.config else dict(SMALL_MACHINE)  # without --config: a small host
    if args.model:
        overrides["model.name"] = args.model
    if args.context:
        from rayturn.cluster.config import load_config

        model = args.model or load_config(args.config, **overrides).model.name
        overrides["model.name"] = with_context(model, args.context, RESULTS_DIR / "models")
    return overrides


def system_overrides(system: str, args: argparse.Namespace, device_kv_pages: int) -> dict[str, Any]:
    return {
        **base_overrides(args),
        "decode.num_pages": device_kv_pages,
        "lifecycle.time_scale": args.time_scale,
        "server.http_port": args.http_port,
        "server.grpc_port": args.grpc_port,
        **SYSTEMS[system],
    }


def run_clusters(
    args: argparse.Namespace, plans: Sequence[ConversationPlan], drive: Drive, device_kv_pages: int
) -> dict[str, SystemRun]:
    import ray

    from rayturn.cluster.app import KV_NAMESPACE
    from rayturn.cluster.config import load_config
    from rayturn.cluster.runner import running_cluster

    names = args.systems or (list(COMPARED) if args.compare else ["rayturn"])
    configs = {name: load_config(args.config, **system_overrides(name, args, device_kv_pages)) for name in names}
    runs: dict[str, SystemRun] = {}
    # "local": a Ray of its own, never one already running on this host (its Serve would be torn down).
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=KV_NAMESPACE)
    try:
        for name, config in configs.items():
            start = time.perf_counter()
            with running_cluster(config) as endpoints:
                start_s = time.perf_counter() - start
                run = asyncio.run(replay(endpoints.http, plans, drive, name))
                runs[name] = dataclasses.replace(run, cluster_start_s=round(start_s, 1))
    finally:
        ray.shutdown()
    return runs


def trace_paths(args: argparse.Namespace) -> tuple[list[Path], bool]:
    """The traces to read, and whether they are generated samples (no traces named, the default folder absent)."""
    paths = [*args.paths, *args.traces]
    if paths:
        return paths, False
    if DEFAULT_TRACES.is_dir():
        return [DEFAULT_TRACES], False
    folder = args.out / "sample_traces"
    samples = write_sample_traces(folder, seed=args.seed)
    print(
        f"no traces at {DEFAULT_TRACES.resolve()}: replaying {len(samples)} generated sample conversations "
        f"(kv-cache-tester format) written to {folder}; pass trace files or folders to replay recorded ones",
        file=sys.stderr,
    )
    return [folder], True


HEADLINE = (
    "hit_within_turn", "hit_cross_turn", "bound_within_turn", "bound_cross_turn", "idle_capture", "prewarm_hit",
    "warm_return_rate", "idle_capture_keep_bound", "idle_capture_keep_bound_at_target",
    "ttft_p50_s", "ttft_p99_s", "ttft_cross_over_within_p99", "itl_p50_s", "itl_p99_s",
    "calls", "failures",
)  # fmt: skip


REPORTED_SETUP = (
    "sample_traces", "token_scale", "time_scale", "announce_lead_s", "device_kv_pages",
    "kv_demand_over_device_capacity", "conversations", "wall_s",
)  # fmt: skip


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from rayturn.cluster.config import load_config

    args = parse_args(argv, prog)
    started = time.perf_counter()
    paths, sample_traces = trace_paths(args)
    base = load_config(args.config, **base_overrides(args))
    model, page_size = base.model.name, base.model.page_size
    vocabulary = model_vocabulary(model, base.model.max_model_len)
    window_s = args.max_duration_s / args.time_scale if args.quick and args.max_duration_s else None
    picked = pick_conversations(read_traces(paths), args.max_conversations, busiest_within_s=window_s)
    if not picked:
        raise ValueError(f"no conversations in {', '.join(map(str, paths))}")
    token_scale = args.token_scale or auto_token_scale(picked, vocabulary.context_tokens)
    fitted = fit_to_context(picked, token_scale, vocabulary.context_tokens)
    if not fitted.kept:
        raise ValueError(f"no conversation's first call fits the {vocabulary.context_tokens}-token context")
    synthesizer = TokenSynthesizer(vocabulary.token_ids, seed=args.seed)
    plans = [plan_conversation(item, synthesizer, Scale(token_scale, args.time_scale)) for item in fitted.kept]
    demand = kv_demand_pages(plans, page_size)
    busiest = busiest_pages(plans, page_size, args.concurrency)
    decode_replicas = base.decode.max_replicas
    announce_lead_s = None if args.announce_lead_s is None else args.announce_lead_s * args.time_scale
    drive = Drive(args.concurrency, args.max_duration_s, vocabulary.token_ids, args.seed, announce_lead_s)
    if args.url:
        url = args.url.rstrip("/")
        runs = {"cluster": asyncio.run(replay(url, plans, drive, "cluster"))}
        capacity = health_capacity_pages(url)
        device_kv_pages = None
    else:
        device_kv_pages = args.device_kv_pages or auto_device_pages(demand, busiest, decode_replicas)
        runs = run_clusters(args, plans, drive, device_kv_pages)
        capacity = decode_replicas * device_kv_pages
    summaries = {name: summarize(run.records, run.sent, page_size, run.wall_s) for name, run in runs.items()}
    for name, run in runs.items():
        summaries[name]["prefill_paths"] = run.prefill_paths
        if run.cluster_start_s is not None:
            summaries[name]["cluster_start_s"] = run.cluster_start_s
        if run.announcements is not None:
            summaries[name]["announcements"] = run.announcements
    result: dict[str, Any] = {
        "bench": "replay",
        "quick": args.quick,
        "model": model,
        "seed": args.seed,
        "traces": [str(path) for path in paths],
        "sample_traces": sample_traces,
        "conversations": len(plans),
        "truncated_conversations": fitted.cut,
        "dropped_conversations": fitted.dropped,
        "planned_calls": sum(plan.num_calls for plan in plans),
        "concurrency": args.concurrency,
        "max_duration_s": args.max_duration_s,
        "token_scale": token_scale,
        "time_scale": args.time_scale,
        "announce_lead_s": args.announce_lead_s,
        "page_size": page_size,
        "decode_replicas": None if args.url else decode_replicas,
        "device_kv_pages": device_kv_pages,
        "kv_demand_pages": demand,
        "busiest_pages": busiest,
        "kv_demand_over_device_capacity": round(demand / capacity, 3) if capacity else None,
        "systems": summaries,
    }
    if len(summaries) > 1 and "rayturn" in summaries:
        result["ratios"] = compare(summaries, reference="rayturn")
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["machine"] = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "replay.json"
    calls = {name: [record_dict(r) for r in run.records] for name, run in runs.items()}
    results_file.write_text(json.dumps({**result, "calls": calls}, indent=1, sort_keys=True))
    (args.out / "replay.md").write_text(markdown(result))
    plots = write_plots({name: run.records for name, run in runs.items()}, summaries, args.out)
    first = next(iter(summaries.values()))
    headline: dict[str, Any] = {key: first[key] for key in HEADLINE}
    headline["targets_met"] = {name: target["met"] for name, target in first["targets"].items()}
    for baseline, ratios in result.get("ratios", {}).items():
        headline.update({f"{metric}_{baseline}_over_rayturn": ratio for metric, ratio in ratios.items()})
    emit({
        "bench": "replay",
        "system": next(iter(summaries)),
        **headline,
        **{key: result[key] for key in REPORTED_SETUP},
        "results_file": str(results_file),
        "markdown_file": str(args.out / "replay.md"),
        "plot_files": [str(path) for path in plots],
    })  # fmt: skip
    return 0 if all(summary["failures"] == 0 for summary in summaries.values()) else 1
