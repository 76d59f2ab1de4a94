"""Offline throughput: rayturn's engine vs transformers with static batching, same weights.

32 requests (fixed seed) with prompts of 16-512 tokens and outputs of 16-128
tokens on the ``small`` preset, float32, both sides on the device rayturn's
engine picks by default (a GPU where one is present, else the CPU). rayturn runs them with
continuous batching; transformers runs one left-padded batch with
``max_new_tokens`` = the longest output, each output then cut to its own
length (what static batching costs). Both must give the same greedy tokens.
Each side runs in its own process, so peak RSS is its own; with ``--rounds``
the two alternate and the median time of each is reported (this machine's
memory bandwidth drifts between runs).

rayturn uses the kernel backend the host gets by default (``cpu`` on a CPU
with a C compiler: native paged decode attention); ``--backend torch`` runs
the pure-PyTorch reference instead. rayturn builds its per-row-count matmul kernels
first, outside the timing, as a serving engine does when it starts.

``--peer vllm`` adds vLLM (set up by ``bench/peers/setup_vllm.sh``): its
OpenAI server on the same model directory, float32, prefix caching off as
on rayturn's side (the rounds repeat the same prompts), every request sent
at once, in each round after rayturn's, the next round waiting until its
threads stop spinning (``VllmServer.wait_idle``), and the server paused while the
other sides run (``VllmServer.pause``: an idle vLLM server still wakes some
hundreds of times a second on the first core). rayturn is measured as an engine and
vLLM through its server: vLLM's server is its engine (the engine core runs in
a process of its own, fed over a socket), and a rayturn server adds Ray's
replica hops, which this benchmark is not about. The server's start-up is
outside the timing; its greedy tokens must equal rayturn's (exit status 1
otherwise).

    python bench/engine_throughput.py [--quick] [--backend NAME] [--peer vllm]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import load_average, peak_rss_mb
from peers.vllm_server import VllmServer

from rayturn.replay.harness import Progress, add_out_argument, emit, machine


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int, vocab: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def run_rayturn(model: str, workload: Workload, backend: str | None) -> dict[str, Any]:
    from rayturn.engine import LLMEngine, SamplingParams
    from rayturn.engine.warm_up import warm_up_kernels

    engine = LLMEngine.from_pretrained(model, backend=backend, dtype="float32", enable_prefix_caching=False)
    warm_up_kernels(engine)  # what a serving engine does when it starts, outside the timing like vLLM's
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    progress = Progress("rayturn (continuous)", workload.useful_tokens)
    start = time.perf_counter()
    for prompt, p in zip(workload.prompts, params):
        engine.add_request(prompt, p)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
                progress.advance(len(output.token_ids))
    elapsed_s = time.perf_counter() - start
    tokens = [finished[str(i + 1)] for i in range(len(workload.prompts))]  # id 0 was the warm-up
    return {"elapsed_s": elapsed_s, "tokens": tokens, "peak_rss_mb": peak_rss_mb(), "backend": engine.backend.name}


def run_transformers(model_dir: str, workload: Workload) -> dict[str, Any]:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where rayturn's engine runs by default
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    pad_id = 0
    max_prompt = max(len(p) for p in workload.prompts)
    input_ids = torch.full((len(workload.prompts), max_prompt), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(workload.prompts):  # left padding
        input_ids[row, max_prompt - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, max_prompt - len(prompt) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    with torch.no_grad():
        model.generate(input_ids[:1, -3:], max_new_tokens=2, do_sample=False, pad_token_id=pad_id)  # warm-up
        progress = Progress("transformers (static)", 1)
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max(workload.output_lens),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed_s = time.perf_counter() - start
        progress.advance()
    tokens = [out[row, max_prompt : max_prompt + n].tolist() for row, n in enumerate(workload.output_lens)]
    return {"elapsed_s": elapsed_s, "tokens": tokens, "peak_rss_mb": peak_rss_mb()}


def run_vllm(server: VllmServer, workload: Workload) -> dict[str, Any]:
    progress = Progress("vllm (server)", 1)
    tokens, elapsed_s = server.complete_all(workload.prompts, workload.output_lens)
    progress.advance()
    return {"elapsed_s": elapsed_s, "tokens": tokens}


def vllm_figures(workload: Workload, ours_runs: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    vllm_s = statistics.median(r["elapsed_s"] for r in runs)
    ours_s = statistics.median(r["elapsed_s"] for r in ours_runs)
    mismatched = [i for i, (a, b) in enumerate(zip(ours_runs[0]["tokens"], runs[0]["tokens"])) if a != b]
    return {
        "vllm_s": round(vllm_s, 3),
        "vllm_s_each": [round(r["elapsed_s"], 3) for r in runs],
        "vllm_tok_s": round(workload.useful_tokens / vllm_s, 1),
        "throughput_vs_vllm": round(vllm_s / ours_s, 3),
        "vllm_outputs_match": not mismatched,
        "vllm_mismatched_requests": mismatched,
    }


def in_fresh_process(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)`` in a newly spawned process (so the peak RSS it reports is its own alone).

    The worker is let go and exits on its own, never terminated: transformers'
    progress bars (tqdm) create a multiprocessing lock, which only the
    process's exit handlers unlink; a terminated worker (what
    ``multiprocessing.Pool``'s context manager does) skips them, and the
    resource tracker then reports the lock as a leaked semaphore after the
    JSON line.
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(run, *args).result()


def versus_transformers(
    workload: Workload, ours_runs: list[dict[str, Any]], theirs_runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The figures of rayturn's runs against transformers' on ``workload``: median times, tokens per second,
    the speedup, whether the first rounds' greedy tokens match, peak memory."""
    ours, theirs = ours_runs[0], theirs_runs[0]
    mismatched = [i for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])) if a != b]
    ours_s = statistics.median(r["elapsed_s"] for r in ours_runs)
    theirs_s = statistics.median(r["elapsed_s"] for r in theirs_runs)
    return {
        "backend": ours["backend"],
        "requests": len(workload.prompts),
        "useful_output_tokens": workload.useful_tokens,
        "rounds": len(ours_runs),
        "rayturn_s": round(ours_s, 3),
        "hf_s": round(theirs_s, 3),
        "rayturn_s_each": [round(r["elapsed_s"], 3) for r in ours_runs],
        "hf_s_each": [round(r["elapsed_s"], 3) for r in theirs_runs],
        "rayturn_tok_s": round(workload.useful_tokens / ours_s, 1),
        "hf_tok_s": round(workload.useful_tokens / theirs_s, 1),
        "speedup_vs_hf": round(theirs_s / ours_s, 3),
        "outputs_match": not mismatched,
        "mismatched_requests": mismatched,
        "rayturn_peak_rss_mb": round(ours["peak_rss_mb"], 1),
        "hf_peak_rss_mb": round(theirs["peak_rss_mb"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 shorter requests; finishes within a minute")
    parser.add_argument("--model", default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend", default=None, help="rayturn's kernel backend (default: what this host gets by default)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="alternating runs of each side (default 3, quick 1)")
    parser.add_argument("--peer", choices=["vllm"], default=None, help="also run this peer engine, alternating")
    add_out_argument(parser, "engine_throughput")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)

    from rayturn.engine.presets import resolve_model_dir
    from rayturn.engine.tokenizer import Tokenizer

    model_dir = str(resolve_model_dir(args.model))
    vocab = Tokenizer.from_dir(Path(model_dir)).vocab_size
    if args.quick:
        workload = make_workload(8, (16, 128), (8, 32), args.seed, vocab)
    else:
        workload = make_workload(32, (16, 512), (16, 128), args.seed, vocab)

    load_before = load_average()
    ours_runs: list[dict[str, Any]] = []
    theirs_runs: list[dict[str, Any]] = []
    vllm_runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        server = None
        if args.peer == "vllm":
            # Prefix caching off, as on rayturn's side: every round sends the same 32 prompts, and vLLM
            # (caching on as it ships) would serve rounds after the first from its cache.
            server = stack.enter_context(
                VllmServer(model_dir, args.out / "vllm_server.log", extra_args=("--no-enable-prefix-caching",))
            )
            server.complete([1, 2, 3], 2)  # warm-up
            server.wait_idle()
            server.pause()  # until its own requests: the other sides are timed on a quiet host
        for _ in range(rounds):
            ours_runs.append(in_fresh_process(run_rayturn, model_dir, workload, args.backend))
            theirs_runs.append(in_fresh_process(run_transformers, model_dir, workload))
            if server is not None:
                vllm_runs.append(run_vllm(server, workload))
                server.wait_idle()  # its threads spin on after a request: the next timing must not share the cores
                server.pause()
    peer = vllm_figures(workload, ours_runs, vllm_runs) if vllm_runs else {}
    result = {
        "bench": "engine_throughput",
        "quick": args.quick,
        "model": args.model,
        **versus_transformers(workload, ours_runs, theirs_runs),
        "machine": machine(),
        "loadavg_1m_before_after": [load_before, load_average()],
        **peer,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_throughput.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)
    if peer and not peer["vllm_outputs_match"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
