"""KV store bandwidth and latency: same-node shared memory vs UCX, against memcpy.

Two actors (separate processes) on this host. A writer stores 64 MiB of
32 KiB pages; a reader lands them in a warm numpy buffer with batched
``get_into`` (1,024 pages a call; the buffer passed as one 2-D array, and
again as a list of per-page rows: ``*_list_*`` figures) — once on the
same-node path (straight out of the owner's shared memory), once with UCX
forced, and once more with UCX on TCP alone (``ucx_tcp``: the reader's
``UCX_TLS=tcp,self``, the path of a reader on another node without RDMA;
between two processes of one host UCX otherwise picks shared memory, which no
deployment uses for a remote read: a same-node reader maps the owner's
segment). It also times a 1-page get and a 256-page batch (p50/p99; 200
batches in a full run, so the p99 is not just the slowest of a handful). In
the same run, a single-thread memcpy of the same bytes into a warm buffer
gives the physical limit, and the Mooncake store runs the
same workloads on the same pages (``--peer mooncake``, the default when its
venv is set up: ``bash bench/peers/setup_mooncake.sh``; see
``bench/peers/mooncake_peer.py``), in its TCP and local-memcpy modes; the
``vs_mooncake`` ratios are rayturn's figure over Mooncake's (bandwidth: higher
is better for rayturn; latency: lower is), and ``targets_met`` says whether
each UCX reader's 256-page p99 is at most Mooncake's TCP mode's.

Where a one-page get's time goes: ``lookup_1_*`` times the master lookup
alone (the one-key ``get_locations`` call every get starts with),
and ``ucx_floor`` is ``bench/ucx_floor.py`` run in the same session: the same
page over the same UCX runtime with no store at all, its owner on the UCX
loop as the store's server is, and polling from a thread of its own.
``ucx_get_1_p50_over_floor`` is the store's UCX get over the bare exchange.

Reads over UCX go to the owner's native reader
(``kvstore/ucx_native.c``: no Python between UCX and the segment on either
side); ``ucx_ucxx`` is the same reader with it turned off in its process
(``RAYTURN_KV_NATIVE=0``: the UCXX path every read took before), run in
the same session, and ``ucx_over_ucxx_path`` the ratios of the two (below 1:
the native reader is faster).

A decode replica loads a call's prefix at its arrival: ``prefix_load_8_*``
times that for 8 held pages as the engine does it (``locate_prefix``, then
``get_prefix_into``: one master lookup), and ``prefix_load_8_two_lookups_*``
the way it did before, in the same loop, alternated (``longest_prefix``, then
``get_into``, which looks the pages up again).

    python bench/kvstore_bandwidth.py [--quick] [--peer mooncake|none] [--out DIR]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
import ray
import ucx_floor
from _common import nearest_rank
from peers import mooncake_peer

from rayturn.kvstore import KVStoreClient, start_master
from rayturn.replay.harness import Progress, add_out_argument, emit

PAGE_BYTES = 32 << 10
BATCH_PAGES = 256  # the latency batch
PREFIX_PAGES = 8  # a prefix load at a call's arrival: often a few pages
PREFIX_LOAD = f"prefix_load_{PREFIX_PAGES}"
BANDWIDTH_BATCH_PAGES = 1024  # 32 MiB per get_into: one master round trip amortised over many pages
UCX_GET_1_P50_TARGET_MS = 0.3
READERS: dict[str, tuple[str, dict[str, str]]] = {
    "same_node": ("auto", {}),
    "ucx": ("ucx", {}),
    "ucx_tcp": ("ucx", {"UCX_TLS": "tcp,self"}),
    "ucx_ucxx": ("ucx", {"RAYTURN_KV_NATIVE": "0"}),
}
"""Each reader's name in the report: the client's transport and what its process's environment adds."""


@ray.remote(num_cpus=0.1)
class Worker:
    def __init__(self, master_name: str, transport: str, segment_bytes: int) -> None:
        self.client = KVStoreClient.connect(master_name, segment_bytes, transport=transport, page_bytes=PAGE_BYTES)

    def fill(self, num_pages: int) -> list[bytes]:
        keys = [f"page-{i}".encode() for i in range(num_pages)]
        rng = np.random.default_rng(0)
        for start in range(0, num_pages, BATCH_PAGES):
            batch = keys[start : start + BATCH_PAGES]
            values = [rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8) for _ in batch]
            assert all(self.client.put_batch(batch, values))
        return keys

    def measure(self, keys: list[bytes], repeats: int, latency_iters: int, batch_iters: int) -> dict[str, Any]:
        num_pages = len(keys)
        dest = np.ones((num_pages, PAGE_BYTES), dtype=np.uint8)  # touched: warm
        rows = list(dest)
        # Two forms of the same batched call: one 2-D array whose rows receive the keys (the
        # batch form), and a list of per-page buffers (what a caller with scattered pages passes).
        best_s = {"batch": float("inf"), "list": float("inf")}
        for repeat in range(repeats + 1):  # the first pass maps the segments and is not timed
            for form in best_s:
                dest[:] = 1
                start = time.perf_counter()
                for first in range(0, num_pages, BANDWIDTH_BATCH_PAGES):
                    batch = slice(first, first + BANDWIDTH_BATCH_PAGES)
                    assert all(self.client.get_into(keys[batch], dest[batch] if form == "batch" else rows[batch]))
                if repeat:
                    best_s[form] = min(best_s[form], time.perf_counter() - start)
                assert bytes(dest[-1]) == self.client.get(keys[-1])
        one, batch, lookup = [], [], []
        for i in range(latency_iters):
            start = time.perf_counter()
            # The lookup every get starts with, exactly as the reader makes it (read grant included).
            self.client.master.call("get_locations", [keys[i % num_pages]], self.client.node_id, self.client.tenant)
            lookup.append(time.perf_counter() - start)
        for i in range(latency_iters):
            start = time.perf_counter()
            self.client.get_into([keys[i % num_pages]], [rows[0]])
            one.append(time.perf_counter() - start)
        loads: dict[str, list[float]] = {PREFIX_LOAD: [], f"{PREFIX_LOAD}_two_lookups": []}
        for i in range(latency_iters):
            first = (i * PREFIX_PAGES) % num_pages
            window = keys[first : first + PREFIX_PAGES]
            for name in sorted(loads, reverse=bool(i % 2)):  # alternated, so neither goes first every time
                start = time.perf_counter()
                if name == PREFIX_LOAD:  # how a decode replica loads a prefix at a call's arrival
                    prefix = self.client.locate_prefix(window)
                    landed = self.client.get_prefix_into(prefix, dest[: prefix.num_keys])
                else:  # the same, as it was: how much is held, then where
                    count = self.client.longest_prefix(window)
                    landed = self.client.get_into(window[:count], dest[:count])
                loads[name].append(time.perf_counter() - start)
                assert len(landed) == PREFIX_PAGES and all(landed)
        for i in range(batch_iters):
            first = (i * BATCH_PAGES) % num_pages
            start = time.perf_counter()
            self.client.get_into(keys[first : first + BATCH_PAGES], rows[:BATCH_PAGES])
            batch.append(time.perf_counter() - start)
        return {
            "gbps": num_pages * PAGE_BYTES / best_s["batch"] / 1e9,
            "list_gbps": num_pages * PAGE_BYTES / best_s["list"] / 1e9,
            "get_1_p50_ms": nearest_rank(one, 50) * 1e3,
            "get_1_p99_ms": nearest_rank(one, 99) * 1e3,
            "get_256_p50_ms": nearest_rank(batch, 50) * 1e3,
            "get_256_p99_ms": nearest_rank(batch, 99) * 1e3,
            "lookup_1_p50_ms": nearest_rank(lookup, 50) * 1e3,
            "lookup_1_p99_ms": nearest_rank(lookup, 99) * 1e3,
            **{f"{name}_p{q}_ms": nearest_rank(times, q) * 1e3 for name, times in loads.items() for q in (50, 99)},
        }

    def memcpy_gbps(self, num_bytes: int, repeats: int) -> float:
        src = np.random.default_rng(1).integers(0, 256, num_bytes, dtype=np.uint8)
        dst = np.ones(num_bytes, dtype=np.uint8)
        best_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            np.copyto(dst, src)
            best_s = min(best_s, time.perf_counter() - start)
        return num_bytes / best_s / 1e9

    def transports(self) -> str:
        from rayturn.kvstore.ucx_transport import describe_transports

        return describe_transports()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 MiB, fewer repeats")
    parser.add_argument(
        "--peer", choices=("mooncake", "none"), default="mooncake", help="the store run beside rayturn's"
    )
    add_out_argument(parser, "kvstore_bandwidth")
    args = parser.parse_args()
    total_bytes = (16 if args.quick else 64) << 20
    repeats, latency_iters, batch_iters = (5, 50, 10) if args.quick else (5, 200, 200)
    num_pages = total_bytes // PAGE_BYTES

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    start_master("kv-bench")
    progress = Progress("kvstore bandwidth", 4 + len(READERS))
    writer = Worker.remote("kv-bench", "auto", int(total_bytes * 1.5))
    keys = ray.get(writer.fill.remote(num_pages))
    progress.advance()
    results: dict[str, dict[str, Any]] = {}
    readers = {}
    for name, (transport, env) in READERS.items():
        options = {"runtime_env": {"env_vars": env}} if env else {}
        readers[name] = Worker.options(**options).remote("kv-bench", transport, 4 << 20)  # type: ignore[attr-defined]
        results[name] = ray.get(readers[name].measure.remote(keys, repeats, latency_iters, batch_iters))
        progress.advance()
    memcpy = ray.get(readers["ucx"].memcpy_gbps.remote(total_bytes, repeats))
    used = {name: ray.get(readers[name].transports.remote()) for name in ("ucx", "ucx_tcp")}
    progress.advance()
    floor = ucx_floor.measure(latency_iters * 2)
    progress.advance()
    ray.shutdown()
    peer = _peer(args.peer, args.out, num_pages, repeats, latency_iters, batch_iters)
    progress.advance()
    same, ucx, ucx_tcp = results["same_node"], results["ucx"], results["ucx_tcp"]
    result = {
        "bench": "kvstore_bandwidth",
        "quick": args.quick,
        "bytes": total_bytes,
        "page_bytes": PAGE_BYTES,
        "same_node_gbps": round(same["gbps"], 3),
        "ucx_gbps": round(ucx["gbps"], 3),
        "memcpy_gbps": round(memcpy, 3),
        "same_node_over_memcpy": round(same["gbps"] / memcpy, 3),
        "same_node_list_over_memcpy": round(same["list_gbps"] / memcpy, 3),
        "ucx_over_memcpy": round(ucx["gbps"] / memcpy, 3),
        "same_node": {k: round(v, 3) for k, v in same.items()},
        "ucx": {k: round(v, 3) for k, v in ucx.items()},
        "ucx_tcp": {k: round(v, 3) for k, v in ucx_tcp.items()},
        "ucx_transports": used["ucx"],
        "ucx_tcp_transports": used["ucx_tcp"],
        "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
        "ucx_floor": {k: round(v, 3) for k, v in floor.items()},
        "ucx_get_1_p50_over_floor": round(ucx["get_1_p50_ms"] / floor["owner_on_loop_p50_ms"], 3),
        "ucx_ucxx": {k: round(v, 3) for k, v in results["ucx_ucxx"].items()},
        "ucx_over_ucxx_path": {
            figure: round(ucx[f"{figure}_ms"] / results["ucx_ucxx"][f"{figure}_ms"], 3)
            for figure in ("get_1_p50", "get_1_p99", f"{PREFIX_LOAD}_p50", f"{PREFIX_LOAD}_p99", "get_256_p99")
        },
        f"{PREFIX_LOAD}_p50_over_two_lookups": {
            name: round(figures[f"{PREFIX_LOAD}_p50_ms"] / figures[f"{PREFIX_LOAD}_two_lookups_p50_ms"], 3)
            for name, figures in results.items()
        },
        "targets": {"ucx_get_1_p50_ms_max": UCX_GET_1_P50_TARGET_MS, "get_256_p99_over_mooncake_tcp_max": 1.0},
        "targets_met": {"ucx_get_1_p50": ucx["get_1_p50_ms"] <= UCX_GET_1_P50_TARGET_MS},
        **peer,
    }
    if "mooncake" in peer and "tcp" in peer["mooncake"]:
        result["vs_mooncake"] = _ratios(same, ucx, ucx_tcp, peer["mooncake"])
        for name in ("ucx", "ucx_tcp"):
            met = result["vs_mooncake"][f"{name}_get_256_p99_over_tcp_mode"] <= 1.0
            result["targets_met"][f"{name}_get_256_p99_vs_mooncake_tcp"] = met
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kvstore_bandwidth.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    emit(result)


def _peer(name: str, out: Any, num_pages: int, repeats: int, latency_iters: int, batch_iters: int) -> dict[str, Any]:
    """The peer's figures per mode, under ``mooncake`` (or why it did not run, under ``mooncake_skipped``)."""
    if name == "none":
        return {}
    config = {
        "page_bytes": PAGE_BYTES,
        "num_pages": num_pages,
        "repeats": repeats,
        "latency_iters": latency_iters,
        "batch_iters": batch_iters,
    }
    try:
        figures = mooncake_peer.measure(config, out)
    except mooncake_peer.PeerMissing as err:
        return {"mooncake_skipped": str(err)}
    return {"mooncake": {mode: {k: round(v, 3) for k, v in f.items()} for mode, f in figures.items()}}


def _ratios(
    same: dict[str, float], ucx: dict[str, float], ucx_tcp: dict[str, float], peer: dict[str, dict[str, float]]
) -> dict[str, float]:
    """rayturn over Mooncake: shared memory against its memcpy mode, each UCX reader against its TCP mode."""
    ratios = {}
    for name, ours, theirs in (("same_node", same, "memcpy"), ("ucx", ucx, "tcp"), ("ucx_tcp", ucx_tcp, "tcp")):
        figures = peer[theirs]
        ratios[f"{name}_gbps_over_{theirs}_mode"] = round(ours["gbps"] / figures["gbps"], 3)
        for figure in ("get_1_p50", "get_256_p99"):
            ratios[f"{name}_{figure}_over_{theirs}_mode"] = round(ours[f"{figure}_ms"] / figures[f"{figure}_ms"], 3)
    return ratios


if __name__ == "__main__":
    main()
