"""The agent-sessions benchmark without a cluster: its workload generator, its report, and ``rayturn bench``.

The workload must be a pure function of the seed (both systems get the same
calls), grow each session's prompt by appending messages (what makes the KV
reusable), share one system prefix across sessions, and scale its gaps by the
time scale alone. The report's percentiles and ratios are checked on
hand-made samples.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import types
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from rayturn.cli import main
from rayturn.cluster.listeners import ListenerError
from rayturn.engine.presets import preset_dir
from rayturn.engine.tokenizer import Tokenizer
from rayturn.replay.agent_client import CallSample, timed_call
from rayturn.replay.agent_report import MIN_GAPS_PER_STREAM_COUNT, compare, itl_p50_by_streams, summarize
from rayturn.replay.agent_sessions import make_shape, parse_args, wait_for_ports
from rayturn.replay.agent_workload import make_workload, warmup_calls
from rayturn.replay.cli import parse_args as replay_args
from rayturn.replay.harness import percentile
from rayturn.replay.paths import RESULTS_DIR


@pytest.fixture(scope="module")
def quick_shape() -> Any:
    return make_shape(parse_args(["--quick"]))


def calls_of(shape: Any, seed: int = 0) -> list[list[Any]]:
    return make_workload(shape, seed)


def test_quick_shape_is_small_and_scaled_to_the_tiny_context(quick_shape: Any) -> None:
    assert quick_shape.num_sessions == 4
    assert quick_shape.calls_per_turn == (2, 4)
    assert quick_shape.context_tokens == 4096
    assert quick_shape.token_scale == pytest.approx(0.8 * 4096 / 104_000)
    sessions = calls_of(quick_shape)
    for calls in sessions:
        per_turn = [sum(1 for call in calls if call.turn == turn) for turn in range(quick_shape.turns_per_session)]
        assert all(2 <= n <= 4 for n in per_turn)
    assert max(call.prompt_tokens for calls in sessions for call in calls) <= quick_shape.prompt_budget_tokens


def test_workload_is_a_function_of_the_seed(quick_shape: Any) -> None:
    assert calls_of(quick_shape, seed=7) == calls_of(quick_shape, seed=7)
    assert calls_of(quick_shape, seed=7) != calls_of(quick_shape, seed=8)
    # A session does not depend on how many others run beside it.
    more = dataclasses.replace(quick_shape, num_sessions=6)
    assert calls_of(more, seed=7)[:4] == calls_of(quick_shape, seed=7)


def test_prompts_grow_by_appended_messages(quick_shape: Any) -> None:
    for calls in calls_of(quick_shape):
        for before, after in pairwise(calls):
            assert after.messages[: len(before.messages)] == before.messages
            if after.turn == before.turn:  # the answer's tool call, then the tool's result
                assert [m["role"] for m in after.messages[len(before.messages) :]] == ["assistant", "tool"]
                assert after.messages[-2]["tool_calls"][0]["id"] == after.messages[-1]["tool_call_id"]
            else:  # the final answer, then the next user message
                assert [m["role"] for m in after.messages[len(before.messages) :]] == ["assistant", "user"]
            assert after.prompt_tokens > before.prompt_tokens


def test_rendered_prompts_extend_each_other_token_by_token(quick_shape: Any) -> None:
    tokenizer = Tokenizer.from_dir(preset_dir("tiny"))
    calls = calls_of(quick_shape)[0]
    prompts = [tokenizer.encode_chat([dict(m) for m in call.messages]) for call in calls]
    for call, prompt in zip(calls, prompts):
        assert len(prompt) <= call.prompt_tokens  # the estimate is an upper bound: the budget holds
    for before, after in pairwise(prompts):
        assert after[: len(before)] == before


def test_sessions_share_the_system_prefix_and_nothing_else(quick_shape: Any) -> None:
    sessions = calls_of(quick_shape)
    systems = {calls[0].messages[0]["content"] for calls in sessions}
    assert len(systems) == 1
    (system,) = systems
    assert len(system) == round(15_000 * quick_shape.token_scale)
    first_users = {calls[0].messages[1]["content"] for calls in sessions}
    assert len(first_users) == len(sessions)
    assert len({calls[0].session_id for calls in sessions}) == len(sessions)


def test_gaps_scale_with_the_time_scale_alone(quick_shape: Any) -> None:
    slow = dataclasses.replace(quick_shape, time_scale=quick_shape.time_scale * 4)
    for fast_calls, slow_calls in zip(calls_of(quick_shape), calls_of(slow)):
        assert [c.messages for c in fast_calls] == [c.messages for c in slow_calls]
        for fast, slow_call in zip(fast_calls, slow_calls):
            assert slow_call.gap_s == pytest.approx(4 * fast.gap_s)
    scale = quick_shape.time_scale
    for calls in calls_of(quick_shape):
        assert 0 <= calls[0].gap_s <= 127 * scale  # sessions start spread over one median think gap
        for before, after in pairwise(calls):
            cap_s = 600 if after.turn != before.turn else 120  # think gap before a user message, else tool gap
            assert 0 < after.gap_s <= cap_s * scale


def test_a_full_context_is_compacted_to_the_prefix_and_a_summary(quick_shape: Any) -> None:
    cramped = dataclasses.replace(quick_shape, context_tokens=2048, turns_per_session=4, calls_per_turn=(6, 6))
    compactions = 0
    for calls in calls_of(cramped):
        system = calls[0].messages[0]
        for before, after in pairwise(calls):
            assert after.prompt_tokens <= cramped.prompt_budget_tokens
            if len(after.messages) < len(before.messages):
                compactions += 1
                assert after.messages[0] == system
                assert after.messages[1]["role"] == "user"
                assert after.messages[-1]["role"] in ("tool", "user")
    assert compactions > 0
    too_small = dataclasses.replace(cramped, context_tokens=512)
    with pytest.raises(ValueError, match="cannot hold the shared prefix"):
        calls_of(too_small)


def sample(session: str, ttft_s: float, **fields: Any) -> Any:
    return CallSample(session, ok=True, ttft_s=ttft_s, **fields)


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)  # unordered input
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_of_synthetic_calls() -> None:
    samples = [
        sample("a", ttft_s=ms / 1000, itl_s=(0.01, 0.03), prompt_tokens=100, cached_tokens=75, completion_tokens=8,
               replica="r1" if ms % 2 else "r2")
        for ms in range(1, 101)
    ]  # fmt: skip
    samples.append(sample("b", ttft_s=0.5, prompt_tokens=100, cached_tokens=0, completion_tokens=8, replica="r1"))
    samples.append(CallSample("b", ok=False, error="APIConnectionError: refused"))
    summary = summarize(samples, wall_s=2.0)
    assert summary["calls"] == 102
    assert summary["failures"] == 1
    ttfts = [ms / 1000 for ms in range(1, 101)] + [0.5]
    assert summary["ttft_p50_s"] == pytest.approx(percentile(ttfts, 50), abs=1e-5)
    assert summary["ttft_p50_s"] == pytest.approx(0.051)
    assert summary["ttft_p99_s"] == pytest.approx(0.1)  # rank 99 of 0..100: the 100th smallest
    assert summary["itl_p50_s"] == pytest.approx(0.02)  # 100 gaps of 10 ms and 100 of 30 ms
    assert summary["itl_p99_s"] == pytest.approx(0.03)
    assert summary["output_tok_s"] == pytest.approx(101 * 8 / 2.0)
    assert summary["prompt_tokens"] == 10_100
    assert summary["cached_tokens"] == 7_500
    assert summary["cached_token_fraction"] == pytest.approx(7_500 / 10_100, abs=1e-4)
    assert summary["replicas_per_session"] == 1.5  # a: two replicas, b: one
    # r1 served a's 50 odd calls (25 prompt tokens computed each) and b's first (100); r2 a's 50 even ones.
    assert summary["largest_replica_share"] == {
        "replicas": 2,
        "calls": round(51 / 101, 3),
        "computed_prompt_tokens": round((50 * 25 + 100) / (100 * 25 + 100), 3),
    }


def test_the_largest_replica_share_shows_calls_piled_on_one_replica() -> None:
    samples = [sample("a", 0.1, prompt_tokens=1000, cached_tokens=900, replica="r1") for _ in range(3)]
    samples.append(sample("b", 0.1, prompt_tokens=1000, cached_tokens=0, replica="r2"))
    samples.append(sample("c", 0.1, prompt_tokens=50, cached_tokens=50, replica=None))  # no replica named: not counted
    shares = summarize(samples, wall_s=1.0)["largest_replica_share"]
    assert shares == {"replicas": 2, "calls": 0.75, "computed_prompt_tokens": round(1000 / 1300, 3)}
    cached_only = summarize([sample("a", 0.1, prompt_tokens=64, cached_tokens=64, replica="r1")], wall_s=1.0)
    assert cached_only["largest_replica_share"] == {"replicas": 1, "calls": 1.0, "computed_prompt_tokens": None}


def test_itl_p50_by_streams_counts_the_calls_streaming_on_the_same_replica() -> None:
    n = MIN_GAPS_PER_STREAM_COUNT
    # On r1: call a streams alone from t=1 to 1 + n * 0.01 (n gaps of 10 ms), then call b from t=10 alone.
    alone = sample("a", 1.0, start_s=0.0, itl_s=(0.01,) * n, replica="r1")
    later = sample("b", 1.0, start_s=9.0, itl_s=(0.01,) * n, replica="r1")
    # On r2, two calls stream side by side over the same span, with 20 ms gaps.
    pair = [sample(name, 1.0, start_s=0.0, itl_s=(0.02,) * n, replica="r2") for name in ("c", "d")]
    assert later.token_times()[:3] == pytest.approx([10.0, 10.01, 10.02])
    assert itl_p50_by_streams([alone, later, *pair]) == {
        "1": {"itl_p50_s": 0.01, "gaps": 2 * n},  # r2's pair does not count against r1's calls
        "2": {"itl_p50_s": 0.02, "gaps": 2 * n},
    }
    # A call that starts streaming halfway between the lone call's last 10 tokens (gaps of 1/64 s, exact in
    # binary): those 10 gaps of the lone call and the first 9 of its own saw two streams, too few to report.
    tick = 1 / 64
    lone = sample("a", 1.0, start_s=0.0, itl_s=(tick,) * n, replica="r1")
    overlap = sample("e", 1.0, start_s=(n - 10) * tick + tick / 2, itl_s=(tick,) * n, replica="r1")
    assert itl_p50_by_streams([lone, overlap]) == {"1": {"itl_p50_s": round(tick, 5), "gaps": 2 * n - 19}}
    # Calls without a replica named, or with one token, are left out.
    assert itl_p50_by_streams([sample("f", 1.0, itl_s=(0.01,) * n), sample("g", 1.0, replica="r1")]) == {}


def test_summary_without_successful_calls_has_no_percentiles() -> None:
    summary = summarize([CallSample("a", ok=False, error="x")], wall_s=1.0)
    assert summary["failures"] == 1
    assert summary["ttft_p99_s"] is None
    assert summary["cached_token_fraction"] is None
    assert summary["replicas_per_session"] is None
    assert summary["largest_replica_share"] is None


def test_ratios_divide_rayturn_by_the_baseline() -> None:
    ours = {"ttft_p50_s": 0.1, "ttft_p99_s": 0.3, "itl_p50_s": 0.02, "itl_p99_s": None, "output_tok_s": 120.0}
    theirs = {"ttft_p50_s": 0.2, "ttft_p99_s": 0.6, "itl_p50_s": 0.0, "itl_p99_s": 0.1, "output_tok_s": 100.0}
    ratios = {
        "ttft_p50_ratio_vs_baseline": 0.5,
        "ttft_p99_ratio_vs_baseline": 0.5,
        "itl_p50_ratio_vs_baseline": None,  # nothing to divide by
        "itl_p99_ratio_vs_baseline": None,
        "output_tok_s_ratio_vs_baseline": 1.2,
    }
    assert compare(ours, theirs) == {**ratios, "itl_p50_ratio_by_streams": {}}
    # Per stream count, for the counts both systems report, in count order.
    ours["itl_p50_by_streams"] = {"10": {"itl_p50_s": 0.09, "gaps": 60}, "2": {"itl_p50_s": 0.03, "gaps": 70}}
    theirs["itl_p50_by_streams"] = {"2": {"itl_p50_s": 0.02, "gaps": 80}, "3": {"itl_p50_s": 0.04, "gaps": 90},
                                    "10": {"itl_p50_s": 0.06, "gaps": 55}}  # fmt: skip
    assert compare(ours, theirs)["itl_p50_ratio_by_streams"] == {"2": 1.5, "10": 1.5}


def test_rayturn_bench_passes_its_arguments_to_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rayturn bench")
    assert "--quick" in out


def test_out_is_a_results_folder_as_for_the_replay(tmp_path: Path) -> None:
    assert parse_args([]).out == RESULTS_DIR / "agent_sessions"
    assert replay_args([]).out == RESULTS_DIR / "replay"
    assert parse_args(["--out", str(tmp_path)]).out == replay_args(["--out", str(tmp_path)]).out == tmp_path
    with pytest.raises(SystemExit):  # the file name it once took
        parse_args(["--out", str(tmp_path / "agent_sessions.json")])


def test_the_next_system_waits_until_the_last_ones_ports_are_let_go() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ListenerError, match="already in use"):
            wait_for_ports("127.0.0.1", {"server.http_port": port}, timeout_s=0.0)
    wait_for_ports("127.0.0.1", {"server.http_port": port}, timeout_s=0.0)


def test_warm_up_calls_name_no_session_and_are_sent_without_a_session_header(quick_shape: Any) -> None:
    warmup = warmup_calls(quick_shape, seed=0, count=4)
    assert len(warmup) == 5 and {call.session_id for call in warmup} == {""}

    class Stream:
        response = types.SimpleNamespace(headers={"x-rayturn-replica": "r1"})

        def __aiter__(self) -> Any:
            return self

        async def __anext__(self) -> Any:
            raise StopAsyncIteration

    sent: list[dict[str, Any]] = []

    async def create(**kwargs: Any) -> Stream:
        sent.append(kwargs)
        return Stream()

    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=types.SimpleNamespace(create=create)))
    asyncio.run(timed_call(client, "m", warmup[0], max_tokens=4))
    session_call = dataclasses.replace(warmup[0], session_id="agent-0-0")
    asyncio.run(timed_call(client, "m", session_call, max_tokens=4))
    assert sent[0]["extra_headers"] is None
    assert sent[1]["extra_headers"] == {"x-session-id": "agent-0-0"}
