"""A session's KV through tool gaps and think time, on a real cluster over HTTP (official openai client).

One decode replica with a small KV cache (so other traffic evicts whatever is
not pinned), the KV store, no prefill pool, time at the users' pace. The
``session`` predictor (log-normal prior, prewarm at a low quantile) offloads a
new session's pages as soon as its turn ends and prewarms them about two
seconds later (its lower quantile, 4.4 s, less a 2 s
lead and the reload), unless the client announces the return first. Calls send
token-id prompts to ``/v1/completions`` with the life-cycle hint headers; the
``x-rayturn-session`` response header and ``usage`` say where the prompt's KV
came from. Every answer must equal the offline engine's.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.api.session import SESSION_STATE_HEADER  # noqa: E402
from rayturn.cluster.config import load_config  # noqa: E402
from rayturn.engine import LLMEngine, SamplingParams  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402

HTTP_PORT, GRPC_PORT = 28591, 29591
SNAPSHOT_DIR = tempfile.mkdtemp(prefix="rayturn-lifecycle-")
NUM_PAGES = 96
PAGE_SIZE = 16
MAX_TOKENS = 8
OVERRIDES = small_cluster(
    HTTP_PORT,
    GRPC_PORT,
    threshold=1 << 20,
    **{
        "prefill.min_replicas": 0,
        "prefill.max_replicas": 0,
        "decode.num_pages": NUM_PAGES,
        "lifecycle.time_scale": 1.0,
        # The mechanics under test need an offload and a prewarm within seconds of a first turn end;
        # the default hazard predictor holds a session it knows nothing about for minutes instead.
        "lifecycle.predictor": "session",
        # Off the device for ~2.6 s must pay for the move: break-even (moves + margin) under 2 s.
        "lifecycle.break_even_margin_s": 1.0,
        # With a 2 s lead the default prior's prewarm timer stops moving after about 2.4 s of idle.
        "lifecycle.prewarm_lead_s": 2.0,
        # No second look within a test: prewarmed pages stay put.
        "lifecycle.turn_hold_s": 1000.0,
        # The master's own snapshot period never comes: only idle windows trigger one.
        "kvstore.snapshot_dir": SNAPSHOT_DIR,
        "kvstore.snapshot_interval_s": 3600.0,
    },
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(load_config(**OVERRIDES)) as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Token ids no other test prompt shares a page with."""
    return [(seed * 7919 + index * 31) % 250 + 3 for index in range(num_tokens)]


def call(
    client: openai.OpenAI, token_ids: list[int], session_id: str | None, kind: str, after: str
) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """One greedy completion: (its text, usage, the session state header)."""
    headers = {"x-rayturn-call": kind, "x-rayturn-after": after}
    if session_id is not None:
        headers["x-session-id"] = session_id
    raw = client.completions.with_raw_response.create(
        model="tiny",
        prompt=token_ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
    )
    completion = raw.parse()
    state = raw.headers.get(SESSION_STATE_HEADER)
    assert completion.usage is not None
    return completion.choices[0].text, completion.usage.model_dump(), json.loads(state) if state else None


def offline(reference: LLMEngine, token_ids: list[int]) -> str:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    output = reference.generate([token_ids], params)[0]
    assert len(output.token_ids) == MAX_TOKENS
    return output.text


def lifecycle(cluster: str) -> dict[str, Any]:
    body = requests.get(f"{cluster}/health", timeout=30).json()
    return body["details"]["decode.lifecycle"]


def next_prompt(previous: list[int], answer_tokens: int, seed: int) -> list[int]:
    """The agent's next prompt: the previous one, the answer (scripted here) and a tool result."""
    return previous + prompt(seed, answer_tokens) + prompt(seed + 1, 40)


def first_turn_offloaded(client: openai.OpenAI, cluster: str, token_ids: list[int], session_id: str) -> None:
    """One call that ends a turn, then wait until the replica has offloaded (the session's pages, here)."""
    before = lifecycle(cluster)
    call(client, token_ids, session_id, "user", "user")
    deadline = time.monotonic() + 30
    while lifecycle(cluster)["offloads"] <= before["offloads"]:
        assert time.monotonic() < deadline, "no offload"
        time.sleep(0.01)


def full_pages(num_tokens: int) -> int:
    return (num_tokens - 1) // PAGE_SIZE * PAGE_SIZE


def test_pinned_through_a_tool_gap_under_memory_pressure(
    client: openai.OpenAI, reference: LLMEngine, cluster: str
) -> None:
    first = prompt(1, 300)
    call(client, first, "pinned", "user", "tool")  # the agent will be back after a tool
    # Other traffic needs more pages than the cache has free: an unpinned session would be evicted.
    for seed in range(100, 108):
        call(client, prompt(seed, 200), None, "user", "user")
    second = first + prompt(2, 60)
    text, usage, state = call(client, second, "pinned", "tool", "tool")
    assert text == offline(reference, second)
    assert state is not None and state["call"] == "tool" and state["idle_s"] is None
    # Every full page of the first call's prompt was still on the device: none came from the store.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= full_pages(len(first))
    assert usage["prompt_tokens_details"]["kv_store_tokens"] == 0
    assert lifecycle(cluster)["tool_holds"] >= 1


def test_offload_then_prewarm_restores_the_session(client: openai.OpenAI, reference: LLMEngine, cluster: str) -> None:
    first = prompt(3, 400)
    before = lifecycle(cluster)
    call(client, first, "thinker", "user", "user")  # the turn is over: the human thinks
    deadline = time.monotonic() + 30
    while lifecycle(cluster)["prewarms"] <= before["prewarms"]:
        assert time.monotonic() < deadline, f"no prewarm: {lifecycle(cluster)}"
        time.sleep(0.2)
    second = next_prompt(first, 8, 4)
    text, usage, state = call(client, second, "thinker", "user", "user")
    assert text == offline(reference, second)
    assert state is not None and state["state"] == "prewarmed"
    assert 0 < state["off_device_s"] < state["idle_s"]
    assert state["resident_pages"] == state["session_pages"] > 0
    # The prompt's KV was back on the device before the call: cached, none of it loaded on demand.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= full_pages(len(first))
    assert usage["prompt_tokens_details"]["kv_store_tokens"] == 0
    stats = lifecycle(cluster)
    assert stats["offloads"] > before["offloads"] and stats["prewarm_hits"] > before["prewarm_hits"]


def test_an_early_return_loads_on_demand_and_answers_the_same(
    client: openai.OpenAI, reference: LLMEngine, cluster: str
) -> None:
    first = prompt(5, 400)
    before = lifecycle(cluster)
    first_turn_offloaded(client, cluster, first, "hasty")
    second = next_prompt(first, 8, 6)
    text, usage, state = call(client, second, "hasty", "user", "user")
    assert text == offline(reference, second)
    assert state is not None and state["state"] in ("offloaded", "prewarming")
    assert state["resident_pages"] < state["session_pages"]
    # The pages came back from the store at arrival.
    assert usage["prompt_tokens_details"]["kv_store_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] >= full_pages(len(first))
    assert lifecycle(cluster)["early_returns"] > before["early_returns"]


def test_the_store_snapshot_waits_for_an_idle_window(cluster: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        body = requests.get(f"{cluster}/health", timeout=30).json()
        runs = body["details"]["decode.idle_work"]["kv-snapshot"]
        if runs["runs"] >= 1:
            break
        assert time.monotonic() < deadline, f"no snapshot in an idle window: {runs}"
        time.sleep(0.5)
    assert runs["forced_runs"] == 0 and runs["failures"] == 0
    assert (Path(SNAPSHOT_DIR) / "kv-master.snapshot").is_file()


def test_a_bad_hint_is_a_400_and_the_server_stays_up(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="x-rayturn-after"):
        client.completions.create(
            model="tiny", prompt=[5, 6, 7], max_tokens=2, extra_headers={"x-rayturn-after": "soon"}
        )
    text, usage, _ = call(client, prompt(9, 20), "after-error", "user", "user")
    assert usage["completion_tokens"] == MAX_TOKENS and text


def announce(cluster: str, session_id: str) -> requests.Response:
    return requests.post(f"{cluster}/v1/sessions/{session_id}/prewarm", timeout=30)


def test_an_announced_return_brings_the_pages_back_at_once(
    client: openai.OpenAI, reference: LLMEngine, cluster: str
) -> None:
    first = prompt(11, 400)
    before = lifecycle(cluster)
    first_turn_offloaded(client, cluster, first, "typist/main")
    answer = announce(cluster, "typist/main")  # a session id with a slash, as sub-agents have
    assert answer.status_code == 202
    assert answer.json() == {"object": "session.prewarm", "session_id": "typist/main", "state": "offloaded"}
    assert answer.headers["x-rayturn-replica"]
    # The user types for a while. The pages come back at once, as for an arrived call: the idle
    # sessions that earlier tests left held give way.
    time.sleep(3.0)
    second = next_prompt(first, 8, 12)
    text, usage, state = call(client, second, "typist/main", "user", "user")
    assert text == offline(reference, second)
    assert state is not None and state["state"] == "prewarmed"
    assert state["idle_s"] > 3.0
    # Off the device from the offload to the announcement only: the predicted prewarm (~2.4 s) never ran.
    assert state["off_device_s"] < 2.0
    assert state["resident_pages"] == state["session_pages"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] >= full_pages(len(first))
    assert usage["prompt_tokens_details"]["kv_store_tokens"] == 0
    stats = lifecycle(cluster)
    assert stats["composing_hints"] == before["composing_hints"] + 1
    assert stats["announced_returns"] == before["announced_returns"] + 1
    assert stats["prewarm_hits"] == before["prewarm_hits"] + 1


def test_announcing_over_grpc_and_bad_announcements(client: openai.OpenAI, cluster: str) -> None:
    call(client, prompt(13, 100), "grpc-typist", "user", "user")
    answer = announce(cluster, "never-seen")
    assert answer.status_code == 202 and answer.json()["state"] == "unknown"
    too_long = announce(cluster, "s" * 300)
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "session_id" and "300" in error["message"]
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        metadata = (("application", "rayturn"),)
        reply = stub.Prewarm(pb.PrewarmRequest(session_id="never-seen-grpc"), metadata=metadata)
        assert reply.state == "unknown" and reply.replica_id
        # The session id may come as metadata, as for Generate; the replica knows this session.
        reply = stub.Prewarm(pb.PrewarmRequest(), metadata=(*metadata, ("session_id", "grpc-typist")))
        assert reply.state in ("held", "offloaded", "prewarming", "prewarmed")
        with pytest.raises(grpc.RpcError) as err:
            stub.Prewarm(pb.PrewarmRequest(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "session id is required" in (err.value.details() or "")
    # Nothing was lost: the cluster still answers.
    assert requests.get(f"{cluster}/health", timeout=30).json()["status"] == "ok"
