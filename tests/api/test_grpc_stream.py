"""A call's deltas as ``Generate`` messages: prose without call markup, whole tool calls, ``tool_calls`` as the
finish, alternatives with their exact bytes, and usage (energy too) only on the stream's last message."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from rayturn.api.grpc_stream import GrpcStream
from rayturn.api.pipeline import CallResult
from rayturn.engine.presets import preset_dir
from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.token_bytes import TokenBytes, token_display
from rayturn.engine.tokenizer import Tokenizer
from rayturn.engine.tool_calls import ToolCallStream
from rayturn.messages import Delta
from rayturn.protos import rayturn_pb2 as pb

CALL = '<tool_call>{"name": "open_file", "arguments": {"path": "README.md"}}</tool_call>'
RESULT = CallResult(
    completions={},
    prompt_tokens=40,
    cached_tokens=32,
    loaded_tokens=16,
    attempt_energy_j=0.25,
    earlier_energy_j=0.5,
    energy_meter="rapl",
    session_energy_j=2.0,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(preset_dir("tiny"))


def replica_deltas(
    pieces: Sequence[str], finish_reason: str, *, index: int = 0, tools: bool = True, parser: str = "hermes"
) -> list[Delta]:
    """The deltas a decode replica sends for text arriving in ``pieces``, split as it splits them."""
    split = ToolCallStream(parser, id_factory=iter(f"call_{i}" for i in range(9)).__next__) if tools else None
    deltas = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        parse = () if split is None else (split.push(piece), split.finish()) if last else (split.push(piece),)
        deltas.append(
            Delta(
                index=index,
                token_ids=(i,),
                text=piece,
                logprobs=None,
                finish_reason=finish_reason if last else None,
                tool_parse=parse,
            )
        )
    return deltas


def responses(stream: GrpcStream, deltas: Sequence[Delta]) -> list[pb.GenerateResponse]:
    return [stream.response(delta, RESULT) for delta in deltas]


def test_prose_and_calls_come_apart_and_the_finish_says_tool_calls() -> None:
    stream = GrpcStream(n=1, tools=True, token_text=str)
    pieces = ["Opening it. ", CALL[:20], CALL[20:50], CALL[50:]]
    out = responses(stream, replica_deltas(pieces, "stop"))
    assert "".join(r.text for r in out) == "Opening it."
    calls = [call for r in out for call in r.tool_calls]
    assert [(c.id, c.name) for c in calls] == [("call_0", "open_file")]
    assert json.loads(calls[0].arguments) == {"path": "README.md"}
    assert [r.finish_reason for r in out] == ["", "", "", "tool_calls"]
    assert [r.HasField("usage") for r in out] == [False, False, False, True]
    energy = pb.Energy(joules=0.75, meter="rapl", session_joules=2.0)
    assert out[-1].usage == pb.Usage(
        prompt_tokens=40, completion_tokens=0, cached_tokens=32, kv_store_tokens=16, energy=energy
    )


@pytest.mark.parametrize(("parallel", "num_calls"), [(True, 2), (False, 1)])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel: bool, num_calls: int) -> None:
    stream = GrpcStream(n=1, tools=True, parallel_tool_calls=parallel, token_text=str)
    out = responses(stream, replica_deltas([CALL, "\n", CALL], "stop"))
    assert [c.id for r in out for c in r.tool_calls] == [f"call_{i}" for i in range(num_calls)]
    assert out[-1].finish_reason == "tool_calls"


def test_harmony_reasoning_comes_apart_from_the_text() -> None:
    answer = "<|channel|>analysis<|message|>Say hi back.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    stream = GrpcStream(n=1, tools=True, token_text=str)
    out = responses(stream, replica_deltas([answer[:34], answer[34:70], answer[70:]], "stop", parser="harmony"))
    assert "".join(r.reasoning for r in out) == "Say hi back."
    assert "".join(r.text for r in out) == "Hi!"
    assert sum(bool(r.reasoning) for r in out) >= 2  # streamed as it is decided


def test_a_call_that_offered_no_tools_streams_its_text_as_is() -> None:
    stream = GrpcStream(n=1, tools=False, token_text=str)
    out = responses(stream, replica_deltas(["Plain ", CALL], "length", tools=False))
    assert "".join(r.text for r in out) == "Plain " + CALL
    assert not any(r.tool_calls for r in out) and out[-1].finish_reason == "length"


def test_usage_waits_for_the_last_completion() -> None:
    stream = GrpcStream(n=2, tools=True, token_text=str)
    first = replica_deltas(["no call"], "stop", index=0)
    second = replica_deltas(["", CALL], "stop", index=1)
    out = responses(stream, [first[0], second[0], second[1]])
    assert [(r.index, r.finish_reason, r.HasField("usage")) for r in out] == [
        (0, "stop", False),
        (1, "", False),
        (1, "tool_calls", True),
    ]


@pytest.mark.parametrize("asked", [True, False])
def test_the_prompt_s_token_ids_go_out_once_on_the_first_message_when_asked(asked: bool) -> None:
    stream = GrpcStream(n=2, tools=False, token_text=str, prompt_token_ids=(7, 8, 9) if asked else None)
    first, second = replica_deltas(["a", "b"], "stop", index=1, tools=False), replica_deltas(["c"], "stop", tools=False)
    out = responses(stream, [first[0], second[0], first[1]])
    assert [list(r.prompt_token_ids) for r in out] == [[7, 8, 9] if asked else [], [], []]
    assert [r.token_ids[0] for r in out] == [0, 0, 1] and out[-1].HasField("usage")


def test_alternatives_carry_text_and_exact_bytes(tokenizer: Tokenizer) -> None:
    token_bytes = TokenBytes(tokenizer.backend)
    stream = GrpcStream(n=1, tools=False, token_text=lambda i: token_display(token_bytes(i)), token_bytes=token_bytes)
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None
    # "é" is two byte tokens: each alone decodes to U+FFFD, its bytes stay exact.
    logprobs = (
        TokenLogprob(token_id=195, logprob=-0.1, top=((195, -0.1), (ord("a"), -2.5))),
        TokenLogprob(token_id=169, logprob=-0.2, top=((169, -0.2), (im_end, -3.0))),
    )
    delta = Delta(index=0, token_ids=(195, 169), text="é", logprobs=logprobs, finish_reason=None)
    response = stream.response(delta, RESULT)
    assert list(response.logprobs.token_logprobs) == pytest.approx([-0.1, -0.2])
    top = [[(a.token_id, a.text, a.token_bytes) for a in t.alternatives] for t in response.logprobs.top_logprobs]
    assert top == [
        [(195, "bytes:\\xc3", b"\xc3"), (ord("a"), "a", b"a")],
        [(169, "bytes:\\xa9", b"\xa9"), (im_end, "<|im_end|>", b"<|im_end|>")],
    ]
    assert [a.logprob for a in response.logprobs.top_logprobs[0].alternatives] == pytest.approx([-0.1, -2.5])
    assert token_bytes(10**6) == b""


def test_without_top_logprobs_only_the_sampled_logprobs_go_out() -> None:
    stream = GrpcStream(n=1, tools=False, token_text=str)
    logprobs = (TokenLogprob(token_id=5, logprob=-0.5, top=()),)
    response = stream.response(Delta(0, (5,), "x", logprobs, None), RESULT)
    assert list(response.logprobs.token_logprobs) == [-0.5] and not response.logprobs.top_logprobs
