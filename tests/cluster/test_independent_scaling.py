"""Prefill and decode scale apart under Ray's real autoscaler, with the node groups of the committed manifest.

The worker groups of ``deploy/kuberay/rayservice-cpu.yaml`` become node types
of Ray's fake multi-node provider (``fake_kuberay``: the same CPUs, custom
resources and replica bounds KubeRay's autoscaler reads from the RayService),
and Ray's autoscaler (v2) adds and removes those nodes on this host. The
application runs the config the manifest's ConfigMap carries, with short
autoscaling delays. Load on one pool grows that pool's Serve replicas; the
replica that does not fit asks for its group's custom resource, the autoscaler
adds a node of that group, and once the load stops the replica and then the
idle node go again, while the other group keeps its one node throughout:

    decode:  streamed chat calls on short prompts (the decode replica prefills them itself)
    prefill: long prompts, each new, past the disaggregation threshold, one token each
"""

from __future__ import annotations

import random
import string
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

import pytest
import yaml

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from fake_kuberay import ClusterShape, FakeKubeRayCluster, cluster_shape, read_manifests  # noqa: E402
from ray import serve  # noqa: E402

from rayturn.cluster.app import APP_NAME, serve_start_options  # noqa: E402
from rayturn.cluster.config import ClusterConfig, load_config  # noqa: E402
from rayturn.cluster.runner import running_cluster  # noqa: E402

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "rayservice-cpu.yaml"
HTTP_PORT, GRPC_PORT = 28671, 29671
RAY_PORT = 26671  # and the Ray client server on the next port
POOLS = ("prefill", "decode")
NODES_PER_GROUP = 2  # a 2-core host: each group grows from one node to at most two
IDLE_TIMEOUT_S = 3.0  # an idle node above its group's minimum goes after this long
# Serve averages each pool's load over this long: its default, 30 s, holds a replica on for half a minute after
# the load stops; the shortest it takes is just over the 10 s its replicas and handles report load at.
LOOK_BACK_S = 11.0
THRESHOLD = 64  # prompt tokens from which the prefill pool computes a prompt
# Decode scales past this many calls in flight per replica, prefill past one: the prefill load (fewer calls
# than the decode target) grows only the prefill pool, the decode load (never touching prefill) only decode.
DECODE_TARGET, DECODE_LOAD_CALLS = 8, 24
PREFILL_TARGET, PREFILL_LOAD_CALLS = 1, 6
PREFILL_PROMPT_CHARS = 700  # byte-level tokenizer: about as many tokens
SCALE_TIMEOUT_S = 240.0


def group_bounds(shape: ClusterShape) -> ClusterShape:
    """The manifest's groups, each capped at ``NODES_PER_GROUP`` nodes."""
    workers = {}
    for name, node_type in shape.workers.items():
        assert node_type["min_workers"] == 1, f"group {name}: the test starts from one node: {node_type}"
        assert node_type["max_workers"] >= NODES_PER_GROUP, f"group {name} cannot grow: {node_type}"
        workers[name] = {**node_type, "max_workers": NODES_PER_GROUP}
    return replace(shape, workers=workers)


def app_config(config_path: Path) -> ClusterConfig:
    """The pods' config with this host's ports, small caches and short autoscaling delays."""
    autoscaling = {"upscale_delay_s": 1.0, "downscale_delay_s": 2.0, "look_back_period_s": LOOK_BACK_S}
    overrides: dict[str, Any] = {
        "server.host": "127.0.0.1",
        "server.http_port": HTTP_PORT,
        "server.grpc_port": GRPC_PORT,
        "model.num_pages": 512,
        "kvstore.segment_bytes": "32MiB",
        "router.disaggregation_threshold_tokens": THRESHOLD,
        "router.stats_period_s": 0.5,
        "prefill.max_replicas": NODES_PER_GROUP,
        "decode.max_replicas": NODES_PER_GROUP,
        "prefill.autoscaling": {**autoscaling, "target_ongoing_requests": PREFILL_TARGET},
        "decode.autoscaling": {**autoscaling, "target_ongoing_requests": DECODE_TARGET},
    }
    return load_config(config_path, **overrides)


def test_each_pool_fits_only_its_own_group_within_the_groups_bounds() -> None:
    """The fake nodes are the manifest's: each deployment's resources fit its own group's nodes and no other's,
    and the group's node bounds are the deployment's replica bounds (one replica per pod)."""
    rayservice, _ = read_manifests(MANIFEST)
    shape = cluster_shape(rayservice)
    (application,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    deployments = {deployment["name"]: deployment for deployment in application["deployments"]}
    for pool in POOLS:
        options = deployments[pool]["ray_actor_options"]
        wants = {"CPU": options["num_cpus"], **options["resources"]}
        fits = {
            name
            for name, node in shape.workers.items()
            if all(node["resources"].get(key, 0) >= amount for key, amount in wants.items())
        }
        assert fits == {pool}, f"{pool} asks for {wants}; it fits the groups {fits}"
        bounds = deployments[pool]["autoscaling_config"]
        assert (shape.workers[pool]["min_workers"], shape.workers[pool]["max_workers"]) == (
            bounds["min_replicas"],
            bounds["max_replicas"],
        )


@dataclass
class Served:
    cluster: FakeKubeRayCluster
    client: openai.OpenAI
    model: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    rayservice, config_text = read_manifests(MANIFEST)
    config_path = tmp_path_factory.mktemp("pods") / "rayturn.yaml"
    config_path.write_text(config_text, encoding="utf-8")
    config = app_config(config_path)
    for pool in POOLS:
        assert getattr(config, pool).autoscaled, f"{pool}: the manifest's pool does not autoscale"
    cluster = FakeKubeRayCluster(group_bounds(cluster_shape(rayservice)), port=RAY_PORT, idle_timeout_s=IDLE_TIMEOUT_S)
    cluster.start()
    try:
        ray.init(address=cluster.address, namespace="rayturn", log_to_driver=False)
        try:
            # One proxy, on the head node: proxies on every node would all bind the same ports on this host.
            serve.start(proxy_location="HeadOnly", **serve_start_options(config))
            with running_cluster(config) as endpoints:
                client = openai.OpenAI(base_url=f"{endpoints.http}/v1", api_key="unused", max_retries=0, timeout=120)
                yield Served(cluster, client, config.model.model_name)
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


@dataclass(frozen=True)
class Sample:
    nodes: dict[str, int]
    replicas: dict[str, dict[Any, int]]  # per pool: replicas per state (Serve's state names)


@dataclass
class Watch:
    """What the cluster looked like, sampled while a pool scaled."""

    samples: list[Sample] = field(default_factory=list)

    def sample(self, cluster: FakeKubeRayCluster) -> Sample:
        app = serve.status().applications[APP_NAME]
        replicas = {pool: dict(app.deployments[pool].replica_states) for pool in POOLS}
        taken = Sample(nodes=dict(cluster.alive_nodes()), replicas=replicas)
        self.samples.append(taken)
        return taken

    def until(self, cluster: FakeKubeRayCluster, done: Callable[[Sample], bool], what: str) -> None:
        deadline = time.monotonic() + SCALE_TIMEOUT_S
        while not done(self.sample(cluster)):
            if time.monotonic() > deadline:
                events = "\n".join(cluster.autoscaler_events()[-10:])
                raise AssertionError(
                    f"{what}: not within {SCALE_TIMEOUT_S:.0f} s; last {self.samples[-1]}; the autoscaler:\n{events}\n"
                    f"live actors by node: {actors_by_node()}"
                )
            time.sleep(0.5)


def actors_by_node() -> dict[str, list[str]]:
    """What may keep a node from counting as idle: each node's live actors (for a failure's message), read from
    the GCS (the cluster runs no dashboard, so Ray's state API has no server to ask)."""
    placed: dict[str, list[str]] = {}
    for actor in ray._private.state.actors().values():
        if actor.get("State") == "ALIVE":
            node = str(actor.get("Address", {}).get("NodeID", "?"))  # whole: fake nodes' ids differ only at the end
            placed.setdefault(node, []).append(str(actor.get("ActorClassName")))
    return placed


def at_size(pool: str, size: int) -> Callable[[Sample], bool]:
    """``size`` nodes of the pool's group alive, and as many of its replicas running, none other."""
    return lambda sample: sample.nodes[pool] == size and sample.replicas[pool] == {"RUNNING": size}


@dataclass
class Load:
    """``calls`` threads, each making ``call`` over and over until stopped."""

    call: Callable[[random.Random], None]
    calls: int
    stop: threading.Event = field(default_factory=threading.Event)
    answered: int = 0
    errors: list[BaseException] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            try:
                self.call(rng)
            except Exception as err:
                with self._lock:
                    self.errors.append(err)
                return
            with self._lock:
                self.answered += 1

    def __enter__(self) -> Self:
        self._threads = [threading.Thread(target=self._run, args=(seed,), daemon=True) for seed in range(self.calls)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def decode_call(served: Served) -> Callable[[random.Random], None]:
    def call(rng: random.Random) -> None:
        stream = served.client.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": f"Say {rng.randrange(1000)}."}],
            max_tokens=48,
            stream=True,
        )
        chunks = list(stream)  # read to the end: a stream left open keeps its call running on the replica
        assert chunks and chunks[-1].choices and chunks[-1].choices[0].finish_reason in ("stop", "length")

    return call


def prefill_call(served: Served) -> Callable[[random.Random], None]:
    def call(rng: random.Random) -> None:
        # New text from the first token: no prefix of it is cached anywhere, the prefill pool computes it all.
        prompt = "".join(rng.choices(string.ascii_lowercase + " ", k=PREFILL_PROMPT_CHARS))
        answer = served.client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": prompt}], max_tokens=1
        )
        assert answer.usage is not None and answer.usage.prompt_tokens > THRESHOLD

    return call


def scale_cycle(served: Served, pool: str, load: Load) -> Watch:
    """Start at one node per group; load ``pool`` until its group has grown to two; stop; wait for one again."""
    watch = Watch()
    for name in POOLS:
        watch.until(served.cluster, at_size(name, 1), f"{name} at its minimum before the load")
    with load:
        watch.until(served.cluster, at_size(pool, NODES_PER_GROUP), f"{pool} grown under load")
    watch.until(served.cluster, at_size(pool, 1), f"{pool} back to its minimum once idle")
    assert load.errors == [], f"calls failed while {pool} scaled: {load.errors[:3]}"
    assert load.answered > 0
    return watch


@pytest.mark.parametrize("pool", ["decode", "prefill"])
def test_load_on_one_pool_grows_and_shrinks_only_its_node_group(served: Served, pool: str) -> None:
    calls = {"decode": (decode_call(served), DECODE_LOAD_CALLS), "prefill": (prefill_call(served), PREFILL_LOAD_CALLS)}
    call, concurrency = calls[pool]
    watch = scale_cycle(served, pool, Load(call, concurrency))
    (other,) = set(POOLS) - {pool}
    assert max(sample.nodes[pool] for sample in watch.samples) == NODES_PER_GROUP
    assert {sample.nodes[other] for sample in watch.samples} == {1}, f"{other}'s group moved while {pool} scaled"
    assert all(sample.replicas[other] == {"RUNNING": 1} for sample in watch.samples), f"{other} scaled with {pool}"
