"""Time to first token of a long prompt cold, then with 200 new tokens after it.

The agentic pattern: a 4,096-token prompt is prefilled cold; the next call
sends the same prompt plus 200 new tokens. With prefix caching only the new
tokens are computed. The baseline, in the same run, is the extended prompt
with prefix caching off (what an engine without it pays every call).
rayturn runs the kernel backend the host gets by default (``--backend`` to
choose), its matmul kernels built first as a serving engine's are.

``--peer vllm`` adds vLLM (set up by ``bench/peers/setup_vllm.sh``; its
OpenAI server on the same model directory, float32, prefix caching on as it
ships): each repeat's cold and extended prompts are sent to it right after
rayturn's, and its first tokens must equal rayturn's (exit status 1
otherwise). vLLM's TTFT is timed at the client, so it includes one local
HTTP round trip (a few milliseconds) that rayturn's in-process engine does not
pay; its start-up is outside the timing. vLLM's OpenMP threads spin on for
about a second after each request, so the next repeat waits until its
processes are idle (``VllmServer.wait_idle``) rather than share the cores,
and the server is paused while rayturn is timed (``VllmServer.pause``: an
idle vLLM server still wakes hundreds of times a second on the first core).

    python bench/prefix_ttft.py [--quick] [--backend NAME] [--peer vllm]

The last line of stdout is one JSON object; ``cached_over_cold_ttft`` is the
median over repeats (target <= 0.15).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time

from _common import load_average, peak_rss_mb
from peers.vllm_server import VllmServer

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.presets import resolve_model_dir
from rayturn.engine.warm_up import warm_up_kernels
from rayturn.replay.harness import Progress, add_out_argument, emit, machine


def ttft_s(engine: LLMEngine, prompt: list[int]) -> float:
    return timed_first_token(engine, prompt)[0]


def timed_first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - start, out.token_ids[0]


def vllm_figures(
    cold: list[float], cached: list[float], runs: list[tuple[float, float]], match: bool
) -> dict[str, object]:
    vllm_cold = statistics.median(c for c, _ in runs)
    vllm_cached = statistics.median(k for _, k in runs)
    return {
        "vllm_cold_ttft_s": round(vllm_cold, 4),
        "vllm_cached_ttft_s": round(vllm_cached, 4),
        "vllm_cold_ttft_s_each": [round(c, 4) for c, _ in runs],
        "vllm_cached_ttft_s_each": [round(k, 4) for _, k in runs],
        "cold_ttft_vs_vllm": round(statistics.median(cold) / vllm_cold, 3),
        "cached_ttft_vs_vllm": round(statistics.median(cached) / vllm_cached, 3),
        "vllm_first_tokens_match": match,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat instead of three")
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend", default=None, help="rayturn's kernel backend (default: what this host gets by default)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="prompts timed (default 3, quick 1)")
    parser.add_argument("--peer", choices=["vllm"], default=None, help="also time this peer engine, alternating")
    add_out_argument(parser, "prefix_ttft")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    load_before = load_average()
    with contextlib.ExitStack() as stack:
        server = None
        if args.peer == "vllm":
            server = stack.enter_context(VllmServer(str(resolve_model_dir(args.model)), args.out / "vllm_server.log"))
            server.complete([1, 2, 3], 1)  # warm-up
            server.wait_idle()
            server.pause()  # until its own requests: rayturn is timed on a quiet host

        cached_engine = LLMEngine.from_pretrained(args.model, backend=args.backend, dtype="float32")
        plain_engine = LLMEngine.from_pretrained(
            args.model, backend=args.backend, dtype="float32", enable_prefix_caching=False
        )
        vocab = cached_engine.config.vocab_size
        rng = random.Random(args.seed)
        for engine in (cached_engine, plain_engine):
            warm_up_kernels(engine)  # what a serving engine does when it starts
            ttft_s(engine, [1, 2, 3])  # warm-up
        cold, cached, uncached, cached_tokens = [], [], [], []
        vllm_runs: list[tuple[float, float]] = []
        first_tokens_match = True
        progress = Progress("prefix TTFT", repeats)
        for _ in range(repeats):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
            extended = prompt + [rng.randrange(vocab) for _ in range(args.new_tokens)]
            cold_s, cold_token = timed_first_token(cached_engine, prompt)
            cold.append(cold_s)
            start = time.perf_counter()
            (out,) = cached_engine.generate([extended], SamplingParams(max_tokens=1, temperature=0.0))
            cached.append(time.perf_counter() - start)
            cached_tokens.append(out.num_cached_prompt_tokens)
            uncached.append(ttft_s(plain_engine, extended))
            if server is not None:
                peer_cold, peer_cached = server.complete(prompt, 1), server.complete(extended, 1)
                server.wait_idle()  # its threads spin on after a request: the next timing must not share the cores
                server.pause()
                vllm_runs.append((peer_cold.elapsed_s, peer_cached.elapsed_s))
                first_tokens_match &= peer_cold.token_ids == [cold_token] and peer_cached.token_ids == out.token_ids
            progress.advance()
    ratios = [c / k for c, k in zip(cached, cold)]
    peer = vllm_figures(cold, cached, vllm_runs, first_tokens_match) if vllm_runs else {}
    result = {
        "bench": "prefix_ttft",
        "quick": args.quick,
        "model": args.model,
        "backend": cached_engine.backend.name,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "cold_ttft_s": round(statistics.median(cold), 4),
        "cached_ttft_s": round(statistics.median(cached), 4),
        "cold_ttft_s_each": [round(c, 4) for c in cold],
        "cached_ttft_s_each": [round(k, 4) for k in cached],
        "no_prefix_cache_ttft_s": round(statistics.median(uncached), 4),
        "cached_prompt_tokens": cached_tokens[0],
        "cached_over_cold_ttft": round(statistics.median(ratios), 4),
        "speedup_vs_no_prefix_cache": round(statistics.median(uncached) / statistics.median(cached), 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "machine": machine(),
        "loadavg_1m_before_after": [load_before, load_average()],
        **peer,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_ttft.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)
    if peer and not first_tokens_match:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
