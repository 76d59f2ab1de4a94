"""Sliding-window layers kept for their window only, against the same layers kept in every page: one budget.

The model is a random GPT-OSS (alternating sliding-window and full attention
layers, window 128, sinks, 8 experts top-2) saved with ``save_pretrained`` into
``--out``. Both engines get the same KV memory budget, sized so that the one
keeping every layer in its pages holds about a quarter of the workload's
sequences at full length; the other keeps the sliding layers in window slots
(``engine/window_slots.py``) and spends the rest of the budget on pages of the
full layers. Both run the same long prompts at once (greedy), alternating
when ``--rounds`` > 1; their tokens must be identical. Reported per side:
tokens/s, the most sequences running in one step, the context tokens the
budget holds; and the ratios windowed / whole.

    python bench/window_kv.py [--quick] [--rounds N] [--backend NAME] [--out DIR]

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

from _common import load_average
from moe_throughput import VOCAB_SIZE, write_checkpoint

from rayturn.replay.harness import add_out_argument, emit, machine

PAGE_SIZE = 16
PRESET: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 131072,  # its YaRN default: 32x an original 4096
    "initializer_range": 0.1,
}


def run_side(
    model_dir: Path, windowed: bool, sizes: dict[str, int], prompts: list[list[int]], args: Any
) -> dict[str, Any]:
    """One engine on the budget: its tokens, time, most sequences running at once, and context capacity."""
    from rayturn.engine import LLMEngine, SamplingParams
    from rayturn.engine.kv_budget import default_window_slots

    num_seqs, budget = len(prompts), sizes["budget"]
    full_bytes, slot_bytes, page_bytes = sizes["full_bytes"], sizes["slot_bytes"], sizes["page_bytes"]
    if windowed:  # once over: a window and a chunk for every sequence
        slots = default_window_slots(PRESET["sliding_window"], PAGE_SIZE, num_seqs, args.max_batched) // 2
        num_pages = (budget - slots * slot_bytes) // full_bytes
    else:
        slots, num_pages = 0, budget // page_bytes
    engine = LLMEngine.from_pretrained(
        str(model_dir),
        backend=args.backend,
        page_size=PAGE_SIZE,
        num_pages=num_pages,
        num_window_slots=slots,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=args.max_batched,
    )
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finished: dict[str, Any] = {}
    most_running = 0
    while len(finished) < len(ids):
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
        most_running = max(most_running, len(engine.scheduler.running))
    seconds = time.perf_counter() - started
    return {
        "tokens": [list(finished[i].token_ids) for i in ids],
        "seconds": seconds,
        "output_tokens_per_s": num_seqs * args.output_tokens / seconds,
        "most_running": most_running,
        "num_pages": num_pages,
        "num_window_slots": slots,
        "kv_bytes": num_pages * (full_bytes if windowed else page_bytes) + slots * slot_bytes,
        "context_tokens": num_pages * PAGE_SIZE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 prompts of 1024 tokens; finishes within a minute")
    parser.add_argument("--rounds", type=int, default=None, help="alternating runs of each side (default 3, quick 1)")
    parser.add_argument("--backend", default=None, help="rayturn's kernel backend (default: this host's)")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "window_kv")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    num_seqs, prompt_tokens = (8, 1024) if args.quick else (16, 4096)
    args.output_tokens = 16 if args.quick else 64
    args.max_batched = 256
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"writing the random GPT-OSS checkpoint to {args.out / 'model'} ...", flush=True)
    model_dir = write_checkpoint(args.out / "model", args.seed, "GptOssConfig", PRESET)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(prompt_tokens)] for _ in range(num_seqs)]

    from rayturn.engine import LLMEngine
    from rayturn.engine.kv_budget import layer_bytes

    probe = LLMEngine.from_pretrained(str(model_dir), backend=args.backend, page_size=PAGE_SIZE, num_pages=1)
    full_bytes, slot_bytes = layer_bytes(probe.model, PAGE_SIZE, probe.dtype)
    seq_pages = -(-(prompt_tokens + args.output_tokens) // PAGE_SIZE)
    budget = probe.bytes_per_page * seq_pages * num_seqs // 4  # the whole-page engine holds a quarter at once
    sizes = {"budget": budget, "page_bytes": probe.bytes_per_page, "full_bytes": full_bytes, "slot_bytes": slot_bytes}
    runs: dict[str, list[dict[str, Any]]] = {"whole": [], "windowed": []}
    for round_index in range(rounds):
        for side in ("whole", "windowed"):
            print(f"round {round_index + 1}/{rounds}: {side} ...", flush=True)
            runs[side].append(run_side(model_dir, side == "windowed", sizes, prompts, args))
    identical = all(run["tokens"] == runs["whole"][0]["tokens"] for side in runs.values() for run in side)
    summary = {}
    for side, side_runs in runs.items():
        last = side_runs[-1]
        summary[side] = {
            "output_tokens_per_s": round(statistics.median(r["output_tokens_per_s"] for r in side_runs), 1),
            "most_running": last["most_running"],
            "num_pages": last["num_pages"],
            "num_window_slots": last["num_window_slots"],
            "kv_bytes": last["kv_bytes"],
            "context_tokens": last["context_tokens"],
        }
    result = {
        "bench": "window_kv",
        "quick": args.quick,
        "model": {"architecture": "GptOssForCausalLM", **PRESET},
        "workload": {"sequences": num_seqs, "prompt_tokens": prompt_tokens, "output_tokens": args.output_tokens},
        "budget_bytes": budget,
        "rounds": rounds,
        **summary,
        "throughput_ratio": round(
            summary["windowed"]["output_tokens_per_s"] / summary["whole"]["output_tokens_per_s"], 3
        ),
        "context_ratio": round(summary["windowed"]["context_tokens"] / summary["whole"]["context_tokens"], 3),
        "identical_outputs": identical,
        "load_average": load_average(),
        "machine": machine(),
    }
    (args.out / "window_kv.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


if __name__ == "__main__":
    main()
