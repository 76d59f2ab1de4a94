"""Prefill attention alone on the CPU: the native kernel against PyTorch's flash kernel, same keys, same run.

One layer of ``small``'s attention (8 query heads over 2 kv heads, head dim 64, pages of 16 tokens in a
shuffled order, as the engine's cache holds them) for a few shapes: a chunk of new tokens after a long cached
prefix (the agentic call), and cold prompts. Three sides alternate per repeat:

- ``native``: the ``cpu`` backend's kernel as it runs by default, keys taken in chunks that stay in cache;
- ``native_one_chunk``: the same kernel with every key in one chunk (the schedule before chunking), whose
  output must equal ``native``'s bit for bit (exit status 1 otherwise);
- ``flash``: PyTorch's fused CPU attention over the same keys gathered from their pages, as the backend
  runs it where the native kernel does not (the baseline).

    python bench/prefill_attention.py [--quick] [--cases 4096+200,0+4096] [--repeats N]

A case is ``CONTEXT+QUERY`` tokens. The last line of stdout is one JSON object: per case, each side's median
milliseconds and GFLOP/s (4 * heads * head_dim * query * (context + query / 2) flops), and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _common import load_average

from rayturn.kernels.backend import PrefillBatch
from rayturn.kernels.cpu_backend import CpuBackend
from rayturn.kernels.native import load, unavailable_reason
from rayturn.replay.harness import Progress, add_out_argument, emit, machine

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 2, 64, 16
DEFAULT_CASES = "4096+200,16384+200,1024+64,0+4096"
QUICK_CASES = "4096+200,0+1024"
ONE_CHUNK = 1 << 40  # more keys than any sequence: every key in one chunk


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        context, _, query = item.partition("+")
        if not context.isdigit() or not query.isdigit() or int(query) < 1:
            raise SystemExit(f"--cases: {item!r} is not CONTEXT+QUERY (token counts, QUERY at least 1)")
        cases.append((int(context), int(query)))
    return cases


def make_case(context: int, query: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrefillBatch]:
    """Queries, key and value caches with the sequence on shuffled pages, and its batch description."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = context + query
    pages = (seq_len + PAGE_SIZE - 1) // PAGE_SIZE
    total_pages = pages + 8  # pages of other sequences around it
    keys = torch.randn(total_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=generator)
    values = torch.randn(total_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=generator)
    page_table = torch.randperm(total_pages, generator=generator)[:pages].to(torch.int32)[None].contiguous()
    queries = torch.randn(query, HEADS, HEAD_DIM, generator=generator)
    batch = PrefillBatch(
        page_table=page_table,
        query_start_loc=torch.tensor([0, query], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        context_lens=torch.tensor([context], dtype=torch.int32),
        max_query_len=query,
        max_seq_len=seq_len,
        query_lens_host=(query,),
        seq_lens_host=(seq_len,),
    )
    return queries, keys, values, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"cases {QUICK_CASES}, 5 repeats; within a minute")
    parser.add_argument("--cases", default=None, help=f"comma-separated CONTEXT+QUERY (default {DEFAULT_CASES})")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls of each side (default 20, quick 5)")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "prefill_attention")
    args = parser.parse_args()
    cases = parse_cases(args.cases or (QUICK_CASES if args.quick else DEFAULT_CASES))
    repeats = args.repeats or (5 if args.quick else 20)
    kernels = load()
    if kernels is None:
        sys.exit(f"the native kernels are unavailable here: {unavailable_reason()}")
    native = CpuBackend(kernels, native_prefill=True)
    one_chunk = CpuBackend(kernels, native_prefill=True)
    one_chunk.native_prefill_chunk_keys = ONE_CHUNK
    flash = CpuBackend(kernels, native_prefill=False)
    sides = {"native": native, "native_one_chunk": one_chunk, "flash": flash}
    scale = HEAD_DIM**-0.5
    load_before = load_average()
    progress = Progress("prefill attention", len(cases) * (repeats + 1) * len(sides))
    results, same_bits = [], True
    for context, query in cases:
        queries, keys, values, batch = make_case(context, query, args.seed)
        outputs = {}
        for name, backend in sides.items():  # first calls: the library's pages, PyTorch's thread pool
            outputs[name] = backend.prefill_attention(queries, keys, values, batch, scale)
            progress.advance()
        times: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for repeat in range(repeats):  # the sides alternate, so drift on the host touches each alike; each goes
            for name in names[repeat % 3 :] + names[: repeat % 3]:  # first in turn (the one after flash starts cold)
                backend = sides[name]
                start = time.perf_counter()
                backend.prefill_attention(queries, keys, values, batch, scale)
                times[name].append((time.perf_counter() - start) * 1e3)
                progress.advance()
        case_same = torch.equal(outputs["native"], outputs["native_one_chunk"])
        same_bits &= case_same
        flops = 4 * HEADS * HEAD_DIM * query * (context + query / 2)
        ms = {name: statistics.median(samples) for name, samples in times.items()}
        results.append(
            {
                "context_tokens": context,
                "query_tokens": query,
                "ms": {name: round(value, 3) for name, value in ms.items()},
                "gflops": {name: round(flops / value / 1e6, 1) for name, value in ms.items()},
                "one_chunk_over_native": round(ms["native_one_chunk"] / ms["native"], 3),
                "flash_over_native": round(ms["flash"] / ms["native"], 3),
                "native_equals_one_chunk": case_same,
                "max_abs_diff_vs_flash": float((outputs["native"] - outputs["flash"]).abs().max()),
            }
        )
    result = {
        "bench": "prefill_attention",
        "quick": args.quick,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE},
        "vector_bits": kernels.vector_bits,
        "repeats": repeats,
        "cases": results,
        "native_equals_one_chunk": same_bits,
        "machine": machine(),
        "loadavg_1m_before_after": [load_before, load_average()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_attention.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)
    if not same_bits:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
