"""How replica states add up to a pool's and the cluster's health, and how the probe asks for them (no
cluster: a stand-in for Serve's controller and replicas; the probe runs against real Serve in test_security
and test_cluster_serve)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.serve._private.constants import SERVE_CONTROLLER_NAME

from rayturn.api.pool_health import PoolHealth, PoolHealthProbe, ReplicaHealth


def pool(target: int, *states: str) -> PoolHealth:
    return PoolHealth("decode", target, tuple(ReplicaHealth(f"r{i}", state) for i, state in enumerate(states)))


def test_a_pool_is_ok_with_its_target_count_of_running_replicas() -> None:
    assert pool(2, "RUNNING", "RUNNING").ok
    assert pool(2, "RUNNING", "RUNNING", "STARTING").ok  # scaling up past the target
    assert pool(0).ok  # scaled to zero on purpose


def test_a_missing_starting_or_dead_replica_degrades_the_pool() -> None:
    assert not pool(2, "RUNNING").ok
    assert not pool(2, "RUNNING", "STARTING").ok
    assert not pool(2, "RUNNING", "RUNNING", "DEAD").ok  # Serve still lists it RUNNING; it does not answer
    assert not pool(1, "RUNNING", "UNREACHABLE").ok


def test_what_callers_with_and_without_a_key_see() -> None:
    degraded = pool(2, "RUNNING", "UNREACHABLE")
    assert degraded.summary() == {"ok": False, "replicas": 1, "target_replicas": 2}
    assert degraded.detail()["replica_states"] == [
        {"replica_id": "r0", "state": "RUNNING", "node_id": None},
        {"replica_id": "r1", "state": "UNREACHABLE", "node_id": None},
    ]


class Method:
    """An actor method as the probe calls it: ``.remote()`` gives something to await."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def remote(self) -> Any:
        self.calls += 1

        async def reply() -> Any:
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

        return reply()


class Actor:
    def __init__(self, health: Any = None, details: Any = None) -> None:
        self.check_health = Method(health)
        self.get_serve_instance_details = Method(details)


def replica(replica_id: str, state: str = "RUNNING") -> dict[str, Any]:
    return {"replica_id": replica_id, "state": state, "actor_name": f"SERVE_REPLICA::app#{replica_id}", "node_id": "n"}


def probe_with(actors: dict[str, Actor], deployments: dict[str, Any]) -> tuple[PoolHealthProbe, list[str], list[float]]:
    details = {"applications": {"app": {"deployments": deployments}}}
    actors[SERVE_CONTROLLER_NAME] = Actor(details=details)
    looked_up: list[str] = []
    now = [0.0]

    def get_actor(name: str, namespace: str) -> Actor:
        looked_up.append(name)
        if name not in actors:
            raise ValueError(f"Failed to look up actor {name}")
        return actors[name]

    probe = PoolHealthProbe("app", ["decode", "prefill"], clock=lambda: now[0], get_actor=get_actor)
    return probe, looked_up, now


def test_the_probe_asks_every_running_replica_and_names_the_dead_and_the_hung() -> None:
    actors = {
        "SERVE_REPLICA::app#d1": Actor(health=None),
        "SERVE_REPLICA::app#d2": Actor(health=RuntimeError("engine stopped")),
        "SERVE_REPLICA::app#p1": Actor(health=None),
    }
    deployments = {
        "decode": {"target_num_replicas": 3, "replicas": [replica("d1"), replica("d2"), replica("d3")]},
        "prefill": {"target_num_replicas": 1, "replicas": [replica("p1"), replica("p2", "STARTING")]},
    }
    probe, _, _ = probe_with(actors, deployments)
    decode, prefill = asyncio.run(probe.check())
    assert [(r.replica_id, r.state) for r in decode.replicas] == [
        ("d1", "RUNNING"),
        ("d2", "UNREACHABLE"),
        ("d3", "DEAD"),
    ]
    assert not decode.ok and prefill.ok


def test_the_probe_keeps_every_pools_handles_and_answers_a_burst_of_callers_once() -> None:
    actors = {name: Actor() for name in ("SERVE_REPLICA::app#d1", "SERVE_REPLICA::app#p1")}
    deployments = {
        "decode": {"target_num_replicas": 1, "replicas": [replica("d1")]},
        "prefill": {"target_num_replicas": 1, "replicas": [replica("p1")]},
    }
    probe, looked_up, now = probe_with(actors, deployments)

    async def bursts() -> list[int]:
        calls = []
        for _ in range(2):
            await asyncio.gather(*(probe.check() for _ in range(20)))
            calls.append(actors["SERVE_REPLICA::app#d1"].check_health.calls)
            now[0] += PoolHealthProbe.CACHE_S
        return calls

    assert asyncio.run(bursts()) == [1, 2]  # twenty callers, one probe; a second after, another
    # Each replica was looked up once: one pool's handles survive the other pool's pass.
    assert looked_up.count("SERVE_REPLICA::app#d1") == looked_up.count("SERVE_REPLICA::app#p1") == 1
