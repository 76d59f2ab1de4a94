"""The KV store under faults: a segment owner killed, the master killed and restarted, a UCX peer gone silent.

Store-level runs with real Ray actors, shared memory and UCX; faults are real
kills (SIGKILL of an owner's process, ``ray.kill`` of the master's, SIGSTOP of
an owner). The baseline, in the same run, reads the same pages with no fault.

- ``store_owner_killed``: an owner writes pages, 3 in 4 with ``replicas=2``,
  and is SIGKILLed; a same-node reader then asks for every page.
- ``kv_master_restarted``: a worker puts and gets in a loop while the master
  is killed; Ray restarts it with no snapshot, owners re-advertise.
- ``ucx_peer_silent``: as ``store_owner_killed``, over UCX, with the owner
  SIGSTOPped instead of killed.

Per fault: ``sent`` gets/puts issued (one per call, the master run; one per
page, the others), ``completed`` served with the right bytes (or stored),
``failed_cleanly`` misses or puts not stored, ``wrong`` bytes that were not
the page's (must be 0), ``hung`` calls not ended within ``HUNG_S`` (must be
0), ``recovery_s`` from the fault until the store serves again,
``warm_next_call_share`` the share of pages still served after the fault
(the master run: of the pages stored before it), and ``errors`` calls that
raised instead (must be 0).

    python bench/faults_store.py [--quick] [--out DIR]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rayturn.kvstore import KVStoreClient, MasterConfig, start_master
from rayturn.replay.harness import add_out_argument, emit, machine

PAGE_BYTES = 32 << 10
SEGMENT_BYTES = 32 << 20
HUNG_S = 60.0
CONFIG = MasterConfig(heartbeat_timeout_s=3.0)
NAMESPACE = "kv-faults-bench"


class Member:
    """A store member in its own process: a segment, its UCX server, a client."""

    def __init__(self, master_name: str, transport: str) -> None:
        self.client = KVStoreClient.connect(
            master_name, SEGMENT_BYTES, transport=transport, heartbeat_interval_s=0.5, page_bytes=PAGE_BYTES
        )

    def pid(self) -> int:
        return os.getpid()

    def put_pages(self, prefix: str, seeds: list[int], replicas: int) -> list[bool]:
        return self.client.put_batch([_key(prefix, s) for s in seeds], [page(s) for s in seeds], replicas=replicas)

    def check_pages(self, prefix: str, seeds: list[int]) -> dict[str, Any]:
        """Get the pages and compare them with what was written: counts, and how long the call took."""
        start = time.monotonic()
        got = self.client.get_batch([_key(prefix, s) for s in seeds])
        served = sum(value == page(s) for value, s in zip(got, seeds))
        missed = sum(value is None for value in got)
        return {
            "served": served,
            "missed": missed,
            "wrong": len(seeds) - served - missed,
            "took_s": time.monotonic() - start,
        }

    def exists(self, prefix: str, seeds: list[int]) -> list[bool]:
        return self.client.exists([_key(prefix, s) for s in seeds])

    def churn(self, prefix: str, duration_s: float) -> dict[str, Any]:
        """Puts of 64 pages in turn and gets of stored ones for ``duration_s``: what each call came to."""
        counts = {"sent": 0, "completed": 0, "failed_cleanly": 0, "wrong": 0, "hung": 0, "errors": 0}
        stored: set[int] = set()
        deadline = time.monotonic() + duration_s
        round_index = 0
        while time.monotonic() < deadline:
            seeds = [(round_index % 16) * 4 + i for i in range(4)]
            recent = sorted(stored)[-8:]
            for call in ("put", "get"):
                counts["sent"] += 1
                start = time.monotonic()
                try:
                    if call == "put":
                        done = self.put_pages(prefix, seeds, 1)
                        stored.update(s for s, ok in zip(seeds, done) if ok)
                        outcome = "completed" if all(done) else "failed_cleanly"
                    else:
                        checked = self.check_pages(prefix, recent)
                        outcome = (
                            "wrong" if checked["wrong"] else "failed_cleanly" if checked["missed"] else "completed"
                        )
                except Exception:
                    outcome = "errors"
                counts[outcome] += 1
                counts["hung"] += time.monotonic() - start > HUNG_S
            round_index += 1
        return counts


def page(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes()


def _key(prefix: str, seed: int) -> bytes:
    return f"{prefix}-{seed}".encode()


def _members(master_name: str, transport: str, count: int) -> list[Any]:
    start_master(master_name, config=CONFIG, namespace=NAMESPACE)
    actor: Any = ray.remote(Member).options(num_cpus=0.1)
    members = [actor.remote(master_name, transport) for _ in range(count)]
    ray.get([m.pid.remote() for m in members])
    return members


def _written(owner: Any, num_pages: int) -> tuple[list[int], list[int]]:
    """Pages the owner writes: 3 in 4 with two replicas, the rest with one. (replicated seeds, single seeds)"""
    twice = list(range(num_pages * 3 // 4))
    once = list(range(len(twice), num_pages))
    assert all(ray.get(owner.put_pages.remote("page", twice, 2))), "replicated puts failed"
    assert all(ray.get(owner.put_pages.remote("page", once, 1))), "single puts failed"
    return twice, once


def _read_all(reader: Any, seeds: list[int], batch: int) -> tuple[dict[str, int], list[float]]:
    """Every page, in batches: totals, and each call's end time (monotonic, this process)."""
    totals = {"served": 0, "missed": 0, "wrong": 0, "hung": 0}
    ended: list[float] = []
    for start in range(0, len(seeds), batch):
        chunk = seeds[start : start + batch]
        try:
            checked = ray.get(reader.check_pages.remote("page", chunk), timeout=HUNG_S)
        except ray.exceptions.GetTimeoutError:
            totals["hung"] += len(chunk)
            continue
        for name in ("served", "missed", "wrong"):
            totals[name] += checked[name]
        ended.append(time.monotonic())
    return totals, ended


def _row(
    fault: str, sent: int, totals: dict[str, int], recovery_s: float | None, share: float | None, errors: int = 0
) -> dict[str, Any]:
    """One fault's figures; ``errors`` counts calls that raised (neither served nor a clean miss)."""
    return {
        "fault": fault,
        "sent": sent,
        "completed": totals["served"],
        "failed_cleanly": totals["missed"],
        "wrong": totals["wrong"],
        "hung": totals["hung"],
        "recovery_s": None if recovery_s is None else round(recovery_s, 2),
        "warm_next_call_share": share,
        "errors": errors,
    }


def baseline(num_pages: int) -> dict[str, Any]:
    """The same reads as ``store_owner_killed``, with no fault."""
    owner, _, reader = _members("kv-bench-baseline", "auto", 3)
    twice, once = _written(owner, num_pages)
    started = time.monotonic()
    totals, ended = _read_all(reader, twice + once, 32)
    return _row(
        "store_baseline", num_pages, totals, ended[0] - started if ended else None, totals["served"] / num_pages
    )


def owner_killed(num_pages: int) -> dict[str, Any]:
    owner, _, reader = _members("kv-bench-owner-killed", "auto", 3)
    twice, once = _written(owner, num_pages)
    pid = ray.get(owner.pid.remote())
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while _running(pid) and time.monotonic() - killed_at < HUNG_S:  # until reaped: the owner is gone for good
        time.sleep(0.01)
    totals, ended = _read_all(reader, twice + once, 32)
    recovery_s = ended[0] - killed_at if ended else None
    return _row("store_owner_killed", num_pages, totals, recovery_s, totals["served"] / num_pages)


def ucx_peer_silent(num_pages: int) -> dict[str, Any]:
    owner, _, reader = _members("kv-bench-silent-peer", "ucx", 3)
    twice, once = _written(owner, num_pages)
    ray.get(reader.check_pages.remote("page", once[:1]))  # a connection to the owner is open
    pid = ray.get(owner.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        totals, ended = _read_all(reader, twice + once, 32)
    finally:
        os.kill(pid, signal.SIGCONT)
    recovery_s = ended[0] - stopped_at if ended else None
    return _row("ucx_peer_silent", num_pages, totals, recovery_s, totals["served"] / num_pages)


def master_restarted(num_pages: int, load_s: float) -> dict[str, Any]:
    master_name = "kv-bench-master-killed"
    worker, reader = _members(master_name, "auto", 2)
    before = list(range(num_pages))
    assert all(ray.get(worker.put_pages.remote("before", before, 1))), "puts before the fault failed"
    master = ray.get_actor(master_name, namespace=NAMESPACE)
    epoch = str(ray.get(master.ready.remote(), timeout=30))
    load = worker.churn.remote("load", load_s)
    time.sleep(load_s / 4)
    ray.kill(master, no_restart=False)  # no snapshot: the owners' re-advertisements bring the keys back
    killed_at = time.monotonic()
    recovery_s = None
    while time.monotonic() - killed_at < HUNG_S:
        if _epoch(master) not in (None, epoch) and all(ray.get(reader.exists.remote("before", before))):
            recovery_s = time.monotonic() - killed_at
            break
        time.sleep(0.1)
    counts = ray.get(load, timeout=load_s + HUNG_S)
    checked = ray.get(reader.check_pages.remote("before", before))
    totals = {
        "served": counts["completed"],
        "missed": counts["failed_cleanly"],
        "wrong": counts["wrong"] + checked["wrong"],
        "hung": counts["hung"],
    }
    share = checked["served"] / num_pages
    return _row("kv_master_restarted", counts["sent"], totals, recovery_s, share, counts["errors"])


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _epoch(master: Any) -> str | None:
    try:
        epoch: str = ray.get(master.ready.remote(), timeout=2)
        return epoch
    except Exception:
        return None


@contextmanager
def ray_session() -> Iterator[None]:
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    try:
        yield
    finally:
        ray.shutdown()


def run_store_faults(quick: bool) -> list[dict[str, Any]]:
    """One row per store fault (owner killed, master restarted, UCX peer silent), in a Ray session of its own."""
    return _runs(quick, with_baseline=False)


def _runs(quick: bool, *, with_baseline: bool) -> list[dict[str, Any]]:
    num_pages, load_s = (64, 8.0) if quick else (512, 30.0)
    with ray_session():
        rows = [baseline(num_pages)] if with_baseline else []
        return [*rows, owner_killed(num_pages), master_restarted(num_pages, load_s), ucx_peer_silent(num_pages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer pages, a shorter load")
    add_out_argument(parser, "faults_store")
    args = parser.parse_args()
    started = time.perf_counter()
    reference, *rows = _runs(args.quick, with_baseline=True)
    for row in [reference, *rows]:
        print(json.dumps(row), file=sys.stderr, flush=True)
    result = {
        "benchmark": "faults_store",
        "quick": args.quick,
        "baseline": reference,
        "faults": rows,
        "wrong": sum(r["wrong"] for r in rows),
        "hung": sum(r["hung"] for r in rows),
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults_store.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


if __name__ == "__main__":
    main()
