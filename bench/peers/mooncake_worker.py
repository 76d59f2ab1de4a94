"""One process of the Mooncake peer of bench/kvstore_bandwidth.py; runs in the peer's own venv
(bench/peers/setup_mooncake.sh), never in rayturn's.

    python mooncake_worker.py writer '{"master": "127.0.0.1:PORT", "protocol": "tcp", "num_pages": N, ...}'
    python mooncake_worker.py reader '{... "repeats": R, "latency_iters": I, "batch_iters": B}'

The writer contributes a segment big enough for every page, stores them with
``batch_put_from`` (256 pages a call), prints ``{"ready": true}`` and keeps
its segment until its stdin closes. The reader contributes a small segment,
lands the pages with the workloads rayturn's reader runs (bulk
``batch_get_into`` of 1,024 pages; a 1-page get; a 256-page batch) into one
registered buffer, and prints one JSON object of figures. Both speak one JSON
line each on stdout; Mooncake's own logging goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
from mooncake.store import MooncakeDistributedStore

PUT_BATCH_PAGES = 256
LATENCY_BATCH_PAGES = 256
BANDWIDTH_BATCH_PAGES = 1024


def _store(config: dict[str, Any], segment_bytes: int, buffer_bytes: int) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    status = store.setup(
        "127.0.0.1", "P2PHANDSHAKE", segment_bytes, buffer_bytes, config["protocol"], "", config["master"]
    )
    if status != 0:
        raise RuntimeError(f"mooncake store setup failed with status {status}")
    return store


def _keys(num_pages: int) -> list[str]:
    return [f"page-{i}" for i in range(num_pages)]


def _check(results: list[int], what: str) -> None:
    failed = [code for code in results if code < 0]
    if failed:
        raise RuntimeError(f"mooncake {what}: {len(failed)} of {len(results)} failed (first status {failed[0]})")


def writer(config: dict[str, Any]) -> None:
    page_bytes, num_pages = config["page_bytes"], config["num_pages"]
    total_bytes = page_bytes * num_pages
    store = _store(config, int(total_bytes * 1.5) + (64 << 20), 64 << 20)
    source = np.random.default_rng(0).integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)
    if store.register_buffer(source.ctypes.data, source.nbytes) != 0:
        raise RuntimeError("mooncake register_buffer failed")
    keys = _keys(num_pages)
    for first in range(0, num_pages, PUT_BATCH_PAGES):
        batch = range(first, min(num_pages, first + PUT_BATCH_PAGES))
        pointers = [source.ctypes.data + i * page_bytes for i in batch]
        _check(store.batch_put_from([keys[i] for i in batch], pointers, [page_bytes] * len(batch)), "put")
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()  # keep the segment until the driver is done
    store.close()


def _percentile_ms(samples: list[float], q: int) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] * 1e3


def reader(config: dict[str, Any]) -> None:
    page_bytes, num_pages = config["page_bytes"], config["num_pages"]
    dest = np.ones((num_pages, page_bytes), dtype=np.uint8)
    store = _store(config, 16 << 20, dest.nbytes + (64 << 20))
    if store.register_buffer(dest.ctypes.data, dest.nbytes) != 0:
        raise RuntimeError("mooncake register_buffer failed")
    keys = _keys(num_pages)
    address = dest.ctypes.data

    def get(first: int, count: int) -> None:
        batch = range(first, first + count)
        pointers = [address + i * page_bytes for i in batch]
        _check(store.batch_get_into([keys[i] for i in batch], pointers, [page_bytes] * count), "get")

    best_s = float("inf")
    for repeat in range(config["repeats"] + 1):  # the first pass is not timed
        dest[:] = 1
        start = time.perf_counter()
        for first in range(0, num_pages, BANDWIDTH_BATCH_PAGES):
            get(first, min(BANDWIDTH_BATCH_PAGES, num_pages - first))
        if repeat:
            best_s = min(best_s, time.perf_counter() - start)
    expected = np.random.default_rng(0).integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)
    if not np.array_equal(dest, expected):
        raise RuntimeError("mooncake landed bytes that are not the pages written")
    one, batch = [], []
    for i in range(config["latency_iters"]):
        key = keys[i % num_pages]
        start = time.perf_counter()
        if store.get_into(key, address, page_bytes) != page_bytes:
            raise RuntimeError(f"mooncake get_into {key} failed")
        one.append(time.perf_counter() - start)
    for i in range(config["batch_iters"]):
        first = (i * LATENCY_BATCH_PAGES) % num_pages
        start = time.perf_counter()
        get(first, min(LATENCY_BATCH_PAGES, num_pages - first))
        batch.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "gbps": num_pages * page_bytes / best_s / 1e9,
                "get_1_p50_ms": _percentile_ms(one, 50),
                "get_1_p99_ms": _percentile_ms(one, 99),
                "get_256_p50_ms": _percentile_ms(batch, 50),
                "get_256_p99_ms": _percentile_ms(batch, 99),
            }
        ),
        flush=True,
    )
    store.close()


if __name__ == "__main__":
    {"writer": writer, "reader": reader}[sys.argv[1]](json.loads(sys.argv[2]))
