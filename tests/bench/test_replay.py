"""The trace replayer without a cluster: token synthesis, scaling, the plan, the bound, the report, ``rayturn replay``.

Traces are tiny weka-shaped files written in ``tmp_path``. The vocabulary is
hand-made (ids 0..49) except where the model's own is the point, and the
page size is 4, so every expected number can be worked out by hand.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from rayturn.cli import main
from rayturn.replay import cli as replay
from rayturn.replay import driver
from rayturn.replay.kv_demand import auto_device_pages, busiest_pages, kv_demand_pages
from rayturn.replay.model import model_vocabulary, with_context
from rayturn.replay.plans import PlannedCall, plan_conversation
from rayturn.replay.records import CallRecord, SessionView, parse_session_header
from rayturn.replay.report import markdown, write_plots
from rayturn.replay.sample_traces import write_sample_traces
from rayturn.replay.scaling import Scale, auto_token_scale, block_tokens, call_tokens, fit_to_context
from rayturn.replay.summaries import compare, lifecycle_figures, prefix_bound, summarize, targets
from rayturn.replay.synthesis import TokenSynthesizer, prompts
from rayturn.replay.traces import Call, Conversation
from rayturn.replay.workload import TracedConversation, pick_conversations, read_traces

BENCH = Path(__file__).resolve().parents[2] / "bench"

VOCAB = tuple(range(50))
PAGE = 4
SCALE = 1 / 16  # a 64-token block -> 4 tokens: one page


def request(t: float, hash_ids: list[int], text: bool = False, **fields: Any) -> dict[str, Any]:
    return {
        "t": t,
        "type": "n",
        "in": 64 * len(hash_ids),
        "out": fields.pop("out", 64),
        "hash_ids": hash_ids,
        "input_types": ["text"] if text else ["tool_result"],
        "stop": fields.pop("stop", "tool_use"),
        "api_time": fields.pop("api_time", 2.0),
        **fields,
    }


def weka_file(folder: Path, conversation_id: str, requests: list[dict[str, Any]], prefix_tokens: int = 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "id": conversation_id,
        "block_size": 64,
        "hash_id_scope": "local",
        "tool_tokens": prefix_tokens // 2,
        "system_tokens": prefix_tokens - prefix_tokens // 2,
        "requests": requests,
    }
    path = folder / f"{conversation_id}.json"
    path.write_text(json.dumps(data))
    return path


def with_subagent(folder: Path) -> Path:
    """Main calls at 0, 10 and 40 s (2 s each); a sub-agent (entry t=35, 15 s) calls at 20 s (1 s) and 30 s (2 s)."""
    sub_requests = [request(0.0, [1, 7], text=True, api_time=1.0), request(10.0, [1, 7, 8], stop="end_turn")]
    sub = {"t": 35.0, "type": "subagent", "agent_id": "agent_1", "duration_ms": 15_000, "requests": sub_requests}
    return weka_file(
        folder, "conv", [request(0.0, [1], text=True), request(10.0, [1, 2]), sub, request(40.0, [1, 2, 3])]
    )


def two_conversations(folder: Path) -> list[Any]:
    """conv_a: first [1, 2], within [1, 2, 3], cross [1, 2, 3, 4]; conv_b: first [1, 5], cross [1, 5, 6]."""
    weka_file(
        folder,
        "conv_a",
        [
            request(0.0, [1, 2], text=True),
            request(10.0, [1, 2, 3]),
            request(100.0, [1, 2, 3, 4], text=True, stop="end_turn"),
        ],
    )
    weka_file(folder, "conv_b", [request(0.0, [1, 5], text=True), request(50.0, [1, 5, 6], text=True)])
    return read_traces([folder])


def plan(item: Any, scale: float = SCALE, time_scale: float = 0.5, seed: int = 0) -> Any:
    synthesizer = TokenSynthesizer(VOCAB, seed=seed)
    return plan_conversation(item, synthesizer, Scale(scale, time_scale))


def blocks(token_ids: tuple[int, ...], size: int = PAGE) -> list[tuple[int, ...]]:
    return [token_ids[i : i + size] for i in range(0, len(token_ids), size)]


# -- tokens -------------------------------------------------------------------


def test_blocks_follow_hash_ids_and_the_prefix_is_shared(tmp_path: Path) -> None:
    conv_a, conv_b = two_conversations(tmp_path)
    a = [call.token_ids for call in plan(conv_a).main.calls]
    b = [call.token_ids for call in plan(conv_b).main.calls]
    assert [len(tokens) for tokens in a] == [4 + 8, 4 + 12, 4 + 16]  # 64-token prefix and blocks -> 4 tokens each
    assert all(t in VOCAB for tokens in a + b for t in tokens)
    prefix_a, *blocks_a = blocks(a[2])
    prefix_b, *blocks_b = blocks(b[1])
    assert prefix_a == prefix_b  # one shared prefix in every conversation
    assert a[1][: len(a[0])] == a[0] and a[2][: len(a[1])] == a[1]  # equal ids -> equal blocks
    assert len(set(blocks_a)) == 4  # different ids -> different blocks
    assert blocks_a[0] != blocks_b[0]  # hash id 1 of another conversation is another block
    assert blocks(b[0])[1] == blocks_b[0]


def test_synthesis_is_a_function_of_the_seed(tmp_path: Path) -> None:
    conv_a, _ = two_conversations(tmp_path)
    first = [call.token_ids for call in plan(conv_a, seed=3).main.calls]
    assert first == [call.token_ids for call in plan(conv_a, seed=3).main.calls]
    assert first != [call.token_ids for call in plan(conv_a, seed=4).main.calls]


def test_longer_prefixes_extend_shorter_ones() -> None:
    synthesizer = TokenSynthesizer(VOCAB, seed=1)
    short = synthesizer.prefix(5)
    long = synthesizer.prefix(40)
    assert long[:5] == short
    assert TokenSynthesizer(VOCAB, seed=1).prefix(40) == long


def test_subagents_share_their_parents_hash_ids(tmp_path: Path) -> None:
    sub = {"t": 30.0, "type": "subagent", "agent_id": "agent_1", "duration_ms": 15_000, "requests": [
        request(0.0, [1, 7], text=True), request(5.0, [1, 7, 8], stop="end_turn")]}  # fmt: skip
    weka_file(tmp_path, "conv", [request(0.0, [1, 2], text=True), sub, request(40.0, [1, 2, 3])])
    (item,) = read_traces([tmp_path])
    conversation_plan = plan(item)
    (agent,) = conversation_plan.subagents
    main_first = blocks(conversation_plan.main.calls[0].token_ids)
    sub_first = blocks(agent.calls[0].token_ids)
    assert sub_first[:2] == main_first[:2]  # prefix and hash id 1
    assert agent.session_id == "conv/agent_1"


def test_calls_without_hash_ids_reuse_the_previous_prompt(tmp_path: Path) -> None:
    conversation = Conversation("tl", "tracelab", (
        Call(0.0, 160, 16, "user", prefix_tokens=0),
        Call(5.0, 320, 16, "tool_continuation", prefix_tokens=160),
    ))  # fmt: skip
    item = TracedConversation(conversation, shared_prefix_tokens=64)
    first, second = prompts(item, TokenSynthesizer(VOCAB), SCALE)
    assert len(first) == 4 + 10 and len(second) == 4 + 20
    assert second[:14] == first  # the prefix, then the 10 reused tokens
    assert second[14:] != first[4:]


def test_the_models_vocabulary_leaves_out_special_tokens() -> None:
    vocabulary = model_vocabulary("tiny")
    assert vocabulary.token_ids == tuple(range(256))  # the byte tokens; 256.. are control tokens
    assert vocabulary.context_tokens == 4096
    assert model_vocabulary("tiny", max_model_len=1024).context_tokens == 1024


# -- scaling ------------------------------------------------------------------


def test_scaled_counts_never_reach_zero() -> None:
    assert block_tokens(64, 1 / 64) == 1
    assert block_tokens(64, 1 / 16) == 4
    assert block_tokens(64, 1 / 1000) == 1
    scale = Scale(1 / 64, 1 / 60)
    assert scale.tokens(0) == 1 and scale.tokens(640) == 10
    assert scale.seconds(120.0) == pytest.approx(2.0) and scale.seconds(-3.0) == 0.0


def test_output_and_gaps_scale(tmp_path: Path) -> None:
    conv_a, _ = two_conversations(tmp_path)
    calls = plan(conv_a, time_scale=0.5).main.calls
    assert [c.max_tokens for c in calls] == [4, 4, 4]
    # Gap: arrival minus the previous call's end (arrival + api_time 2 s), x 0.5.
    assert [c.gap_s for c in calls] == pytest.approx([0.0, 4.0, 44.0])


def test_auto_token_scale_fits_the_longest_call(tmp_path: Path) -> None:
    weka_file(tmp_path, "c", [request(0.0, list(range(1, 11)), text=True, out=640)], prefix_tokens=1280)
    traced = read_traces([tmp_path])
    # At 1/n: round(1280/n) + 10 * round(64/n) + round(640/n) tokens must fit 0.9 * 512 = 460.8.
    assert auto_token_scale(traced, 512) == pytest.approx(1 / 6)  # 213 + 110 + 107 = 430
    assert call_tokens(traced[0], traced[0].conversation.calls[0], 1 / 5) == 256 + 130 + 128  # 514: too long
    # Nothing fits with one token per block: the answer is 1/block_size.
    assert auto_token_scale(traced, 16) == pytest.approx(1 / 64)


def test_conversations_too_long_for_the_context_are_cut(tmp_path: Path) -> None:
    weka_file(tmp_path, "a", [request(0.0, [1], text=True), request(5.0, [1, 2, 3, 4, 5, 6, 7, 8]),
                              request(9.0, [1, 2])])  # fmt: skip
    weka_file(tmp_path, "b", [request(0.0, list(range(1, 40)), text=True)])
    weka_file(tmp_path, "c", [request(0.0, [1], text=True)])
    fitted = fit_to_context(read_traces([tmp_path]), SCALE, 40)  # budget 36 tokens
    assert [item.conversation_id for item in fitted.kept] == ["a", "c"]
    assert len(fitted.kept[0].conversation.calls) == 1  # cut before the 4 + 32 + 4 = 40-token call
    assert fitted.cut == ["a"] and fitted.dropped == ["b"]


def test_quick_picks_the_conversations_opening_the_most_turns_early(tmp_path: Path) -> None:
    weka_file(tmp_path, "a", [request(0.0, [1], text=True), request(500.0, [1, 2], text=True)])
    weka_file(tmp_path, "b", [request(0.0, [1], text=True), request(50.0, [1, 2], text=True)])
    weka_file(tmp_path, "c", [request(0.0, [1], text=True), request(60.0, [1, 2], text=True)])
    traced = read_traces([tmp_path])
    assert [i.conversation_id for i in pick_conversations(traced, 2)] == ["a", "b"]
    picked = pick_conversations(traced, 2, busiest_within_s=100.0)
    assert [i.conversation_id for i in picked] == ["b", "c"]
    assert len(pick_conversations(traced, None)) == 3


# -- the plan -----------------------------------------------------------------


def test_call_kinds_and_headers(tmp_path: Path) -> None:
    conv_a, conv_b = two_conversations(tmp_path)
    calls = plan(conv_a).main.calls
    assert [c.kind for c in calls] == ["first", "within", "cross"]
    assert [c.call_header for c in calls] == ["user", "tool", "user"]
    assert [c.after_header for c in calls] == ["tool", "tool", "user"]  # stop: tool_use, tool_use, end_turn
    assert {c.session_id for c in calls} == {"conv_a"}
    assert [c.kind for c in plan(conv_b).main.calls] == ["first", "cross"]


def test_subagents_start_after_their_parent_call_and_hold_back_the_next(tmp_path: Path) -> None:
    # The parent's call at t=10 ends at 12; the sub-agent runs 20..32 on the parent's clock (entry t=35, 15 s).
    (item,) = read_traces([with_subagent(tmp_path)])
    conversation_plan = plan(item, time_scale=1.0)
    main_calls = conversation_plan.main.calls
    (agent,) = conversation_plan.subagents
    assert agent.parent_call == 1
    assert [c.kind for c in agent.calls] == ["within", "within"]
    assert [c.call_header for c in agent.calls] == ["user", "tool"]
    assert [c.gap_s for c in agent.calls] == pytest.approx([20.0 - 12.0, 30.0 - 21.0])
    assert main_calls[2].waits_for_subagents == (0,)
    assert main_calls[2].gap_s == pytest.approx(40.0 - 32.0)  # from the sub-agent's end, not the parent's call


# -- the bound ----------------------------------------------------------------


def test_bound_on_hand_made_token_streams() -> None:
    sent = [
        ("first", tuple(range(1, 11))),  # pages [1-4] [5-8]: excluded, but cached from now on
        ("within", (*range(1, 9), 20, 21, 22, 23, 24)),  # 2 of 3 countable pages seen: 8 of 13
        ("cross", (*range(1, 9), 20, 21, 22, 23)),  # its 3rd page was seen but holds the last token: 8 of 12
        ("cross", (1, 2, 3, 4, 9, 9, 9, 9, 9)),  # 4 of 9
        ("cross", (9, 9, 9, 9, 1, 2, 3, 4, 5)),  # [9 9 9 9] was seen, but after another page: 0 of 9
    ]
    assert prefix_bound(sent, PAGE) == {
        "bound_within_turn": round(8 / 13, 4),
        "bound_cross_turn": round((8 + 4 + 0) / (12 + 9 + 9), 4),
    }
    assert prefix_bound([("first", (1, 2, 3, 4, 5))], PAGE) == {
        "bound_within_turn": None,
        "bound_cross_turn": None,
    }


def test_bound_of_a_planned_replay(tmp_path: Path) -> None:
    conv_a, conv_b = two_conversations(tmp_path)
    sent = [(c.kind, c.token_ids) for item in (conv_a, conv_b) for c in plan(item).main.calls]
    # conv_a: within [P 1 2 3]: P, 1, 2 countable and seen (12 of 16); cross [P 1 2 3 4]: 16 of 20.
    # conv_b (its id 1 is a new block): first [P 1' 5]; cross [P 1' 5 6]: 12 of 16.
    assert prefix_bound(sent, PAGE) == {"bound_within_turn": 0.75, "bound_cross_turn": round(28 / 36, 4)}


# -- KV demand ----------------------------------------------------------------


def test_kv_demand_counts_the_shared_prefix_once(tmp_path: Path) -> None:
    conv_a, conv_b = two_conversations(tmp_path)
    plans = [plan(conv_a), plan(conv_b)]
    # Largest contexts beyond the 4-token prefix: a 16 + 4 output = 5 pages, b 12 + 4 = 4 pages; prefix 1 page.
    assert kv_demand_pages(plans, PAGE) == 1 + 5 + 4
    # One conversation at a time: the larger peak; both at once: both.
    assert busiest_pages(plans, PAGE, concurrency=1) == 1 + 5
    assert busiest_pages(plans, PAGE, concurrency=2) == 1 + 5 + 4
    assert auto_device_pages(100, busiest=6, decode_replicas=2) == 20  # 100 / (2.5 x 2)
    assert auto_device_pages(100, busiest=60, decode_replicas=2) == 30  # each replica's share of 60


# -- the report ---------------------------------------------------------------


def view(state: str, idle_s: float | None, off_device_s: float | None, resident: int = 10, pages: int = 10) -> Any:
    return SessionView("user", state, idle_s, off_device_s, resident, pages)


def record(kind: str, prompt: int = 100, cached: int = 90, store: int = 0, ttft_s: float = 0.1, **fields: Any) -> Any:
    return CallRecord("c", 0, kind, ok=True, prompt_tokens=prompt, cached_tokens=cached, store_tokens=store,
                             ttft_s=ttft_s, **fields)  # fmt: skip


def test_idle_capture_prewarm_hit_and_warm_returns() -> None:
    cross = [
        record("cross", session=view("prewarmed", 10.0, 9.0)),
        record("cross", session=view("offloaded", 10.0, 10.0, resident=0)),
        record("cross", session=view("held", 5.0, 0.0)),
        record("cross", session=view("prewarming", 5.0, 4.0, resident=8)),
        record("cross", session=view("new", None, None, resident=0, pages=0)),
        record("cross"),  # no header
    ]
    figures = lifecycle_figures(cross)
    assert figures["session_header_calls"] == 5
    assert figures["idle_capture"] == round((9 + 10 + 0 + 4) / 30, 4)
    assert figures["offloaded_returns"] == 3
    assert figures["prewarm_hit"] == round(1 / 3, 4)
    assert figures["warm_return_rate"] == round(3 / 5, 4)  # prewarmed, held, new (0 of 0 pages)
    # Gaps 5, 5, 10, 10 s, two of the four returns warm (the prewarmed and the held): without prewarms,
    # keep the two shortest (10 s on the device). 90% warm keeps all four.
    assert figures["idle_capture_keep_bound"] == round(1 - 10 / 30, 4)
    assert figures["idle_capture_keep_bound_at_target"] == 0.0
    empty = lifecycle_figures([record("cross")])
    assert empty["idle_capture"] is None and empty["idle_capture_keep_bound"] is None
    assert empty["idle_capture_keep_bound_at_target"] is None


def test_summary_splits_tokens_and_checks_targets() -> None:
    records = [
        record("first", prompt=100, cached=0, ttft_s=1.0),
        record("within", prompt=100, cached=95, store=15, ttft_s=0.1, itl_s=(0.01, 0.02)),
        record("within", prompt=100, cached=85, ttft_s=0.2),
        record("cross", prompt=200, cached=180, store=100, ttft_s=0.3, session=view("prewarmed", 10.0, 9.5)),
        CallRecord("c", 9, "within", ok=False, error="boom"),
    ]
    sent = [("within", tuple(range(1, 21))), ("within", tuple(range(1, 21)))]  # bound: 0 of 20, then 16 of 20
    summary = summarize(records, sent, PAGE, wall_s=3.0)
    assert summary["calls"] == 5 and summary["failures"] == 1 and summary["errors"] == ["boom"]
    assert summary["prompt_tokens"] == 500
    assert summary["store_tokens"] == 115
    assert summary["device_cache_tokens"] == 360 - 115
    assert summary["recomputed_tokens"] == 140
    assert summary["hit_within_turn"] == 0.9 and summary["hit_cross_turn"] == 0.9
    assert summary["bound_within_turn"] == 0.4
    assert summary["hit_within_turn_over_bound"] == 2.25
    assert summary["idle_capture"] == 0.95 and summary["prewarm_hit"] == 1.0
    assert summary["ttft_within_p99_s"] == pytest.approx(0.199, abs=1e-5)
    assert summary["ttft_cross_over_within_p99"] == round(0.3 / 0.199, 4)
    targets = summary["targets"]
    assert targets["hit_within_turn_over_bound"] == {"target": ">= 0.95", "value": 2.25, "met": True}
    assert targets["hit_cross_turn_over_bound"]["met"] is False  # no cross-turn bound: not measured
    assert targets["idle_capture"]["met"] and targets["prewarm_hit"]["met"]
    assert targets["ttft_cross_over_within_p99"]["met"] is True  # 1.51 <= 2


def test_targets_compare_each_way() -> None:
    figures = {"hit_within_turn_over_bound": 0.94, "hit_cross_turn_over_bound": 0.9, "idle_capture": None,
               "prewarm_hit": 0.95, "ttft_cross_over_within_p99": 2.5}  # fmt: skip
    met = {name: target["met"] for name, target in targets(figures).items()}
    assert met == {"hit_within_turn_over_bound": False, "hit_cross_turn_over_bound": True, "idle_capture": False,
                   "prewarm_hit": True, "ttft_cross_over_within_p99": False}  # fmt: skip


def test_baselines_are_divided_by_rayturn() -> None:
    systems = {"rayturn": {"ttft_p99_s": 0.5, "hit_cross_turn": 0.9}, "round_robin": {"ttft_p99_s": 1.0}}
    ratios = compare(systems)
    assert list(ratios) == ["round_robin"]
    assert ratios["round_robin"]["ttft_p99_s"] == 2.0
    assert ratios["round_robin"]["hit_cross_turn"] is None


def session_json(call: str, state: str, idle_s: Any, off_device_s: Any, resident: int, pages: int) -> str:
    fields = {"call": call, "state": state, "idle_s": idle_s, "off_device_s": off_device_s}
    return json.dumps({**fields, "resident_pages": resident, "session_pages": pages})


def test_session_header_parsing() -> None:
    header = ('{"call": "user", "state": "prewarmed", "idle_s": 12.5, "off_device_s": 11, '
              '"resident_pages": 30, "session_pages": 32}')  # fmt: skip
    assert parse_session_header(header) == SessionView("user", "prewarmed", 12.5, 11.0, 30, 32)
    new = session_json("tool", "new", None, None, 0, 0)
    assert parse_session_header(new) == SessionView("tool", "new", None, None, 0, 0)
    assert parse_session_header(None) is None
    with pytest.raises(ValueError, match="invalid JSON"):
        parse_session_header("{nope")
    with pytest.raises(ValueError, match="state: expected one of"):
        parse_session_header(header.replace("prewarmed", "asleep"))
    with pytest.raises(ValueError, match="missing 'session_pages'"):
        parse_session_header('{"call": "user", "state": "held", "resident_pages": 1}')
    with pytest.raises(ValueError, match="resident_pages: expected a page count"):
        parse_session_header(header.replace("30", "-1"))


def test_markdown_and_plots(tmp_path: Path) -> None:
    records = [record("within", ttft_s=0.1), record("cross", ttft_s=0.3, session=view("held", 1.0, 0.0))]
    summary = summarize(records, [], PAGE, wall_s=1.0)
    result = {"systems": {"rayturn": summary}, "traces": ["t"], "conversations": 1, "truncated_conversations": [],
              "dropped_conversations": [], "model": "tiny", "token_scale": 1 / 64, "time_scale": 1 / 60,
              "device_kv_pages": 100, "kv_demand_over_device_capacity": 2.5}  # fmt: skip
    text = markdown(result)
    assert "| metric | rayturn |" in text
    assert "| hit_within_turn | 0.9 |" in text
    assert "| target: idle_capture >= 0.9 | not met |" in text
    paths = write_plots({"rayturn": records}, {"rayturn": summary}, tmp_path)
    assert [p.name for p in paths] == ["replay_ttft_cdf.png", "replay_hit_vs_bound.png"]
    assert all(p.stat().st_size > 0 for p in paths)


# -- the driver, against a fake client ----------------------------------------


class FakeClient:
    """Answers every completion with ``max_tokens`` chunks and a usage chunk; remembers what it was sent."""

    def __init__(self, session_header: str | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.session_header = session_header
        self.completions = SimpleNamespace(with_raw_response=SimpleNamespace(create=self.create))

    async def create(self, **kwargs: Any) -> Any:
        self.sent.append(kwargs)
        prompt = len(kwargs["prompt"])
        details = SimpleNamespace(cached_tokens=prompt - 1, kv_store_tokens=3)
        usage = SimpleNamespace(prompt_tokens=prompt, prompt_tokens_details=details)

        async def chunks() -> Any:
            for _ in range(kwargs["max_tokens"]):
                yield SimpleNamespace(choices=[SimpleNamespace(text="x")], usage=None)
            yield SimpleNamespace(choices=[], usage=usage)

        headers = {} if self.session_header is None else {"x-rayturn-session": self.session_header}
        return SimpleNamespace(headers=headers, parse=chunks)


def test_a_call_sends_token_ids_and_headers_and_records_the_answer(tmp_path: Path) -> None:
    conv_a, _ = two_conversations(tmp_path)
    call = plan(conv_a).main.calls[1]
    client = FakeClient(session_json("tool", "held", None, None, 3, 3))
    result = asyncio.run(driver.timed_call(client, "tiny", call))
    (sent,) = client.sent
    assert sent["prompt"] == list(call.token_ids)
    assert sent["max_tokens"] == call.max_tokens and sent["temperature"] == 0.0 and sent["stream"] is True
    assert sent["extra_body"] == {"ignore_eos": True}
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["extra_headers"] == {"x-session-id": "conv_a", "x-rayturn-call": "tool", "x-rayturn-after": "tool"}
    assert result.ok and result.kind == "within" and result.call_index == 1
    assert result.prompt_tokens == 16 and result.cached_tokens == 15 and result.store_tokens == 3
    assert len(result.itl_s) == call.max_tokens - 1
    assert result.session == SessionView("tool", "held", None, None, 3, 3)


def test_a_failed_call_is_recorded() -> None:
    class Refusing(FakeClient):
        async def create(self, **kwargs: Any) -> Any:
            raise ConnectionError("refused")

    client = Refusing()
    call = PlannedCall("c", 0, "c", "first", "user", "user", (1, 2), 1, 0.0)
    result = asyncio.run(driver.timed_call(client, "tiny", call))
    assert not result.ok and result.error == "ConnectionError: refused"


def test_conversation_order_and_the_deadline(tmp_path: Path) -> None:
    (item,) = read_traces([with_subagent(tmp_path)])
    conversation_plan = plan(item, time_scale=0.01)  # gaps of 80-90 ms
    order: list[str] = []

    async def send(call: Any) -> None:
        order.append(call.session_id + f"#{call.index}")
        await asyncio.sleep(0.01)

    asyncio.run(driver.run_conversation(conversation_plan, send, deadline=float("inf")))
    assert order == ["conv#0", "conv#1", "conv/agent_1#2", "conv/agent_1#3", "conv#4"]
    order.clear()
    # #0 goes out at once, #1 after 80 ms, the sub-agent's first call 80 ms after #1 ends: past the deadline.
    asyncio.run(driver.run_conversation(conversation_plan, send, deadline=time.perf_counter() + 0.14))
    assert order == ["conv#0", "conv#1"]


# -- files and the command line -----------------------------------------------


def test_a_bad_trace_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    bad = request(0.0, [1], text=True)
    del bad["in"]
    path = weka_file(tmp_path, "bad", [bad])
    with pytest.raises(ValueError, match=r"bad\.json: requests\[0\]\.in: missing key"):
        read_traces([path])
    weka_file(tmp_path / "other", "prefix", [request(0.0, [1], text=True)])
    data = json.loads((tmp_path / "other" / "prefix.json").read_text())
    (tmp_path / "other" / "prefix.json").write_text(json.dumps({**data, "tool_tokens": "many"}))
    with pytest.raises(ValueError, match=r"prefix\.json: tool_tokens: expected a non-negative integer"):
        read_traces([tmp_path / "other"])
    with pytest.raises(ValueError, match="no such trace file or folder"):
        read_traces([tmp_path / "absent"])


def test_without_traces_the_replay_writes_sample_ones_under_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(replay, "DEFAULT_TRACES", tmp_path / "shared" / "traces" / "weka")
    args = replay.parse_args(["--quick", "--out", str(tmp_path / "out")])
    paths, sample = replay.trace_paths(args)
    assert sample and paths == [tmp_path / "out" / "sample_traces"]
    assert "shared/traces/weka" in capsys.readouterr().err
    traced = read_traces(paths)
    assert [item.conversation_id for item in traced] == [f"sample_{i:04d}" for i in range(1, 7)]
    assert all(item.shared_prefix_tokens == 15_000 for item in traced)
    assert replay.trace_paths(args)[0] == paths  # the same files again: a function of the seed
    weka_file(tmp_path / "real", "conv", [request(0.0, [1], text=True)])
    assert replay.trace_paths(replay.parse_args([str(tmp_path / "real")])) == ([tmp_path / "real"], False)
    monkeypatch.setattr(replay, "DEFAULT_TRACES", tmp_path / "real")
    assert replay.trace_paths(replay.parse_args([])) == ([tmp_path / "real"], False)


def test_sample_traces_grow_by_appended_blocks_and_open_turns_with_text(tmp_path: Path) -> None:
    for item in read_traces(write_sample_traces(tmp_path, seed=3)):
        calls = item.conversation.calls
        assert item.conversation.block_size == 64 and calls[0].starts_turn
        assert 2 <= sum(call.starts_turn for call in calls) <= 4
        for before, after in itertools.pairwise(calls):
            assert after.arrival_s >= before.end_s and after.input_tokens > before.input_tokens
            full_blocks = before.input_tokens // 64
            assert after.hash_ids[:full_blocks] == before.hash_ids[:full_blocks]  # a growing prompt's blocks
            assert len(after.hash_ids) == -(-after.input_tokens // 64)
            assert set(after.hash_ids[full_blocks:]).isdisjoint(before.hash_ids)
            assert (after.kind == "user") == (before.finish_reason == "stop")  # a turn ends, the next opens
    assert (tmp_path / "sample_0001.json").read_text() == write_sample_traces(tmp_path / "again", seed=3)[0].read_text()


def test_arguments() -> None:
    args = replay.parse_args(["a", "--traces", "b", "--token-scale", "1/64", "--time-scale", "0.5"])
    assert [str(p) for p in (*args.paths, *args.traces)] == ["a", "b"]
    assert args.token_scale == 1 / 64 and args.time_scale == 0.5
    defaults = replay.parse_args([])
    assert defaults.token_scale is None and defaults.device_kv_pages is None  # auto
    assert defaults.time_scale == pytest.approx(1 / 60)
    quick = replay.parse_args(["--quick"])
    assert quick.max_conversations == 4 and quick.max_duration_s == 20.0
    assert replay.parse_args(["--device-kv-pages", "300"]).device_kv_pages == 300
    with pytest.raises(SystemExit):
        replay.parse_args(["--token-scale", "0"])
    with pytest.raises(SystemExit):
        replay.parse_args(["--url", "http://x", "--compare"])


def test_systems_override_the_config_as_specified() -> None:
    args = replay.parse_args(["--compare", "--time-scale", "1/30"])
    rayturn = replay.system_overrides("rayturn", args, 700)
    assert rayturn["decode.num_pages"] == 700 and rayturn["lifecycle.time_scale"] == pytest.approx(1 / 30)
    assert replay.system_overrides("no_lifecycle", args, 700)["lifecycle.enabled"] is False
    round_robin = replay.system_overrides("round_robin", args, 700)
    assert round_robin["router.policy"] == "round_robin" and round_robin["kvstore.enabled"] is False
    assert round_robin["prefill.max_replicas"] == 0 and round_robin["lifecycle.enabled"] is False
    lognormal = replay.system_overrides("lognormal_idle", args, 700)
    assert lognormal["lifecycle.predictor"] == "session" and lognormal["decode.num_pages"] == 700
    assert replay.COMPARED == ("rayturn", "no_lifecycle", "round_robin")
    assert replay.parse_args(["--systems", "rayturn,lognormal_idle"]).systems == ["rayturn", "lognormal_idle"]


def test_rayturn_replay_passes_its_arguments_to_the_replayer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rayturn replay")
    assert "--token-scale" in out and "--compare" in out


def test_with_context_stretches_a_preset_copy(tmp_path: Path) -> None:
    stretched = Path(with_context("tiny", 16384, tmp_path))
    assert json.loads((stretched / "config.json").read_text())["max_position_embeddings"] == 16384
    assert model_vocabulary(str(stretched)).context_tokens == 16384
    assert model_vocabulary(str(stretched)).token_ids == model_vocabulary("tiny").token_ids
    assert with_context("tiny", 1024, tmp_path) == "tiny"  # long enough already
    with pytest.raises(ValueError, match="stretches a preset"):
        with_context(str(tmp_path), 16384, tmp_path)


# -- the idle frontier -------------------------------------------------------------


def load_script(path: Path) -> ModuleType:
    """A benchmark script of ``bench/`` as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


frontier: ModuleType = load_script(BENCH / "idle_frontier.py")


def test_hindsight_hold_picks_each_sessions_best_threshold() -> None:
    # One session, gaps 10 s and 1000 s. At 100 s a warm return, holding 10 s (capture 990 of 1010 s,
    # one warm return: 1090) beats offloading at once (1010) and holding through both (200).
    point = frontier.hindsight_hold([[10.0, 1000.0]], weight_s=100.0)
    assert point == {"weight_s": 100.0, "idle_capture": 990 / 1010, "warm_return": 0.5}
    # A second session decides on its own gaps: at 100 s a return, never hold 500 s gaps.
    both = frontier.hindsight_hold([[10.0, 1000.0], [500.0]], weight_s=100.0)
    assert both["idle_capture"] == (990 + 500) / 1510 and both["warm_return"] == 1 / 3


def test_keep_or_offload_keeps_the_shortest_gaps() -> None:
    # Warm returns without prewarms cost their whole gap: keep the shortest ones.
    point = frontier.keep_or_offload([1000.0, 10.0, 90.0, 900.0], warm_share=0.5)
    assert point == {"warm_share": 0.5, "idle_capture": 1 - 100 / 2000, "warm_return": 0.5}
    assert frontier.keep_or_offload([1000.0, 10.0], warm_share=1.0)["idle_capture"] == 0.0
    assert frontier.keep_or_offload([1000.0, 10.0], warm_share=0.0)["idle_capture"] == 1.0
    # The bound is no lower than any hindsight threshold at the same warm share.
    sessions = [[10.0, 1000.0], [500.0, 20.0, 30.0]]
    for weight in frontier.WEIGHTS_S:
        hold = frontier.hindsight_hold(sessions, weight)
        bound = frontier.keep_or_offload([g for gaps in sessions for g in gaps], hold["warm_return"])
        assert bound["idle_capture"] >= hold["idle_capture"] - 1e-12


def test_idle_frontier_quick_on_a_small_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    traces = tmp_path / "weka"
    for n in range(4):  # four conversations, three turns each: think gaps of 20 s to 2 h
        calls, t = [], 0.0
        for turn in range(3):
            calls.append(request(t, [1, 2, 3 + turn], text=True, stop="end_turn"))
            t += 2.0 + [20.0, 600.0, 7200.0][(n + turn) % 3]
        weka_file(traces, f"conversation-{n}", calls)
    assert frontier.main(["--quick", "--traces", str(traces), "--out", str(tmp_path / "out")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["gaps"] == 8 and result["conversations"] == 4
    assert [p["lower_quantile"] for p in result["session"]] == list(frontier.QUICK_QUANTILES)
    assert [p["warm_return_worth_s"] for p in result["hazard"]] == list(frontier.QUICK_WORTHS_S)
    for curve in ("hazard", "session", "hindsight", "keep_or_offload"):
        assert all(0.0 <= p["idle_capture"] <= 1.0 and 0.0 <= p["warm_return"] <= 1.0 for p in result[curve])
    # A warm return worth more keeps pages on the device longer: more warm returns, less capture.
    hazard = result["hazard"]
    assert hazard[0]["warm_return"] <= hazard[-1]["warm_return"]
    assert hazard[0]["idle_capture"] >= hazard[-1]["idle_capture"]
    # 8 gaps: 90% warm means keeping 8 (all), so no capture is left without prewarms.
    assert result["keep_or_offload_capture_at_target"] == 0.0
    # Announced returns: every one warm, and beyond the keep-or-offload bound.
    assert [p["announce_lead_s"] for p in result["announced"]] == list(frontier.QUICK_ANNOUNCE_LEADS_S)
    assert all(p["warm_return"] == 1.0 and p["idle_capture"] > 0.9 for p in result["announced"])
    assert result["announced_meets_target"]
    assert result["oracle"]["warm_return"] == 1.0
    assert (tmp_path / "out" / "idle_frontier_quick.json").is_file()
    assert (tmp_path / "out" / "idle_frontier_quick.png").is_file()
