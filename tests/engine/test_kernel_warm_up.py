"""A serving engine builds its matmul kernels when it starts: prompts of new lengths build none later.

oneDNN builds and keeps a kernel for each row count a packed matmul meets
(``TorchBackend.linear_row_counts``); built while serving, they made a
replica's memory grow with every new prompt length and batch size. Its
verbose log names every kernel built (``cache_miss``) and every one reused.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.async_engine import AsyncEngine
from rayturn.kernels import torch_backend

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packed matmuls need oneDNN")


async def serve(server: AsyncEngine, prompts: list[list[int]]) -> list[int]:
    async def one(request_id: str, prompt: list[int]) -> int:
        count = 0
        async for output in server.generate(prompt, PARAMS, request_id):
            count = len(output.completions[0].token_ids)
        return count

    return await asyncio.gather(*(one(f"r{index}", prompt) for index, prompt in enumerate(prompts)))


def test_prompts_of_new_lengths_build_no_matmul_kernel_after_start(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # tiny's weights are all small: pack them all, as on hosts with wider vectors than AVX2.
    monkeypatch.setattr(torch_backend, "_AVX2_PACK_MIN_ELEMENTS", 0)
    server = AsyncEngine(LLMEngine.from_pretrained("tiny", backend="torch", num_pages=256))
    try:
        rng = random.Random(0)
        # Mixed batches of prompts of lengths never met before: each step's matmuls run at a new row count.
        batches = [[[rng.randint(5, 200) for _ in range(rng.randint(1, 700))] for _ in range(4)] for _ in range(6)]
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            answers = [asyncio.run(serve(server, prompts)) for prompts in batches]
        log = capfd.readouterr().out
    finally:
        server.shutdown()
    assert answers == [[3] * 4] * len(batches)
    assert "create:cache_hit,cpu,inner_product" in log  # the matmuls ran through oneDNN, and its log is on
    assert [line for line in log.splitlines() if "cache_miss" in line] == []
