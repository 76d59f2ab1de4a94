"""How the ingress turns failures before the first token into OpenAI errors (no cluster needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError, ActorUnavailableError, RaySystemError, RayTaskError
from ray.serve.exceptions import BackPressureError

from rayturn.api.errors import APIError, client_error, refused_reason
from rayturn.api.pipeline import NO_STEP, announced, chain_steps, first_step


async def failing(error: BaseException) -> AsyncIterator[list[dict[str, Any]]]:
    raise error
    yield []  # an async generator that fails on its first step


async def steps(*items: list[dict[str, Any]]) -> AsyncIterator[list[dict[str, Any]]]:
    for item in items:
        yield item


def test_a_full_decode_queue_is_429() -> None:
    with pytest.raises(APIError) as err:
        asyncio.run(first_step(failing(BackPressureError(num_queued_requests=256, max_queued_requests=256))))
    assert err.value.status_code == 429 and err.value.to_dict()["error"]["type"] == "rate_limit_error"


def test_a_replica_refusing_the_request_is_400_with_its_reason() -> None:
    with pytest.raises(APIError) as err:
        asyncio.run(first_step(failing(ValueError("request needs up to 40 KV pages; the cache has 32"))))
    assert err.value.status_code == 400 and "KV pages" in err.value.message


def test_first_step_then_the_rest_in_order() -> None:
    async def collect() -> list[list[dict[str, Any]]]:
        iterator = steps([{"a": 1}], [{"b": 2}])
        first = await first_step(iterator)
        return [step async for step in chain_steps(first, iterator)]

    assert asyncio.run(collect()) == [[{"a": 1}], [{"b": 2}]]

    async def empty() -> list[list[dict[str, Any]]]:
        iterator = steps()
        first = await first_step(iterator)
        assert first is NO_STEP
        return [step async for step in chain_steps(first, iterator)]

    assert asyncio.run(empty()) == []


async def raising(error: BaseException) -> dict[str, Any]:
    raise error


def test_a_lost_announcement_is_an_openai_error() -> None:
    with pytest.raises(APIError) as err:
        asyncio.run(announced(raising(BackPressureError(num_queued_requests=8, max_queued_requests=8))))
    assert err.value.status_code == 429
    with pytest.raises(APIError) as err:
        asyncio.run(announced(raising(ActorDiedError())))
    assert err.value.status_code == 503 and err.value.code == "replica_unavailable"
    assert err.value.to_dict()["error"]["type"] == "server_error"


# What Ray says when a replica died mid-call: its class, actor id, pid, node and name.
RAY_DETAILS = (
    "The actor died unexpectedly before finishing this task. class_name: ServeReplica:rayturn:decode "
    "actor_id: 5c1f0a7e9b3d2c1a0f000000 pid: 48213 name: SERVE_REPLICA::rayturn#decode#n01v5jvs "
    "namespace: serve ip: 10.0.0.7"
)


@pytest.mark.parametrize(
    "error",
    [ActorDiedError(), ActorUnavailableError(RAY_DETAILS, None), RaySystemError(RAY_DETAILS)],
    ids=["died", "unavailable", "system"],
)
def test_a_failed_replica_is_a_clean_retryable_503(error: Exception) -> None:
    with pytest.raises(APIError) as err:
        asyncio.run(first_step(failing(error), "req-1"))
    assert err.value.status_code == 503 and err.value.code == "replica_unavailable"
    for internal in ("48213", "5c1f0a7e", "SERVE_REPLICA", "10.0.0.7", "actor_id", "pid"):
        assert internal not in err.value.message


def test_a_replicas_refusal_keeps_its_reason_and_a_bug_names_only_the_request() -> None:
    refusal = RayTaskError(
        "generate", "Traceback ... pid=48213", ValueError("prompt needs 40 KV pages; the cache has 32")
    )
    assert refused_reason(refusal) == "prompt needs 40 KV pages; the cache has 32"
    assert client_error(refusal, "req-2").status_code == 400
    bug = client_error(KeyError("deltas"), "req-3")
    assert bug.status_code == 500 and "req-3" in bug.message and "deltas" not in bug.message


def test_an_announcement_passes_the_replicas_answer_through() -> None:
    async def answer() -> dict[str, Any]:
        return {"state": "offloaded", "replica_id": "r1"}

    assert asyncio.run(announced(answer())) == {"state": "offloaded", "replica_id": "r1"}
