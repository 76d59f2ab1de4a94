"""A busy decode replica admits continuations before new turns, and new turns before background calls: the exact
rule, and the 429 it makes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import ExitStack

import pytest

from rayturn.decode.admission import Admission, AdmissionLimits, call_class
from rayturn.engine.priority import Priority
from rayturn.engine.sampling_params import SamplingParams
from rayturn.messages import Call, CallKind, ReplicaAtCapacity
from rayturn.settings import FieldError

CONTINUATION, INTERACTIVE, BACKGROUND = Priority.CONTINUATION, Priority.INTERACTIVE, Priority.BACKGROUND


@pytest.mark.parametrize(
    ("max_ongoing_requests", "continuation_reserve", "new_turn_limit", "background_limit"),
    [(64, 0.25, 48, 32), (4, 0.5, 2, 1), (10, 0.0, 10, 10), (3, 0.34, 2, 1), (1, 0.9, 1, 1), (7, 0.99, 1, 1)],
)
def test_limits(
    max_ongoing_requests: int, continuation_reserve: float, new_turn_limit: int, background_limit: int
) -> None:
    limits = AdmissionLimits(max_ongoing_requests, continuation_reserve)
    assert (limits.new_turn_limit, limits.background_limit) == (new_turn_limit, background_limit)
    assert limits.limit(CONTINUATION) is None


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
        first.enter_context(admission.admitted(INTERACTIVE))
        second.enter_context(admission.admitted(INTERACTIVE))
        assert admission.num_running == 2
        for priority in (INTERACTIVE, BACKGROUND):
            with pytest.raises(ReplicaAtCapacity, match=r"runs 2 calls, its limit for "), admission.admitted(priority):
                pass
        assert (admission.num_running, admission.num_refused) == (2, 2)
        with admission.admitted(CONTINUATION), admission.admitted(CONTINUATION):
            assert admission.num_running == 4
            with pytest.raises(ReplicaAtCapacity), admission.admitted(INTERACTIVE):
                pass
        second.close()
        assert admission.num_running == 1
        with admission.admitted(INTERACTIVE):  # back under the share
            assert admission.num_running == 2
    assert (admission.num_running, admission.num_refused) == (0, 3)
    assert admission.calls_by_priority() == {"continuation": 2, "interactive": 3, "background": 0}


def test_background_calls_stop_before_new_turns_do() -> None:
    admission = Admission(AdmissionLimits(max_ongoing_requests=8, continuation_reserve=0.25))  # limits 6 and 4
    with ExitStack() as running:
        for _ in range(4):
            running.enter_context(admission.admitted(BACKGROUND))
        with (
            pytest.raises(ReplicaAtCapacity, match=r"runs 4 calls, its limit for background calls \(4 of 8"),
            admission.admitted(BACKGROUND),
        ):
            pass
        running.enter_context(admission.admitted(INTERACTIVE))
        running.enter_context(admission.admitted(INTERACTIVE))
        with pytest.raises(ReplicaAtCapacity, match=r"runs 6 calls, its limit for new turns \(6 of 8"):
            running.enter_context(admission.admitted(INTERACTIVE))
        running.enter_context(admission.admitted(BACKGROUND, resumed=True))  # admitted once already
        running.enter_context(admission.admitted(CONTINUATION))
        assert admission.num_running == 8
    assert admission.calls_by_priority() == {"continuation": 1, "interactive": 2, "background": 5}
    assert admission.num_refused == 2


@pytest.mark.parametrize(
    ("kind", "priority", "expected"),
    [
        ("user", None, INTERACTIVE),
        (None, None, INTERACTIVE),  # a call of no known kind is a new turn
        ("tool_continuation", None, CONTINUATION),
        ("tool_continuation", "background", BACKGROUND),  # a batch agent's tool result yields to people's
        ("user", "continuation", CONTINUATION),
    ],
)
def test_a_calls_class_is_the_one_it_names_else_by_its_kind(
    kind: CallKind | None, priority: str | None, expected: Priority
) -> None:
    call = Call("r", (1, 2, 3), SamplingParams(max_tokens=1), call=kind, priority=priority)
    assert call_class(call) is expected


def test_a_failed_call_gives_its_slot_back() -> None:
    admission = Admission(AdmissionLimits(max_ongoing_requests=1, continuation_reserve=0.0))
    with pytest.raises(RuntimeError), admission.admitted(INTERACTIVE):
        raise RuntimeError("the engine failed")
    assert admission.num_running == 0
    with admission.admitted(INTERACTIVE):
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
