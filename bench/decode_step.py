"""Time of one decode step: rayturn's engine against transformers' per-token step, same weights, same run.

For each batch size, that many requests of a 64-token prompt (fixed seed) decode together, greedy. A
step's time is the decode loop's wall time over its steps, the prefill step left out; the median of
``--repeats`` runs. rayturn runs as it starts by default (on a GPU, decode steps replayed from the CUDA
graphs its warm-up records: ``engine/decode_graphs.py``) and, where it recorded graphs, again with
``enforce_eager`` (every step launched kernel by kernel), so the graphs' gain is in the same run. The
baseline: transformers' model called a token at a time over its KV cache (``past_key_values``), greedy,
as ``generate`` does less its per-token bookkeeping, batch not padded; it waits on the device only at the
end, where rayturn's engine reads each step's tokens back. Everything runs on the device rayturn's
engine picks (a GPU where one is present). The graph engine's greedy tokens must equal the eager
engine's (exit status 1 otherwise); whether rayturn's equal transformers' is reported beside them.

    python bench/decode_step.py [--quick] [--model small] [--backend NAME] [--batches 1,8,32]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import load_average

from rayturn.replay.harness import Progress, add_out_argument, emit, machine

PROMPT_TOKENS = 64


def prompts_of(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed + batch)
    return [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rayturn_step(engine: Any, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """Seconds per decode step of ``prompts`` decoding ``steps`` tokens after their first, and their tokens."""
    from rayturn.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    done: dict[str, list[int]] = {}

    def step() -> None:
        done.update({out.request_id: list(out.token_ids) for out in engine.step() if out.finished})

    step()  # the prefills (one step: the default budget holds 32 prompts of 64 tokens)
    synchronize(engine.device)
    start, num_steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        step()
        num_steps += 1
    elapsed_s = time.perf_counter() - start
    if num_steps != steps:
        raise RuntimeError(f"expected {steps} decode steps after the prefill, ran {num_steps}")
    return elapsed_s / num_steps, [done[request_id] for request_id in ids]


def transformers_step(model: Any, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """The same for transformers: its prefill, then ``steps`` one-token forwards over its KV cache, greedy."""
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        past, last = out.past_key_values, out.logits[:, -1].argmax(dim=-1, keepdim=True)
        chosen = [last]
        synchronize(model.device)
        start = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(last)], dim=1)
            out = model(last, attention_mask=mask, past_key_values=past, use_cache=True)
            past, last = out.past_key_values, out.logits[:, -1].argmax(dim=-1, keepdim=True)
            chosen.append(last)
        synchronize(model.device)
        elapsed_s = time.perf_counter() - start
    return elapsed_s / steps, torch.cat(chosen, dim=1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, 8 steps, one run; within a minute")
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--backend", default=None, help="rayturn's kernel backend (default: the host's default)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32; quick 1,8)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed (default 32, quick 8)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each, median kept (default 3, quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "decode_step")
    args = parser.parse_args()
    batches = [int(b) for b in (args.batches or ("1,8" if args.quick else "1,8,32")).split(",")]
    steps = args.steps or (8 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)

    import transformers

    from rayturn.engine import LLMEngine
    from rayturn.engine.presets import resolve_model_dir
    from rayturn.engine.warm_up import warm_up_kernels

    model_dir = resolve_model_dir(args.model)
    load_before = load_average()

    def started(enforce_eager: bool) -> Any:
        engine = LLMEngine.from_pretrained(
            args.model,
            backend=args.backend,
            dtype=args.dtype,
            enable_prefix_caching=False,
            max_num_seqs=max(batches),
            enforce_eager=enforce_eager,
        )
        warm_up_kernels(engine)  # what a serving engine does at start (and where it records its graphs)
        return engine

    engine = started(enforce_eager=False)
    graphs = engine.runner.decode_graphs is not None
    eager = started(enforce_eager=True) if graphs else None
    hf = transformers.AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=getattr(torch, args.dtype))
    hf = hf.to(engine.device).eval()
    vocab = engine.config.vocab_size
    rayturn_step(engine, prompts_of(1, vocab, args.seed + 99), 2)  # first-call costs (allocator, caches)
    if eager is not None:
        rayturn_step(eager, prompts_of(1, vocab, args.seed + 99), 2)
    transformers_step(hf, prompts_of(1, vocab, args.seed + 99), 2)

    sides = ["rayturn", *(["rayturn_eager"] if eager is not None else []), "hf"]
    progress = Progress("decode steps", len(batches) * repeats * len(sides))
    times: dict[str, dict[int, list[float]]] = {side: {b: [] for b in batches} for side in sides}
    tokens: dict[str, dict[int, list[list[int]]]] = {side: {} for side in sides}
    for batch in batches:
        prompts = prompts_of(batch, vocab, args.seed)
        for _ in range(repeats):  # the sides alternate, so drift on the host touches each alike
            for side in sides:
                if side == "hf":
                    seconds, out = transformers_step(hf, prompts, steps)
                else:
                    seconds, out = rayturn_step(engine if side == "rayturn" else eager, prompts, steps)
                times[side][batch].append(seconds * 1e3)
                tokens[side][batch] = out
                progress.advance()

    def medians(side: str) -> dict[str, float]:
        return {str(b): round(statistics.median(times[side][b]), 3) for b in batches}

    ours, theirs = medians("rayturn"), medians("hf")
    eager_ms = medians("rayturn_eager") if eager is not None else None
    graphs_match = eager is None or all(tokens["rayturn"][b] == tokens["rayturn_eager"][b] for b in batches)
    result = {
        "bench": "decode_step",
        "quick": args.quick,
        "model": args.model,
        "dtype": args.dtype,
        "backend": engine.backend.name,
        "device": str(engine.device),
        "graphs": graphs,
        "graph_sizes": engine.runner.decode_graphs.sizes if graphs else [],
        "batches": batches,
        "steps": steps,
        "repeats": repeats,
        "rayturn_ms": ours,
        "rayturn_eager_ms": eager_ms,
        "hf_ms": theirs,
        "speedup_vs_hf": {b: round(theirs[b] / ours[b], 3) for b in ours},
        "graphs_speedup": {b: round(eager_ms[b] / ours[b], 3) for b in ours} if eager_ms else None,
        "graph_outputs_match_eager": graphs_match,
        "outputs_match_hf": all(tokens["rayturn"][b] == tokens["hf"][b] for b in batches),
        "machine": machine(),
        "loadavg_1m_before_after": [load_before, load_average()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_step.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)
    if not graphs_match:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
