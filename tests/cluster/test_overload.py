"""Overload on the whole cluster really started: bounded queues, 429 / RESOURCE_EXHAUSTED, continuations first.

The decode pool has one replica with 4 call slots, half of them kept for
calls that continue a turn, and a queue of 2 at the ingress. Two long new
turns take the new turns' share: every API then refuses a new turn (429 with
``Retry-After`` in its own error shape; gRPC RESOURCE_EXHAUSTED) while tool
continuations still get in. With every slot taken, continuations queue up to
the bound and the rest get 429 too: nothing queues without end. Closed
streams give their slots back, and the cluster serves as before. Last,
the pool grows to two replicas: a new turn that the full one refuses is
served by the other, not refused.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from ray import serve  # noqa: E402
from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.app import APP_NAME, build_app  # noqa: E402
from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402
from rayturn.router.scoring import preferred_replica  # noqa: E402

HTTP_PORT, GRPC_PORT = 28621, 29621
THRESHOLD = 4096  # every prompt is prefilled on the decode replica
MAX_ONGOING, MAX_QUEUED = 4, 2
OVERRIDES = small_cluster(
    HTTP_PORT,
    GRPC_PORT,
    THRESHOLD,
    **{
        "prefill.min_replicas": 0,
        "prefill.max_replicas": 0,
        "decode.max_ongoing_requests": MAX_ONGOING,
        "decode.max_queued_requests": MAX_QUEUED,
        "decode.continuation_reserve": 0.5,  # new turns stop at 2 running calls
    },
)
# A call that holds its slot until the test closes it: thousands of tokens, no early end.
LONG = {"max_tokens": 3500, "extra_body": {"min_tokens": 3500, "ignore_eos": True}}
MAX_ATTEMPTS = 120
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}


def new_turn(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def continuation(text: str) -> list[dict[str, Any]]:
    """A chat whose last message is a tool's result: the ingress classifies it as a tool continuation."""
    return [
        {"role": "user", "content": text},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print('hello')"},
    ]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(load_config(**OVERRIDES)) as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stub(cluster: str) -> Iterator[Any]:
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        yield pb_grpc.RayTurnStub(channel)


class Holder:
    """A long streamed call that holds one of the replica's slots from its first token until ``close``."""

    def __init__(self, client: openai.OpenAI, messages: list[dict[str, Any]], session_id: str) -> None:
        # A client's retry: the calls an earlier test closed may still be leaving the replica.
        for _ in range(MAX_ATTEMPTS):
            try:
                self.stream = client.chat.completions.create(
                    model="tiny",
                    messages=messages,  # type: ignore[arg-type]
                    stream=True,
                    extra_headers={"x-session-id": session_id},
                    **LONG,  # type: ignore[arg-type]
                )
                break
            except openai.RateLimitError:
                time.sleep(0.5)
        else:
            raise AssertionError(f"no slot came free for {session_id} in {MAX_ATTEMPTS} attempts")
        next(iter(self.stream))  # the first token: the call runs on the replica

    def close(self) -> None:
        self.stream.close()


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], session_id: str) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=3,
        temperature=0,
        extra_headers={"x-session-id": session_id},
    )


def decode_replicas(count: int) -> set[str]:
    """Serve's ids of the decode pool's replicas once ``count`` of them run (else none)."""
    app = serve.status().applications.get(APP_NAME)
    if app is None or app.status != "RUNNING" or dict(app.deployments["decode"].replica_states) != {"RUNNING": count}:
        return set()
    prefix = f"SERVE_REPLICA::{APP_NAME}#decode#"
    actors = ray.util.list_named_actors(all_namespaces=True)
    return {actor["name"].removeprefix(prefix) for actor in actors if actor["name"].startswith(prefix)}


def refused_new_turns(cluster: str, replica: str) -> int:
    """The replica's count of refused new turns, from the detailed health report (of one decode replica a time)."""
    for _ in range(200):  # the report comes from the least loaded replica: ask until this one answers
        details = requests.get(f"{cluster}/health", timeout=60).json()["details"]
        if details["decode.replica_id"] == replica:
            return int(details["decode.refused_new_turns"])
        time.sleep(0.1)
    raise AssertionError(f"no health report from replica {replica}; the last from {details['decode.replica_id']}")


def grpc_chat(stub: Any, text: str, call: str) -> list[Any]:
    request = pb.GenerateRequest(
        messages=pb.Messages(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingOptions(max_tokens=3),
        session_id=f"grpc-{call}",
    )
    return list(stub.Generate(request, metadata=(("application", "rayturn"), ("x-rayturn-call", call))))


def assert_refused(err: openai.APIStatusError) -> None:
    assert err.status_code == 429
    assert err.response.headers["retry-after"] == "1"


def test_new_turns_are_refused_while_continuations_get_in(cluster: str, client: openai.OpenAI, stub: Any) -> None:
    holders = [Holder(client, new_turn(f"write a long story {i}"), f"holder-{i}") for i in range(2)]
    try:
        # OpenAI chat, in OpenAI's error shape.
        with pytest.raises(openai.RateLimitError) as refused:
            chat(client, new_turn("a new question"), "new-1")
        assert_refused(refused.value)
        assert refused.value.body["type"] == "rate_limit_error"  # type: ignore[index]
        # Anthropic's Messages, in Anthropic's shape.
        anthropic = requests.post(
            f"{cluster}/v1/messages",
            json={"model": "tiny", "max_tokens": 3, "messages": new_turn("a new question")},
            timeout=60,
        )
        assert anthropic.status_code == 429 and anthropic.headers["retry-after"] == "1"
        assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "rate_limit_error"
        # OpenAI Responses.
        with pytest.raises(openai.RateLimitError) as refused:
            client.responses.create(model="tiny", input="a new question", max_output_tokens=3)
        assert_refused(refused.value)
        # gRPC.
        with pytest.raises(grpc.RpcError) as rpc_refused:
            grpc_chat(stub, "a new question", "user")
        assert rpc_refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

        # Tool continuations use the reserve: over HTTP (classified from the messages) and gRPC (told).
        answer = chat(client, continuation("read a.py"), "agent-1")
        assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
        assert answer.usage is not None and answer.usage.completion_tokens >= 1
        tool_result = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "print('hello')"}]
        messages = [
            {"role": "user", "content": "read a.py"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}],
            },
            {"role": "user", "content": tool_result},
        ]
        anthropic = requests.post(
            f"{cluster}/v1/messages", json={"model": "tiny", "max_tokens": 3, "messages": messages}, timeout=60
        )
        assert anthropic.status_code == 200, anthropic.text
        responses = grpc_chat(stub, "the tool's result", "tool")
        assert responses and responses[-1].finish_reason in ("length", "stop")
    finally:
        for holder in holders:
            holder.close()


def test_the_queue_is_bounded_even_for_continuations(client: openai.OpenAI) -> None:
    holders = [Holder(client, new_turn(f"write a long story {i}"), f"holder-{i}") for i in range(2)]
    holders += [Holder(client, continuation(f"read file {i}"), f"agent-hold-{i}") for i in range(2)]
    num_calls = 6
    pool = concurrent.futures.ThreadPoolExecutor(num_calls)
    try:
        calls = [pool.submit(chat, client, continuation(f"read b{i}.py"), f"agent-{i}") for i in range(num_calls)]
        # Every slot is taken: the ingress queues MAX_QUEUED calls, the others are refused at once.
        refusals: list[BaseException] = []
        for done in concurrent.futures.as_completed(calls):
            error = done.exception()
            assert isinstance(error, openai.RateLimitError), error
            assert_refused(error)
            refusals.append(error)
            if len(refusals) == num_calls - MAX_QUEUED:
                break
        assert sum(not call.done() for call in calls) == MAX_QUEUED
    finally:
        for holder in holders:
            holder.close()
    # Released slots serve the queued calls.
    answers = [call.result() for call in calls if call.exception() is None]
    pool.shutdown()
    assert len(answers) == MAX_QUEUED
    assert all(answer.usage.completion_tokens >= 1 for answer in answers)


def test_healthy_after_overload_and_closed_streams_give_their_slots_back(cluster: str, client: openai.OpenAI) -> None:
    health = requests.get(f"{cluster}/health", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    details = health.json()["details"]
    assert details["decode.refused_new_turns"] >= 4  # the four refusals of the first test
    # The closed holders' calls end on the replica: two new turns fit again side by side.
    holders = [Holder(client, new_turn(f"another long story {i}"), f"again-{i}") for i in range(2)]
    try:
        with pytest.raises(openai.RateLimitError):
            chat(client, new_turn("one more"), "new-2")
    finally:
        for holder in holders:
            holder.close()


def test_a_new_turn_a_full_replica_refuses_is_served_by_one_with_room(cluster: str, client: openai.OpenAI) -> None:
    (first,) = decode_replicas(1)
    config = load_config(**OVERRIDES, **{"decode.min_replicas": 2, "decode.max_replicas": 2})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    deadline = time.monotonic() + 240
    while len(replicas := decode_replicas(2)) != 2:
        assert time.monotonic() < deadline, "the decode pool did not grow to two replicas"
        time.sleep(0.5)
    # The new replica fills up: it has refused nothing before this test.
    (full,) = replicas - {first}
    session = next(f"full-{i}" for i in range(1000) if preferred_replica(f"full-{i}", replicas) == full)
    # A shared prefix cached on the full replica: the new turn's pages and its session both point there.
    prefix = "You are a careful coding agent working in a large repository. " * 4
    warm = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=new_turn(prefix),
        max_tokens=1,
        extra_headers={"x-session-id": session},  # type: ignore[arg-type]
    )
    assert warm.headers["x-rayturn-replica"] == full
    holders = [Holder(client, new_turn(f"{prefix} long story {i}"), session) for i in range(2)]
    try:
        assert all(holder.stream.response.headers["x-rayturn-replica"] == full for holder in holders)
        answer = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=new_turn(f"{prefix} one more question"),  # type: ignore[arg-type]
            max_tokens=3,
            extra_headers={"x-session-id": session},
        )
        assert answer.status_code == 200
        assert answer.headers["x-rayturn-replica"] == first
        assert answer.parse().usage.completion_tokens >= 1
    finally:
        for holder in holders:
            holder.close()
    assert refused_new_turns(cluster, full) >= 1  # the full replica refused it first
