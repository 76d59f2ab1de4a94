"""Time to first token of a long prompt cold, then with 200 new tokens after it.

The agentic pattern: a 4,096-token prompt is prefilled cold; the next call
sends the same prompt plus 200 new tokens. With prefix caching only the new
tokens are computed. The baseline, in the same run, is the extended prompt
with prefix caching off (what an engine without it pays every call).

    python bench/prefix_ttft.py [--quick]

The last line of stdout is one JSON object; ``cached_over_cold_ttft`` is the
median over repeats (target <= 0.15).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from _common import peak_rss_mb

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.replay.harness import Progress, emit, machine


def ttft_s(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat instead of three")
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    repeats = 1 if args.quick else 3

    cached_engine = LLMEngine.from_pretrained(args.model, backend="torch", dtype="float32")
    plain_engine = LLMEngine.from_pretrained(args.model, backend="torch", dtype="float32", enable_prefix_caching=False)
    vocab = cached_engine.config.vocab_size
    rng = random.Random(args.seed)
    for engine in (cached_engine, plain_engine):
        ttft_s(engine, [1, 2, 3])  # warm-up
    cold, cached, uncached, cached_tokens = [], [], [], []
    progress = Progress("prefix TTFT", repeats)
    for _ in range(repeats):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        extended = prompt + [rng.randrange(vocab) for _ in range(args.new_tokens)]
        cold.append(ttft_s(cached_engine, prompt))
        start = time.perf_counter()
        (out,) = cached_engine.generate([extended], SamplingParams(max_tokens=1, temperature=0.0))
        cached.append(time.perf_counter() - start)
        cached_tokens.append(out.num_cached_prompt_tokens)
        uncached.append(ttft_s(plain_engine, extended))
        progress.advance()
    ratios = [c / k for c, k in zip(cached, cold)]
    emit(
        {
            "bench": "prefix_ttft",
            "quick": args.quick,
            "model": args.model,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "cold_ttft_s": round(statistics.median(cold), 4),
            "cached_ttft_s": round(statistics.median(cached), 4),
            "no_prefix_cache_ttft_s": round(statistics.median(uncached), 4),
            "cached_prompt_tokens": cached_tokens[0],
            "cached_over_cold_ttft": round(statistics.median(ratios), 4),
            "speedup_vs_no_prefix_cache": round(statistics.median(uncached) / statistics.median(cached), 2),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
