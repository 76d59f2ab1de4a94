"""Request classes under a saturating background batch: agents' TTFT with priorities on against off.

One offline engine, a mixed load in wall-clock time: a background batch
(``--background`` requests of long prompts and outputs, all queued at the
start: more than the engine's sequence slots, so it saturates it for the
whole run) and agent calls arriving at random (``--rate`` per second for
``--seconds``): new turns (interactive) and calls that continue a turn
(continuations), half each, short outputs. Two runs in the same invocation,
same seed and arrivals, each on its own engine (same weights):

- **on**: every request in its class (background, interactive, continuation);
- **off**: every request in one class (first come, first served), what a
  scheduler without classes does.

Reported per run: TTFT p50/p99 of interactive and of continuation calls
(queueing included: arrival to first token), how many of the batch's
requests started ahead of an agent's call on average (first scheduled
after it arrived, before it was: a count, not a time, so it does not depend on how
fast this machine is), and the background batch's throughput (its output
tokens over the time until its last request finished); and the ratios
on/off. Targets: interactive p99 TTFT on <= 0.5x
off, background throughput on >= 0.8x off.

    python bench/priority.py [--quick] [--model tiny] [--out DIR]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.priority import Priority
from rayturn.replay.harness import Progress, add_out_argument, emit, machine, percentile


@dataclass(frozen=True)
class Arrival:
    at_s: float
    request_id: str
    prompt: list[int]
    priority: Priority
    max_tokens: int


@dataclass
class RunResult:
    ttft_s: dict[Priority, list[float]] = field(default_factory=dict)
    background_tokens: int = 0
    background_done_s: float = 0.0
    # Per agent call: background requests first scheduled after the call arrived and before it was (the batch's
    # requests that went ahead of it in the queue). A count: independent of the machine's speed.
    overtaken_by: list[int] = field(default_factory=list)


def workload(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    rng = random.Random(args.seed)
    arrivals = [
        Arrival(
            0.0,
            f"batch-{i}",
            [rng.randrange(vocab) for _ in range(args.background_prompt)],
            Priority.BACKGROUND,
            args.background_tokens,
        )
        for i in range(args.background)
    ]
    rng = random.Random(args.seed + 1)  # the agents' arrivals do not depend on the batch's size
    at_s = 0.0
    index = 0
    while True:
        at_s += rng.expovariate(args.rate)
        if at_s >= args.seconds:
            return arrivals
        kind = Priority.INTERACTIVE if rng.random() < 0.5 else Priority.CONTINUATION
        prompt = [rng.randrange(vocab) for _ in range(args.agent_prompt)]
        arrivals.append(Arrival(at_s, f"agent-{index}", prompt, kind, args.agent_tokens))
        index += 1


def run(engine: LLMEngine, arrivals: list[Arrival], classes: bool) -> RunResult:
    """Feed the arrivals at their times and step the engine until every request finished."""
    pending = sorted(arrivals, key=lambda arrival: arrival.at_s)
    by_id = {arrival.request_id: arrival for arrival in arrivals}
    added_at: dict[str, float] = {}  # when the call arrived (TTFT counts from here)
    queued_at: dict[str, float] = {}  # when it entered the engine's queue (after the step running at its arrival)
    first_token: set[str] = set()
    started_at: dict[str, float] = {}  # the start of the step that first scheduled the request
    result = RunResult(ttft_s={priority: [] for priority in Priority})
    start = time.perf_counter()
    finished = 0
    while finished < len(arrivals):
        now_s = time.perf_counter() - start
        while pending and pending[0].at_s <= now_s:
            arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True)
            priority = arrival.priority if classes else Priority.INTERACTIVE
            engine.add_request(arrival.prompt, params, request_id=arrival.request_id, priority=priority)
            added_at[arrival.request_id] = start + arrival.at_s
            queued_at[arrival.request_id] = time.perf_counter()
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, pending[0].at_s - now_s)) if pending else 0.0)
            continue
        step_start = time.perf_counter()
        outputs = engine.step()
        for seq in engine.scheduler.running:
            started_at.setdefault(seq.request_id, step_start)
        for output in outputs:
            started_at.setdefault(output.request_id, step_start)
            now = time.perf_counter()
            arrival = by_id[output.request_id]
            if output.request_id not in first_token and output.completions[0].token_ids:
                first_token.add(output.request_id)
                result.ttft_s[arrival.priority].append(now - added_at[output.request_id])
            if output.finished:
                finished += 1
                if arrival.priority is Priority.BACKGROUND:
                    result.background_tokens += len(output.completions[0].token_ids)
                    result.background_done_s = now - start
    batch_starts = [at for request_id, at in started_at.items() if by_id[request_id].priority is Priority.BACKGROUND]
    for request_id, at in started_at.items():
        if by_id[request_id].priority is not Priority.BACKGROUND:
            queued = queued_at[request_id]
            result.overtaken_by.append(sum(queued < started < at for started in batch_starts))
    return result


def summary(result: RunResult) -> dict[str, float]:
    figures: dict[str, float] = {}
    for priority in (Priority.INTERACTIVE, Priority.CONTINUATION):
        samples = result.ttft_s[priority]
        figures[f"{priority.value}_ttft_p50_s"] = round(percentile(samples, 50), 4)
        figures[f"{priority.value}_ttft_p99_s"] = round(percentile(samples, 99), 4)
        figures[f"{priority.value}_calls"] = len(samples)
    figures["agent_calls_overtaken_by_batch_mean"] = round(sum(result.overtaken_by) / len(result.overtaken_by), 2)
    figures["background_tokens_per_s"] = round(result.background_tokens / result.background_done_s, 1)
    figures["background_done_s"] = round(result.background_done_s, 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 s of arrivals, a smaller batch")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the engine's sequence slots")
    parser.add_argument("--background", type=int, default=None, help="background requests (default 400, quick 120)")
    parser.add_argument("--background-prompt", type=int, default=512)
    parser.add_argument("--background-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=None, help="agent arrivals for (default 30, quick 8)")
    parser.add_argument("--rate", type=float, default=3.0, help="agent calls per second")
    parser.add_argument("--agent-prompt", type=int, default=256)
    parser.add_argument("--agent-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "priority")
    args = parser.parse_args()
    args.background = args.background or (120 if args.quick else 400)
    args.seconds = args.seconds or (8.0 if args.quick else 30.0)

    # One engine per run (the same weights), so neither finds the other's prompts cached.
    engines = {
        mode: LLMEngine.from_pretrained(args.model, backend="torch", dtype="float32", max_num_seqs=args.max_num_seqs)
        for mode in ("off", "on")
    }
    for engine in engines.values():
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    arrivals = workload(args, engines["on"].config.vocab_size)
    progress = Progress("priority", 2)
    results = {}
    for mode, engine in engines.items():
        results[mode] = summary(run(engine, arrivals, classes=mode == "on"))
        progress.advance()
    on, off = results["on"], results["off"]
    result = {
        "bench": "priority",
        "quick": args.quick,
        "model": args.model,
        "max_num_seqs": args.max_num_seqs,
        "background_requests": args.background,
        "agent_calls": len(arrivals) - args.background,
        "on": on,
        "off": off,
        "interactive_p99_ttft_on_over_off": round(on["interactive_ttft_p99_s"] / off["interactive_ttft_p99_s"], 3),
        "continuation_p99_ttft_on_over_off": round(on["continuation_ttft_p99_s"] / off["continuation_ttft_p99_s"], 3),
        "background_throughput_on_over_off": round(on["background_tokens_per_s"] / off["background_tokens_per_s"], 3),
        "machine": machine(),
    }
    result["targets_met"] = (
        result["interactive_p99_ttft_on_over_off"] <= 0.5 and result["background_throughput_on_over_off"] >= 0.8
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "priority.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


if __name__ == "__main__":
    main()
