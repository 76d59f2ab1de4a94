"""A busy decode replica admits calls that continue a turn before new turns: the exact rule, and the 429 it makes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import ExitStack

import pytest

from rayturn.decode.admission import Admission, AdmissionLimits
from rayturn.messages import ReplicaAtCapacity
from rayturn.settings import FieldError


@pytest.mark.parametrize(
    ("max_ongoing_requests", "continuation_reserve", "new_turn_limit"),
    [(64, 0.25, 48), (4, 0.5, 2), (10, 0.0, 10), (3, 0.34, 2), (1, 0.9, 1), (7, 0.99, 1)],
)
def test_new_turn_limit(max_ongoing_requests: int, continuation_reserve: float, new_turn_limit: int) -> None:
    assert AdmissionLimits(max_ongoing_requests, continuation_reserve).new_turn_limit == new_turn_limit


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"continuation_reserve": 1.0}, r"continuation_reserve must lie in \[0, 1\)"),
        ({"continuation_reserve": -0.25}, r"continuation_reserve must lie in \[0, 1\)"),
        ({"max_ongoing_requests": 0}, r"max_ongoing_requests must be >= 1"),
    ],
)
def test_bad_limits_name_the_field(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(FieldError, match=message):
        AdmissionLimits(**kwargs)  # type: ignore[arg-type]


def test_new_turns_stop_at_their_share_and_continuations_use_the_reserve() -> None:
    admission = Admission(AdmissionLimits(max_ongoing_requests=4, continuation_reserve=0.5))
    with ExitStack() as first, ExitStack() as second:
        first.enter_context(admission.admitted("user"))
        second.enter_context(admission.admitted(None))  # a call of no known kind is a new turn
        assert admission.num_running == 2
        for kind in ("user", None):
            with (
                pytest.raises(ReplicaAtCapacity, match=r"runs 2 calls, its limit for new turns \(2 of 4"),
                admission.admitted(kind),
            ):
                pass
        assert (admission.num_running, admission.num_refused) == (2, 2)
        with admission.admitted("tool_continuation"), admission.admitted("tool_continuation"):
            assert admission.num_running == 4
            with pytest.raises(ReplicaAtCapacity), admission.admitted("user"):
                pass
        second.close()
        assert admission.num_running == 1
        with admission.admitted("user"):  # back under the share
            assert admission.num_running == 2
    assert (admission.num_running, admission.num_refused) == (0, 3)


def test_a_failed_call_gives_its_slot_back() -> None:
    admission = Admission(AdmissionLimits(max_ongoing_requests=1, continuation_reserve=0.0))
    with pytest.raises(RuntimeError), admission.admitted("user"):
        raise RuntimeError("the engine failed")
    assert admission.num_running == 0
    with admission.admitted("user"):
        assert admission.num_running == 1


def test_the_refusal_reaches_clients_as_429() -> None:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from rayturn.api.errors import APIError
    from rayturn.api.pipeline import first_step

    async def refused() -> AsyncIterator[object]:
        raise ray_exceptions.RayTaskError("generate", "Traceback ...", ReplicaAtCapacity("the replica is full"))
        yield  # an async generator that fails on its first step

    with pytest.raises(APIError) as err:
        asyncio.run(first_step(refused(), "request-1"))
    assert err.value.status_code == 429
    assert err.value.to_dict()["error"]["type"] == "rate_limit_error"
    assert "the replica is full" not in err.value.message  # the replica's words stay in its log
