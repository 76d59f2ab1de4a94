"""The committed gRPC modules match rayturn.proto, and the messages behave as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayturn.protos import SERVICER_FUNCTION, generate, rayturn_pb2, rayturn_pb2_grpc


def test_committed_modules_match_proto(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert sorted(path.name for path in written) == sorted(generate.GENERATED_NAMES)
    for name in generate.GENERATED_NAMES:
        committed = generate.PROTO_DIR / name
        assert committed.exists(), f"protos/{name} is missing; run `make protos`"
        assert (tmp_path / name).read_bytes() == committed.read_bytes(), (
            f"protos/{name} is stale against protos/rayturn.proto; run `make protos`"
        )


def _round_trip(request: rayturn_pb2.GenerateRequest) -> rayturn_pb2.GenerateRequest:
    return rayturn_pb2.GenerateRequest.FromString(request.SerializeToString())


def test_text_input_round_trips() -> None:
    parsed = _round_trip(rayturn_pb2.GenerateRequest(model="m", text="def f():", session_id="s1", request_id="r1"))
    assert parsed.WhichOneof("input") == "text"
    assert (parsed.model, parsed.text, parsed.session_id, parsed.request_id) == ("m", "def f():", "s1", "r1")


def test_token_ids_input_round_trips() -> None:
    parsed = _round_trip(rayturn_pb2.GenerateRequest(token_ids=rayturn_pb2.TokenIds(ids=[1, 2, 3])))
    assert parsed.WhichOneof("input") == "token_ids"
    assert list(parsed.token_ids.ids) == [1, 2, 3]


def test_messages_input_round_trips() -> None:
    messages = [
        rayturn_pb2.ChatMessage(role="user", content="run the tests"),
        rayturn_pb2.ChatMessage(role="tool", content="3 passed", name="pytest", tool_call_id="call_0"),
    ]
    parsed = _round_trip(rayturn_pb2.GenerateRequest(messages=rayturn_pb2.Messages(messages=messages)))
    assert parsed.WhichOneof("input") == "messages"
    assert [(m.role, m.content, m.name, m.tool_call_id) for m in parsed.messages.messages] == [
        ("user", "run the tests", "", ""),
        ("tool", "3 passed", "pytest", "call_0"),
    ]


def test_an_agent_turn_round_trips() -> None:
    call = rayturn_pb2.ToolCall(id="call_0", name="run_tests", arguments='{"path": "tests"}')
    request = rayturn_pb2.GenerateRequest(
        messages=rayturn_pb2.Messages(
            messages=[
                rayturn_pb2.ChatMessage(role="assistant", tool_calls=[call]),
                rayturn_pb2.ChatMessage(role="tool", content="3 passed", tool_call_id="call_0"),
            ]
        ),
        tools=[rayturn_pb2.Tool(name="run_tests", description="Run pytest.", parameters_json='{"type": "object"}')],
        tool_choice=rayturn_pb2.ToolChoice(function_name="run_tests"),
        parallel_tool_calls=False,
    )
    parsed = _round_trip(request)
    assert parsed == request
    assert list(parsed.messages.messages[0].tool_calls) == [call]
    assert parsed.tool_choice.WhichOneof("choice") == "function_name"
    assert parsed.HasField("parallel_tool_calls") and not parsed.parallel_tool_calls
    assert not rayturn_pb2.GenerateRequest(text="x").HasField("parallel_tool_calls")
    assert not rayturn_pb2.GenerateRequest(text="x").HasField("tool_choice")
    choice = rayturn_pb2.ToolChoice(function_name="run_tests")
    choice.mode = rayturn_pb2.ToolChoice.MODE_REQUIRED  # one form at a time
    assert choice.WhichOneof("choice") == "mode" and not choice.function_name


def test_setting_one_input_clears_the_others() -> None:
    request = rayturn_pb2.GenerateRequest(text="hello")
    request.token_ids.ids.append(7)
    assert request.WhichOneof("input") == "token_ids"
    assert not request.HasField("text")
    assert rayturn_pb2.GenerateRequest().WhichOneof("input") is None


def test_optional_sampling_fields_keep_explicit_zero_apart_from_unset() -> None:
    sampling = rayturn_pb2.SamplingOptions(temperature=0.0, seed=0, stop=["\n\n"], stop_token_ids=[2], n=2)
    parsed = _round_trip(rayturn_pb2.GenerateRequest(text="x", sampling=sampling)).sampling
    assert parsed.HasField("temperature") and parsed.temperature == 0.0
    assert parsed.HasField("seed") and parsed.seed == 0
    for unset in ("max_tokens", "top_p", "top_k"):
        assert not parsed.HasField(unset), unset
    assert (list(parsed.stop), list(parsed.stop_token_ids), parsed.n) == (["\n\n"], [2], 2)
    with pytest.raises(ValueError):
        parsed.HasField("n")


def test_response_and_health_round_trip() -> None:
    response = rayturn_pb2.GenerateResponse(
        index=1,
        token_ids=[5, 6],
        text="ok",
        finish_reason="stop",
        usage=rayturn_pb2.Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=8, kv_store_tokens=4),
        logprobs=rayturn_pb2.Logprobs(
            token_logprobs=[-0.5, -0.25],
            top_logprobs=[
                rayturn_pb2.TopLogprobs(
                    alternatives=[
                        rayturn_pb2.TokenLogprob(token_id=5, text="\ufffd", logprob=-0.5, token_bytes=b"\xc3")
                    ]
                ),
                rayturn_pb2.TopLogprobs(),
            ],
        ),
        tool_calls=[rayturn_pb2.ToolCall(id="call_1", name="open_file", arguments="{}")],
    )
    parsed = rayturn_pb2.GenerateResponse.FromString(response.SerializeToString())
    assert parsed == response
    assert not rayturn_pb2.GenerateResponse(text="x").HasField("usage")
    health = rayturn_pb2.HealthResponse(status="degraded", details={"router": "ok", "decode-0": "down"})
    assert dict(rayturn_pb2.HealthResponse.FromString(health.SerializeToString()).details) == {
        "router": "ok",
        "decode-0": "down",
    }


def test_service_entry_points_exist() -> None:
    assert callable(rayturn_pb2_grpc.add_RayTurnServicer_to_server)
    assert callable(rayturn_pb2_grpc.RayTurnStub)
    assert hasattr(rayturn_pb2_grpc.RayTurnServicer, "Generate")
    assert hasattr(rayturn_pb2_grpc.RayTurnServicer, "Health")
    assert hasattr(rayturn_pb2_grpc.RayTurnServicer, "Prewarm")
    assert hasattr(rayturn_pb2_grpc.RayTurnServicer, "Tokenize")
    module_name, _, function_name = SERVICER_FUNCTION.rpartition(".")
    assert module_name == rayturn_pb2_grpc.__name__
    assert getattr(rayturn_pb2_grpc, function_name) is rayturn_pb2_grpc.add_RayTurnServicer_to_server
