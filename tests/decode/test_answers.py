"""``AnswerTracker``: per-step deltas, split by the model's tool-call format when the call offered tools."""

from __future__ import annotations

import json

from rayturn.decode.answers import AnswerTracker
from rayturn.engine.outputs import CompletionOutput, RequestOutput
from rayturn.messages import ResumePoint

QWEN3_CODER_CALL = (
    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def _output(text: str, finished: bool) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        token_ids=list(text.encode()),
        text=text,
        finish_reason="stop" if finished else None,
        stop_reason=None,
        logprobs=None,
    )
    return RequestOutput("r", [1, 2], 0, (completion,), finished)


def test_the_configured_format_splits_each_step() -> None:
    tracker = AnswerTracker(tools=True, tool_call_parser="qwen3_coder")
    cut = QWEN3_CODER_CALL.index("</parameter>")
    (first,) = tracker.deltas(_output(QWEN3_CODER_CALL[:cut], finished=False))
    assert [(piece.content, piece.tool_calls) for piece in first.tool_parse] == [("Checking.", ())]
    (last,) = tracker.deltas(_output(QWEN3_CODER_CALL, finished=True))
    pushed, finished = last.tool_parse
    assert pushed.content == "" and finished.content == "" and finished.tool_calls == ()
    (call,) = pushed.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert tracker.called_tools(0)


def test_hermes_is_the_default_and_calls_without_tools_are_not_parsed() -> None:
    hermes = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    (delta,) = AnswerTracker(tools=True).deltas(_output(hermes, finished=True))
    assert [call.name for piece in delta.tool_parse for call in piece.tool_calls] == ["now"]
    untracked = AnswerTracker(tools=False, tool_call_parser="qwen3_coder")
    (delta,) = untracked.deltas(_output(QWEN3_CODER_CALL, finished=True))
    assert delta.tool_parse == () and delta.text == QWEN3_CODER_CALL and not untracked.called_tools(0)


def test_the_call_s_tool_schemas_type_xml_parameter_values() -> None:
    """Qwen3-Coder writes parameter values as raw text: the tool's schema says ``42`` is a string here."""
    tool = {
        "type": "function",
        "function": {
            "name": "write",
            "parameters": {
                "type": "object",
                "properties": {"content": {"type": "string"}, "line": {"type": "integer"}},
            },
        },
    }
    text = (
        "<tool_call>\n<function=write>\n<parameter=content>\n42\n</parameter>\n"
        "<parameter=line>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    typed = AnswerTracker(tools=True, tool_call_parser="qwen3_coder", tool_specs=(tool,))
    (delta,) = typed.deltas(_output(text, finished=True))
    (call,) = [call for piece in delta.tool_parse for call in piece.tool_calls]
    assert json.loads(call.arguments) == {"content": "42", "line": 7}
    untyped = AnswerTracker(tools=True, tool_call_parser="qwen3_coder")
    (delta,) = untyped.deltas(_output(text, finished=True))
    (call,) = [call for piece in delta.tool_parse for call in piece.tool_calls]
    assert json.loads(call.arguments) == {"content": 42, "line": 7}  # without the schema, as JSON


def test_a_resumed_answer_sends_only_what_follows_and_splits_tool_calls_as_one_run_would() -> None:
    cuts = (QWEN3_CODER_CALL.index("<tool_call>") + 3, QWEN3_CODER_CALL.index("Paris"))
    whole = AnswerTracker(tools=True, tool_call_parser="qwen3_coder")
    lost = AnswerTracker(tools=True, tool_call_parser="qwen3_coder")
    streamed = [delta for cut in cuts for delta in lost.deltas(_output(QWEN3_CODER_CALL[:cut], finished=False))]
    pieces = tuple(delta.text for delta in streamed)
    assert "".join(pieces) == QWEN3_CODER_CALL[: cuts[-1]]

    resumed = AnswerTracker(tools=True, tool_call_parser="qwen3_coder")
    prefix = QWEN3_CODER_CALL[: cuts[-1]].encode()
    resumed.resume(ResumePoint(tuple(prefix), None, pieces))
    (rest,) = resumed.deltas(_output(QWEN3_CODER_CALL, finished=True))
    assert rest.text == QWEN3_CODER_CALL[cuts[-1] :] and rest.token_ids == tuple(
        QWEN3_CODER_CALL.encode()[len(prefix) :]
    )
    assert resumed.called_tools(0)

    parsed = [piece for delta in (*streamed, rest) for piece in delta.tool_parse]
    (reference,) = whole.deltas(_output(QWEN3_CODER_CALL, finished=True))
    assert "".join(piece.content for piece in parsed) == "".join(piece.content for piece in reference.tool_parse)
    calls = [(call.name, call.arguments) for piece in parsed for call in piece.tool_calls]
    assert calls == [(call.name, call.arguments) for piece in reference.tool_parse for call in piece.tool_calls]


def test_the_call_s_reasoning_format_splits_the_reasoning_off_before_the_calls() -> None:
    """The Call's ``reasoning`` (the ingress's choice: the server's parser, thinking on): what the model thinks,
    and a call it only thinks about, stay reasoning; the call after ``</think>`` is the call."""
    text = f"<think>\nFirst I would try <tool_call>.\n</think>\n\n{QWEN3_CODER_CALL}"
    tracker = AnswerTracker(tools=True, tool_call_parser="qwen3_coder", reasoning="deepseek_r1")
    cut = text.index("</th")
    (first,) = tracker.deltas(_output(text[:cut], finished=False))
    (last,) = tracker.deltas(_output(text, finished=True))
    pieces = (*first.tool_parse, *last.tool_parse)
    assert "".join(piece.reasoning for piece in pieces) == "First I would try <tool_call>."
    assert "".join(piece.content for piece in pieces) == "Checking."
    assert [call.name for piece in pieces for call in piece.tool_calls] == ["get_weather"]
    plain = AnswerTracker(tools=True, tool_call_parser="qwen3_coder")
    (whole,) = plain.deltas(_output(text, finished=True))
    assert all(piece.reasoning == "" for piece in whole.tool_parse)
