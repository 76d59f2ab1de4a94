"""A decode replica around failures: a prefill pool that fails or never answers, and a call resumed mid-answer.

The replica runs its real engine (the ``tiny`` model, no KV store); only the
prefill pool's handle is a double, one that fails like a dead replica or
never answers like a stuck one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from rayturn.decode import remote_prefill
from rayturn.decode.server import DecodeServer
from rayturn.engine import LLMEngine, SamplingParams
from rayturn.messages import Call, ResumePoint, Step

THRESHOLD = 32
PROMPT = tuple((7 * i) % 200 + 3 for i in range(80))  # past the threshold: a remote prefill is asked for
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class PrefillPool:
    """A prefill pool's handle whose every call fails as a dead replica's does (``dead``) or never ends."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead
        self.num_calls = 0

    @property
    def prefill(self) -> PrefillPool:
        return self

    def remote(self, call: Call) -> Any:
        self.num_calls += 1
        return self._answer()

    async def _answer(self) -> None:
        if self.dead:
            raise ActorDiedError()
        await asyncio.Event().wait()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return LLMEngine.from_pretrained("tiny", dtype="float32").generate([list(PROMPT)], GREEDY)[0].token_ids


@pytest.fixture
def replica(request: pytest.FixtureRequest) -> Iterator[tuple[DecodeServer, PrefillPool]]:
    pool = PrefillPool(dead=request.param)
    server = DecodeServer("tiny", {"dtype": "float32"}, None, pool, THRESHOLD)
    try:
        yield server, pool
    finally:
        server.__del__()


def steps(server: DecodeServer, call: Call) -> list[Step]:
    async def run() -> list[Step]:
        return [step async for step in server.generate(call)]

    return asyncio.run(run())


def tokens_of(steps: list[Step]) -> list[int]:
    return [token for step in steps for delta in step.deltas for token in delta.token_ids]


@pytest.mark.parametrize("replica", [True], indirect=True)
def test_a_dead_prefill_pool_costs_a_local_prefill_and_is_left_alone_for_a_while(
    replica: tuple[DecodeServer, PrefillPool], reference: list[int]
) -> None:
    server, pool = replica
    for request_id in ("a", "b"):
        answer = steps(server, Call(request_id, PROMPT, GREEDY))
        assert tokens_of(answer) == reference and {step.path for step in answer} == {"local"}
    assert pool.num_calls == 1  # the second call came within PREFILL_BACKOFF_S: the pool was not asked
    assert (server.counters["failed_prefill"], server.counters["local_prefill"]) == (1, 2)


@pytest.mark.parametrize("replica", [False], indirect=True)
def test_a_prefill_pool_that_never_answers_is_abandoned_after_the_timeout(
    replica: tuple[DecodeServer, PrefillPool], reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, pool = replica
    monkeypatch.setattr(remote_prefill, "PREFILL_TIMEOUT_S", 0.2)
    monkeypatch.setattr(remote_prefill, "PREFILL_TIMEOUT_S_PER_TOKEN", 0.0)
    answer = steps(server, Call("stuck", PROMPT, GREEDY))
    assert tokens_of(answer) == reference and pool.num_calls == 1
    assert server.counters["failed_prefill"] == 1


@pytest.mark.parametrize("replica", [True], indirect=True)
def test_a_resumed_call_decodes_on_after_what_was_streamed(
    replica: tuple[DecodeServer, PrefillPool], reference: list[int]
) -> None:
    server, pool = replica
    # Asking for prompt logprobs keeps this first call off the prefill pool (it scores every prompt position).
    scored = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    whole = steps(server, Call("whole", PROMPT, scored))
    streamed = [delta for step in whole for delta in step.deltas]
    cut = 3  # the replica died after three steps
    point = ResumePoint(
        tuple(token for delta in streamed[:cut] for token in delta.token_ids),
        None,
        tuple(delta.text for delta in streamed[:cut]),
    )
    rest = steps(server, Call("whole-resume1", PROMPT, GREEDY, resume=point))
    # Only what follows the resume point is sent, and it continues the answer exactly.
    assert list(point.token_ids) + tokens_of(rest) == reference
    text = point.text + "".join(delta.text for step in rest for delta in step.deltas)
    assert text == "".join(delta.text for delta in streamed)
    assert pool.num_calls == 0 and server.counters["resumed"] == 1  # a resumed call prefills where it is
