"""The engine thread and its asyncio callers: cancellation and bad input never hurt other requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
import torch

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.async_engine import AsyncEngine
from rayturn.engine.page_hash import hash_pages

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


def test_the_facade_describes_the_engine_and_reads_beside_its_thread(server: AsyncEngine) -> None:
    engine: LLMEngine = server.call(lambda engine: engine).result(timeout=5)
    assert (server.backend_name, server.device) == (engine.backend.name, str(engine.device))
    assert (server.model_id, server.page_size) == (engine.model_id, engine.page_size)
    assert server.bytes_per_page == engine.runner.kv_cache[0].nbytes
    assert server.has_store is False and server.store_prefix_pages([b"\0" * 32], "") == 0
    assert server.session_residency("nobody") == (0, 0)
    prompt = list(range(3, 3 + 2 * server.page_size + 1))
    hashes = hash_pages(prompt[: 2 * server.page_size], server.page_size, server.model_id)

    async def main() -> list[int]:
        tokens: list[int] = []
        async for output in server.generate(prompt, PARAMS, "hashed", page_hashes=hashes):
            tokens = list(output.completions[0].token_ids)
        return tokens

    assert len(asyncio.run(main())) == 4
    assert server.prefix_residency(prompt, page_hashes=hashes[:1]) == (hashes, 2)
    assert server.has_unfinished_requests() is False


class CountingConnector:
    """A KVConnector whose store holds the pages it was given; counts lookups."""

    def __init__(self, held: list[bytes]) -> None:
        self.held = held
        self.lookups: list[tuple[list[bytes], str]] = []

    def longest_prefix(self, keys: Sequence[bytes], tenant: str = "") -> int:
        self.lookups.append((list(keys), tenant))
        count = 0
        while count < len(keys) and keys[count] in self.held:
            count += 1
        return count

    def load(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        return [False] * len(keys)

    def save(self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], tenant: str = "") -> list[bool]:
        return [False] * len(keys)


def test_store_prefix_pages_asks_the_engines_store() -> None:
    connector = CountingConnector([b"a" * 32, b"b" * 32])
    server = AsyncEngine(LLMEngine.from_pretrained("tiny", backend="torch", num_pages=16, kv_connector=connector))
    try:
        assert server.has_store is True
        keys = [b"a" * 32, b"b" * 32, b"c" * 32]
        assert server.store_prefix_pages(keys, "alice") == 2
        assert connector.lookups == [(keys, "alice")]
    finally:
        server.shutdown()
