"""Offline throughput on a mixture-of-experts model: rayturn's engine vs transformers, same weights.

The model is a random Qwen3-MoE (16 experts, top-2 with renormalised
probabilities, per-head q/k norm, every layer sparse) built with transformers
and saved with ``save_pretrained`` into ``--out``. The workload, the two sides
and how they are timed are ``engine_throughput``'s: rayturn with continuous
batching, transformers with one left-padded static batch; each side in its own
process; with ``--rounds`` they alternate and the median time of each is
reported. Both must give the same greedy tokens.

    python bench/moe_throughput.py [--quick] [--backend NAME] [--out DIR]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _common import load_average
from engine_throughput import in_fresh_process, make_workload, run_rayturn, run_transformers, versus_transformers

from rayturn.replay.harness import add_out_argument, emit, machine

VOCAB_SIZE = 300  # the byte tokenizer's ids, so the checkpoint loads with it
PRESET: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "initializer_range": 0.1,
}


def write_checkpoint(
    directory: Path, seed: int, config_class: str = "Qwen3MoeConfig", preset: dict[str, Any] | None = None
) -> Path:
    """A random model of transformers' ``config_class`` (default: the Qwen3-MoE preset) saved as transformers
    saves it, with a byte tokenizer beside it."""
    import torch
    import transformers

    from rayturn.engine.byte_tokenizer import CHATML_TOOLS_TEMPLATE, save_byte_tokenizer

    config = getattr(transformers, config_class)(
        vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=None, pad_token_id=None, **(preset or PRESET)
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    save_byte_tokenizer(directory, CHATML_TOOLS_TEMPLATE)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 shorter requests; finishes within a minute")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend", default=None, help="rayturn's kernel backend (default: what this host gets by default)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="alternating runs of each side (default 3, quick 1)")
    add_out_argument(parser, "moe_throughput")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = str(write_checkpoint(args.out / "model", args.seed))
    if args.quick:
        workload = make_workload(8, (16, 128), (8, 32), args.seed, VOCAB_SIZE)
    else:
        workload = make_workload(32, (16, 512), (16, 128), args.seed, VOCAB_SIZE)

    ours_runs, theirs_runs = [], []
    for _ in range(rounds):
        ours_runs.append(in_fresh_process(run_rayturn, model_dir, workload, args.backend))
        theirs_runs.append(in_fresh_process(run_transformers, model_dir, workload))
    result = {
        "bench": "moe_throughput",
        "quick": args.quick,
        "model": {"architecture": "Qwen3MoeForCausalLM", **PRESET},
        **versus_transformers(workload, ours_runs, theirs_runs),
        "load_average": load_average(),
        "machine": machine(),
    }
    (args.out / "moe_throughput.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


if __name__ == "__main__":
    main()
