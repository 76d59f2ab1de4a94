"""Bounds on one request's cost, and work kept off the event loop (no cluster needed)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator

import pytest

from rayturn.api.errors import APIError
from rayturn.api.request_limits import (
    INLINE_BYTES,
    SAFETY,
    PromptBudget,
    off_loop,
    parse_json,
    read_body,
)


async def chunks(*parts: bytes, consumed: list[int] | None = None) -> AsyncIterator[bytes]:
    for part in parts:
        if consumed is not None:
            consumed.append(len(part))
        yield part


def test_a_declared_length_over_the_limit_is_413_before_a_byte_is_read() -> None:
    consumed: list[int] = []
    with pytest.raises(APIError) as err:
        asyncio.run(read_body({"content-length": "2048"}, chunks(b"x" * 2048, consumed=consumed), 1024))
    assert err.value.status_code == 413 and err.value.code == "request_too_large"
    assert "2048 bytes" in err.value.message and "at most 1024 bytes" in err.value.message
    assert consumed == []


def test_a_streamed_body_is_cut_off_at_the_limit() -> None:
    consumed: list[int] = []
    parts = (b"a" * 600, b"b" * 600, b"c" * 600)
    with pytest.raises(APIError) as err:
        asyncio.run(read_body({}, chunks(*parts, consumed=consumed), 1024))
    assert err.value.status_code == 413 and consumed == [600, 600]  # the third chunk was never pulled
    assert asyncio.run(read_body({"content-length": "6"}, chunks(b"abc", b"def"), 1024)) == b"abcdef"


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [3000, 200_000])
def test_json_nested_too_deep_to_parse_is_a_400_not_a_crash(depth: int) -> None:
    with pytest.raises(APIError) as err:
        parse_json(nested(depth))
    assert err.value.status_code == 400 and err.value.code == "json_too_deep"
    assert err.value.to_dict()["error"]["type"] == "invalid_request_error"


def test_json_that_parses_and_bad_json() -> None:
    assert parse_json(nested(200)) == json.loads(nested(200))
    with pytest.raises(APIError, match="could not parse the JSON body"):
        parse_json(b"{not json")
    with pytest.raises(APIError, match="could not parse the JSON body"):
        parse_json(b"\xff\xfe")


def test_a_prompt_budget_refuses_only_text_that_surely_holds_more_tokens_than_the_context() -> None:
    budget = PromptBudget(max_model_len=100, max_token_chars=5)
    budget.check("x" * budget.max_chars, param="messages")  # might still fit: left to the tokenizer
    with pytest.raises(APIError) as err:
        budget.check("x" * (budget.max_chars + 1), param="prompt")
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    at_least = int(err.value.message.split("at least ")[1].split(" tokens")[0])
    assert at_least > 100 and at_least * 5 * SAFETY >= budget.max_chars + 1


def test_large_work_runs_in_a_worker_thread_and_the_loop_keeps_serving() -> None:
    async def scenario() -> tuple[int, int, int, int]:
        loop_thread = threading.get_ident()

        def slow_work() -> int:
            time.sleep(0.5)  # a long tokenization, say
            return threading.get_ident()

        ticks = 0

        async def other_calls() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.get_running_loop().create_task(other_calls())
        worker_thread = await off_loop(INLINE_BYTES, slow_work)
        ticker.cancel()
        small = await off_loop(10, threading.get_ident)
        return loop_thread, worker_thread, small, ticks

    loop_thread, worker_thread, small, ticks = asyncio.run(scenario())
    assert worker_thread != loop_thread and small == loop_thread
    assert ticks >= 10  # other calls went on while the large one worked (each tick is 10 ms)
