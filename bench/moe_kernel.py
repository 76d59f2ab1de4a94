"""The Triton fused mixture-of-experts MLP against the torch reference, the same inputs, one run.

On a GPU (CUDA or ROCm) it times ``TritonBackend.fused_moe`` and
``TorchBackend.fused_moe`` (route, permute, one matmul per expert, weighted
sum) at the expert shapes of the coding models served most: Qwen3-Coder-30B-A3B
(128 experts of 2048 x 768, top-8) and GPT-OSS-20B (32 experts of 2880 x
2880, top-4, biased, clamped SwiGLU), in bfloat16, from a single decode token
to a 2,048-token prefill chunk. Each case reports both times (median of the
timed repeats after warm-up, the device synchronised around each), the
speedup and the largest difference from the reference run in float32.

Without a GPU the kernels run under the Triton interpreter on tiny shapes:
that checks the harness and the kernels' results, and its times say nothing
of speed (``"interpreted": true`` in the result).

    python bench/moe_kernel.py [--quick] [--repeats N] [--out DIR]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

from _common import load_average  # noqa: E402

from rayturn.kernels import moe  # noqa: E402
from rayturn.kernels.torch_backend import TorchBackend  # noqa: E402
from rayturn.kernels.triton_backend import TritonBackend  # noqa: E402
from rayturn.kernels.triton_moe import kernels_run_on  # noqa: E402
from rayturn.replay.harness import add_out_argument, emit, machine  # noqa: E402

# Largest difference from the float32 reference, relative to the reference's largest value, that still counts
# as the same result: float32 accumulates in another order; 16-bit types round the intermediates.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class Case:
    model: str
    num_tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    gpt_oss: bool = False  # biased experts and the clamped SwiGLU


def cases(quick: bool) -> list[Case]:
    if not ON_GPU:  # the interpreter: shapes that finish in seconds
        return [Case("tiny", n, 32, 32, 4, 2) for n in (1, 17)] + [Case("tiny-gpt-oss", 9, 32, 32, 4, 2, True)]
    tokens = (1, 256) if quick else (1, 32, 256, 2048)
    return [Case("qwen3-coder-30b-a3b", n, 2048, 768, 128, 8) for n in tokens] + [
        Case("gpt-oss-20b", n, 2880, 2880, 32, 4, True) for n in tokens
    ]


def make_inputs(case: Case, dtype: torch.dtype, device: str, seed: int) -> dict[str, Any]:
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    hidden, intermediate, experts = case.hidden, case.intermediate, case.experts
    inputs: dict[str, Any] = {
        "x": randn(case.num_tokens, hidden),
        "router_logits": randn(case.num_tokens, experts) * 2,
        "gate_up": randn(experts, 2 * intermediate, hidden) / math.sqrt(hidden),
        "down": randn(experts, hidden, intermediate) / math.sqrt(intermediate),
        "top_k": case.top_k,
        "renormalize": True,
    }
    if case.gpt_oss:
        inputs["gate_up_bias"] = randn(experts, 2 * intermediate) * 0.5
        inputs["down_bias"] = randn(experts, hidden) * 0.5
        inputs["activation"] = moe.ClampedSwiGLU(alpha=1.702, limit=7.0)
    return inputs


def timed(run: Any, repeats: int, warmup: int) -> tuple[torch.Tensor, float]:
    """The output of ``run()`` and its median time in ms over ``repeats`` runs after ``warmup`` untimed ones."""
    out = run()
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        if ON_GPU:
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if ON_GPU:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return out, statistics.median(times)


def run_case(case: Case, dtype: torch.dtype, device: str, repeats: int, warmup: int) -> dict[str, Any]:
    inputs = make_inputs(case, dtype, device, seed=case.num_tokens)
    triton, torch_reference = TritonBackend(), TorchBackend()
    triton_out, triton_ms = timed(lambda: triton.fused_moe(**inputs), repeats, warmup)
    torch_out, torch_ms = timed(lambda: torch_reference.fused_moe(**inputs), repeats, warmup)
    upcast = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    reference = torch_reference.fused_moe(**upcast)
    scale = max(reference.abs().max().item(), 1e-6)
    triton_error = (triton_out.float() - reference).abs().max().item() / scale
    torch_error = (torch_out.float() - reference).abs().max().item() / scale
    return {
        **asdict(case),
        "dtype": str(dtype).removeprefix("torch."),
        "triton_ms": round(triton_ms, 4),
        "torch_ms": round(torch_ms, 4),
        "speedup": float(f"{torch_ms / triton_ms:.4g}"),  # significant digits: the interpreter's are ~0.001
        "triton_relative_error": triton_error,
        "torch_relative_error": torch_error,
        "close": triton_error <= TOLERANCE[dtype],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats; finishes within a minute")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per side and case (default 20, quick 5)")
    add_out_argument(parser, "moe_kernel")
    args = parser.parse_args()
    device = "cuda" if ON_GPU else "cpu"
    if not kernels_run_on(torch.device(device)):
        raise SystemExit(f"the Triton MoE kernels do not run on {device} here (is Triton installed?)")
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    repeats = (args.repeats or (5 if args.quick else 20)) if ON_GPU else 1
    warmup = 3 if ON_GPU else 0
    results = []
    all_cases = cases(args.quick)
    for index, case in enumerate(all_cases, 1):
        print(f"[{index}/{len(all_cases)}] {case.model}: {case.num_tokens} tokens ...", flush=True)
        result = run_case(case, dtype, device, repeats, warmup)
        print(f"    triton {result['triton_ms']} ms, torch {result['torch_ms']} ms ({result['speedup']}x)", flush=True)
        results.append(result)
    speedups = [r["speedup"] for r in results]
    summary = {
        "bench": "moe_kernel",
        "quick": args.quick,
        "device": torch.cuda.get_device_name() if ON_GPU else "cpu",
        "interpreted": not ON_GPU,
        "repeats": repeats,
        "cases": results,
        "geomean_speedup": round(math.exp(statistics.fmean(math.log(s) for s in speedups)), 3),
        "all_close": all(r["close"] for r in results),
        "load_average": load_average(),
        "machine": machine(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_kernel.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    emit(summary)


if __name__ == "__main__":
    main()
