"""Parallel sampling (Best-of-N, Self-Refine): one request with ``n`` completions against ``n`` separate requests.

A request with ``n`` > 1 computes its prompt once and forks the pages for the
``n`` decodes (copy-on-write: the completions share every prompt page, each
copies only the tail page it writes). The baseline, in the same run, is what a
client without ``n`` sends: ``n`` separate requests for the same prompt at
once, seeded ``seed + i`` (completion ``i`` of the forked request draws what
request ``i`` draws alone, so their outputs must be identical: checked).
The baseline runs with prefix caching on (the engine's default, so the
separate requests share the pages of whichever computed the prompt first) and
again with it off (what an engine without a prefix cache pays).

Each mode runs on its own engine (the ``--model`` preset's same weights), with
a fresh random prompt per repeat so every mode starts cold. Reported per mode:
wall time, peak KV pages in use, prompt tokens computed; and the ratios of the
forked request to each baseline.

    python bench/parallel_sampling.py [--quick] [--n 8] [--prompt-tokens 2048] [--out DIR]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from dataclasses import dataclass

from _common import peak_rss_mb

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.replay.harness import Progress, add_out_argument, emit, machine


@dataclass
class Run:
    wall_s: float
    peak_pages: int
    computed_prompt_tokens: int
    outputs: list[list[int]]


def run(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> Run:
    """Add every request at once and step the engine until all finish, sampling the pages in use each step."""
    pool = engine.kv_cache.pool
    start = time.perf_counter()
    ids = [engine.add_request(prompt, p) for p in params]
    finished = {}
    peak_pages = 0
    while len(finished) < len(ids):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        peak_pages = max(peak_pages, pool.num_pages - pool.num_free_pages)
    wall_s = time.perf_counter() - start
    outs = [finished[request_id] for request_id in ids]
    computed = sum(len(out.prompt_token_ids) - out.num_cached_prompt_tokens for out in outs)
    return Run(wall_s, peak_pages, computed, [c.token_ids for out in outs for c in out.completions])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 512-token prompt, 16 tokens, one repeat")
    parser.add_argument("--model", default="small")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 2048 (quick 512)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default 64, quick 16)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "parallel_sampling")
    args = parser.parse_args()
    prompt_tokens = args.prompt_tokens or (512 if args.quick else 2048)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)

    engines = {
        "forked": LLMEngine.from_pretrained(args.model, backend="torch", dtype="float32"),
        "separate": LLMEngine.from_pretrained(args.model, backend="torch", dtype="float32"),
        "separate_no_prefix_cache": LLMEngine.from_pretrained(
            args.model, backend="torch", dtype="float32", enable_prefix_caching=False
        ),
    }
    vocab = engines["forked"].config.vocab_size
    rng = random.Random(args.seed)
    sample = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=args.seed, ignore_eos=True)
    forked_params = [dataclasses.replace(sample, n=args.n)]
    separate_params = [dataclasses.replace(sample, seed=args.seed + i) for i in range(args.n)]
    for engine in engines.values():
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    runs: dict[str, list[Run]] = {mode: [] for mode in engines}
    progress = Progress("parallel sampling", repeats * len(engines))
    for _ in range(repeats):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for mode, engine in engines.items():
            runs[mode].append(run(engine, prompt, forked_params if mode == "forked" else separate_params))
            progress.advance()
        outputs = {mode: mode_runs[-1].outputs for mode, mode_runs in runs.items()}
        if not outputs["forked"] == outputs["separate"] == outputs["separate_no_prefix_cache"]:
            raise SystemExit("the forked completions differ from the separately seeded requests")

    def summary(mode: str) -> dict[str, float]:
        mode_runs = runs[mode]
        return {
            "wall_s": round(statistics.median(r.wall_s for r in mode_runs), 3),
            "peak_pages": max(r.peak_pages for r in mode_runs),
            "computed_prompt_tokens": mode_runs[-1].computed_prompt_tokens,
        }

    results = {mode: summary(mode) for mode in engines}
    forked = results["forked"]
    result = {
        "bench": "parallel_sampling",
        "quick": args.quick,
        "model": args.model,
        "n": args.n,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "page_size": engines["forked"].page_size,
        **results,
        "outputs_identical": True,
        "pages_ratio_vs_separate": round(forked["peak_pages"] / results["separate"]["peak_pages"], 3),
        "time_ratio_vs_separate": round(forked["wall_s"] / results["separate"]["wall_s"], 3),
        "pages_ratio_vs_no_prefix_cache": round(
            forked["peak_pages"] / results["separate_no_prefix_cache"]["peak_pages"], 3
        ),
        "time_ratio_vs_no_prefix_cache": round(forked["wall_s"] / results["separate_no_prefix_cache"]["wall_s"], 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "machine": machine(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parallel_sampling.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


if __name__ == "__main__":
    main()
