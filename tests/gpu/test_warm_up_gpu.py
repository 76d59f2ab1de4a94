"""After the engine's warm-up, no request compiles a Triton kernel: prompts of new lengths (1 token, a page,
a page and one, many pages, longer than a step's budget), cached prefixes, batches of new sizes and a
mixture-of-experts model at every token count class. Compiles are counted in each kernel's own cache of
compiled variants. Skipped without a GPU."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")
from moe_models import make_moe_checkpoint
from triton.runtime.jit import JITFunction

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.warm_up import warm_up_kernels
from rayturn.kernels import triton_attention, triton_kernels, triton_moe

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def compiled_variants() -> dict[str, set[str]]:
    """Kernel name -> the signatures it has compiled so far in this process (every device)."""
    variants: dict[str, set[str]] = {}
    for module in (triton_kernels, triton_attention, triton_moe):
        for name, kernel in vars(module).items():
            if isinstance(kernel, JITFunction):
                caches = getattr(kernel, "device_caches", None)
                per_device = [cache[0] for cache in caches.values()] if caches is not None else kernel.cache.values()
                variants[name] = {str(key) for cache in per_device for key in cache}
    return variants


def compiled_since(before: dict[str, set[str]]) -> dict[str, list[str]]:
    """What compiled after ``before`` was taken: kernel name -> its new signatures (cut short)."""
    return {
        name: [key[:600] for key in keys - before.get(name, set())]
        for name, keys in compiled_variants().items()
        if keys - before.get(name, set())
    }


def serve_every_shape(engine: LLMEngine, vocab: int) -> None:
    rng = random.Random(0)
    budget = engine.scheduler.config.max_num_batched_tokens
    longest = engine.max_model_len - PARAMS.max_tokens - 40  # room for the second call's extra tokens
    assert budget + 100 <= longest  # a prompt prefilled in more than one chunk
    lengths = [1, 15, 16, 17, 31, 33, 100, 255, 256, 257, budget + 100, longest]
    for length in lengths:  # one at a time, then again (its full pages now cached), then in batches
        prompt = [rng.randrange(vocab) for _ in range(length)]
        engine.generate([prompt], PARAMS)
        engine.generate([prompt + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]], PARAMS)
    for batch_size in (2, 3, 16, 17, 33):
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(batch_size)]
        engine.generate(prompts, PARAMS)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_small_preset_compiles_nothing_after_warm_up(dtype: str) -> None:
    engine = LLMEngine.from_pretrained("small", backend="triton", dtype=dtype, device="cuda", num_pages=1024)
    warm_up_kernels(engine)
    after_warm_up = compiled_variants()
    assert after_warm_up["prefill_attention_kernel"] and after_warm_up["decode_attention_kernel"]
    serve_every_shape(engine, engine.config.vocab_size)
    assert compiled_since(after_warm_up) == {}


def test_a_mixture_of_experts_model_compiles_nothing_after_warm_up(tmp_path: Path) -> None:
    _, path = make_moe_checkpoint("gptoss-e8-top3-window32-gqa4", tmp_path)
    # A step budget under the model's 1,024-token context, and over the 171 tokens at which its 8 experts'
    # kernels take their third tile shape.
    engine: Any = LLMEngine.from_pretrained(
        str(path), backend="triton", dtype="bfloat16", device="cuda", max_num_batched_tokens=256
    )
    warm_up_kernels(engine)
    after_warm_up = compiled_variants()
    assert len(after_warm_up["expert_gate_up_kernel"]) >= 3  # a variant for each tile shape
    serve_every_shape(engine, engine.config.vocab_size)
    assert compiled_since(after_warm_up) == {}
