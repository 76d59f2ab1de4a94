"""Speculative decoding with suffix-matching drafts: decode speed with it on and off, same engine, same run.

The offline ``LLMEngine`` on the ``small`` preset (random weights, CPU,
float32) runs each workload twice, speculation off then on (the per-request
switch), for ``--rounds`` rounds; the outputs of the two must be identical.

(a) Agent sessions that re-emit code from their history. With random
    weights the model copies nothing by itself: its output is whatever
    greedy decoding of the context gives. So the workload makes the measured
    call's answer text this engine has seen, the way an agent's next call
    holds its last answer. Each session's earlier call (not measured) has a
    prompt of a code file (rayturn's own sources) and an edit instruction,
    and answers ``--tokens`` tokens. The measured call is the session's next
    call: its prompt is that context plus the first quarter of the earlier
    answer (an answer cut short, asked to go on), so greedy decoding re-emits
    the rest of the earlier answer, which the session's history holds. The
    drafts also catch the loops random models fall into, from the sequence's
    own tokens.
(b) Random text, where drafting fails: random-token prompts, sampled at
    temperature 1 with a seed per request (the greedy output of a random
    model loops, which drafts predict; sampled output does not). Seeded
    outputs are identical with speculation on or off.
(c) A large batch, where verification competes with many sequences for the
    step: ``--batch`` calls decoded together, half (a)'s agent calls and
    half (b)'s random text, so drafts of many sequences are verified in the
    same forward passes as the non-drafting sequences' single tokens.

Reported per workload: decode time (from the step that gave every call its
first token to the last), output tokens per decode step, drafts, acceptance
rate, and the decode speedup (off time / on time; medians over rounds, and
bests: the fastest round of each); for (b) also the overhead (on time / off
time - 1). Each is given in wall time and in this process's CPU time
(steadier where other work shares the cores). The agent calls are the same
each round; the random ones are new each round, since a call's output,
once finished, is recent output that drafts may copy.

    python bench/speculative.py [--quick] [--rounds N] [--batch N] [--out DIR]

Writes ``speculative.json`` to ``--out``; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.speculative import SpeculativeConfig
from rayturn.replay.harness import add_out_argument, emit, machine

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("engine/stop.py", "engine/page_pool.py", "engine/sampler.py", "engine/scheduler.py", "engine/request.py")


@dataclass(frozen=True)
class Call:
    prompt: list[int]
    params: SamplingParams
    session_id: str | None = None


@dataclass(frozen=True)
class Run:
    outputs: list[list[int]]
    decode_s: float
    decode_cpu_s: float  # this process's CPU time over the decode phase (steadier than wall time on a busy host)
    decode_tokens: int
    decode_steps: int

    @property
    def tokens_per_step(self) -> float:
        return self.decode_tokens / max(self.decode_steps, 1)


def run_calls(engine: LLMEngine, calls: list[Call], speculative: bool) -> Run:
    """Run the calls together to completion; time their decode phase."""
    ids = [
        engine.add_request(call.prompt, replace(call.params, speculative=speculative), session_id=call.session_id)
        for call in calls
    ]
    lengths = dict.fromkeys(ids, 0)
    finished: dict[str, list[int]] = {}
    decode_start_s = decode_start_cpu_s = 0.0
    tokens_at_start = steps = 0
    while len(finished) < len(ids):
        for out in engine.step():
            lengths[out.request_id] = len(out.token_ids)
            if out.finished:
                finished[out.request_id] = list(out.token_ids)
        if decode_start_s:
            steps += 1
        elif all(lengths.values()):
            decode_start_s, decode_start_cpu_s = time.perf_counter(), time.process_time()
            tokens_at_start = sum(lengths.values())
    decode_s = time.perf_counter() - decode_start_s
    decode_cpu_s = time.process_time() - decode_start_cpu_s
    return Run([finished[i] for i in ids], decode_s, decode_cpu_s, sum(lengths.values()) - tokens_at_start, steps)


def agent_calls(engine: LLMEngine, num_sessions: int, prompt_chars: int, num_tokens: int) -> list[Call]:
    """Each session's earlier call runs here (unmeasured); returns each session's next call, to measure."""
    greedy = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, speculative=True)
    earlier: list[Call] = []
    for index in range(num_sessions):
        path = SOURCES[index % len(SOURCES)]
        source = (ROOT / path).read_text()[:prompt_chars]
        text = f"<file path={path!r}>\n{source}\n</file>\nRename `seq` to `sequence` and return the whole file.\n"
        earlier.append(Call(engine.tokenizer.encode(text), greedy, f"session-{index}"))
    answers = run_calls(engine, earlier, speculative=True).outputs
    cut = num_tokens // 4
    rest = replace(greedy, max_tokens=num_tokens - cut)
    return [Call(call.prompt + answer[:cut], rest, call.session_id) for call, answer in zip(earlier, answers)]


def random_calls(vocab_size: int, num_calls: int, prompt_len: int, num_tokens: int, seed: int) -> list[Call]:
    rng = random.Random(seed)
    return [
        Call(
            [rng.randrange(vocab_size) for _ in range(prompt_len)],
            SamplingParams(max_tokens=num_tokens, temperature=1.0, seed=seed + index, ignore_eos=True),
        )
        for index in range(num_calls)
    ]


def measure(engine: LLMEngine, rounds: list[list[Call]]) -> dict[str, Any]:
    """Each round's calls off, then on; medians and bests, and whether on and off gave the same outputs.

    The rounds' calls may differ (a finished call's output is recent output
    that later drafts may copy, so random text gets fresh calls each round).
    """
    offs: list[Run] = []
    ons: list[Run] = []
    stats = engine.drafter.stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    for calls in rounds:
        offs.append(run_calls(engine, calls, speculative=False))
        ons.append(run_calls(engine, calls, speculative=True))
    num_drafts, num_draft_tokens, num_accepted = (
        stats.num_drafts - before[0],
        stats.num_draft_tokens - before[1],
        stats.num_accepted_tokens - before[2],
    )
    off_s = statistics.median(run.decode_s for run in offs)
    on_s = statistics.median(run.decode_s for run in ons)
    off_best_s = min(run.decode_s for run in offs)
    on_best_s = min(run.decode_s for run in ons)
    off_cpu_s = statistics.median(run.decode_cpu_s for run in offs)
    on_cpu_s = statistics.median(run.decode_cpu_s for run in ons)
    return {
        "calls": len(rounds[0]),
        "prompt_tokens": sum(len(call.prompt) for call in rounds[0]),
        "output_tokens": sum(len(out) for out in offs[0].outputs),
        "off_decode_s": round(off_s, 3),
        "on_decode_s": round(on_s, 3),
        "off_decode_s_each": [round(run.decode_s, 3) for run in offs],
        "on_decode_s_each": [round(run.decode_s, 3) for run in ons],
        "off_decode_cpu_s": round(off_cpu_s, 3),
        "on_decode_cpu_s": round(on_cpu_s, 3),
        "off_tokens_per_step": round(statistics.median(run.tokens_per_step for run in offs), 3),
        "on_tokens_per_step": round(statistics.median(run.tokens_per_step for run in ons), 3),
        "drafts": num_drafts // len(rounds),
        "draft_tokens": num_draft_tokens // len(rounds),
        "acceptance_rate": round(num_accepted / num_draft_tokens, 3) if num_draft_tokens else 0.0,
        "decode_speedup": round(off_s / on_s, 3),
        "overhead": round(on_s / off_s - 1, 4),
        "decode_speedup_best": round(off_best_s / on_best_s, 3),
        "overhead_best": round(on_best_s / off_best_s - 1, 4),
        "decode_speedup_cpu_time": round(off_cpu_s / on_cpu_s, 3),
        "overhead_cpu_time": round(on_cpu_s / off_cpu_s - 1, 4),
        "outputs_identical": all(off.outputs == on.outputs for off, on in zip(offs, ons)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter calls; finishes within about a minute")
    parser.add_argument("--model", default="small")
    parser.add_argument("--backend", default=None, help="kernel backend (default: what this host gets)")
    parser.add_argument("--rounds", type=int, default=None, help="off/on pairs per workload (default 3, quick 1)")
    parser.add_argument("--batch", type=int, default=None, help="calls decoded together in (c) (default 32, quick 8)")
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "speculative")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    num_sessions, prompt_chars, num_tokens = (2, 600, 64) if args.quick else (4, 2400, 256)

    config = SpeculativeConfig(enabled=False, num_speculative_tokens=args.num_speculative_tokens)
    engine = LLMEngine.from_pretrained(args.model, backend=args.backend, dtype="float32", speculative=config)
    warm_up = [Call([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]
    run_calls(engine, warm_up, speculative=False)
    run_calls(engine, warm_up, speculative=True)

    print("agent sessions ...", file=sys.stderr, flush=True)
    agent = measure(engine, [agent_calls(engine, num_sessions, prompt_chars, num_tokens)] * rounds)
    print("random text ...", file=sys.stderr, flush=True)
    vocab_size = engine.tokenizer.vocab_size
    noise = measure(
        engine,
        [
            random_calls(vocab_size, num_sessions, prompt_chars // 4, num_tokens, args.seed + 1000 * index)
            for index in range(rounds)
        ],
    )
    print("a large batch ...", file=sys.stderr, flush=True)
    batch = args.batch or (8 if args.quick else 32)
    if batch < 2:
        parser.error(f"--batch must be at least 2, got {batch}")
    batch_agent = agent_calls(engine, batch // 2, prompt_chars, num_tokens)
    mixed = measure(
        engine,
        [
            batch_agent
            + random_calls(vocab_size, batch - batch // 2, prompt_chars // 4, num_tokens, args.seed + 7 + 1000 * index)
            for index in range(rounds)
        ],
    )
    result = {
        "bench": "speculative",
        "quick": args.quick,
        "model": args.model,
        "backend": engine.backend.name,
        "rounds": rounds,
        "num_speculative_tokens": args.num_speculative_tokens,
        "agent_sessions": agent,
        "random_text": noise,
        "large_batch": mixed,
        "agent_decode_speedup": agent["decode_speedup"],
        "random_text_overhead": noise["overhead"],
        "large_batch_decode_speedup": mixed["decode_speedup"],
        "outputs_identical": agent["outputs_identical"] and noise["outputs_identical"] and mixed["outputs_identical"],
        "machine": machine(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)
    if not result["outputs_identical"]:
        sys.exit("outputs differ with speculation on and off")


if __name__ == "__main__":
    main()
