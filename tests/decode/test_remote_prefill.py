"""Where a decode replica's long prompts are computed (``rayturn.decode.remote_prefill``): the prefill pool while it
is no busier than the replica, else the replica; a full queue is a moment's state, a failure keeps the pool out for
a while, and a remote prefill's time limit counts the tokens queued ahead of it. The pool is a double whose calls
wait until the test answers them; the last test runs a decode replica's real engine (``tiny``) on a burst."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from rayturn.decode import remote_prefill
from rayturn.decode.remote_prefill import PREFILL_BACKOFF_S, RemotePrefill
from rayturn.decode.server import DecodeServer
from rayturn.engine import LLMEngine, SamplingParams
from rayturn.messages import Call, PrefillAnswer

ANSWER = PrefillAnswer(token_ids=(5,), logprobs=None, cached_tokens=0, loaded_tokens=0)
PROMPT = (1, 2, 3)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class Pool:
    """A prefill pool's handle: each call waits until ``answer`` (or ``fail``) ends it, or raises ``refuse``."""

    def __init__(self, refuse: Exception | None = None, delay_s: float | None = None) -> None:
        self.refuse = refuse
        self.delay_s = delay_s
        self.calls: list[str] = []
        self.pending: list[asyncio.Future[PrefillAnswer]] = []

    @property
    def prefill(self) -> Pool:
        return self

    def remote(self, call: Call) -> Any:
        self.calls.append(call.request_id)
        return self._answer()

    async def _answer(self) -> PrefillAnswer:
        if self.refuse is not None:
            raise self.refuse
        if self.delay_s is not None:
            await asyncio.sleep(self.delay_s)
            return ANSWER
        future: asyncio.Future[PrefillAnswer] = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        return await future


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def call(request_id: str) -> Call:
    return Call(request_id, PROMPT, GREEDY)


def test_the_pool_takes_long_prompts_while_it_is_no_busier_than_the_replica() -> None:
    async def run() -> None:
        pool, counters = Pool(), {}
        remote = RemotePrefill(pool, counters)
        first = asyncio.ensure_future(remote.prefill(call("a"), 1000))
        await asyncio.sleep(0.01)  # the calls reach the pool
        assert remote.remote_tokens == 1000 and pool.calls == ["a"]
        # The pool holds 1,000 tokens of this replica's, the replica none: the next long prompt is computed here.
        assert await remote.prefill(call("b"), 800) is None
        done_b = remote.started_here(800)
        assert (remote.local_tokens, counters["pool_busy"], pool.calls) == (800, 1, ["a"])
        assert await remote.prefill(call("c"), 300) is None  # 1,000 waiting there against 800 here
        done_c = remote.started_here(300)
        # 1,000 against 1,100: the pool again.
        fourth = asyncio.ensure_future(remote.prefill(call("d"), 500))
        await asyncio.sleep(0.01)  # the calls reach the pool
        assert pool.calls == ["a", "d"] and remote.remote_tokens == 1500
        for future in pool.pending:
            future.set_result(ANSWER)
        assert await first is ANSWER and await fourth is ANSWER
        done_b()
        done_b()  # once however often it is called
        done_c()
        assert (remote.remote_tokens, remote.local_tokens) == (0, 0)
        assert (counters["disaggregated"], counters["pool_busy"], counters["failed_prefill"]) == (2, 2, 0)

    asyncio.run(run())


def test_without_balance_the_pool_gets_every_long_prompt() -> None:
    async def run() -> None:
        pool = Pool()
        remote = RemotePrefill(pool, {}, balance=False)
        waiting = [asyncio.ensure_future(remote.prefill(call(name), 1000)) for name in "abc"]
        await asyncio.sleep(0.01)  # the calls reach the pool
        assert pool.calls == ["a", "b", "c"] and remote.remote_tokens == 3000
        for future in pool.pending:
            future.set_result(ANSWER)
        assert await asyncio.gather(*waiting) == [ANSWER] * 3

    asyncio.run(run())


def test_a_full_queue_sends_the_prompt_here_and_the_next_to_the_pool_again() -> None:
    async def run() -> None:
        pool, counters = Pool(refuse=BackPressureError(num_queued_requests=4, max_queued_requests=4)), {}
        remote = RemotePrefill(pool, counters)
        assert await remote.prefill(call("a"), 1000) is None
        assert remote.open and counters["pool_full"] == 1 and counters["failed_prefill"] == 0
        assert await remote.prefill(call("b"), 1000) is None and pool.calls == ["a", "b"]
        assert remote.remote_tokens == 0

    asyncio.run(run())


def test_a_failing_pool_is_left_alone_for_the_backoff() -> None:
    async def run() -> None:
        clock = Clock()
        pool, counters = Pool(refuse=ActorDiedError()), {}
        remote = RemotePrefill(pool, counters, clock=clock)
        assert await remote.prefill(call("a"), 1000) is None
        assert not remote.open and counters["failed_prefill"] == 1 and remote.remote_tokens == 0
        clock.now += PREFILL_BACKOFF_S
        assert remote.open

    asyncio.run(run())


def test_the_time_limit_counts_the_tokens_queued_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit of 0.05 s plus 1 ms per token: alone, 100 tokens have 0.15 s (a 0.25 s answer is too late); behind
    another call's 200 they have 0.35 s (it is in time)."""
    monkeypatch.setattr(remote_prefill, "PREFILL_TIMEOUT_S", 0.05)
    monkeypatch.setattr(remote_prefill, "PREFILL_TIMEOUT_S_PER_TOKEN", 0.001)

    async def run() -> None:
        alone = RemotePrefill(Pool(delay_s=0.25), {})
        assert await alone.prefill(call("a"), 100) is None and alone.counters["failed_prefill"] == 1

        pool = Pool(delay_s=0.25)
        queued = RemotePrefill(pool, {}, balance=False)
        queued.remote_tokens = 200  # another call's, ahead of this one
        assert await queued.prefill(call("b"), 100) is ANSWER

    asyncio.run(run())


def test_the_time_limit_grows_with_what_long_prefills_took_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow host: a long prompt prefilled here took 1 s for its 100 tokens (10 ms each), so a remote prefill of
    100 tokens may take 0.05 s plus three times 10 ms per token (a 0.25 s answer is in time, where the fixed 1 ms
    per token alone would have given up at 0.15 s). A prefill here that ends without a token teaches nothing."""
    monkeypatch.setattr(remote_prefill, "PREFILL_TIMEOUT_S", 0.05)
    monkeypatch.setattr(remote_prefill, "PREFILL_TIMEOUT_S_PER_TOKEN", 0.001)

    async def run() -> None:
        clock = Clock()
        remote = RemotePrefill(Pool(delay_s=0.25), {}, clock=clock)
        cancelled = remote.started_here(100)
        clock.now += 50.0
        cancelled(False)
        assert remote.seconds_per_token == 0.0 and remote.local_tokens == 0
        done = remote.started_here(100)
        clock.now += 1.0
        done()
        assert remote.seconds_per_token == pytest.approx(0.01)
        assert await remote.prefill(call("a"), 100) is ANSWER

    asyncio.run(run())


class SilentPool(Pool):
    """Never answers: a remote prefill ends only at its time limit."""

    async def _answer(self) -> PrefillAnswer:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def reference() -> list[int]:
    prompt = list(range(3, 83))
    return LLMEngine.from_pretrained("tiny", dtype="float32").generate([prompt], GREEDY)[0].token_ids


@pytest.fixture
def replica() -> Iterator[DecodeServer]:
    server = DecodeServer("tiny", {"dtype": "float32"}, None, SilentPool(), 32)
    try:
        yield server
    finally:
        server.__del__()


def test_a_burst_is_split_between_a_busy_pool_and_the_replica(
    replica: DecodeServer, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two long prompts at once: the first waits on the pool (which never answers here), the second is computed
    by the replica at once and answered while the first still waits; the first, given up at its limit, is
    computed here too. Both answers are the engine's own."""
    monkeypatch.setattr(remote_prefill, "PREFILL_TIMEOUT_S", 3.0)
    monkeypatch.setattr(remote_prefill, "PREFILL_TIMEOUT_S_PER_TOKEN", 0.0)
    prompt = tuple(range(3, 83))

    async def answer(request_id: str) -> tuple[list[int], float]:
        tokens = [
            token
            async for step in replica.generate(Call(request_id, prompt, GREEDY))
            for delta in step.deltas
            for token in delta.token_ids
        ]
        return tokens, time.perf_counter()

    async def run() -> list[tuple[list[int], float]]:
        first = asyncio.ensure_future(answer("first"))
        await asyncio.sleep(0.05)
        return [await answer("second"), await first]

    started = time.perf_counter()
    (second_tokens, second_at), (first_tokens, first_at) = asyncio.run(run())
    assert second_tokens == first_tokens == reference
    assert second_at - started < 2.5 < first_at - started  # the second did not wait for the first's limit
    counters = replica.counters
    assert (counters["pool_busy"], counters["failed_prefill"], counters["local_prefill"]) == (1, 1, 2)
    assert replica.remote is not None and (replica.remote.remote_tokens, replica.remote.local_tokens) == (0, 0)
