"""The energy a decode replica's steps carry: its engine's joules for the call so far, growing step by step, plus
the prefill replica's share when the prefill pool computed the prompt, with the meters that measured them.

The replica runs its real engine (the ``tiny`` model, no KV store); only the prefill pool's handle is a double,
one that answers with a first token and the joules its replica spent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from rayturn.decode.server import DecodeServer
from rayturn.engine import LLMEngine, SamplingParams
from rayturn.messages import Call, PrefillAnswer, Step

THRESHOLD = 32
PROMPT = tuple((5 * i) % 200 + 3 for i in range(48))  # past the threshold: the prefill pool is asked
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL_J = 0.5
METERS = {"model", "rapl", "nvml"}


class PrefillPool:
    """A prefill pool's handle that answers with the prompt's first token and ``PREFILL_J`` joules of a GPU."""

    def __init__(self, first_token: int) -> None:
        self.first_token = first_token
        self.num_calls = 0

    @property
    def prefill(self) -> PrefillPool:
        return self

    async def remote(self, call: Call) -> PrefillAnswer:
        self.num_calls += 1
        return PrefillAnswer((self.first_token,), None, 0, 0, energy_j=PREFILL_J, energy_meter="nvml")


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return LLMEngine.from_pretrained("tiny", dtype="float32").generate([list(PROMPT)], GREEDY)[0].token_ids


@pytest.fixture(scope="module")
def replica(reference: list[int]) -> Iterator[tuple[DecodeServer, PrefillPool]]:
    pool = PrefillPool(reference[0])
    server = DecodeServer("tiny", {"dtype": "float32"}, None, pool, THRESHOLD)
    try:
        yield server, pool
    finally:
        server.__del__()


def steps(server: DecodeServer, call: Call) -> list[Step]:
    async def run() -> list[Step]:
        return [step async for step in server.generate(call)]

    return asyncio.run(run())


def test_a_local_call_carries_its_engines_joules_so_far(replica: tuple[DecodeServer, PrefillPool]) -> None:
    server, pool = replica
    answer = steps(server, Call("local", PROMPT[:16], GREEDY))  # below the threshold: prefilled here
    energies_j = [step.energy_j for step in answer]
    assert {step.path for step in answer} == {"local"} and pool.num_calls == 0
    assert energies_j == sorted(energies_j) and energies_j[-1] > 0
    assert {step.energy_meter for step in answer} <= METERS and len({step.energy_meter for step in answer}) == 1


def test_a_disaggregated_call_adds_the_prefill_replicas_share_and_names_both_meters(
    replica: tuple[DecodeServer, PrefillPool], reference: list[int]
) -> None:
    server, pool = replica
    answer = steps(server, Call("remote", PROMPT, GREEDY))
    assert pool.num_calls == 1 and {step.path for step in answer} == {"disaggregated"}
    assert [token for step in answer for delta in step.deltas for token in delta.token_ids] == reference
    assert answer[-1].energy_j > PREFILL_J and all(step.energy_j >= PREFILL_J for step in answer)
    decode_meter = steps(server, Call("local-meter", PROMPT[:16], GREEDY))[-1].energy_meter
    assert decode_meter in METERS
    assert {step.energy_meter for step in answer} == {"+".join(sorted({decode_meter, "nvml"}))}
