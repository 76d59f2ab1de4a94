"""How replica states add up to a pool's and the cluster's health (no cluster needed; the probe itself
runs against real Serve in test_security and test_cluster_serve)."""

from __future__ import annotations

from rayturn.cluster.pool_health import PoolHealth, ReplicaHealth


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
