"""What a one-page read over UCX costs without the store: the floor under ``kvstore_bandwidth``'s UCX get.

A store read over UCX is a master lookup, then a request frame to the
owner and one page back. This measures the second part bare, between two
processes of this host, through the same ucxx runtime the store uses
(``rayturn.kvstore.ucx_runtime``: one context without RMA, a UCX progress
thread, ucxx's notifier): a reader posts a 64-byte frame and the receive of
one page, then polls the two requests from its own thread, as the store's
direct read does (``ucx_direct``). The owner answers every frame with the
page in one of two ways:

- ``owner_on_loop``: its coroutine on the UCX loop awaits the frame and
  the send, as the store's server does (a completion reaches it through the
  progress thread, ucxx's notifier and the loop);
- ``owner_polling``: a thread of its own posts the receive and the send and
  polls them (``POLL_INTERVAL_S``), as the reader does, with no loop in
  between. A store cannot afford it (an idle connection costs a core's
  polling); it bounds what any owner written in Python can reach here.

No lookup, no grant check, no digest: the difference between these figures
and the store's one-page get is the store's own work.

    python bench/ucx_floor.py [--quick]

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any, Final

import numpy as np
import ray
from _common import nearest_rank

from rayturn.kvstore.ucx_runtime import load_ucxx, run_in_ucx_loop
from rayturn.replay.harness import emit

PAGE_BYTES: Final = 32 << 10
FRAME_BYTES: Final = 64
POLL_INTERVAL_S: Final = 20e-6
TIMEOUT_S: Final = 10.0
OWNER_MODES: Final = ("owner_on_loop", "owner_polling")


def _tags(endpoint: Any) -> tuple[Any, Any]:
    """ucxx's (send, receive) tags agreed on connecting, as its own send and recv use them."""
    tag = load_ucxx().types.Tag
    return tag(endpoint._tags["msg_send"]), tag(endpoint._tags["msg_recv"])


def _wait(request: Any, deadline: float) -> None:
    while not request.completed:
        if time.monotonic() > deadline:
            raise TimeoutError("a UCX request did not complete in time")
        time.sleep(POLL_INTERVAL_S)
    request.check_error()


@ray.remote(num_cpus=0.1)
class FloorOwner:
    """Answers ``rounds`` frames of the first connection with one page each."""

    def __init__(self) -> None:
        self.page = np.random.default_rng(0).integers(0, 256, PAGE_BYTES, dtype=np.uint8)
        self.listener: Any = None
        self.frames = 0  # counted as each frame lands, before its page goes back

    def listen(self, mode: str, rounds: int) -> int:
        if mode not in OWNER_MODES:
            raise ValueError(f"mode must be one of {OWNER_MODES}, got {mode!r}")
        return run_in_ucx_loop(self._listen(mode, rounds), timeout_s=TIMEOUT_S)

    async def _listen(self, mode: str, rounds: int) -> int:
        async def serve(endpoint: Any) -> None:
            if mode == "owner_polling":
                thread = threading.Thread(target=self._serve_polling, args=(endpoint, rounds), daemon=True)
                thread.start()
                while thread.is_alive():
                    await asyncio.sleep(0.05)
                return
            frame = bytearray(FRAME_BYTES)
            for _ in range(rounds):
                await endpoint.recv(frame)
                self.frames += 1
                await endpoint.send(self.page)

        self.listener = load_ucxx().create_listener(serve, port=0)
        return int(self.listener.port)

    def _serve_polling(self, endpoint: Any, rounds: int) -> None:
        array = load_ucxx()._lib.arr.Array
        send_tag, recv_tag = _tags(endpoint)
        frame = bytearray(FRAME_BYTES)
        for _ in range(rounds):
            deadline = time.monotonic() + TIMEOUT_S
            _wait(endpoint._ep.tag_recv(array(frame), recv_tag), deadline)
            self.frames += 1
            _wait(endpoint._ep.tag_send(array(self.page), send_tag), deadline)

    def answered(self) -> int:
        return self.frames


@ray.remote(num_cpus=0.1)
class FloorReader:
    def round_trips(self, port: int, rounds: int) -> list[float]:
        """Seconds per round trip: a frame out, a page back, both polled from this thread."""
        ucxx = load_ucxx()
        endpoint = run_in_ucx_loop(ucxx.create_endpoint("127.0.0.1", port), timeout_s=TIMEOUT_S)
        array = ucxx._lib.arr.Array
        send_tag, recv_tag = _tags(endpoint)
        frame, page = bytearray(FRAME_BYTES), np.zeros(PAGE_BYTES, dtype=np.uint8)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            deadline = time.monotonic() + TIMEOUT_S
            receive = endpoint._ep.tag_recv(array(page), recv_tag)
            send = endpoint._ep.tag_send(array(frame), send_tag)
            _wait(send, deadline)
            _wait(receive, deadline)
            times.append(time.perf_counter() - start)
            time.sleep(0.001)  # one read at a time, as the store's one-page latency loop does
        if not page.any():
            raise RuntimeError("the page did not land")
        return times


def measure(rounds: int) -> dict[str, float]:
    """p50/p99 (ms) of the bare one-page round trip under each owner mode; needs a running Ray."""
    warm_up = max(10, rounds // 10)
    figures: dict[str, float] = {}
    for mode in OWNER_MODES:
        owner = FloorOwner.remote()
        port = ray.get(owner.listen.remote(mode, warm_up + rounds))
        times = ray.get(FloorReader.remote().round_trips.remote(port, warm_up + rounds))[warm_up:]
        if ray.get(owner.answered.remote()) != warm_up + rounds:
            raise RuntimeError(f"{mode}: the owner did not answer every frame")
        figures[f"{mode}_p50_ms"] = nearest_rank(times, 50) * 1e3
        figures[f"{mode}_p99_ms"] = nearest_rank(times, 99) * 1e3
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 round trips per mode instead of 1,000")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        figures = measure(100 if args.quick else 1000)
    finally:
        ray.shutdown()
    emit(
        {
            "bench": "ucx_floor",
            "quick": args.quick,
            "page_bytes": PAGE_BYTES,
            **{k: round(v, 3) for k, v in figures.items()},
        }
    )


if __name__ == "__main__":
    main()
