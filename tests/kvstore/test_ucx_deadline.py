"""``by_deadline``, the deadline every UCX request on the loop keeps: counted from the call, and a result that
arrives past it is a timeout too (a busy host can wake the loop late to both the completion and the timer)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rayturn.kvstore.ucx_runtime import by_deadline, deadline_after


def test_a_request_done_in_time_returns_its_result() -> None:
    async def quick() -> str:
        await asyncio.sleep(0)
        return "pages"

    assert asyncio.run(by_deadline(quick, deadline_after(5.0))) == "pages"


def test_a_request_whose_deadline_passed_while_it_waited_is_never_started() -> None:
    started = []

    async def request() -> None:
        started.append(True)

    deadline = deadline_after(0.01)
    time.sleep(0.02)  # the call waited for its turn past the deadline
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(by_deadline(request, deadline))
    assert not started


def test_a_slow_request_times_out_and_is_cancelled() -> None:
    cancelled = []

    async def slow() -> None:
        try:
            await asyncio.sleep(5.0)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    start = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(by_deadline(slow, deadline_after(0.05)))
    assert cancelled and time.monotonic() - start < 2.0


def test_a_result_that_arrives_past_the_deadline_is_a_timeout() -> None:
    """The loop is held past the deadline (as a busy host holds it): the request completes, but late."""

    async def late() -> str:
        time.sleep(0.05)  # no await: the loop cannot run the timer before the result is in
        return "pages"

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(by_deadline(late, deadline_after(0.01)))
