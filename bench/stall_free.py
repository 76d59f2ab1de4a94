"""A long prompt computed by a replica while others arrive: stall-free batching on against off, and the cap on a
step's prompt tokens while streams decode against none, in one run.

One offline engine per arm (the same weights). Each round, ``--streams``
interactive calls start and stream their answers; once they decode, a new
turn arrives with a ``--long-prompt``-token prompt (nothing cached). While it
is computed, one call arrives after each of its chunks but the last
(arrivals counted in steps, not seconds, so both arms see the same load
however fast the host is), these in turn:

- a **new turn** of a session whose history (``--turn-history`` tokens) is
  cached, with ``--turn-new`` new tokens: the same class as the long prompt;
- a **handed-over** call, as a decode replica receives one from the prefill
  pool: its prompt's pages already cached (as pages loaded from the KV store
  are) and its first token made elsewhere, so it has one token to compute
  before it decodes on;
- a **continuation** (a tool's result: a call that continues a turn), with a
  ``--continuation-prompt``-token prompt of its own.

Arms:

- **on**: the scheduler's default: running decodes before prompt chunks, a
  waiting call admitted ahead of a running prompt when it is of a higher
  class, or has at most a page or an eighth of the prompt's rest to compute,
  and in a step where streams decode at most
  ``--max-prefill-tokens-while-decoding`` prompt tokens (default: the
  engine's for the device, 512 on a CPU);
- **uncapped**: the same without that cap (the prompt chunks take the rest of
  each step's budget);
- **off**: ``SchedulerConfig.stall_free=False``: every running sequence in
  class order, then the waiting ones: the long prompt's chunks take each
  step's whole budget until it is computed.

Reported per arm: the new turns' and continuations' time to first token and
the handed-over calls' time to their first token computed here (p50, max) and
the steps they waited (a count, the same on any host), the long prompt's own
time to first token (what admitting the others costs it),
the steps it took, the streams' longest gap between two tokens and
inter-token latency p50/p99 (over their tokens after the long prompt
arrived), and ratios on/off and on/uncapped (below 1 is better). Rounds
alternate the arms' order; each round has prompts of its own.

    python bench/stall_free.py [--quick] [--model small] [--rounds 3] [--out DIR]
                               [--max-prefill-tokens-while-decoding N]

Writes ``stall_free.json`` and ``stall_free.png`` (each arriving call's wait and the streams' gaps, per arm)
to ``--out``; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import load_average

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.priority import Priority
from rayturn.replay.harness import Progress, add_out_argument, emit, machine, percentile, pyplot, save_figure

ARMS = ("on", "uncapped", "off")
RATIOS = (
    "continuation_ttft_max",
    "new_turn_ttft_max",
    "handed_over_ttft_max",
    "long_ttft",
    "stream_gap_max",
    "stream_itl_p50",
    "stream_itl_p99",
)


@dataclass
class RoundResult:
    stream_gaps_s: list[float] = field(default_factory=list)  # between a stream's tokens after the long prompt came
    ttft_s: dict[str, list[float]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    # The engine steps from a call's arrival to its first token computed here (the step that computed it counts).
    ttft_steps: dict[str, list[int]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    long_ttft_s: float = 0.0
    long_ttft_steps: int = 0


KINDS = ("new_turn", "handed_over", "continuation")  # in the order they arrive


def num_arrivals(long_prompt: int, budget: int) -> int:
    """One call after each of the long prompt's chunks but the last."""
    return -(-long_prompt // budget) - 1


def prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


def cached(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt with its first token, its pages left in the prefix cache: what a prefill server hands over."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    return [(ids, output.completions[0].token_ids[0]) for ids, output in zip(prompts, engine.generate(prompts, params))]


def run_round(engine: LLMEngine, args: argparse.Namespace, seed: int) -> RoundResult:
    """One round on ``engine``: streams, then the long prompt, then the arriving calls, to the end."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    arrivals: list[tuple[str, list[int], int | None]] = []  # (kind, prompt, first token made elsewhere)
    budget = engine.scheduler.config.max_num_batched_tokens
    kinds = [KINDS[index % len(KINDS)] for index in range(num_arrivals(args.long_prompt, budget))]
    handed = cached(engine, [prompt(rng, vocab, args.handed_prompt) for kind in kinds if kind == "handed_over"])
    histories = cached(engine, [prompt(rng, vocab, args.turn_history) for kind in kinds if kind == "new_turn"])
    for kind in kinds:
        if kind == "continuation":
            arrivals.append((kind, prompt(rng, vocab, args.continuation_prompt), None))
        elif kind == "new_turn":
            history, _ = histories.pop(0)
            arrivals.append((kind, history + prompt(rng, vocab, args.turn_new), None))
        else:
            arrivals.append((kind, *handed.pop(0)))
    streams = [f"stream-{i}-{seed}" for i in range(args.streams)]
    for request_id in streams:
        params = SamplingParams(max_tokens=args.stream_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt(rng, vocab, args.stream_prompt), params, request_id=request_id)
    long_id = f"long-{seed}"
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    result = RoundResult()
    last_token: dict[str, float] = {}
    added_at: dict[str, tuple[str, float, int]] = {}
    num_steps = 0
    steps_since_long: int | None = None
    while engine.has_unfinished_requests():
        if steps_since_long is None and len(last_token) == len(streams):  # every stream decodes: the turn comes
            engine.add_request(prompt(rng, vocab, args.long_prompt), short, request_id=long_id)
            added_at[long_id] = ("long", time.perf_counter(), num_steps)
            steps_since_long = 0
        elif steps_since_long is not None and 0 < steps_since_long <= len(arrivals):
            kind, ids, first = arrivals[steps_since_long - 1]
            request_id = f"{kind}-{steps_since_long}-{seed}"
            if kind == "continuation":
                engine.add_request(ids, short, request_id=request_id, priority=Priority.CONTINUATION)
            else:
                prefix = [first] if first is not None else []
                engine.add_request(ids, short, request_id=request_id, output_prefix=prefix)
            added_at[request_id] = (kind, time.perf_counter(), num_steps)
        outputs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        if steps_since_long is not None:
            steps_since_long += 1
        for output in outputs:
            request_id = output.request_id
            num_tokens = len(output.completions[0].token_ids)
            if request_id in streams:
                if steps_since_long is not None and request_id in last_token:
                    result.stream_gaps_s.append(now - last_token[request_id])
                last_token[request_id] = now
                continue
            kind, at, step = added_at[request_id]
            computed_here = num_tokens - (1 if kind == "handed_over" else 0)
            if computed_here > 0 and request_id not in last_token:
                last_token[request_id] = now
                if kind == "long":
                    result.long_ttft_s = now - at
                    result.long_ttft_steps = num_steps - step
                else:
                    result.ttft_s[kind].append(now - at)
                    result.ttft_steps[kind].append(num_steps - step)
    return result


def summary(rounds: list[RoundResult]) -> dict[str, float | int]:
    gaps = [gap for result in rounds for gap in result.stream_gaps_s]
    figures: dict[str, float | int] = {}
    for kind in KINDS:
        ttfts = [ttft for result in rounds for ttft in result.ttft_s[kind]]
        figures[f"{kind}_ttft_p50_s"] = round(percentile(ttfts, 50), 4)
        figures[f"{kind}_ttft_max_s"] = round(max(ttfts), 4)
        figures[f"{kind}_ttft_steps_max"] = max(steps for result in rounds for steps in result.ttft_steps[kind])
    figures["long_ttft_s"] = round(sum(result.long_ttft_s for result in rounds) / len(rounds), 4)
    figures["long_ttft_steps"] = max(result.long_ttft_steps for result in rounds)
    figures["stream_gap_max_s"] = round(max(gaps), 4)
    figures["stream_itl_p50_s"] = round(percentile(gaps, 50), 4)
    figures["stream_itl_p99_s"] = round(percentile(gaps, 99), 4)
    return figures


COLORS = {"on": "tab:green", "uncapped": "tab:blue", "off": "tab:red"}


def plot(rounds: dict[str, list[RoundResult]], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    figure, (calls, streams) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 1]})
    labels = [f"{kind}\n{arm}" for kind in KINDS for arm in ARMS]
    for position, (kind, arm) in enumerate((kind, arm) for kind in KINDS for arm in ARMS):
        values = [ttft for result in rounds[arm] for ttft in result.ttft_s[kind]]
        calls.scatter([position] * len(values), values, color=COLORS[arm])
    long_ttft = sum(result.long_ttft_s for result in rounds["on"]) / len(rounds["on"])
    calls.axhline(long_ttft, color="grey", linestyle="--", label="the long prompt's first token (on)")
    calls.set_xticks(range(len(labels)), labels, fontsize=7)
    calls.set_ylabel("seconds from arrival to first token computed here")
    calls.set_title("calls arriving while a long prompt is computed")
    calls.legend(fontsize=8)
    gaps = [[gap for result in rounds[arm] for gap in result.stream_gaps_s] for arm in ARMS]
    streams.boxplot(gaps, whis=(0, 100))
    streams.set_xticks(range(1, len(ARMS) + 1), ARMS)
    streams.set_ylabel("seconds between a stream's tokens")
    streams.set_title("the streams meanwhile")
    return save_figure(plt, figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny, one round")
    parser.add_argument("--model", default=None, help="preset or checkpoint (default small, quick tiny)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per arm (default 3, quick 1)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-prompt", type=int, default=128)
    parser.add_argument("--stream-tokens", type=int, default=None, help="each stream's output (default 96)")
    parser.add_argument("--long-prompt", type=int, default=None, help="its tokens (default 8000, quick 3584)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the engine's step budget (default 2048, quick 512)"
    )
    parser.add_argument(
        "--max-prefill-tokens-while-decoding", type=int, default=None, help="the on arm's cap (default: the device's)"
    )
    parser.add_argument("--continuation-prompt", type=int, default=256)
    parser.add_argument("--turn-history", type=int, default=2048, help="a new turn's cached history")
    parser.add_argument("--turn-new", type=int, default=256, help="a new turn's new tokens")
    parser.add_argument("--handed-prompt", type=int, default=1024, help="a handed-over call's cached prompt")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "stall_free")
    args = parser.parse_args()
    args.model = args.model or ("tiny" if args.quick else "small")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.stream_tokens = args.stream_tokens or 96
    args.long_prompt = args.long_prompt or (3584 if args.quick else 8000)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (512 if args.quick else 2048)

    engines = {}
    for arm in ARMS:
        cap = args.max_num_batched_tokens if arm == "uncapped" else args.max_prefill_tokens_while_decoding
        engine = LLMEngine.from_pretrained(
            args.model,
            backend="torch",
            dtype="float32",
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_tokens_while_decoding=cap,
        )
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, stall_free=arm != "off")
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        engines[arm] = engine
    budget = engines["on"].scheduler.config.max_num_batched_tokens
    load_before = load_average()
    progress = Progress("stall_free", args.rounds * len(ARMS))
    rounds: dict[str, list[RoundResult]] = {arm: [] for arm in ARMS}
    for round_index in range(args.rounds):
        for arm in ARMS if round_index % 2 == 0 else ARMS[::-1]:
            rounds[arm].append(run_round(engines[arm], args, args.seed + round_index))
            progress.advance()
    on, uncapped, off = (summary(rounds[arm]) for arm in ARMS)
    args.out.mkdir(parents=True, exist_ok=True)
    figure = plot(rounds, args.out / "stall_free.png")
    result: dict[str, Any] = {
        "bench": "stall_free",
        "quick": args.quick,
        "model": args.model,
        "rounds": args.rounds,
        "streams": args.streams,
        "long_prompt_tokens": args.long_prompt,
        "max_num_batched_tokens": budget,
        "max_prefill_tokens_while_decoding": engines["on"].scheduler.config.max_prefill_tokens_while_decoding,
        "arrivals_per_round": num_arrivals(args.long_prompt, budget),
        "on": on,
        "uncapped": uncapped,
        "off": off,
        **{f"{name}_on_over_off": round(on[f"{name}_s"] / off[f"{name}_s"], 3) for name in RATIOS},
        **{f"{name}_on_over_uncapped": round(on[f"{name}_s"] / uncapped[f"{name}_s"], 3) for name in RATIOS},
        "load_before": load_before,
        "machine": machine(),
        "plot": str(figure) if figure else None,
    }
    (args.out / "stall_free.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


if __name__ == "__main__":
    main()
