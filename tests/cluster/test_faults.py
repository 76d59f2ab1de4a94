"""Serving through faults on a real cluster: a decode replica killed mid-stream, a prefill replica killed under
load, and a decode replica retired by a redeploy; the kills are SIGKILLs of the replicas' processes.

One Serve application for the module (two decode replicas, one prefill
replica, the KV store), driven over HTTP with the official openai client.
Every answer that completes must equal the offline engine's greedy answer,
every call must end (each runs on a thread that must finish), and a stream
cut by a dead replica must either continue identically on another replica or
end with an error event, never look finished. Session ids are chosen by the
replica they hash to (``preferred_replica``), so a test knows whose sessions
it interrupts.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from ray import serve  # noqa: E402
from small_cluster import serving, small_cluster  # noqa: E402

from rayturn.cluster.app import APP_NAME, build_app  # noqa: E402
from rayturn.cluster.config import ClusterConfig, load_config  # noqa: E402
from rayturn.engine import LLMEngine, SamplingParams  # noqa: E402
from rayturn.router.scoring import preferred_replica  # noqa: E402

HTTP_PORT, GRPC_PORT = 28611, 29611
THRESHOLD = 48  # uncached prompt tokens from which the prefill pool computes the prompt
CALL_TIMEOUT_S = 120.0  # a call still running after this is hung
SETTLE_TIMEOUT_S = 240.0  # a replacement replica starts slowly on a busy 2-core host
STREAM_TOKENS = 64
HANDED = re.compile(r"handed (\d+) session pages to the KV store")  # a retiring decode replica's last line
OVERRIDES = small_cluster(HTTP_PORT, GRPC_PORT, THRESHOLD)


def pool_config(decode_replicas: int) -> ClusterConfig:
    pools = {"decode.min_replicas": decode_replicas, "decode.max_replicas": decode_replicas}
    return load_config(**OVERRIDES, **pools)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with serving(pool_config(decode_replicas=2)) as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)


# -- the cluster's replicas --------------------------------------------------------


def replica_pids(deployment: str) -> dict[str, int]:
    """Serve's ids of the deployment's live replicas -> their process ids."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    named = [actor for actor in ray.util.list_named_actors(all_namespaces=True) if actor["name"].startswith(prefix)]
    pids = {}
    for actor in named:
        handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        try:
            pids[actor["name"].removeprefix(prefix)] = ray.get(
                handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue  # dying or gone
    return pids


def replica_log(replica: str, word: str) -> list[str]:
    """The lines of a decode replica's Serve log (its id as ``replica_pids`` names it) that hold ``word``: what a
    failing assertion shows of what the replica said."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return [
        line.strip()
        for path in sorted(logs.glob(f"replica_{APP_NAME}_decode_{replica}*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if word in line
    ]


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def exited(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie: it ran its last line)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_exited(pid: int) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not exited(pid):
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.1)


def settled(decode_replicas: int) -> bool:
    app = serve.status().applications.get(APP_NAME)
    if app is None or app.status != "RUNNING":
        return False
    running = {name: dict(deployment.replica_states) for name, deployment in app.deployments.items()}
    return running.get("decode") == {"RUNNING": decode_replicas} and running.get("prefill") == {"RUNNING": 1}


def wait_settled(decode_replicas: int) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not settled(decode_replicas) or len(replica_pids("decode")) != decode_replicas:
        assert time.monotonic() < deadline, f"the pools did not settle at {decode_replicas} decode replicas"
        time.sleep(0.25)


def sessions_on(replica: str, replicas: set[str], count: int, tag: str) -> list[str]:
    """``count`` session ids that hash to ``replica`` among ``replicas``."""
    chosen = [f"{tag}-{i}" for i in range(1000) if preferred_replica(f"{tag}-{i}", replicas) == replica]
    assert len(chosen) >= count
    return chosen[:count]


def replica_losses(cluster: str) -> dict[str, float]:
    """The ingress's count of calls whose decode replica died, by what followed."""
    metrics = requests.get(f"{cluster}/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("rayturn_replica_losses_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = counts.get(outcome, 0.0) + float(line.split()[-1])
    return counts


# -- calls on threads ----------------------------------------------------------


def opening(session_id: str, num_chars: int) -> list[dict[str, str]]:
    body = f"[{session_id}] The build fails in module parser; read the log and fix it. " * 8
    return [{"role": "user", "content": body[:num_chars]}]


@dataclass
class Stream:
    """One streamed chat call on its own thread: the text so far and how it ended."""

    client: openai.OpenAI
    session_id: str
    messages: list[dict[str, str]]
    max_tokens: int
    n: int = 1
    text: str = ""  # the first choice's
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            for chunk in self.client.chat.completions.create(
                model="tiny",
                messages=self.messages,  # type: ignore[arg-type]
                max_tokens=self.max_tokens,
                temperature=0,
                n=self.n,
                stream=True,
                extra_headers={"x-session-id": self.session_id},
            ):
                for choice in chunk.choices:
                    if choice.index == 0:
                        self.text += choice.delta.content or ""
                        self.finish_reason = choice.finish_reason or self.finish_reason
                self.chunks += 1
        except openai.APIError as err:
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self.done.set()


def expected_texts(reference: LLMEngine, calls: list[tuple[list[dict[str, str]], int]]) -> list[tuple[str, str]]:
    """The offline engine's greedy (text, finish reason) for each (messages, max_tokens)."""
    prompts = [reference.tokenizer.encode_chat(messages) for messages, _ in calls]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0) for _, max_tokens in calls]
    return [(out.text, out.finish_reason or "") for out in reference.generate(prompts, params)]


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    cached_tokens: int  # prompt tokens served from cache: the replica's device or the KV store
    kv_store_tokens: int  # of those, loaded from the KV store
    replica: str | None = None  # the decode replica that served it (``x-rayturn-replica``)


def chat(client: openai.OpenAI, session_id: str, messages: list[dict[str, str]], max_tokens: int, n: int = 1) -> Answer:
    """A non-streamed greedy call (its first choice)."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        n=n,
        extra_headers={"x-session-id": session_id},
    )
    response = raw.parse()
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    details = response.usage.prompt_tokens_details
    choice = response.choices[0]
    return Answer(
        choice.message.content or "",
        choice.finish_reason,
        details.cached_tokens or 0,
        getattr(details, "kv_store_tokens", 0),
        raw.headers.get("x-rayturn-replica"),
    )


def follow_up(messages: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    """The session's next call: the answer, then a tool's result."""
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Tool returned: ok."}]


# -- the faults ------------------------------------------------------------------


def test_streams_cut_by_a_killed_decode_replica_continue_identically_on_another(
    cluster: str, client: openai.OpenAI, reference: LLMEngine
) -> None:
    wait_settled(decode_replicas=2)
    pids = replica_pids("decode")
    victim, survivor = sorted(pids)
    affected = sessions_on(victim, set(pids), 4, "cut")
    spared = sessions_on(survivor, set(pids), 1, "spared")
    # Long openings go through the prefill pool, short ones are prefilled by the decode replica itself;
    # the last affected stream asks for two completions, which cannot continue elsewhere.
    streams = [
        Stream(client, session_id, opening(session_id, 200 if i % 2 else 40), STREAM_TOKENS).start()
        for i, session_id in enumerate(affected[:3] + spared)
    ]
    forked = Stream(client, affected[3], opening(affected[3], 40), STREAM_TOKENS, n=2).start()
    losses_before = replica_losses(cluster)

    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not all(stream.chunks >= 3 or stream.done.is_set() for stream in [*streams, forked]):
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.02)
    kill(pids[victim])
    cut = sum(1 for stream in streams[:3] if stream.chunks < STREAM_TOKENS // 2)  # far from done when killed
    forked_cut = forked.chunks < STREAM_TOKENS // 2
    for stream in [*streams, forked]:
        assert stream.done.wait(CALL_TIMEOUT_S), f"{stream.session_id}: the call hung"

    expected = expected_texts(reference, [(stream.messages, STREAM_TOKENS) for stream in [*streams, forked]])
    for stream, (text, finish_reason) in zip(streams, expected):
        # Resumed streams read exactly as an unfaulted run; none fails.
        assert stream.error is None, (stream.session_id, stream.error)
        assert (stream.text, stream.finish_reason) == (text, finish_reason), stream.session_id
    # Two completions end with an error event (the client raises), never as a stream that looks finished.
    if forked.error is None:
        assert not forked_cut and (forked.text, forked.finish_reason) == expected[-1]
    else:
        assert "replica failed" in forked.error and forked.finish_reason is None
    losses = replica_losses(cluster)
    assert losses.get("resumed", 0) - losses_before.get("resumed", 0) >= cut
    assert losses.get("failed", 0) - losses_before.get("failed", 0) >= forked_cut

    # The affected sessions' next calls land elsewhere and find their prompt cached (device or KV store).
    following = [follow_up(stream.messages, stream.text) for stream in streams[:3]]
    answers = [chat(client, stream.session_id, messages, 4) for stream, messages in zip(streams, following)]
    expected = expected_texts(reference, [(messages, 4) for messages in following])
    assert [(answer.text, answer.finish_reason) for answer in answers] == expected
    assert all(answer.cached_tokens > 0 for answer in answers), answers


LONG_TEXT = "def handler(event):\n    return process(event)\n" * 12  # far past the threshold: prefilled remotely
SHORT_TEXT = "def f(): g()"  # with the chat template and a session tag, 41-43 tokens: prefilled locally


class Load:
    """Threads sending long-prompt chat calls (each prompt new) until stopped; every answer is kept."""

    def __init__(self, client: openai.OpenAI, num_threads: int) -> None:
        self.client = client
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.answers: list[tuple[list[dict[str, str]], Answer]] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(index,), daemon=True) for index in range(num_threads)]

    def __enter__(self) -> Self:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=CALL_TIMEOUT_S)
        assert not any(thread.is_alive() for thread in self.threads), "a call hung"

    def _run(self, index: int) -> None:
        call = 0
        while not self.stop.is_set():
            messages = [{"role": "user", "content": f"[load {index}.{call}] {LONG_TEXT}"}]
            try:
                answer = chat(self.client, f"load-{index}-{call}", messages, 8)
            except openai.APIError as err:
                with self.lock:
                    self.failures.append(f"{type(err).__name__}: {err}")
            else:
                with self.lock:
                    self.answers.append((messages, answer))
            call += 1

    def wait_for_answers(self, num_answers: int) -> None:
        with self.lock:
            target = len(self.answers) + num_answers
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while len(self.answers) < target:
            assert time.monotonic() < deadline, "the load stalled"
            time.sleep(0.05)


def ttft_count(cluster: str, path: str) -> float:
    """Calls the ingress saw take this prefill path (its time-to-first-token histogram's count)."""
    metrics = requests.get(f"{cluster}/metrics", timeout=30).text
    prefix = f'rayturn_time_to_first_token_seconds_count{{path="{path}"}}'
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix))


def test_calls_survive_a_killed_prefill_replica(cluster: str, client: openai.OpenAI, reference: LLMEngine) -> None:
    wait_settled(decode_replicas=2)
    (prefill_pid,) = replica_pids("prefill").values()
    with Load(client, num_threads=3) as load:
        load.wait_for_answers(3)
        local_before = ttft_count(cluster, "local")
        kill(prefill_pid)
        load.wait_for_answers(6)  # while the pool has no live replica, the decode replicas prefill themselves
        assert ttft_count(cluster, "local") > local_before
        wait_settled(decode_replicas=2)
        disaggregated_before = ttft_count(cluster, "disaggregated")
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while ttft_count(cluster, "disaggregated") == disaggregated_before:  # the replacement serves
            assert time.monotonic() < deadline, "the prefill pool never served again"
            time.sleep(0.2)
    assert load.failures == []
    calls = [(messages, 8) for messages, _ in load.answers]
    expected = expected_texts(reference, calls)
    assert [(answer.text, answer.finish_reason) for _, answer in load.answers] == expected


def test_a_retired_decode_replica_hands_its_sessions_to_the_store(client: openai.OpenAI, reference: LLMEngine) -> None:
    wait_settled(decode_replicas=2)
    pids = replica_pids("decode")
    replicas = set(pids)
    # Prompts under the threshold (< 48 tokens) do not go through the prefill pool: each session's pages exist
    # only in its decode replica's segment. New sessions until each replica serves two: the router sends a
    # session nobody has seen to the replica following the fewest sessions active in the last 5 minutes, so
    # after the tests above (a replaced replica follows none of theirs) one replica may take every new session
    # for a while; where each landed is read from its answer.
    conversations: dict[str, list[dict[str, str]]] = {}
    served: dict[str, str | None] = {}
    deadline = time.monotonic() + 240
    for i in itertools.count():
        if all(list(served.values()).count(replica) >= 2 for replica in replicas):
            break
        assert time.monotonic() < deadline, f"after {i} new sessions, each replica has not served two: {served}"
        session = f"moved-{i}"
        messages = [{"role": "user", "content": f"[{session}] {SHORT_TEXT}"}]
        answer = chat(client, session, messages, 6)
        assert answer.replica in replicas, (answer.replica, replicas)
        if list(served.values()).count(answer.replica) < 2:
            conversations[session], served[session] = follow_up(messages, answer.text), answer.replica
    sessions = list(conversations)
    assert sorted(served.values()) == sorted(list(replicas) * 2), served  # two each, no more

    serve.run(build_app(pool_config(decode_replicas=1)), name=APP_NAME, route_prefix="/")
    wait_settled(decode_replicas=1)
    (kept,) = replica_pids("decode")
    moved = [session for session in sessions if served[session] != kept]
    assert len(moved) == 2
    # Serve counts a replica gone once it stops answering; it hands its sessions' pages over in its last moments
    # (``decode.server.shut_down_replica``), and its process ends only after that.
    retired = next(name for name in replicas if name != kept)
    wait_exited(pids[retired])

    # What each replica said, in its Serve log: the one that stayed, which backend it started on; the retired
    # one, how many of its sessions' pages it handed over.
    assert any("decode replica ready: backend" in line for line in replica_log(kept, "ready")), replica_log(kept, "")
    # The hand-off ran; it writes only the pages the store lacks (a session's pages are published at each answer's
    # end, and may already live on a segment that stays), so its count may be 0: whether the sessions' pages
    # survived is what their next calls below show.
    handed = [int(found) for line in replica_log(retired, "handed") for found in HANDED.findall(line)]
    assert handed, replica_log(retired, "")[-20:]

    answers = {session: chat(client, session, conversations[session], 4) for session in sessions}
    expected = expected_texts(reference, [(conversations[session], 4) for session in sessions])
    assert [(answers[s].text, answers[s].finish_reason) for s in sessions] == expected
    for session in moved:  # served from the pages the retired replica handed over, not recomputed
        assert answers[session].kv_store_tokens > 0, (session, answers[session], replica_log(retired, "hand"))
