"""KVAwareRequestRouter inside a real Ray Serve deployment with two replicas."""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402
from ray.serve.config import ProxyLocation, RequestRouterConfig  # noqa: E402
from ray.serve.handle import DeploymentHandle  # noqa: E402

from rayturn.router.replica_stats import ReplicaStats  # noqa: E402

APP = "kv-router-test"
ROUTER_CLASS = "rayturn.router.request_router.KVAwareRequestRouter"
# Replica rank -> the pages that replica claims to hold in device memory.
HELD_BY_RANK = {
    rank: [hashlib.sha256(f"rank-{rank}-page-{i}".encode()).hexdigest() for i in range(6)] for rank in (0, 1)
}


@serve.deployment(
    num_replicas=2,
    ray_actor_options={"num_cpus": 0.1},
    request_router_config=RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={"kv_overlap": 1.0, "load": 1.0, "affinity": 0.5},
        request_routing_stats_period_s=0.2,
        request_routing_stats_timeout_s=5.0,
    ),
)
class FakeDecode:
    def __init__(self) -> None:
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id
        self._rank = context.rank.rank
        self._held = HELD_BY_RANK[self._rank]

    def record_routing_stats(self) -> dict[str, Any]:
        return ReplicaStats(
            replica_id=self._replica_id,
            queued_prompt_tokens=0,
            running_seqs=0,
            max_num_seqs=8,
            free_pages=1000,
            total_pages=1000,
            cached_page_hashes=frozenset(self._held),
        ).to_dict()

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"replica_id": self._replica_id, "rank": self._rank}


def request(session_id: str | None = None, page_hashes: list[str] | None = None) -> dict[str, Any]:
    page_hashes = page_hashes or []
    return {"session_id": session_id, "page_hashes": page_hashes, "prompt_tokens": 16 * len(page_hashes) + 8}


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def handle() -> Iterator[DeploymentHandle]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="router-test")
    try:
        serve.start(proxy_location=ProxyLocation.Disabled)
        yield serve.run(FakeDecode.bind(), name=APP, route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def replica_id_by_rank(handle: DeploymentHandle) -> dict[int, str]:
    """Both replica ids, once both replicas' stats have reached this process's router."""

    def call(rank: int) -> dict[str, Any]:
        result: dict[str, Any] = handle.generate.remote(request(page_hashes=HELD_BY_RANK[rank])).result()
        return result

    wait_until(lambda: call(0)["rank"] == 0 and call(1)["rank"] == 1)
    return {rank: call(rank)["replica_id"] for rank in (0, 1)}


def test_calls_go_to_the_replica_holding_their_pages(
    handle: DeploymentHandle, replica_id_by_rank: dict[int, str]
) -> None:
    for rank in (0, 1):
        prompt = HELD_BY_RANK[rank]
        served = {handle.generate.remote(request(page_hashes=prompt)).result()["rank"] for _ in range(10)}
        assert served == {rank}
        # A prompt that continues the held prefix with new pages still lands there.
        longer = [*prompt, hashlib.sha256(b"new page").hexdigest()]
        assert handle.generate.remote(request(page_hashes=longer)).result()["rank"] == rank


def test_a_sessions_calls_stay_on_one_replica_and_new_sessions_spread_evenly(
    handle: DeploymentHandle, replica_id_by_rank: dict[int, str]
) -> None:
    homes = []
    for i in range(12):
        session_id = f"session-{i}"
        served = {handle.generate.remote(request(session_id)).result()["replica_id"] for _ in range(4)}
        assert len(served) == 1, f"{session_id} was served by {served}"
        homes.extend(served)
    # Each new session goes to the replica following the fewest: the twelve split six and six.
    assert Counter(homes) == dict.fromkeys(replica_id_by_rank.values(), 6)


def test_held_pages_outweigh_session_affinity(handle: DeploymentHandle, replica_id_by_rank: dict[int, str]) -> None:
    home = handle.generate.remote(request("held-pages-session")).result()["rank"]
    other = 1 - home
    result = handle.generate.remote(request("held-pages-session", HELD_BY_RANK[other])).result()
    assert result["rank"] == other


def test_session_id_from_handle_options_is_used(handle: DeploymentHandle, replica_id_by_rank: dict[int, str]) -> None:
    homes = []
    for i in range(6):
        session = handle.options(session_id=f"handle-session-{i}")
        served = {session.generate.remote(request()).result()["replica_id"] for _ in range(4)}
        assert len(served) == 1, f"handle-session-{i} was served by {served}"
        homes.extend(served)
    assert set(homes) == set(replica_id_by_rank.values())


def test_serve_shutdown_removes_controller_and_replicas(handle: DeploymentHandle) -> None:
    def serve_actors() -> list[str]:
        named = ray.util.list_named_actors(all_namespaces=True)
        return [actor["name"] for actor in named if actor["name"].startswith("SERVE_")]

    assert serve_actors()
    serve.shutdown()
    wait_until(lambda: not serve_actors(), timeout_s=20.0)
