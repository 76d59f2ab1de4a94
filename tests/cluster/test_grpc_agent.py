"""A coding agent's loop over gRPC, on the whole cluster really started (Serve's gRPC proxy, the generated stubs).

A forced tool choice (``MODE_REQUIRED`` or a named function) comes back as a
parsed call of a declared tool with arguments valid for its schema and the
finish ``tool_calls``, even from random weights (constrained decoding); the
conversation then continues with the assistant's call and the tool's result,
rendered as the HTTP API renders the same turn (same prompt, same greedy
answer). ``top_logprobs`` gives k alternatives per token with their exact
bytes; a repeated prompt reports its cached tokens in ``Usage`` as HTTP's
``prompt_tokens_details`` does; bad fields are INVALID_ARGUMENT naming the
field, and the server keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
requests = pytest.importorskip("requests")

from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.engine.presets import preset_dir  # noqa: E402
from rayturn.engine.token_bytes import token_display  # noqa: E402
from rayturn.engine.tokenizer import Tokenizer  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402

HTTP_PORT, GRPC_PORT = 28561, 29561
THRESHOLD = 48  # uncached prompt tokens from which a prefill replica computes the prompt
PAGE_SIZE = 16
METADATA = (("application", "rayturn"),)
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "enum": ["README.md", "setup.py"]},
        "line": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["path", "line"],
}
# Bounded arguments: random weights never close a free string.
TOOLS = [
    pb.Tool(name="open_file", description="Open a file at a line.", parameters_json=json.dumps(OPEN_SCHEMA)),
    pb.Tool(name="close_file", parameters_json=json.dumps(OPEN_SCHEMA)),
]
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "open_file", "description": "Open a file at a line.", "parameters": OPEN_SCHEMA},
    },
    {"type": "function", "function": {"name": "close_file", "parameters": OPEN_SCHEMA}},
]
USER = "Open the readme."


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(load_config(**small_cluster(HTTP_PORT, GRPC_PORT, THRESHOLD))) as url:
        yield url


@pytest.fixture(scope="module")
def stub(cluster: str) -> Iterator[Any]:
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        yield pb_grpc.RayTurnStub(channel)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(preset_dir("tiny"))


def chat(*messages: pb.ChatMessage, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=pb.Messages(messages=messages), session_id="grpc-agent", **fields)


def generate(stub: Any, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, metadata=METADATA, timeout=120))


def tool_calls(responses: Sequence[pb.GenerateResponse]) -> list[pb.ToolCall]:
    return [call for response in responses for call in response.tool_calls]


def forced_call(stub: Any, choice: pb.ToolChoice) -> tuple[list[pb.GenerateResponse], pb.ToolCall]:
    request = chat(
        pb.ChatMessage(role="user", content=USER),
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        sampling=pb.SamplingOptions(max_tokens=80, temperature=0.0),
    )
    responses = generate(stub, request)
    calls = tool_calls(responses)
    assert len(calls) == 1
    return responses, calls[0]


@pytest.mark.parametrize(
    "choice",
    [pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED), pb.ToolChoice(function_name="open_file")],
    ids=["required", "named"],
)
def test_a_forced_tool_choice_returns_a_parsed_call(stub: Any, choice: pb.ToolChoice) -> None:
    responses, call = forced_call(stub, choice)
    if choice.HasField("function_name"):
        assert call.name == "open_file"
    else:
        assert call.name in ("open_file", "close_file")
    arguments = json.loads(call.arguments)
    assert arguments["path"] in ("README.md", "setup.py") and 1 <= arguments["line"] <= 99
    assert call.id.startswith("call_")
    assert "<tool_call>" not in "".join(r.text for r in responses)  # the markup became the call
    assert [r.finish_reason for r in responses][-1] == "tool_calls"
    assert not any(r.finish_reason for r in responses[:-1])
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    usage = responses[-1].usage
    assert usage.completion_tokens == sum(len(r.token_ids) for r in responses)


def test_the_loop_continues_after_the_tool_ran(cluster: str, stub: Any) -> None:
    """The assistant's call and the tool's result go back; the turn renders and answers as over HTTP."""
    first, call = forced_call(stub, pb.ToolChoice(function_name="open_file"))
    continued = generate(
        stub,
        chat(
            pb.ChatMessage(role="user", content=USER),
            pb.ChatMessage(role="assistant", tool_calls=[call]),
            pb.ChatMessage(role="tool", content="# rayturn\nA serving cluster.", tool_call_id=call.id),
            tools=TOOLS,
            sampling=pb.SamplingOptions(max_tokens=12, temperature=0.0),
        ),
    )
    last = continued[-1]
    assert last.finish_reason in ("stop", "length", "tool_calls")
    assert last.usage.prompt_tokens > first[-1].usage.prompt_tokens

    openai_call = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": USER},
            {"role": "assistant", "content": None, "tool_calls": [openai_call]},
            {"role": "tool", "content": "# rayturn\nA serving cluster.", "tool_call_id": call.id},
        ],
        "tools": OPENAI_TOOLS,
        "max_tokens": 12,
        "temperature": 0,
    }
    answer = requests.post(f"{cluster}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    http = answer.json()
    assert http["usage"]["prompt_tokens"] == last.usage.prompt_tokens
    assert http["usage"]["completion_tokens"] == last.usage.completion_tokens
    message = http["choices"][0]["message"]
    assert (message["content"] or "") == "".join(r.text for r in continued)
    assert [c["function"]["name"] for c in message.get("tool_calls") or []] == [c.name for c in tool_calls(continued)]


def test_top_logprobs_give_k_alternatives_with_their_bytes(stub: Any, tokenizer: Tokenizer) -> None:
    request = chat(
        pb.ChatMessage(role="user", content="name a sorting algorithm"),
        sampling=pb.SamplingOptions(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3),
    )
    responses = generate(stub, request)
    num_tokens = 0
    for response in responses:
        logprobs = response.logprobs
        assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(response.token_ids)
        for token_id, logprob, top in zip(response.token_ids, logprobs.token_logprobs, logprobs.top_logprobs):
            alternatives = list(top.alternatives)
            assert len(alternatives) == 3
            assert alternatives[0].token_id == token_id  # greedy picks the most likely token
            assert alternatives[0].logprob == pytest.approx(logprob, abs=1e-5)
            assert [a.logprob for a in alternatives] == sorted((a.logprob for a in alternatives), reverse=True)
            for alternative in alternatives:
                # Named as the HTTP APIs name it: its text, or its bytes when it holds part of a character.
                assert alternative.text == token_display(alternative.token_bytes)
                # The byte tokenizer: ids below 256 are the bytes themselves; the others are named tokens.
                name = tokenizer.backend.id_to_token(alternative.token_id)
                assert alternative.token_bytes == (
                    bytes([alternative.token_id]) if alternative.token_id < 256 else name.encode()
                )
        num_tokens += len(response.token_ids)
    assert num_tokens == responses[-1].usage.completion_tokens


def test_a_repeated_prompt_reports_its_cached_tokens_as_http_does(
    cluster: str, stub: Any, tokenizer: Tokenizer
) -> None:
    messages = [{"role": "user", "content": "Refactor this module: " + "def g(y): return y * 2\n" * 6}]
    prompt_len = len(tokenizer.encode_chat(messages))
    assert prompt_len >= THRESHOLD
    request = chat(
        pb.ChatMessage(role="user", content=messages[0]["content"]),
        sampling=pb.SamplingOptions(max_tokens=4, temperature=0.0),
    )
    generate(stub, request)
    usage = generate(stub, request)[-1].usage
    assert usage.prompt_tokens == prompt_len
    assert usage.cached_tokens == (prompt_len - 1) // PAGE_SIZE * PAGE_SIZE > 0
    assert usage.kv_store_tokens <= usage.cached_tokens

    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    http = requests.post(f"{cluster}/v1/chat/completions", json=body, timeout=120).json()
    assert http["usage"]["prompt_tokens_details"] == {
        "cached_tokens": usage.cached_tokens,
        "kv_store_tokens": usage.kv_store_tokens,
    }


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"tools": [pb.Tool(name="open_file", parameters_json="{'type': 'object'}")]}, "tools[0].parameters_json"),
        ({"tools": TOOLS, "tool_choice": pb.ToolChoice(function_name="delete_repo")}, "tool_choice.function_name"),
        ({"sampling": pb.SamplingOptions(logprobs=True, top_logprobs=50)}, "sampling.top_logprobs"),
        ({"sampling": pb.SamplingOptions(top_logprobs=2)}, "sampling.top_logprobs"),
    ],
    ids=["parameters-not-json", "unknown-tool", "top-logprobs-out-of-range", "top-logprobs-without-logprobs"],
)
def test_bad_fields_are_invalid_argument_naming_them(stub: Any, request_fields: dict[str, Any], field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        generate(stub, chat(pb.ChatMessage(role="user", content="hi"), **request_fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'{field}'" in (caught.value.details() or "")
    # The server stays up: the next call is answered.
    ok = generate(stub, chat(pb.ChatMessage(role="user", content="hi"), sampling=pb.SamplingOptions(max_tokens=2)))
    assert ok[-1].usage.completion_tokens == sum(len(r.token_ids) for r in ok) >= 1
    assert stub.Health(pb.HealthRequest(), metadata=METADATA).status == "ok"


def test_usage_carries_energy_per_call_and_session_and_speculation_keeps_the_answer(stub: Any) -> None:
    """``Usage.energy``: each call's joules (the prefill replica's too past the threshold), the meter, and the
    session's running total; ``sampling.speculative`` changes nothing of a greedy answer."""
    long_prompt = "Refactor this module: " + "def h(z): return z - 1\n" * 6  # past the threshold
    energies = []
    for text in (long_prompt, "hi"):
        request = pb.GenerateRequest(
            text=text, session_id="grpc-energy", sampling=pb.SamplingOptions(max_tokens=4, temperature=0.0)
        )
        energies.append(generate(stub, request)[-1].usage.energy)
    for energy in energies:
        assert energy.joules > 0 and set(energy.meter.split("+")) <= {"model", "rapl", "nvml"}
    assert [energy.session_joules for energy in energies] == pytest.approx(
        [energies[0].joules, energies[0].joules + energies[1].joules]
    )
    answers = []
    for speculative in (False, True):
        sampling = pb.SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=speculative)
        responses = generate(stub, pb.GenerateRequest(text="a = 1\nb = 1\n" * 4, sampling=sampling))
        assert not responses[-1].usage.energy.HasField("session_joules")  # no session named
        answers.append([token for response in responses for token in response.token_ids])
    assert answers[0] == answers[1] and len(answers[0]) == 24
