"""``GenerateRequest`` messages become the chat form HTTP builds: the same ChatRequest for the same call, and
400s whose message quotes the proto field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rayturn.api.chat_request import parse_chat_request
from rayturn.api.errors import APIError
from rayturn.api.grpc_request import RawPrompt, parse_generate_request
from rayturn.api.protocol import ChatRequest, SamplingSpec
from rayturn.engine.guided import Guide
from rayturn.protos import rayturn_pb2 as pb

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "line": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["path"],
}
TOOL = pb.Tool(name="open_file", description="Open a file.", parameters_json=json.dumps(SCHEMA))


def request(*messages: pb.ChatMessage, **fields: Any) -> pb.GenerateRequest:
    conversation = messages or (pb.ChatMessage(role="user", content="open the readme"),)
    return pb.GenerateRequest(messages=pb.Messages(messages=conversation), **fields)


def parsed_chat(message: pb.GenerateRequest) -> ChatRequest:
    parsed = parse_generate_request(message, MODEL)
    assert isinstance(parsed, ChatRequest)
    return parsed


def test_an_agent_turn_is_the_chat_request_http_builds() -> None:
    """Tools, a named choice, an assistant tool call and its result: field for field what the OpenAI body gives."""
    grpc_chat = parsed_chat(
        request(
            pb.ChatMessage(role="developer", content="You edit code."),
            pb.ChatMessage(role="user", content="open the readme"),
            pb.ChatMessage(
                role="assistant",
                tool_calls=[pb.ToolCall(id="call_1", name="open_file", arguments='{"path": "README.md"}')],
            ),
            pb.ChatMessage(role="tool", content="# rayturn", tool_call_id="call_1"),
            tools=[TOOL],
            tool_choice=pb.ToolChoice(function_name="open_file"),
            parallel_tool_calls=False,
            sampling=pb.SamplingOptions(max_tokens=40, temperature=0.0, logprobs=True, top_logprobs=3),
        )
    )
    http_chat = parse_chat_request(
        {
            "model": MODEL,
            "messages": [
                {"role": "developer", "content": "You edit code."},
                {"role": "user", "content": "open the readme"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "open_file", "arguments": '{"path": "README.md"}'},
                        }
                    ],
                },
                {"role": "tool", "content": "# rayturn", "tool_call_id": "call_1"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "open_file", "description": "Open a file.", "parameters": SCHEMA},
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "open_file"}},
            "parallel_tool_calls": False,
            "max_tokens": 40,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
        MODEL,
    )
    assert grpc_chat.messages == http_chat.messages
    assert grpc_chat.messages[2]["tool_calls"][0]["function"]["arguments"] == {"path": "README.md"}
    assert (grpc_chat.tools, grpc_chat.tool_choice, grpc_chat.prompt_tools) == (
        http_chat.tools,
        http_chat.tool_choice,
        http_chat.prompt_tools,
    )
    assert grpc_chat.parallel_tool_calls is False
    assert grpc_chat.sampling == http_chat.sampling


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, "auto"),
        (pb.ToolChoice(), "auto"),
        (pb.ToolChoice(mode=pb.ToolChoice.MODE_AUTO), "auto"),
        (pb.ToolChoice(mode=pb.ToolChoice.MODE_NONE), "none"),
        (pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED), "required"),
    ],
)
def test_tool_choice_modes(choice: pb.ToolChoice | None, expected: str) -> None:
    fields: dict[str, Any] = {"tools": [TOOL]}
    if choice is not None:
        fields["tool_choice"] = choice
    chat = parsed_chat(request(**fields))
    assert chat.tool_choice == expected
    assert (chat.prompt_tools is None) == (expected == "none")
    assert chat.parallel_tool_calls is True


def test_without_tools_nothing_is_offered() -> None:
    chat = parsed_chat(request())
    assert (chat.tools, chat.tool_choice, chat.prompt_tools) == (None, "none", None)
    assert chat.messages == [{"role": "user", "content": "open the readme"}]


def test_raw_prompts_keep_their_form_and_sampling() -> None:
    sampling = pb.SamplingOptions(temperature=0.0, top_k=-1, seed=0, stop=["\n"], n=2)
    text = parse_generate_request(pb.GenerateRequest(text="def f():", sampling=sampling), MODEL)
    assert isinstance(text, RawPrompt) and (text.prompt, text.param) == ("def f():", "text")
    assert text.sampling == SamplingSpec(temperature=0.0, top_k=-1, seed=0, stop=("\n",), n=2)
    ids = parse_generate_request(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])), MODEL)
    assert isinstance(ids, RawPrompt) and (ids.prompt, ids.param) == ([1, 2], "token_ids")
    assert ids.sampling == SamplingSpec()


def test_penalties_and_logit_bias_reach_the_sampling() -> None:
    sampling = pb.SamplingOptions(frequency_penalty=0.5, presence_penalty=-1.5, logit_bias={42: 10.0, 7: -100.0})
    parsed = parse_generate_request(pb.GenerateRequest(text="def f():", sampling=sampling), MODEL)
    assert parsed.sampling == SamplingSpec(
        frequency_penalty=0.5, presence_penalty=-1.5, logit_bias=((7, -100.0), (42, 10.0))
    )


def structured(**constraint: Any) -> pb.SamplingOptions:
    return pb.SamplingOptions(structured_output=pb.StructuredOutput(**constraint))


def test_a_structured_output_is_the_guide_http_builds() -> None:
    for constraint, body in [
        ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"choice": pb.Choices(values=["yes", 'say "no"'])}, {"choice": ["yes", 'say "no"']}),
        ({"grammar": 'root ::= "a" | "b"'}, {"grammar": 'root ::= "a" | "b"'}),
        (
            {"json": json.dumps(SCHEMA), "disable_additional_properties": True},
            {"json": SCHEMA, "disable_additional_properties": True},
        ),
        ({"json_object": True}, {"json_object": True}),
    ]:
        over_grpc = parse_generate_request(pb.GenerateRequest(text="hi", sampling=structured(**constraint)), MODEL)
        over_http = parse_chat_request(
            {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": body}, MODEL
        )
        assert over_grpc.sampling.guide == over_http.sampling.guide is not None, constraint
        assert over_grpc.sampling.guide_param == f"sampling.structured_output.{next(iter(constraint))}"
    closed = parse_generate_request(
        pb.GenerateRequest(text="hi", sampling=structured(json=json.dumps(SCHEMA), disable_additional_properties=True)),
        MODEL,
    )
    assert closed.sampling.guide == Guide.json_schema({**SCHEMA, "additionalProperties": False})
    offered = parsed_chat(request(tools=[TOOL], sampling=structured(regex="a")))
    assert offered.tool_choice == "auto" and offered.sampling.guide == Guide.regex("a")


def test_chat_template_kwargs_are_the_ones_http_reads() -> None:
    kwargs = {"enable_thinking": False, "persona": {"name": "agent", "tags": [1, 2.5]}}
    grpc_chat = parsed_chat(request(chat_template_kwargs_json=json.dumps(kwargs)))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "open the readme"}]}
    http_chat = parse_chat_request({**body, "chat_template_kwargs": kwargs}, MODEL)
    assert grpc_chat.template_kwargs == http_chat.template_kwargs == kwargs
    assert parsed_chat(request()).template_kwargs is None
    assert parsed_chat(request(chat_template_kwargs_json="{}")).template_kwargs is None


FORCED = pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED)
BAD_TOOL_CALL = pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="open_file", arguments="{}")])


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (request(tools=[pb.Tool(name="open_file", parameters_json="{not json")]), "tools[0].parameters_json"),
        (request(tools=[pb.Tool(name="open_file", parameters_json="[1, 2]")]), "tools[0].parameters_json"),
        (request(tools=[pb.Tool(name="open_file", parameters_json="[" * 100_000)]), "tools[0].parameters_json"),
        (request(tools=[TOOL, pb.Tool(name="has space")]), "tools[1].name"),
        (request(tools=[TOOL, TOOL]), "tools[1].name"),
        (request(tools=[TOOL] * 129), "tools"),
        (request(tools=[TOOL], tool_choice=pb.ToolChoice(function_name="rm_rf")), "tool_choice.function_name"),
        (request(tool_choice=pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED)), "tool_choice.mode"),
        (request(tools=[TOOL], tool_choice=pb.ToolChoice(mode=7)), "tool_choice.mode"),  # type: ignore[arg-type]
        (pb.GenerateRequest(text="hi", tools=[TOOL]), "tools"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), parallel_tool_calls=False), "parallel_tool_calls"),
        (request(pb.ChatMessage(role="robot", content="hi")), "messages.messages[0].role"),
        (request(pb.ChatMessage(role="tool", content="3 passed")), "messages.messages[0].tool_call_id"),
        (request(BAD_TOOL_CALL), "messages.messages[0].tool_calls[0].id"),
        (
            request(pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(id="c", name="f")])),
            "messages.messages[0].tool_calls",
        ),
        (pb.GenerateRequest(messages=pb.Messages()), "messages.messages"),
        (pb.GenerateRequest(), "input"),
        (pb.GenerateRequest(model="other", text="hi"), "model"),
        (request(sampling=pb.SamplingOptions(logprobs=True, top_logprobs=21)), "sampling.top_logprobs"),
        (request(sampling=pb.SamplingOptions(logprobs=True, top_logprobs=-1)), "sampling.top_logprobs"),
        (request(sampling=pb.SamplingOptions(top_logprobs=2)), "sampling.top_logprobs"),
        (request(sampling=pb.SamplingOptions(max_tokens=0)), "sampling.max_tokens"),
        (request(sampling=pb.SamplingOptions(temperature=-1.0)), "sampling.temperature"),
        (request(sampling=pb.SamplingOptions(top_p=0.0)), "sampling.top_p"),
        (request(sampling=pb.SamplingOptions(top_k=-2)), "sampling.top_k"),
        (request(sampling=pb.SamplingOptions(n=17)), "sampling.n"),
        (request(sampling=pb.SamplingOptions(stop=["a", ""])), "sampling.stop[1]"),
        (request(sampling=pb.SamplingOptions(stop_token_ids=[-3])), "sampling.stop_token_ids[0]"),
        (request(sampling=pb.SamplingOptions(stop=["s"] * 65)), "sampling.stop"),
        (request(sampling=pb.SamplingOptions(stop_token_ids=list(range(257)))), "sampling.stop_token_ids"),
        (request(sampling=pb.SamplingOptions(frequency_penalty=2.5)), "sampling.frequency_penalty"),
        (request(sampling=pb.SamplingOptions(presence_penalty=float("nan"))), "sampling.presence_penalty"),
        (request(sampling=pb.SamplingOptions(logit_bias={3: 100.5})), "sampling.logit_bias[3]"),
        (request(sampling=pb.SamplingOptions(logit_bias={-3: 1.0})), "sampling.logit_bias"),
        (request(sampling=pb.SamplingOptions(logit_bias=dict.fromkeys(range(1025), 1.0))), "sampling.logit_bias"),
        (request(sampling=pb.SamplingOptions(structured_output=pb.StructuredOutput())), "sampling.structured_output"),
        (request(sampling=structured(json_object=False)), "sampling.structured_output"),
        (request(sampling=structured(regex="(?<=a)b")), "sampling.structured_output.regex"),
        (request(sampling=structured(regex="")), "sampling.structured_output.regex"),
        (request(sampling=structured(choice=pb.Choices())), "sampling.structured_output.choice"),
        (request(sampling=structured(grammar="root ::= (")), "sampling.structured_output.grammar"),
        (request(sampling=structured(json="{")), "sampling.structured_output.json"),
        (request(sampling=structured(json='{"type": "banana"}')), "sampling.structured_output.json"),
        (request(tools=[TOOL], tool_choice=FORCED, sampling=structured(regex="a")), "sampling.structured_output.regex"),
        (request(chat_template_kwargs_json="{not json"), "chat_template_kwargs_json"),
        (request(chat_template_kwargs_json='["enable_thinking"]'), "chat_template_kwargs_json"),
        (request(chat_template_kwargs_json='{"tools": []}'), "chat_template_kwargs_json.tools"),
        (request(chat_template_kwargs_json='{"raise_exception": 1}'), "chat_template_kwargs_json.raise_exception"),
        (pb.GenerateRequest(text="hi", chat_template_kwargs_json="{}"), "chat_template_kwargs_json"),
    ],
)
def test_bad_fields_are_400s_that_name_them(message: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_generate_request(message, MODEL)
    assert caught.value.status_code == 400
    assert f"'{field}'" in caught.value.message
