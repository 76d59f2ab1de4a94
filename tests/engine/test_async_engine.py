"""The engine thread and its asyncio callers: cancellation and bad input never hurt other requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.async_engine import AsyncEngine

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server() -> AsyncEngine:
    return AsyncEngine(LLMEngine.from_pretrained("tiny", backend="torch", num_pages=64))


async def collect(server: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for output in server.generate(prompt, PARAMS, request_id):
        tokens = list(output.completions[0].token_ids)
    return tokens


def test_a_caller_cancelled_before_admission_leaves_the_engine_serving(server: AsyncEngine) -> None:
    long_params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def bystander() -> int:
        count = 0
        async for output in server.generate([1, 2, 3, 4], long_params, "bystander"):
            count = len(output.completions[0].token_ids)
        return count

    async def main() -> tuple[int, list[int]]:
        running = asyncio.create_task(bystander())
        await asyncio.sleep(0.05)  # admitted and decoding
        server.call(lambda engine: time.sleep(0.3))  # the engine thread is busy: the next admission must wait
        waiting = asyncio.create_task(collect(server, "cancelled", [5, 6, 7, 8]))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return await running, await collect(server, "after", [5, 6, 7, 8])

    bystander_tokens, after = asyncio.run(main())
    assert bystander_tokens == 200 and len(after) == 4
    assert server.healthy
    assert server.call(lambda engine: engine.has_unfinished_requests()).result(timeout=5) is False


def test_a_duplicate_request_id_fails_alone(server: AsyncEngine) -> None:
    async def main() -> tuple[list[int], str]:
        server.call(lambda engine: time.sleep(0.2))  # both admissions queue behind this
        first = asyncio.create_task(collect(server, "same-id", [9, 10, 11, 12]))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="already in use") as err:
            await collect(server, "same-id", [13, 14, 15, 16])
        return await first, str(err.value)

    tokens, _ = asyncio.run(main())
    assert len(tokens) == 4  # the first request kept its listener and finished
