"""Serving through faults: real kills of replica processes on an embedded cluster, and what the clients saw.

One embedded cluster (two decode replicas, one prefill replica, the KV
store, the ``tiny`` model), driven over HTTP with the official openai
client, every call greedy so each completed answer can be checked against
the offline engine's answer for the same prompt. In order:

- ``none`` (the baseline, same run): the streams of the next row, no fault;
- ``decode_killed_mid_stream``: streams from sessions on both decode
  replicas; once every stream has begun, SIGKILL one replica's process.
  Its streams resume on the other replica (``rayturn.api.resume``; the row's
  ``replica_losses`` counts what the ingress did with each lost call);
- ``prefill_killed``: closed-loop calls with long prompts (prefilled by the
  prefill pool); SIGKILL the prefill replica. Decode replicas prefill
  locally until the replacement serves;
- ``decode_scaled_down``: sessions on both decode replicas, then a redeploy
  with one: the retired replica hands its sessions' pages to the store;

then the KV store's faults (``bench/faults_store.py``'s ``run_store_faults``)
when that module is there. Each row: calls ``sent``, ``completed``,
``failed_cleanly`` (an error status, or an error event in a stream: never a
stream that looks finished), ``wrong`` (completed but unlike the offline
answer; must be 0), ``hung`` (no end within ``--deadline-s``; must be 0),
``recovery_s`` (the kill to the first success of a call sent after it) and
``warm_next_call_share`` (of the sessions the fault touched, the share whose
next call found its prompt cached, on a device or in the store).

    python bench/faults.py [--quick] [--out DIR]

Writes ``faults.json`` to ``--out``; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.replay.harness import add_out_argument, emit, machine
from rayturn.router.scoring import preferred_replica

THRESHOLD_TOKENS = 48  # uncached prompt tokens from which the prefill pool computes a prompt
LONG_TEXT = "def handler(event):\n    return process(event)\n" * 12
SETTLE_TIMEOUT_S = 180.0
Messages = list[dict[str, str]]


def cluster_overrides(http_port: int, grpc_port: int) -> dict[str, Any]:
    return {
        "model.name": "tiny",
        "model.num_pages": 512,
        "decode.min_replicas": 2,
        "decode.max_replicas": 2,
        "decode.num_cpus": 0.25,
        "prefill.num_cpus": 0.25,
        "server.ingress_num_cpus": 0.25,
        "kvstore.segment_bytes": "32MiB",
        "router.disaggregation_threshold_tokens": THRESHOLD_TOKENS,
        "router.stats_period_s": 0.5,
        "server.http_port": http_port,
        "server.grpc_port": grpc_port,
    }


# -- calls and what came of them --------------------------------------------------


@dataclass
class Outcome:
    """One call: its prompt, its end, and when it ended."""

    session_id: str
    messages: Messages
    max_tokens: int
    started_at: float
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    hung: bool = False
    ended_at: float | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and not self.hung and self.ended_at is not None


def call(client: openai.OpenAI, outcome: Outcome, stream: bool, progress: Callable[[int], None] | None = None) -> None:
    """Run one greedy chat call into ``outcome`` (a timeout is a hang; any other API error a clean failure)."""
    headers = {"x-session-id": outcome.session_id}
    try:
        if stream:
            stream_chunks = client.chat.completions.create(  # type: ignore[call-overload]
                model="tiny",
                messages=outcome.messages,
                max_tokens=outcome.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
            )
            for chunks, chunk in enumerate(stream_chunks, start=1):
                for choice in chunk.choices:
                    outcome.text += choice.delta.content or ""
                    outcome.finish_reason = choice.finish_reason or outcome.finish_reason
                if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                    outcome.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens or 0
                if progress is not None:
                    progress(chunks)
        else:
            response = client.chat.completions.create(
                model="tiny",
                messages=outcome.messages,  # type: ignore[arg-type]
                max_tokens=outcome.max_tokens,
                temperature=0,
                extra_headers=headers,
            )
            outcome.text = response.choices[0].message.content or ""
            outcome.finish_reason = response.choices[0].finish_reason
            details = response.usage.prompt_tokens_details if response.usage is not None else None
            outcome.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
    except openai.APITimeoutError:
        outcome.hung = True
    except openai.APIError as err:
        outcome.error = f"{type(err).__name__}: {err}"
    outcome.ended_at = time.monotonic()


def run_all(client: openai.OpenAI, outcomes: Sequence[Outcome], stream: bool, deadline_s: float) -> None:
    """Run calls concurrently; a call still running after ``deadline_s`` is marked hung."""
    threads = [threading.Thread(target=call, args=(client, o, stream), daemon=True) for o in outcomes]
    for thread in threads:
        thread.start()
    for thread, outcome in zip(threads, outcomes):
        thread.join(deadline_s)
        outcome.hung = outcome.hung or thread.is_alive()


def expected(reference: LLMEngine, outcomes: Sequence[Outcome]) -> list[tuple[str, str | None]]:
    prompts = [reference.tokenizer.encode_chat(o.messages) for o in outcomes]
    params = [SamplingParams(max_tokens=o.max_tokens, temperature=0.0) for o in outcomes]
    return [(out.text, out.finish_reason) for out in reference.generate(prompts, params)]


def row(
    fault: str,
    outcomes: Sequence[Outcome],
    reference: LLMEngine,
    recovery_s: float | None,
    warm_share: float | None,
) -> dict[str, Any]:
    completed = [o for o in outcomes if o.completed]
    wrong = sum(1 for o, want in zip(completed, expected(reference, completed)) if (o.text, o.finish_reason) != want)
    return {
        "fault": fault,
        "sent": len(outcomes),
        "completed": len(completed),
        "failed_cleanly": sum(1 for o in outcomes if o.error is not None and not o.hung),
        "wrong": wrong,
        "hung": sum(1 for o in outcomes if o.hung),
        "recovery_s": round(recovery_s, 2) if recovery_s is not None else None,
        "warm_next_call_share": round(warm_share, 3) if warm_share is not None else None,
    }


def follow_up(outcome: Outcome) -> Messages:
    return [
        *outcome.messages,
        {"role": "assistant", "content": outcome.text},
        {"role": "user", "content": "Tool returned: ok."},
    ]


def next_calls(client: openai.OpenAI, outcomes: Sequence[Outcome], deadline_s: float) -> list[Outcome]:
    """Each session's next call (the answer, a tool's result), one at a time."""
    following = [Outcome(o.session_id, follow_up(o), 4, time.monotonic()) for o in outcomes if o.completed]
    for outcome in following:
        run_all(client, [outcome], stream=False, deadline_s=deadline_s)
    return following


def replica_losses(url: str) -> dict[str, float]:
    """The ingress's count of calls whose decode replica died, by what followed (its ``/metrics``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("rayturn_replica_losses_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = counts.get(outcome, 0.0) + float(line.split()[-1])
    return counts


def warm_share(next_outcomes: Sequence[Outcome]) -> float | None:
    if not next_outcomes:
        return None
    return sum(1 for o in next_outcomes if o.completed and o.cached_tokens > 0) / len(next_outcomes)


class ProbeLoop:
    """Short calls, one at a time from ``killed_at`` on (on a thread), until one completes: the recovery time."""

    def __init__(self, client: openai.OpenAI, killed_at: float, deadline_s: float, tag: str) -> None:
        self.client, self.killed_at, self.deadline_s, self.tag = client, killed_at, deadline_s, tag
        self.recovery_s: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        index = 0
        while time.monotonic() - self.killed_at < self.deadline_s:
            messages = [{"role": "user", "content": f"[{self.tag} {index}] ls"}]
            probe = Outcome(f"{self.tag}-probe-{index}", messages, 2, time.monotonic())
            call(self.client, probe, stream=False)
            if probe.completed and probe.ended_at is not None:
                self.recovery_s = probe.ended_at - self.killed_at
                return
            index += 1
            time.sleep(0.05)

    def result(self) -> float | None:
        self._thread.join(self.deadline_s)
        return self.recovery_s


# -- the cluster's replicas -------------------------------------------------------


def os_pid(_: object) -> int:
    """Run inside an actor (``__ray_call__``): its process id."""
    return os.getpid()


def replica_pids(deployment: str) -> dict[str, int]:
    """Serve's ids of the deployment's live replicas -> their process ids."""
    import ray

    from rayturn.cluster.app import APP_NAME

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    pids: dict[str, int] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if not actor["name"].startswith(prefix):
            continue
        handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        try:
            pid: Any = ray.get(handle.__ray_call__.remote(os_pid), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue  # dying or gone
        pids[actor["name"].removeprefix(prefix)] = int(pid)
    return pids


def wait_settled(decode_replicas: int) -> None:
    from ray import serve

    from rayturn.cluster.app import APP_NAME

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        app = serve.status().applications.get(APP_NAME)
        states = {name: dict(d.replica_states) for name, d in app.deployments.items()} if app is not None else {}
        if (
            app is not None
            and app.status == "RUNNING"
            and states.get("decode") == {"RUNNING": decode_replicas}
            and states.get("prefill") == {"RUNNING": 1}
            and len(replica_pids("decode")) == decode_replicas
        ):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pools did not settle at {decode_replicas} decode replicas: {states}")
        time.sleep(0.25)


def sessions_on(replicas: set[str], per_replica: int, tag: str) -> dict[str, str]:
    """Session ids -> the replica each hashes to, ``per_replica`` for every replica."""
    chosen: dict[str, str] = {}
    for index in range(10_000):
        session_id = f"{tag}-{index}"
        replica = preferred_replica(session_id, replicas)
        assert replica is not None
        if sum(1 for r in chosen.values() if r == replica) < per_replica:
            chosen[session_id] = replica
        if len(chosen) == per_replica * len(replicas):
            return chosen
    raise RuntimeError("rendezvous hashing never chose some replica")


def opening(session_id: str, num_chars: int) -> Messages:
    body = f"[{session_id}] The build fails in module parser; read the log and fix it. " * 8
    return [{"role": "user", "content": body[:num_chars]}]


# -- the faults -----------------------------------------------------------------


@dataclass
class Setup:
    url: str
    client: openai.OpenAI
    reference: LLMEngine
    quick: bool
    deadline_s: float
    streams: int = field(init=False)
    stream_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.streams, self.stream_tokens = (6, 48) if self.quick else (12, 96)


def stream_outcomes(setup: Setup, replicas: set[str], tag: str) -> tuple[list[Outcome], dict[str, str]]:
    sessions = sessions_on(replicas, setup.streams // len(replicas), tag)
    outcomes = [
        Outcome(session_id, opening(session_id, 200 if i % 2 else 40), setup.stream_tokens, time.monotonic())
        for i, session_id in enumerate(sessions)
    ]
    return outcomes, sessions


def baseline(setup: Setup) -> dict[str, Any]:
    wait_settled(decode_replicas=2)
    outcomes, _ = stream_outcomes(setup, set(replica_pids("decode")), "none")
    run_all(setup.client, outcomes, stream=True, deadline_s=setup.deadline_s)
    return row(
        "none", outcomes, setup.reference, None, warm_share(next_calls(setup.client, outcomes, setup.deadline_s))
    )


def decode_killed(setup: Setup) -> dict[str, Any]:
    wait_settled(decode_replicas=2)
    pids = replica_pids("decode")
    victim = sorted(pids)[0]
    losses_before = replica_losses(setup.url)
    outcomes, sessions = stream_outcomes(setup, set(pids), "cut")
    started = [threading.Event() for _ in outcomes]
    threads = [
        threading.Thread(
            target=call,
            args=(setup.client, o, True, lambda chunks, event=event: event.set() if chunks >= 3 else None),
            daemon=True,
        )
        for o, event in zip(outcomes, started)
    ]
    for thread in threads:
        thread.start()
    for event in started:
        event.wait(setup.deadline_s)
    os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    recovery = ProbeLoop(setup.client, killed_at, setup.deadline_s, "cut")
    for thread, outcome in zip(threads, outcomes):
        thread.join(setup.deadline_s)
        outcome.hung = outcome.hung or thread.is_alive()
    recovery_s = recovery.result()
    affected = [o for o in outcomes if sessions[o.session_id] == victim]
    following = next_calls(setup.client, affected, setup.deadline_s)
    result = row("decode_killed_mid_stream", outcomes, setup.reference, recovery_s, warm_share(following))
    losses = replica_losses(setup.url)
    # What the ingress did with the calls it lost a replica under (``rayturn.api.resume``).
    result["replica_losses"] = {kind: int(n - losses_before.get(kind, 0)) for kind, n in sorted(losses.items())}
    return result


def prefill_killed(setup: Setup) -> dict[str, Any]:
    wait_settled(decode_replicas=2)
    (pid,) = replica_pids("prefill").values()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop = threading.Event()

    def load(index: int) -> None:
        number = 0
        while not stop.is_set():
            messages = [{"role": "user", "content": f"[prefill {index}.{number}] {LONG_TEXT}"}]
            outcome = Outcome(f"prefill-{index}-{number}", messages, 8, time.monotonic())
            with lock:
                outcomes.append(outcome)
            call(setup.client, outcome, stream=False)
            number += 1

    def completed_since(moment: float) -> int:
        with lock:
            return sum(1 for o in outcomes if o.started_at > moment and o.completed)

    def wait_for(count: int, since: float) -> None:
        deadline = time.monotonic() + setup.deadline_s
        while completed_since(since) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    threads = [threading.Thread(target=load, args=(index,), daemon=True) for index in range(3)]
    for thread in threads:
        thread.start()
    wait_for(3, 0.0)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(3 if setup.quick else 9, killed_at)  # prefilled by the decode replicas while the pool has none
    wait_settled(decode_replicas=2)
    wait_for(3, time.monotonic())  # and by the replacement, once it is back
    stop.set()
    for thread in threads:
        thread.join(setup.deadline_s)
    with lock:
        for outcome in outcomes:
            outcome.hung = outcome.hung or outcome.ended_at is None
        after = [o.ended_at for o in outcomes if o.started_at > killed_at and o.completed and o.ended_at]
        recovery_s = min(after) - killed_at if after else None
        return row("prefill_killed", outcomes, setup.reference, recovery_s, None)


def decode_scaled_down(setup: Setup, redeploy: Callable[[int], None]) -> dict[str, Any]:
    wait_settled(decode_replicas=2)
    replicas = set(replica_pids("decode"))
    sessions = sessions_on(replicas, max(setup.streams // 4, 2), "moved")
    outcomes = [Outcome(session_id, opening(session_id, 200), 6, time.monotonic()) for session_id in sessions]
    run_all(setup.client, outcomes, stream=False, deadline_s=setup.deadline_s)
    redeploy(1)
    started_at = time.monotonic()
    wait_settled(decode_replicas=1)
    (kept,) = replica_pids("decode")
    moved = [o for o in outcomes if sessions[o.session_id] != kept]
    following = next_calls(setup.client, moved, setup.deadline_s)
    recovery_s = min((o.ended_at - started_at for o in following if o.completed and o.ended_at), default=None)
    return row("decode_scaled_down", [*outcomes, *following], setup.reference, recovery_s, warm_share(following))


def store_rows(quick: bool) -> list[dict[str, Any]]:
    """The KV store's fault rows (``bench/faults_store.py``), when that module is there."""
    path = Path(__file__).with_name("faults_store.py")
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location("faults_store", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows: list[dict[str, Any]] = module.run_store_faults(quick)
    return rows


# -- the run --------------------------------------------------------------------


@contextmanager
def embedded_cluster(http_port: int, grpc_port: int) -> Iterator[tuple[str, Callable[[int], None]]]:
    """A Ray session of its own with the cluster deployed: the HTTP URL, and a redeploy at N decode replicas."""
    import ray
    from ray import serve

    from rayturn.cluster.app import APP_NAME, KV_NAMESPACE, build_app
    from rayturn.cluster.config import load_config
    from rayturn.cluster.runner import running_cluster

    overrides = cluster_overrides(http_port, grpc_port)

    def redeploy(decode_replicas: int) -> None:
        pools: dict[str, Any] = {"decode.min_replicas": decode_replicas, "decode.max_replicas": decode_replicas}
        serve.run(build_app(load_config(**{**overrides, **pools})), name=APP_NAME, route_prefix="/")

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=KV_NAMESPACE)
    try:
        with running_cluster(load_config(**overrides)) as endpoints:
            yield endpoints.http, redeploy
    finally:
        ray.shutdown()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and shorter streams")
    parser.add_argument("--deadline-s", type=float, default=120.0, help="a call not ended by then is hung")
    parser.add_argument("--http-port", type=int, default=28621)
    parser.add_argument("--grpc-port", type=int, default=29621)
    parser.add_argument("--no-store-faults", action="store_true", help="skip bench/faults_store.py's rows")
    add_out_argument(parser, "faults")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    reference = LLMEngine.from_pretrained("tiny", dtype="float32")
    rows: list[dict[str, Any]] = []
    with embedded_cluster(args.http_port, args.grpc_port) as (url, redeploy):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.deadline_s)
        setup = Setup(url, client, reference, args.quick, args.deadline_s)
        for run in (baseline, decode_killed, prefill_killed):
            rows.append(run(setup))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        rows.append(decode_scaled_down(setup, redeploy))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if not args.no_store_faults:
        rows.extend(store_rows(args.quick))
    result = {
        "benchmark": "faults",
        "quick": args.quick,
        "faults": rows,
        "wrong": sum(r["wrong"] for r in rows),
        "hung": sum(r["hung"] for r in rows),
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faults.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)
    return 0 if result["wrong"] == 0 and result["hung"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
