"""Trace readers: Claude Code (weka) JSON, Mooncake JSON lines, TraceLab round traces; turns and gaps."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from rayturn.replay.trace_files import load_traces, read_trace
from rayturn.replay.traces import Call, Conversation

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def weka_request(t: float, kind: str, out: int = 10, api_time: float | None = 2.0, **extra: Any) -> dict[str, Any]:
    request: dict[str, Any] = {
        "t": t,
        "type": "n",
        "in": 1000,
        "out": out,
        "hash_ids": [1, 2],
        "input_types": ["text"] if kind == "user" else ["tool_result"],
        "stop": "tool_use",
        "think_time": 0.0,
    }
    if api_time is not None:
        request["api_time"] = api_time
    request.update(extra)
    return request


def weka_trace() -> dict[str, Any]:
    subagent = {
        "t": 30.0,
        "type": "subagent",
        "agent_id": "agent_001",
        "duration_ms": 20_000,
        "requests": [weka_request(0.0, "user", hash_ids=[7]), weka_request(6.0, "tool", stop="end_turn")],
    }
    return {
        "id": "conv-1",
        "block_size": 64,
        "requests": [
            weka_request(0.0, "user"),  # turn 0: 0 .. 2
            subagent,  # runs 10 .. 30 on the parent's clock
            weka_request(32.0, "tool", think_time=30.0),  # ends 34
            weka_request(40.0, "tool", stop="end_turn", think_time=6.0),  # ends 42: turn 0 over
            weka_request(100.0, "user", stop="", api_time=None),  # turn 1: cut off, no duration
            weka_request(
                103.0, "user", input_types=["text", "tool_result", "tool_use"], stop="end_turn"
            ),  # turn 2 (a message with a tool result)
        ],
    }


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def write_lines(path: Path, rows: list[dict[str, Any]]) -> Path:
    text = "\n".join(json.dumps(row) for row in rows) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as stream:
            stream.write(text)
    else:
        path.write_text(text)
    return path


def test_weka_calls_kinds_subagents_and_finish_reasons(tmp_path: Path) -> None:
    (conversation,) = read_trace(write(tmp_path / "c.json", weka_trace()))
    assert conversation.conversation_id == "conv-1"
    assert conversation.trace_format == "weka"
    assert conversation.block_size == 64
    arrivals = [call.arrival_s for call in conversation.calls]
    assert arrivals == [0.0, 10.0, 16.0, 32.0, 40.0, 100.0, 103.0]
    assert [call.subagent_id for call in conversation.calls] == [None, "agent_001", "agent_001", None, None, None, None]
    assert [call.kind for call in conversation.calls] == [
        "user",
        "user",
        "tool_continuation",
        "tool_continuation",
        "tool_continuation",
        "user",
        "user",
    ]
    assert [call.starts_turn for call in conversation.calls] == [True, False, False, False, False, True, True]
    assert [call.finish_reason for call in conversation.calls] == [
        "tool_calls",
        "tool_calls",
        "stop",
        "tool_calls",
        "stop",
        None,
        "stop",
    ]
    assert conversation.calls[1].hash_ids == (7,)
    assert conversation.calls[3].tool_latency_s == 30.0
    assert conversation.calls[0].tool_latency_s is None
    assert conversation.calls[5].duration_s is None
    assert conversation.calls[5].end_s == 100.0


def test_weka_turns_and_gaps(tmp_path: Path) -> None:
    (conversation,) = read_trace(write(tmp_path / "c.json", weka_trace()))
    turns = conversation.turns()
    assert [len(turn.calls) for turn in turns] == [5, 1, 1]
    assert (turns[0].start_s, turns[0].end_s, turns[0].duration_s) == (0.0, 42.0, 42.0)
    think = conversation.think_gaps()
    assert [(gap.kind, gap.start_s, gap.duration_s, gap.turn_index) for gap in think] == [
        ("think", 42.0, 58.0, 0),
        ("think", 100.0, 3.0, 1),
    ]
    tool = conversation.tool_gaps()
    # Parent: 2 -> 32 and 34 -> 40; the sub-agent's own loop: 12 -> 16.
    assert sorted((gap.start_s, gap.duration_s) for gap in tool) == [(2.0, 30.0), (12.0, 4.0), (34.0, 6.0)]
    assert all(gap.kind == "tool" and gap.turn_index == 0 for gap in tool)
    assert think[0].end_s == 100.0


def test_an_async_subagent_without_a_duration_starts_at_its_entry(tmp_path: Path) -> None:
    """kv-cache-tester records a sub-agent launched in the background with ``duration_ms: null``."""
    trace = weka_trace()
    trace["requests"][1] |= {"t": 12.5, "duration_ms": None, "status": "async_launched"}
    (conversation,) = read_trace(write(tmp_path / "c.json", trace))
    assert [call.arrival_s for call in conversation.calls if call.subagent_id] == [12.5, 18.5]


def test_first_turn_opens_with_the_first_call_even_without_a_user_message() -> None:
    calls = (Call(0.0, 10, 1, "tool_continuation", duration_s=1.0), Call(5.0, 10, 1, "user", duration_s=1.0))
    conversation = Conversation("c", "weka", calls)
    assert [len(turn.calls) for turn in conversation.turns()] == [1, 1]
    assert [gap.duration_s for gap in conversation.think_gaps()] == [4.0]


def test_conversation_rejects_calls_out_of_order() -> None:
    calls = (Call(5.0, 10, 1, "user"), Call(1.0, 10, 1, "user"))
    with pytest.raises(ValueError, match="arrival order"):
        Conversation("c", "weka", calls)


def test_mooncake_requests_chain_into_conversations(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 700, "output_length": 9, "hash_ids": [0, 5]},
        # Repeats request 1's two full blocks: the same conversation, 60 s later.
        {"timestamp": 60_000, "input_length": 1700, "output_length": 20, "hash_ids": [0, 1, 3, 4]},
        # Request 2 has one full block only, too little to be continued: a new conversation.
        {"timestamp": 61_000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 5, 6]},
        # Request 1 was continued already (line 3), so this fork starts another conversation.
        {"timestamp": 62_000, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, 8]},
        {"timestamp": 90_000, "input_length": 2200, "output_length": 5, "hash_ids": [0, 1, 3, 4, 9]},
    ]
    conversations = read_trace(write_lines(tmp_path / "conversation_trace.jsonl", rows))
    by_id = {c.conversation_id: c for c in conversations}
    assert sorted(by_id) == ["conversation_trace:1", "conversation_trace:2", "conversation_trace:4"] + [
        "conversation_trace:5"
    ]
    chained = by_id["conversation_trace:1"]
    assert [call.arrival_s for call in chained.calls] == [0.0, 60.0, 90.0]
    assert [call.input_tokens for call in chained.calls] == [1100, 1700, 2200]
    assert all(call.starts_turn and call.duration_s is None for call in chained.calls)
    assert chained.block_size == 512
    assert [gap.duration_s for gap in chained.think_gaps()] == [60.0, 30.0]
    assert by_id["conversation_trace:4"].calls[0].arrival_s == 0.0


def tracelab_round(
    session_id: str, round_index: int, events: list[tuple[str, str]], tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "provider": "claude",
        "session_id": session_id,
        "round_index": round_index,
        "input_tokens_total": 1500,
        "prefix_tokens": 1000,
        "newly_append_tokens": 500,
        "output_tokens": 40,
        "timing_events": [{"event_type": kind, "timestamp": stamp} for kind, stamp in events],
        "tools": tools or [],
    }


def tracelab_rows() -> list[dict[str, Any]]:
    tools = [
        {"tool_name": "Bash", "tool_wall_latency_ms": 860, "tool_internal_latency_ms": None},
        {"tool_name": "WebSearch", "tool_wall_latency_ms": 19_291, "tool_internal_latency_ms": 19_287},
    ]
    return [
        # Rows out of round order on purpose: the reader sorts by round_index.
        tracelab_round(
            "s1",
            1,
            [
                ("tool_result", "2026-06-01T05:40:31.696Z"),
                ("tool_result", "2026-06-01T05:40:50.938Z"),
                ("text", "2026-06-01T05:41:04.609Z"),
            ],
        ),
        tracelab_round(
            "s1",
            0,
            [
                ("user_message", "2026-06-01T05:40:20.151Z"),
                ("reasoning", "2026-06-01T05:40:29.420Z"),
                ("tool_call", "2026-06-01T05:40:31.647Z"),
            ],
            tools,
        ),
        tracelab_round("s2", 0, [("user_message", "2026-06-01T06:00:00Z"), ("text", "2026-06-01T06:00:02Z")]),
        tracelab_round(
            "s1", 2, [("user_message", "2026-06-01T05:45:00.000Z"), ("usage_report", "2026-06-01T05:45:03.000Z")]
        ),
    ]


def test_tracelab_rounds_become_calls(tmp_path: Path) -> None:
    conversations = read_trace(write_lines(tmp_path / "round_trace.jsonl", tracelab_rows()))
    assert [c.conversation_id for c in conversations] == ["s1", "s2"]
    s1 = conversations[0]
    assert s1.trace_format == "tracelab"
    assert s1.start_epoch_s == pytest.approx(1780292420.151)
    assert [call.arrival_s for call in s1.calls] == pytest.approx([0.0, 30.787, 279.849])
    assert [call.kind for call in s1.calls] == ["user", "tool_continuation", "user"]
    assert [call.finish_reason for call in s1.calls] == ["tool_calls", "stop", "stop"]
    assert s1.calls[0].duration_s == pytest.approx(11.496)
    assert (s1.calls[0].input_tokens, s1.calls[0].prefix_tokens, s1.calls[0].output_tokens) == (1500, 1000, 40)
    # The longest tool of the round before, runner-reported where known.
    assert s1.calls[1].tool_latency_s == pytest.approx(19.287)
    assert s1.calls[2].tool_latency_s is None
    assert [len(turn.calls) for turn in s1.turns()] == [2, 1]
    assert [gap.duration_s for gap in s1.think_gaps()] == pytest.approx([279.849 - 44.458])


def test_tracelab_gzip_and_folders_detect_format_per_file(tmp_path: Path) -> None:
    write_lines(tmp_path / "a_round_trace.jsonl.gz", tracelab_rows())
    write(tmp_path / "b_conv.json", weka_trace())
    (tmp_path / "README.md").write_text("not a trace")
    conversations = load_traces([tmp_path])
    assert [(c.trace_format, c.conversation_id) for c in conversations] == [
        ("tracelab", "s1"),
        ("tracelab", "s2"),
        ("weka", "conv-1"),
    ]


@pytest.mark.parametrize(
    ("mutate", "field", "problem"),
    [
        (lambda d: d["requests"][2].pop("in"), "requests[2].in", "missing key"),
        (lambda d: d["requests"][2].update(t="soon"), "requests[2].t", "expected a number"),
        (lambda d: d["requests"][3].update(t=1.0), "requests[3].t", "time goes backwards"),
        (lambda d: d["requests"][1]["requests"][1].update(hash_ids=["x"]), "requests[1].requests[1].hash_ids", "list"),
        (lambda d: d["requests"][0].update(api_time=True), "requests[0].api_time", "expected a number"),
        (lambda d: d.pop("id"), "id", "missing key"),
    ],
)
def test_bad_weka_files_name_file_and_field(tmp_path: Path, mutate: Any, field: str, problem: str) -> None:
    data = weka_trace()
    mutate(data)
    path = write(tmp_path / "bad.json", data)
    with pytest.raises(ValueError, match=r"bad\.json") as error:
        read_trace(path)
    assert f": {field}: " in str(error.value)
    assert problem in str(error.value)


def test_bad_json_lines_name_file_line_and_field(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 5000, "input_length": 10, "output_length": 1, "hash_ids": [0]},
        {"timestamp": 4000, "input_length": 10, "output_length": 1, "hash_ids": [0]},
    ]
    with pytest.raises(ValueError, match=r"moon\.jsonl: line 2: timestamp: time goes backwards"):
        read_trace(write_lines(tmp_path / "moon.jsonl", rows))
    rows[1] = {"timestamp": 6000, "input_length": -1, "output_length": 1, "hash_ids": [0]}
    with pytest.raises(ValueError, match=r"moon\.jsonl: line 2: input_length: expected a non-negative integer"):
        read_trace(write_lines(tmp_path / "moon.jsonl", rows))
    (tmp_path / "broken.jsonl").write_text('{"timestamp": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 2: invalid JSON"):
        read_trace(tmp_path / "broken.jsonl")


def test_bad_tracelab_files_name_file_and_field(tmp_path: Path) -> None:
    rows = tracelab_rows()
    rows[0]["timing_events"][0]["timestamp"] = "yesterday"
    with pytest.raises(ValueError, match=r"rt\.jsonl: line 1: timing_events\[0\]\.timestamp: not an ISO 8601"):
        read_trace(write_lines(tmp_path / "rt.jsonl", rows))
    rows = tracelab_rows()
    rows[3]["timing_events"] = [{"event_type": "user_message", "timestamp": "2026-06-01T05:00:00Z"}]
    with pytest.raises(ValueError, match=r"rt\.jsonl: line 4: timing_events: .*round 2 arrives before round 1"):
        read_trace(write_lines(tmp_path / "rt.jsonl", rows))
    rows = tracelab_rows()
    del rows[2]["newly_append_tokens"]
    with pytest.raises(ValueError, match=r"rt\.jsonl: line 3: newly_append_tokens: missing key"):
        read_trace(write_lines(tmp_path / "rt.jsonl", rows))


def test_unknown_formats_and_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"list\.json: unknown trace format"):
        read_trace(write(tmp_path / "list.json", [1, 2]))
    with pytest.raises(ValueError, match=r"other\.jsonl: unknown trace format"):
        read_trace(write_lines(tmp_path / "other.jsonl", [{"prompt": "hi"}]))
    with pytest.raises(ValueError, match="no such trace file"):
        load_traces([tmp_path / "missing"])


def shared(*parts: str) -> Path:
    path = SHARED_TRACES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real traces not found at {path} (expected ../shared/traces next to the repository)")
    return path


def test_real_claude_code_traces_with_subagents() -> None:
    names = ["trace_0016.json", "trace_0054.json", "trace_0277.json"]
    conversations = load_traces([shared("weka", name) for name in names])
    assert [c.conversation_id for c in conversations] == ["trace_0016", "trace_0054", "trace_0277"]
    with_subagents = conversations[2]
    subagents = {call.subagent_id for call in with_subagents.calls} - {None}
    assert subagents == {"agent_001", "agent_002", "agent_003", "agent_004"}
    assert len(with_subagents.calls) == 9 + 4 + 12 + 17 + 11  # the parent, then each sub-agent
    for conversation in conversations:
        assert all(gap.duration_s >= 0 for gap in conversation.think_gaps() + conversation.tool_gaps())
        assert sum(len(turn.calls) for turn in conversation.turns()) == len(conversation.calls)
    # trace_0016: three user messages, at 0 s, 483 s and 733 s, after responses that ended at 40.4 s and 649.8 s.
    assert [round(gap.duration_s) for gap in conversations[0].think_gaps()] == [443, 83]


def test_real_mooncake_trace() -> None:
    conversations = load_traces([shared("mooncake", "conversation_trace.jsonl")])
    assert sum(len(c.calls) for c in conversations) == 12_031
    assert all(call.starts_turn for c in conversations for call in c.calls)
    multi_turn = [c for c in conversations if len(c.calls) > 1]
    assert len(multi_turn) > 1000
