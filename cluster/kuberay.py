"""Cluster config -> KubeRay manifests: what ``rayturn deploy render`` writes.

The YAML config ``rayturn serve`` reads becomes three Kubernetes objects:

    ConfigMap   <name>-config  the config as the pods read it (``rayturn.yaml``), mounted in every pod
    RayService  <name>         a head group and a worker group per pool (``prefill``, ``decode``, and
                               ``kvstore`` when the config has store nodes), in-tree autoscaling (v2),
                               and a ``serveConfigV2`` that builds the application from the mounted config
    Service     <name>-grpc    the gRPC port (KubeRay's own ``<name>-serve-svc`` carries only HTTP)

Each worker group hosts one replica of its pool per pod: the group offers the
Ray resources of one replica (CPUs, GPUs and a custom resource of its own, e.g.
``{"rayturn-decode": 1}``, which the pool's ``ray_actor_options`` ask for), and
its ``minReplicas`` / ``maxReplicas`` are the pool's. Serve scales a pool's
replicas, and the autoscaler adds or removes that group's pods to fit them, so
prefill and decode scale apart.

The application's ``args`` carry the config file's digest: a changed config
changes ``serveConfigV2``, so Serve builds the application again, and only the
deployments whose replicas are built differently roll (``app._bind``).

API keys never enter a manifest: the pods read them from the Secret
``rayturn-api-keys`` (``$RAYTURN_API_KEYS``, which ``load_config`` takes), and
a config holding keys is refused. Rendering is pure and deterministic, so the
committed manifests under ``deploy/kuberay/`` are checked against a fresh render.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import yaml

from rayturn import __version__

from .app import APP_NAME, CONFIG_DIGEST_ARG, config_digest, deployment_options, serve_start_options
from .config import API_KEYS_ENV, ClusterConfig, PoolSpec
from .pods import POD_LABEL, PodShape, PodWiring, head_group, worker_group

RAY_VERSION = "2.60.0"
NAME = "rayturn"
IMPORT_PATH = "rayturn.cluster.app:app_builder"
# Where the pods find the config (the ConfigMap's mount) and the key it sits under.
CONFIG_DIR = "/etc/rayturn"
CONFIG_FILE = "rayturn.yaml"
API_KEYS_SECRET = "rayturn-api-keys"
API_KEYS_SECRET_KEY = "api-keys"
# The custom resource each worker group offers when its pool names none.
GROUP_RESOURCES = {"prefill": "rayturn-prefill", "decode": "rayturn-decode", "kvstore": "rayturn-kvstore"}
GIB = 1 << 30
# Host memory per pod beyond the KV store's shared memory: Ray's own processes, the replica, its tokenizer;
# each GPU adds room to stage the weights it loads.
BASE_MEMORY_BYTES = 2 * GIB
MEMORY_PER_GPU_BYTES = 16 * GIB
HEAD_MEMORY_BYTES = 4 * GIB


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerGroup:
    """One KubeRay worker group: pods of one shape, each hosting one replica of its pool."""

    name: str
    replicas: int
    min_replicas: int
    max_replicas: int
    shape: PodShape


class RenderError(ValueError):
    """The config cannot become manifests: it holds API keys, which belong in a Secret."""


def deploy_config(config: ClusterConfig) -> ClusterConfig:
    """The config the pods run: listening on every interface, each pool asking for its group's resource.

    Refuses keys in the config: they would travel in a ConfigMap, readable by anyone who reads the namespace.
    """
    server = config.server
    if server.api_keys or server.tenant_keys:
        raise RenderError(
            "server.api_keys / server.tenant_keys: keys do not go into manifests; remove them from the config "
            f"and put them in the Secret {API_KEYS_SECRET!r} (key {API_KEYS_SECRET_KEY!r}, comma-separated), "
            f"which the pods read as ${API_KEYS_ENV}"
        )
    kv = config.kvstore
    store_resources = kv.store_node_resources
    if kv.store_nodes > 0 and not store_resources:
        store_resources = {GROUP_RESOURCES["kvstore"]: 1.0}
    return dataclasses.replace(
        config,
        server=dataclasses.replace(server, host="0.0.0.0"),
        prefill=_with_group_resource(config.prefill, GROUP_RESOURCES["prefill"]),
        decode=_with_group_resource(config.decode, GROUP_RESOURCES["decode"]),
        kvstore=dataclasses.replace(kv, store_node_resources=store_resources),
    )


def _with_group_resource(pool: PoolSpec, resource: str) -> PoolSpec:
    return pool if pool.resources else dataclasses.replace(pool, resources={resource: 1.0})


def worker_groups(config: ClusterConfig) -> list[WorkerGroup]:
    """A group per pool (prefill only when it has replicas, kvstore only with store nodes), for a deploy config."""
    segment_bytes = config.kvstore.segment_bytes if config.kvstore.enabled else 0
    groups = []
    for name, pool in (("prefill", config.prefill), ("decode", config.decode)):
        if pool.max_replicas == 0:
            continue
        shape = _shape(name, pool.num_cpus, pool.num_gpus, pool.resources, segment_bytes)
        initial = pool.min_replicas if pool.initial_replicas is None else pool.initial_replicas
        groups.append(WorkerGroup(name, initial, pool.min_replicas, pool.max_replicas, shape))
    kv = config.kvstore
    if kv.enabled and kv.store_nodes > 0:
        shape = _shape("kvstore", kv.store_node_num_cpus, 0.0, kv.store_node_resources, kv.store_node_bytes)
        groups.append(WorkerGroup("kvstore", kv.store_nodes, kv.store_nodes, kv.store_nodes, shape))
    return groups


def _shape(group: str, num_cpus: float, num_gpus: float, resources: Mapping[str, float], shared_bytes: int) -> PodShape:
    """A pod that fits one replica: Ray counts whole CPUs and GPUs, and the autoscaler only whole custom resources."""
    num_gpus_per_pod = math.ceil(num_gpus)
    return PodShape(
        num_cpus=max(1, math.ceil(num_cpus)),
        num_gpus=num_gpus_per_pod,
        memory_bytes=BASE_MEMORY_BYTES + num_gpus_per_pod * MEMORY_PER_GPU_BYTES + shared_bytes,
        resources={name: max(1, math.ceil(amount)) for name, amount in sorted(resources.items())},
        group=group,
    )


def serve_config(config: ClusterConfig, config_text: str) -> dict[str, Any]:
    """``serveConfigV2`` (Ray Serve's ``ServeDeploySchema``) for a deploy config written as ``config_text``: the
    start options ``rayturn serve`` uses and the application, its deployments listed with the options
    ``build_app`` binds, and the file's digest (a changed file builds the application again)."""
    application = {
        "name": APP_NAME,
        "import_path": IMPORT_PATH,
        "route_prefix": "/",
        "args": {"config": f"{CONFIG_DIR}/{CONFIG_FILE}", CONFIG_DIGEST_ARG: config_digest(config_text)},
        "deployments": list(deployment_options(config).values()),
    }
    return {**serve_start_options(config), "applications": [application]}


def render(config: ClusterConfig, image: str, name: str = NAME, source: str = "the defaults") -> list[dict[str, Any]]:
    """The ConfigMap, RayService and gRPC Service for ``config`` (rendered from ``source``), running ``image``."""
    pods_config = deploy_config(config)
    server = pods_config.server
    config_text = f"# Rendered from {source} by `rayturn deploy render`.\n" + yaml.safe_dump(
        pods_config.to_dict(), sort_keys=False
    )
    config_map_name = f"{name}-config"
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name, "labels": {POD_LABEL: name}},
        "data": {CONFIG_FILE: config_text},
    }
    wiring = PodWiring(
        name=name,
        image=image,
        http_port=server.http_port,
        grpc_port=server.grpc_port,
        config_map=config_map_name,
        config_dir=CONFIG_DIR,
        secret=API_KEYS_SECRET,
        secret_key=API_KEYS_SECRET_KEY,
        keys_env=API_KEYS_ENV,
    )
    groups = worker_groups(pods_config)
    ray_service = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, "labels": {POD_LABEL: name}},
        "spec": {
            # A changed cluster spec starts a new cluster and moves traffic once it serves (zero downtime).
            "upgradeStrategy": {"type": "NewCluster"},
            "serveConfigV2": _dump(serve_config(pods_config, config_text)),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"version": "v2", "upscalingMode": "Default", "idleTimeoutSeconds": 60},
                "headGroupSpec": head_group(wiring, _head_shape(pods_config)),
                "workerGroupSpecs": [
                    {
                        "groupName": group.name,
                        "replicas": group.replicas,
                        "minReplicas": group.min_replicas,
                        "maxReplicas": group.max_replicas,
                        **worker_group(wiring, group.shape),
                    }
                    for group in groups
                ],
            },
        },
    }
    grpc_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-grpc", "labels": {POD_LABEL: name}},
        "spec": {
            # The pods of this RayService whose Serve proxy is up (KubeRay keeps ``ray.io/serve`` current).
            "selector": {POD_LABEL: name, "ray.io/serve": "true"},
            "ports": [{"name": "serve-grpc", "port": server.grpc_port, "targetPort": server.grpc_port}],
        },
    }
    return [config_map, ray_service, grpc_service]


def _head_shape(config: ClusterConfig) -> PodShape:
    """The head runs Ray's control plane and the ingress replicas (the only ones without a group of their own)."""
    server = config.server
    return PodShape(
        num_cpus=max(1, math.ceil(server.ingress_replicas * server.ingress_num_cpus)),
        num_gpus=0,
        memory_bytes=HEAD_MEMORY_BYTES,
        resources={},
        group="head",
    )


def default_image(config: ClusterConfig) -> str:
    """The image ``deploy/docker/Dockerfile`` builds, its CUDA variant when a pool asks for GPUs."""
    uses_gpus = config.prefill.num_gpus > 0 or config.decode.num_gpus > 0
    return f"rayturn:{__version__}{'-gpu' if uses_gpus else ''}"


def dump_manifests(manifests: list[dict[str, Any]], header: str) -> str:
    """The manifests as one multi-document YAML file, after ``header`` (comment lines)."""
    return header + "".join(f"---\n{_dump(manifest)}" for manifest in manifests)


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, so the embedded config and ``serveConfigV2`` read as YAML; a value
    used twice (the pools' request router) written out twice, not as an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_str)


def _dump(data: Mapping[str, Any]) -> str:
    return yaml.dump(dict(data), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
