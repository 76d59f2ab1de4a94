"""The whole cluster, really started: Ray Serve HTTP + gRPC, prefill and decode pools, the KV store.

Checked against the offline engine on the same model: greedy outputs are
equal over HTTP (the official ``openai`` client, streaming and not) and over
gRPC, on both the disaggregated path (a prefill replica computes the prompt,
the decode replica pulls its pages from the store) and the local one (the
decode replica prefills a short uncached suffix itself). The OpenAI surface
beyond plain chat: tools offered with ``tool_choice="auto"``, seeded sampling
of two choices with logprobs (the same seed gives the same answer), and stop
strings (the answer ends before one, streamed or not, as offline).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.engine import LLMEngine, SamplingParams  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402

HTTP_PORT, GRPC_PORT = 28431, 29431
API_KEY = "test-key"
THRESHOLD = 48  # uncached prompt tokens from which a prefill replica computes the prompt
OVERRIDES = small_cluster(HTTP_PORT, GRPC_PORT, THRESHOLD, **{"server.api_keys": [API_KEY]})
# gRPC metadata: Serve's application, and the key (gRPC checks it on every method, as HTTP does).
GRPC_METADATA = (("application", "rayturn"), ("authorization", f"Bearer {API_KEY}"))
AUTH_HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(load_config(**OVERRIDES)) as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def offline_chat(engine: LLMEngine, messages: list[dict[str, str]], max_tokens: int) -> list[int]:
    prompt = engine.tokenizer.encode_chat(messages)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return engine.generate([prompt], params)[0].token_ids


SHORT = [{"role": "user", "content": "hi"}]  # below the threshold: the decode replica prefills it
LONG = [{"role": "user", "content": "Refactor this module: " + "def f(x): return x + 1\n" * 6}]


@pytest.mark.parametrize("messages", [SHORT, LONG], ids=["local-prefill", "disaggregated"])
def test_chat_matches_offline_engine(
    client: openai.OpenAI, reference: LLMEngine, messages: list[dict[str, str]]
) -> None:
    expected = offline_chat(reference, messages, 12)
    prompt_len = len(reference.tokenizer.encode_chat(messages))
    assert (prompt_len >= THRESHOLD) == (messages is LONG)
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    choice = response.choices[0]
    assert choice.message.content == reference.tokenizer.decode(expected)
    assert response.usage is not None and response.usage.completion_tokens == len(expected)
    assert response.usage.prompt_tokens == prompt_len

    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == reference.tokenizer.decode(expected)
    assert finish == "length" and usage is not None and usage.completion_tokens == len(expected)
    # The second identical call finds the prompt's full pages cached.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (prompt_len - 1) // 16 * 16


def test_completions_with_token_ids(client: openai.OpenAI, reference: LLMEngine) -> None:
    prompt = list(range(5, 90))
    expected = reference.generate([prompt], SamplingParams(max_tokens=9, temperature=0.0))[0].token_ids
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0)
    assert response.choices[0].text == reference.tokenizer.decode(expected)


def test_grpc_generate_matches_offline_engine(cluster: str, reference: LLMEngine) -> None:
    prompt = list(range(3, 80))
    expected = reference.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))[0].token_ids
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingOptions(max_tokens=10, temperature=0.0)
        )
        tokens: list[int] = []
        last = None
        for response in stub.Generate(request, metadata=(*GRPC_METADATA, ("session_id", "g1"))):
            tokens.extend(response.token_ids)
            last = response
        assert tokens == expected
        assert last is not None and last.finish_reason == "length" and last.usage.completion_tokens == 10

        bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**7]))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, metadata=GRPC_METADATA))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "vocabulary" in (err.value.details() or "")

        health = stub.Health(pb.HealthRequest(), metadata=GRPC_METADATA)
        assert health.status == "ok" and health.details["decode.backend"] == "cpu"
        assert health.details["decode.replicas"] == "1" and health.details["prefill.target_replicas"] == "1"


def test_bad_requests_get_openai_errors_and_the_server_stays_up(cluster: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=SHORT, temperature=7)  # type: ignore[arg-type]
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=SHORT)  # type: ignore[arg-type]
    unauthenticated = openai.OpenAI(base_url=f"{cluster}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unauthenticated.models.list()
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt=[5] * 5000, max_tokens=4)
    assert "context" in str(too_long.value)
    raw = requests.post(
        f"{cluster}/v1/chat/completions", data=b"{not json", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    # Still serving.
    assert client.models.list().data[0].id == "tiny"


def test_health_and_metrics(cluster: str, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="tiny", messages=SHORT, max_tokens=2)  # type: ignore[arg-type]
    health = requests.get(f"{cluster}/health", headers=AUTH_HEADERS).json()
    assert health["status"] == "ok"
    assert health["details"]["decode.backend"] == "cpu" and health["details"]["prefill.backend"] == "cpu"
    assert [state["state"] for state in health["pools"]["decode"]["replica_states"]] == ["RUNNING"]
    metrics = requests.get(f"{cluster}/metrics").text
    assert "rayturn_time_to_first_token_seconds_bucket" in metrics
    assert "rayturn_prompt_tokens_total" in metrics


READ_FILE_TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


def test_chat_with_tools_goes_through_the_template_and_answers(client: openai.OpenAI, reference: LLMEngine) -> None:
    messages = [{"role": "user", "content": "Open README.md"}]
    prompt = reference.tokenizer.encode_chat(messages, tools=[READ_FILE_TOOL])
    assert len(prompt) > len(reference.tokenizer.encode_chat(messages))  # the template showed the tool
    expected = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    response = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=[READ_FILE_TOOL],  # type: ignore[list-item]
        tool_choice="auto",
        max_tokens=8,
        temperature=0,
    )
    choice = response.choices[0]
    # Random weights call no tool; the request still takes the whole tool-aware path, whose
    # parser trims the prose around tool calls (``rayturn.engine.tool_calls``).
    assert choice.finish_reason in ("length", "stop") and not choice.message.tool_calls
    assert choice.message.content == expected.text.strip()
    assert response.usage is not None and response.usage.prompt_tokens == len(prompt)


OPEN_TOOL = {
    "type": "function",
    "function": {
        "name": "open_file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "enum": ["README.md", "setup.py"]},
                "line": {"type": "integer", "minimum": 1, "maximum": 99},
            },
            "required": ["path", "line"],
        },
    },
}


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "open_file"}}], ids=["required", "named"]
)
def test_forced_tool_choice_yields_a_valid_call(client: openai.OpenAI, tool_choice: Any, streamed: bool) -> None:
    """Constrained decoding: even random weights answer a forced choice with a well-formed call of a declared
    tool whose arguments fit its schema (bounded ones: random weights never close a free string)."""
    close_tool = {"type": "function", "function": {**OPEN_TOOL["function"], "name": "close_file"}}
    request: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Open the readme."}],
        "tools": [OPEN_TOOL, close_tool],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 0,
    }
    if streamed:
        names, arguments, finish = [], [], None
        for chunk in client.chat.completions.create(**request, stream=True):
            for c in chunk.choices:
                for call in c.delta.tool_calls or []:
                    names.append(call.function.name)
                    arguments.append(call.function.arguments)
                finish = c.finish_reason or finish
    else:
        choice = client.chat.completions.create(**request).choices[0]
        calls = choice.message.tool_calls or []
        names = [call.function.name for call in calls]  # type: ignore[union-attr]
        arguments = [call.function.arguments for call in calls]  # type: ignore[union-attr]
        finish = choice.finish_reason
    assert finish == "tool_calls" and len(names) == 1
    assert names[0] == "open_file" if isinstance(tool_choice, dict) else names[0] in ("open_file", "close_file")
    value = json.loads(arguments[0])
    assert value["path"] in ("README.md", "setup.py") and 1 <= value["line"] <= 99


def test_json_response_formats_give_json(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Is it ok? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
        max_tokens=30,
        temperature=0,
    )
    assert isinstance(json.loads(response.choices[0].message.content or "")["ok"], bool)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], response_format=bad, max_tokens=5
        )  # type: ignore[arg-type]
    assert "response_format" in str(caught.value)


def test_seeded_sampling_of_two_choices_with_logprobs_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> Any:
        return client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "name a sorting algorithm"}],
            n=2,
            seed=7,
            temperature=0.8,
            logprobs=True,
            top_logprobs=2,
            max_tokens=6,
        )

    first, second = sample(), sample()
    for response in (first, second):
        assert [choice.index for choice in response.choices] == [0, 1]
        total_tokens = 0
        for choice in response.choices:
            assert choice.logprobs is not None and choice.logprobs.content is not None
            content = choice.logprobs.content
            if choice.finish_reason == "length":
                assert len(content) == 6
            else:
                assert 1 <= len(content) <= 6
            for entry in content:
                assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
            total_tokens += len(content)
        assert response.usage is not None and response.usage.completion_tokens == total_tokens

    def tokens(response: Any) -> list[list[str]]:
        return [[entry.token for entry in choice.logprobs.content] for choice in response.choices]

    def logprobs(response: Any) -> list[float]:
        return [entry.logprob for choice in response.choices for entry in choice.logprobs.content]

    assert tokens(first) == tokens(second)
    assert logprobs(first) == pytest.approx(logprobs(second), abs=1e-4)


def test_stop_string_ends_the_answer_before_it(client: openai.OpenAI, reference: LLMEngine) -> None:
    messages = [{"role": "user", "content": "explain"}]
    prompt = reference.tokenizer.encode_chat(messages)
    unstopped = reference.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "x" in unstopped.text  # the model would write it
    expected = reference.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=("x",)))[0]
    assert expected.finish_reason == "stop" and "x" not in expected.text

    response = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stop=["x"],
    )
    choice = response.choices[0]
    assert choice.message.content == expected.text and choice.finish_reason == "stop"

    text, finish_reason = "", None
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stop=["x"],
        stream=True,
    ):
        for streamed in chunk.choices:
            text += streamed.delta.content or ""
            finish_reason = streamed.finish_reason or finish_reason
    assert text == expected.text and finish_reason == "stop"
