"""The health of every replica of every pool, as ``/health`` and gRPC ``Health`` report it.

Serve's controller lists each pool's replicas with their states, but learns
that a replica died only at its next periodic health check. So every replica
the controller calls RUNNING is also asked directly, with a short timeout,
through the same ``check_health`` the controller calls (it runs the
replica's own: its engine thread is alive): a replica that died a moment
ago shows at once::

    replica:  RUNNING and answers        -> ok (RUNNING)
              RUNNING, no answer         -> UNREACHABLE
              gone from Ray              -> DEAD
              any other Serve state      -> that state (STARTING, STOPPING, ...)
    pool:     ok  <=>  at least its target count of replicas is ok
    cluster:  ok  <=>  every pool is ok

Replica ids, nodes and states are operator information: the ingress shows
them only to authenticated callers when API keys are set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from .errors import client_error

logger = logging.getLogger(__name__)

REPLICA_TIMEOUT_S = 2.0
RUNNING = "RUNNING"


@dataclass(frozen=True, slots=True)
class ReplicaHealth:
    replica_id: str
    state: str  # Serve's replica state, or UNREACHABLE / DEAD for a RUNNING one that does not answer
    node_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == RUNNING


@dataclass(frozen=True, slots=True)
class PoolHealth:
    name: str
    target_replicas: int
    replicas: tuple[ReplicaHealth, ...]

    @property
    def num_ok(self) -> int:
        return sum(replica.ok for replica in self.replicas)

    @property
    def ok(self) -> bool:
        return self.num_ok >= self.target_replicas and all(
            replica.ok or replica.state not in ("UNREACHABLE", "DEAD") for replica in self.replicas
        )

    def summary(self) -> dict[str, Any]:
        """Counts only: what a caller without credentials may see."""
        return {"ok": self.ok, "replicas": self.num_ok, "target_replicas": self.target_replicas}

    def detail(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "replica_states": [
                {"replica_id": r.replica_id, "state": r.state, "node_id": r.node_id} for r in self.replicas
            ],
        }


class PoolHealthProbe:
    """Asks Serve's controller for a Serve application's pools, then each RUNNING replica itself.

    Load balancers and anyone without a key may ask as often as they like: one probe runs at a time and its
    answer serves every caller for ``CACHE_S``, so the controller and the replicas see at most one round of
    questions per ``CACHE_S`` whatever the traffic on ``/health``.
    """

    CACHE_S = 1.0

    def __init__(
        self,
        app_name: str,
        pools: Sequence[str],
        timeout_s: float = REPLICA_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        get_actor: Callable[..., Any] = ray.get_actor,
    ) -> None:
        self.app_name = app_name
        self.get_actor = get_actor
        self.pools = tuple(pools)
        self.timeout_s = timeout_s
        self.clock = clock
        self._actors: dict[str, Any] = {}  # actor name -> handle
        self._last: tuple[float, list[PoolHealth]] | None = None
        self._probing = asyncio.Lock()

    async def check(self) -> list[PoolHealth]:
        async with self._probing:  # callers arriving during a probe wait for its answer
            if self._last is not None and self.clock() - self._last[0] < self.CACHE_S:
                return self._last[1]
            pools = await self._probe()
            self._last = (self.clock(), pools)
            return pools

    async def _probe(self) -> list[PoolHealth]:
        controller = await asyncio.to_thread(self.get_actor, SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        details: dict[str, Any] = await asyncio.wait_for(controller.get_serve_instance_details.remote(), self.timeout_s)
        deployments = details.get("applications", {}).get(self.app_name, {}).get("deployments", {})
        listed = {name: (deployments.get(name) or {}).get("replicas", []) for name in self.pools}
        current = {replica.get("actor_name") for replicas in listed.values() for replica in replicas}
        self._actors = {name: actor for name, actor in self._actors.items() if name in current}
        return list(await asyncio.gather(*(self._pool(name, deployments.get(name)) for name in self.pools)))

    async def _pool(self, name: str, deployment: Mapping[str, Any] | None) -> PoolHealth:
        if deployment is None:  # the application is (re)deploying, or lost the pool
            return PoolHealth(name, 1, ())
        replicas = await asyncio.gather(*(self._replica(replica) for replica in deployment.get("replicas", [])))
        return PoolHealth(name, int(deployment.get("target_num_replicas", 0)), tuple(replicas))

    async def _replica(self, replica: Mapping[str, Any]) -> ReplicaHealth:
        replica_id = str(replica.get("replica_id"))
        raw_state = replica.get("state")
        state = str(getattr(raw_state, "value", raw_state))  # Serve's ReplicaState, a str enum
        node_id = replica.get("node_id")
        actor_name = replica.get("actor_name")
        if state != RUNNING or not actor_name:
            return ReplicaHealth(replica_id, state, node_id)
        actor: Any = self._actors.get(actor_name)
        if actor is None:
            try:  # a GCS round trip: off the event loop
                actor = await asyncio.to_thread(self.get_actor, actor_name, namespace=SERVE_NAMESPACE)
            except ValueError:  # its name is gone: the actor died
                return ReplicaHealth(replica_id, "DEAD", node_id)
            self._actors[actor_name] = actor
        try:
            await asyncio.wait_for(actor.check_health.remote(), self.timeout_s)
        except Exception as err:  # dead, hung or failing its own check: all mean it cannot serve now
            logger.warning("replica %s failed its health check: %s", replica_id, type(err).__name__)
            self._actors.pop(actor_name, None)
            return ReplicaHealth(replica_id, "UNREACHABLE", node_id)
        return ReplicaHealth(replica_id, RUNNING, node_id)


async def cluster_health(
    probe: PoolHealthProbe, detailed: bool, model: Mapping[str, Any], handles: Sequence[tuple[str, Any]]
) -> tuple[str, dict[str, Any]]:
    """``ok`` or ``degraded``, with every pool's replica counts; ``detailed`` adds replica states, the ``model``
    and the own report of one replica behind each of ``handles`` (for callers allowed to see them)."""
    body: dict[str, Any] = {}
    try:
        pools = await probe.check()
    except Exception as err:  # Serve's controller is away: nothing can be vouched for
        logger.warning("health: Serve's controller did not answer: %s: %s", type(err).__name__, err)
        return "degraded", {"pools": {}, "error": "the cluster's controller did not answer"}
    status = "ok" if all(pool.ok for pool in pools) else "degraded"
    body["pools"] = {pool.name: pool.detail() if detailed else pool.summary() for pool in pools}
    if not detailed:
        return status, body
    details: dict[str, Any] = dict(model)
    for pool in pools:
        details[f"{pool.name}.replicas"] = pool.num_ok
    for name, handle in handles:
        if handle is None:
            continue
        try:
            report = await handle.health.remote()
        except Exception as err:
            details[f"{name}.error"] = client_error(err, f"health-{name}").message
            continue
        for key, value in report.items():
            details[f"{name}.{key}"] = value
    body["details"] = details
    return status, body
