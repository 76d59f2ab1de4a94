"""The control plane at scale: one routing decision, and the KV master's operations, against plain baselines.

Router. 16 decode replicas report what ``DecodeServer.record_routing_stats``
reports (``router.replica_stats.routing_report``): their load, the 2,048 page keys
their engine reports as cached, and the sessions they follow, 10,000 live
sessions spread over them by rendezvous hashing. Every session's prompt
(1k-30k tokens) starts with its agent's shared system prompt and tools; a
replica's reported pages are those shared prefixes and then the pages of the
sessions it saw last. Half the calls continue one of those sessions (an
agent's tool loop), half come from any session. One decision is
``KVAwareRequestRouter.choose_replicas`` for a ``Call`` of one session (its
page keys made once at the ingress, as there), on the real router with
Serve's ``PendingRequest``. Reports are
replaced while it routes, a replica at a time, as Serve broadcasts them
(``update_replicas``), ``--decisions-per-report`` decisions apart; the time
that takes is reported on its own (it runs on the same event loop, between
decisions). The baseline in the same run is the power-of-two-choices pick
over the same replicas (two at random, the less loaded).

Master. The real ``KVMaster`` in this process (no Ray: its methods are
awaited directly, its housekeeping tick runs on the same loop as in the
actor), with 16 worker segments and ``--keys`` pages stored in them (sized
so the store sits near its high watermark, as a busy one does). Then a
mix of calls as workers make them, each for one agent call's pages (1-64
keys): puts (start, then end), location lookups (which take read leases),
existence and prefix checks, pins with a time-to-live, removes. Puts of new
pages keep evicting old ones. Then the same mix with every call naming one
key: a master operation, as in a per-object API (a put is two of them,
start and end). The baseline does the same bookkeeping in a plain dict (no
grants, leases, tenants or eviction), replaying the same calls.

    python bench/control_plane.py [--quick] [--out DIR]

The last line of stdout is one JSON object: ``router_p50_ms``,
``router_p99_ms`` (target < 1 ms), ``master_ops_per_s`` and
``master_keys_per_s`` (batched calls, and the keys they name),
``single_key_ops_per_cpu_s`` (master operations on one key each per CPU
second of this process, target >= 20,000) with its wall-clock twin and its
ratio to the baseline, and whether each target is met. On a shared machine
read the wall-clock figures beside ``router_cpu_p99_ms``, the CPU-time ones
and ``load_average``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from _common import peak_rss_mb
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from rayturn.decode.lifecycle.session import MAX_REPORTED_SESSIONS
from rayturn.engine.sampling_params import SamplingParams
from rayturn.kvstore.master import KVMaster
from rayturn.kvstore.master_types import MasterConfig
from rayturn.messages import Call
from rayturn.replay.harness import Progress, add_out_argument, emit, machine, percentile
from rayturn.router.replica_stats import PAGE_HASH_PREFIX_CHARS, routing_report
from rayturn.router.request_router import KVAwareRequestRouter
from rayturn.router.scoring import preferred_replica, session_key

ROUTER_P99_TARGET_MS = 1.0
MASTER_OPS_TARGET_PER_S = 20_000

PAGE_SIZE = 16
# Page keys a decode engine reports as cached (``AsyncEngine``'s report).
REPORTED_PAGES = 2048
PROMPT_TOKENS = (1_000, 30_000)
# Agents (system prompt + tools) whose prefix many sessions share.
NUM_AGENTS = 4
DEPLOYMENT = DeploymentID(name="decode", app_name="control-plane-bench")

# A KV page of a small model (a 1B model's 16 tokens), and the pages per master call.
PAGE_BYTES = 256 << 10
KEYS_PER_OP = (1, 64)
NUM_SEGMENTS = 16
# The store's fill after the initial puts: just under the high watermark, so new pages soon evict old ones.
FILL_FRACTION = 0.88
TENANTS = ("tenant-a", "tenant-b", "tenant-c", "tenant-d")
# Calls of the mix, with their weights: what a worker asks per agent call (a lookup for every call, a put of
# its new pages, the rest rarer).
MIX = (("get_locations", 30), ("exists", 10), ("longest_prefix", 15), ("put", 25), ("pin", 10), ("remove", 10))


def page_key(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=PAGE_HASH_PREFIX_CHARS // 2).hexdigest()


# --- router ---------------------------------------------------------------------------------


@dataclass
class ReportingReplica:
    """What a request router reads of a Serve ``RunningReplica``: its id and its last reported stats."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Session:
    session_id: str
    agent: int
    prompt_tokens: int


class Fleet:
    """Replicas, sessions and what each replica reports about them."""

    def __init__(self, num_replicas: int, num_sessions: int, shared_prefix_tokens: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.shared_prefix_pages = shared_prefix_tokens // PAGE_SIZE
        self.replica_ids = [f"decode-{i:02d}" for i in range(num_replicas)]
        low, high = PROMPT_TOKENS
        self.sessions = [
            Session(f"tenant-{i % 8}/session-{i}", i % NUM_AGENTS, self.rng.randint(low, high))
            for i in range(num_sessions)
        ]
        self.agent_keys = [
            [page_key("agent", a, i) for i in range(self.shared_prefix_pages)] for a in range(NUM_AGENTS)
        ]
        self._page_keys: dict[str, list[str]] = {}
        self.reported: dict[str, set[str]] = {}  # replica id -> the page keys it reports
        self.hot: dict[str, list[Session]] = {}  # replica id -> the sessions whose own pages it reports
        self.followed: dict[str, list[Session]] = {replica_id: [] for replica_id in self.replica_ids}
        for session in self.sessions:
            self.followed[str(preferred_replica(session.session_id, self.replica_ids))].append(session)
        self.now_s = 1.8e9
        self.seen_s = {session.session_id: self.now_s - self.rng.uniform(0, 600) for session in self.sessions}
        self.replicas = [ReportingReplica(ReplicaID(unique_id=r, deployment_id=DEPLOYMENT)) for r in self.replica_ids]
        for replica in self.replicas:
            replica.routing_stats = self.report(replica.replica_id.unique_id)

    def page_keys(self, session: Session) -> list[str]:
        """The session's prompt pages: its agent's shared prefix, then its own."""
        keys = self._page_keys.get(session.session_id)
        if keys is None:
            num_pages = session.prompt_tokens // PAGE_SIZE
            shared = min(self.shared_prefix_pages, num_pages)
            own = [page_key(session.session_id, i) for i in range(shared, num_pages)]
            keys = self._page_keys[session.session_id] = self.agent_keys[session.agent][:shared] + own
        return keys

    def report(self, replica_id: str) -> dict[str, Any]:
        """The replica's ``record_routing_stats``: its load, its most recent pages, the sessions it follows."""
        recent = sorted(self.followed[replica_id], key=lambda s: -self.seen_s[s.session_id])
        held: dict[str, None] = {}
        for keys in self.agent_keys:
            held.update(dict.fromkeys(keys))
        self.hot[replica_id] = []
        for session in recent:
            if len(held) >= REPORTED_PAGES:
                break
            held.update(dict.fromkeys(self.page_keys(session)))
            self.hot[replica_id].append(session)
        max_num_seqs, total_pages = 64, 32_768
        cached = list(held)[:REPORTED_PAGES]
        self.reported[replica_id] = set(cached)
        engine_stats = {
            "queued_prompt_tokens": self.rng.randint(0, 8_192),
            "running_seqs": self.rng.randint(0, max_num_seqs),
            "max_num_seqs": max_num_seqs,
            "free_pages": self.rng.randint(0, total_pages),
            "total_pages": total_pages,
            "page_size": PAGE_SIZE,
            "cached_page_hashes": cached,
        }
        sessions = {session_key(s.session_id): round(self.seen_s[s.session_id], 3) for s in recent}
        return routing_report(engine_stats, replica_id, dict(list(sessions.items())[:MAX_REPORTED_SESSIONS]))

    def call(self, session: Session) -> Call:
        """The session's next call: its prompt's pages plus a few new tokens, as the ingress builds it."""
        new_tokens = self.rng.randint(50, 1_000)
        prompt_tokens = session.prompt_tokens + new_tokens
        keys = self.page_keys(session) + [
            page_key(session.session_id, "new", i) for i in range(new_tokens // PAGE_SIZE)
        ]
        params = SamplingParams(max_tokens=256)
        return Call("bench", tuple(range(prompt_tokens)), params, session_id=session.session_id, page_keys=tuple(keys))

    def touch(self, session: Session) -> None:
        self.now_s += 0.01
        self.seen_s[session.session_id] = self.now_s


def pending(call: Call) -> PendingRequest:
    metadata = RequestMetadata(request_id="r", internal_request_id="ir", session_id=call.session_id or "")
    return PendingRequest(args=[call], kwargs={}, metadata=metadata)


def power_of_two(replicas: Sequence[ReportingReplica], rng: random.Random) -> ReportingReplica:
    """The baseline: two replicas at random, the one with fewer running sequences (Serve's default router)."""
    first, second = rng.sample(list(replicas), 2)
    return min(first, second, key=lambda replica: replica.routing_stats["running_seqs"])


async def route(fleet: Fleet, num_decisions: int, decisions_per_report: int) -> dict[str, Any]:
    router = KVAwareRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    router.refresh_stats(fleet.replicas)  # type: ignore[arg-type]
    rng = random.Random(7)
    decision_ms, decision_cpu_ms, baseline_ms, refresh_ms = [], [], [], []
    kv_calls = kv_hits = 0
    for i in range(num_decisions):
        # Half the calls continue a session its replica saw last (an agent's tool loop), half any session.
        hot = [session for sessions in fleet.hot.values() for session in sessions]
        session = rng.choice(hot) if hot and rng.random() < 0.5 else rng.choice(fleet.sessions)
        call = fleet.call(session)
        request = pending(call)
        start, start_cpu = time.perf_counter(), time.thread_time()
        ranks = await router.choose_replicas(fleet.replicas, request)  # type: ignore[arg-type]
        decision_ms.append((time.perf_counter() - start) * 1e3)
        decision_cpu_ms.append((time.thread_time() - start_cpu) * 1e3)
        start = time.perf_counter()
        power_of_two(fleet.replicas, rng)
        baseline_ms.append((time.perf_counter() - start) * 1e3)
        # A call whose session's own pages some replica reports should go to one of those replicas.
        own_pages = fleet.page_keys(session)[fleet.shared_prefix_pages :]
        holders = [r for r in fleet.replica_ids if own_pages and own_pages[0] in fleet.reported[r]]
        if holders:
            kv_calls += 1
            kv_hits += ranks[0][0].replica_id.unique_id in holders
        fleet.touch(session)
        if (i + 1) % decisions_per_report == 0:
            replica = fleet.replicas[(i // decisions_per_report) % len(fleet.replicas)]
            replica.routing_stats = fleet.report(replica.replica_id.unique_id)
            start = time.perf_counter()
            router.refresh_stats(fleet.replicas)  # type: ignore[arg-type]
            refresh_ms.append((time.perf_counter() - start) * 1e3)
    return {
        "decision_ms": decision_ms,
        "decision_cpu_ms": decision_cpu_ms,
        "baseline_ms": baseline_ms,
        "refresh_ms": refresh_ms,
        "kv_calls": kv_calls,
        "kv_hits": kv_hits,
    }


# --- master ---------------------------------------------------------------------------------


@dataclass
class DictMaster:
    """The baseline: the same calls' bookkeeping in one dict (key -> [segment, offset, size, complete])."""

    objects: dict[bytes, list[Any]] = field(default_factory=dict)
    next_offset: int = 0

    def put_start(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[Any]:
        plans: list[Any] = []
        for key, num_bytes in zip(keys, sizes):
            if key in self.objects:
                plans.append(None)
                continue
            self.objects[key] = entry = ["segment", self.next_offset, num_bytes, False]
            self.next_offset += num_bytes
            plans.append(entry)
        return plans

    def put_end(self, keys: Sequence[bytes]) -> list[bool]:
        done = []
        for key in keys:
            entry = self.objects.get(key)
            if entry is not None:
                entry[3] = True
            done.append(entry is not None)
        return done

    def get_locations(self, keys: Sequence[bytes]) -> list[Any]:
        return [entry[:3] if (entry := self.objects.get(key)) and entry[3] else None for key in keys]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool((entry := self.objects.get(key)) and entry[3]) for key in keys]

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            entry = self.objects.get(key)
            if not (entry and entry[3]):
                break
            count += 1
        return count

    def pin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            entry = self.objects.get(key)
            if entry is not None:
                entry.append(True)
                entry.pop()

    def remove(self, keys: Sequence[bytes]) -> int:
        return sum(self.objects.pop(key, None) is not None for key in keys)


class MasterCall(NamedTuple):
    name: str
    keys: list[bytes]
    tenant: str
    writer: str  # the calling worker's segment


class Workload:
    """Which keys each call names: a tenant's session prefix, some of it stored, new pages after it."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_key = 0
        self.stored: list[tuple[bytes, str]] = []

    def new_keys(self, num_keys: int) -> list[bytes]:
        start, self.next_key = self.next_key, self.next_key + num_keys
        return [hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).digest() for i in range(start, start + num_keys)]

    def stored_run(self, num_keys: int) -> tuple[list[bytes], str]:
        """A run of stored keys of one tenant, in the order they were put (a cached prefix)."""
        start = self.rng.randrange(max(1, len(self.stored) - num_keys))
        run = self.stored[start : start + num_keys]
        tenant = run[0][1]
        return [key for key, owner in run if owner == tenant], tenant

    def writer(self) -> str:
        """The segment of the worker that makes a call: puts go to the writer's own segment first."""
        return segment_id(self.rng.randrange(NUM_SEGMENTS))

    def ops(self, num_ops: int, keys_per_op: tuple[int, int] = KEYS_PER_OP) -> list[MasterCall]:
        """The mix's calls, drawn once so that the master and the baseline replay the same ones."""
        names = [name for name, _ in MIX]
        weights = [weight for _, weight in MIX]
        calls: list[MasterCall] = []
        for name in self.rng.choices(names, weights, k=num_ops):
            if name == "put":
                tenant = self.rng.choice(TENANTS)
                keys = self.new_keys(self.rng.randint(*keys_per_op))
                self.stored.extend((key, tenant) for key in keys)
                calls.append(MasterCall("put", keys, tenant, self.writer()))
            else:
                keys, tenant = self.stored_run(self.rng.randint(*keys_per_op))
                calls.append(MasterCall(name, keys, tenant, self.writer()))
        return calls


async def fill(master: KVMaster, workload: Workload, num_keys: int) -> float:
    """Put ``num_keys`` pages, a call's pages at a time; returns the seconds it took."""
    start = time.perf_counter()
    while workload.next_key < num_keys:
        tenant = workload.rng.choice(TENANTS)
        keys = workload.new_keys(min(KEYS_PER_OP[1], num_keys - workload.next_key))
        await master.put_start(keys, [PAGE_BYTES] * len(keys), tenant, preferred_segment_id=workload.writer())
        await master.put_end(keys)
        workload.stored.extend((key, tenant) for key in keys)
        if workload.next_key % 16_384 < KEYS_PER_OP[1]:
            await heartbeat(master)
    return time.perf_counter() - start


def segment_id(index: int) -> str:
    return f"segment-{index:02d}"


def node_of(segment_index: int) -> str:
    return f"node-{segment_index // 4}"


async def run_master_mix(master: KVMaster, calls: Sequence[MasterCall]) -> tuple[float, float, int]:
    """Replay the calls on the master; (seconds, CPU seconds, keys named). A put is two calls: start and end."""
    num_keys = 0
    start, start_cpu = time.perf_counter(), time.process_time()
    for i, (name, keys, tenant, writer) in enumerate(calls):
        num_keys += len(keys)
        if name == "put":
            sizes = [PAGE_BYTES] * len(keys)
            await master.put_start(keys, sizes, tenant, preferred_segment_id=writer)
            await master.put_end(keys)
        elif name == "get_locations":
            await master.get_locations(keys, node_of(int(writer[-2:])), tenant)
        elif name == "exists":
            await master.exists(keys, tenant)
        elif name == "longest_prefix":
            await master.longest_prefix(keys, tenant)
        elif name == "pin":
            await master.pin(keys, 30.0, tenant)
        else:
            await master.remove(keys)
        if i % 256 == 0:
            await heartbeat(master)
    return time.perf_counter() - start, time.process_time() - start_cpu, num_keys


async def heartbeat(master: KVMaster) -> None:
    """The segment owners' heartbeats (each sends one a second; here, more often), and a turn for the tick."""
    for i in range(NUM_SEGMENTS):
        await master.heartbeat(segment_id(i))
    await asyncio.sleep(0)


def run_dict_mix(baseline: DictMaster, calls: Sequence[MasterCall]) -> tuple[float, float]:
    """Replay the calls on the baseline; (seconds, CPU seconds)."""
    actions: dict[str, Callable[[list[bytes]], object]] = {
        "get_locations": baseline.get_locations,
        "exists": baseline.exists,
        "longest_prefix": baseline.longest_prefix,
        "pin": baseline.pin,
        "remove": baseline.remove,
    }
    start, start_cpu = time.perf_counter(), time.process_time()
    for name, keys, _, _ in calls:
        if name == "put":
            baseline.put_start(keys, [PAGE_BYTES] * len(keys))
            baseline.put_end(keys)
        else:
            actions[name](keys)
    return time.perf_counter() - start, time.process_time() - start_cpu


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def num_master_calls(calls: Sequence[MasterCall]) -> int:
    return sum(2 if call.name == "put" else 1 for call in calls)


async def master_figures(num_keys: int, num_ops: int, num_single_key_ops: int, rounds: int) -> dict[str, Any]:
    capacity_bytes = int(num_keys * PAGE_BYTES / FILL_FRACTION / NUM_SEGMENTS)
    gc.collect()
    rss_before_mb = rss_mb()
    master = KVMaster(MasterConfig())
    for i in range(NUM_SEGMENTS):
        await master.register_segment(segment_id(i), node_of(i), f"shm-{i}", capacity_bytes, None, PAGE_BYTES)
    workload = Workload(seed=11)
    fill_s = await fill(master, workload, num_keys)
    gc.collect()
    bytes_per_key = (rss_mb() - rss_before_mb) * 2**20 / num_keys
    baseline = DictMaster()
    for key, _ in workload.stored:
        baseline.objects[key] = ["segment", 0, PAGE_BYTES, True]
    master_ops_s, master_cpu_ops_s, baseline_ops_s, keys_s = [], [], [], []
    for _ in range(rounds):
        calls = workload.ops(num_ops)
        elapsed_s, cpu_s, named_keys = await run_master_mix(master, calls)
        master_ops_s.append(num_master_calls(calls) / elapsed_s)
        master_cpu_ops_s.append(num_master_calls(calls) / cpu_s)
        keys_s.append(named_keys / elapsed_s)
        baseline_ops_s.append(num_master_calls(calls) / run_dict_mix(baseline, calls)[0])
    single: dict[str, list[float]] = {"wall": [], "cpu": [], "baseline_wall": [], "baseline_cpu": []}
    for _ in range(rounds):
        calls = workload.ops(num_single_key_ops, keys_per_op=(1, 1))
        elapsed_s, cpu_s, _ = await run_master_mix(master, calls)
        baseline_s, baseline_cpu_s = run_dict_mix(baseline, calls)
        for name, seconds in zip(single, (elapsed_s, cpu_s, baseline_s, baseline_cpu_s)):
            single[name].append(num_master_calls(calls) / seconds)
    stats = await master.stats()
    return {
        "keys": num_keys,
        "fill_keys_per_s": round(num_keys / fill_s),
        "ops_per_s_each": [round(v) for v in master_ops_s],
        "ops_per_cpu_s_each": [round(v) for v in master_cpu_ops_s],
        "baseline_ops_per_s_each": [round(v) for v in baseline_ops_s],
        "keys_per_s": round(max(keys_s)),
        "single_key_ops_per_s_each": [round(v) for v in single["wall"]],
        "single_key_ops_per_cpu_s_each": [round(v) for v in single["cpu"]],
        "single_key_baseline_ops_per_s_each": [round(v) for v in single["baseline_wall"]],
        "single_key_baseline_ops_per_cpu_s_each": [round(v) for v in single["baseline_cpu"]],
        "bytes_per_key": round(bytes_per_key),
        "objects_after": stats["objects"],
        "evictions": stats["evictions"],
    }


# --- main -----------------------------------------------------------------------------------


def cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown")


def summary_ms(samples: Sequence[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(samples, 50), 4),
        "p99": round(percentile(samples, 99), 4),
        "max": round(max(samples), 4),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer decisions, keys and calls")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--shared-prefix-tokens", type=int, default=4_096, help="an agent's system prompt and tools")
    parser.add_argument("--decisions", type=int, default=None)
    parser.add_argument("--decisions-per-report", type=int, default=64, help="decisions between two replica reports")
    parser.add_argument("--keys", type=int, default=None, help="pages stored in the KV master")
    parser.add_argument("--ops", type=int, default=None, help="master calls per round")
    parser.add_argument("--single-key-ops", type=int, default=None, help="master calls of one key per round")
    parser.add_argument("--rounds", type=int, default=None)
    add_out_argument(parser, "control_plane")
    args = parser.parse_args(argv)
    num_decisions = args.decisions or (2_000 if args.quick else 20_000)
    num_keys = args.keys or (200_000 if args.quick else 1_000_000)
    num_ops = args.ops or (10_000 if args.quick else 50_000)
    num_single_key_ops = args.single_key_ops or (20_000 if args.quick else 100_000)
    rounds = args.rounds or (2 if args.quick else 5)

    progress = Progress("control plane", 3)
    fleet = Fleet(args.replicas, args.sessions, args.shared_prefix_tokens, seed=5)
    progress.advance()
    routed = asyncio.run(route(fleet, num_decisions, args.decisions_per_report))
    progress.advance()
    master = asyncio.run(master_figures(num_keys, num_ops, num_single_key_ops, rounds))
    progress.advance()

    decision, baseline = summary_ms(routed["decision_ms"]), summary_ms(routed["baseline_ms"])
    master_ops_per_s = max(master["ops_per_s_each"])
    baseline_ops_per_s = max(master["baseline_ops_per_s_each"])
    single_key_cpu = max(master["single_key_ops_per_cpu_s_each"])
    single_key_baseline_cpu = max(master["single_key_baseline_ops_per_cpu_s_each"])
    result: dict[str, Any] = {
        "bench": "control_plane",
        "quick": args.quick,
        "replicas": args.replicas,
        "sessions": args.sessions,
        "shared_prefix_tokens": args.shared_prefix_tokens,
        "decisions": num_decisions,
        "decisions_per_report": args.decisions_per_report,
        "router_p50_ms": decision["p50"],
        "router_p99_ms": decision["p99"],
        "router_max_ms": decision["max"],
        "router_cpu_p99_ms": summary_ms(routed["decision_cpu_ms"])["p99"],
        "router_kv_calls": routed["kv_calls"],
        "router_kv_hit_share": round(routed["kv_hits"] / max(routed["kv_calls"], 1), 4),
        "baseline_power_of_two_ms": baseline,
        "router_p99_over_baseline": round(decision["p99"] / max(baseline["p99"], 1e-6), 1),
        "stats_refresh_ms": summary_ms(routed["refresh_ms"]) if routed["refresh_ms"] else None,
        "router_p99_target_ms": ROUTER_P99_TARGET_MS,
        "router_target_met": decision["p99"] < ROUTER_P99_TARGET_MS,
        "master": master,
        "master_ops_per_s": round(master_ops_per_s),
        "master_ops_spread": [min(master["ops_per_s_each"]), max(master["ops_per_s_each"])],
        "baseline_dict_ops_per_s": round(baseline_ops_per_s),
        "master_over_baseline": round(master_ops_per_s / baseline_ops_per_s, 3),
        "master_keys_per_s": master["keys_per_s"],
        "single_key_ops_per_s": max(master["single_key_ops_per_s_each"]),
        "single_key_ops_per_cpu_s": single_key_cpu,
        "single_key_baseline_ops_per_cpu_s": single_key_baseline_cpu,
        "single_key_over_baseline": round(single_key_cpu / single_key_baseline_cpu, 3),
        "master_ops_target_per_s": MASTER_OPS_TARGET_PER_S,
        "master_target_met": single_key_cpu >= MASTER_OPS_TARGET_PER_S,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "machine": machine(),
        "cpu_model": cpu_model(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "control_plane_quick" if args.quick else "control_plane"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


if __name__ == "__main__":
    main()
