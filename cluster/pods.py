"""The pods of a rayturn RayService: one Ray container each, the config mounted, the API keys from a Secret.

``PodShape`` is what one pod offers Ray (whole CPUs and GPUs, memory, custom
resources); it becomes both the container's Kubernetes requests and limits
and its ``rayStartParams``, so that Ray, the autoscaler and the Kubernetes
scheduler count the same pod the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The label that ties a RayService's pods to the Services that select them (KubeRay's own labels name a
# RayCluster, which a zero-downtime upgrade replaces).
POD_LABEL = "rayturn/service"
METRICS_PORT = 8080  # KubeRay's default metrics export port for every Ray node
MIB = 1 << 20
CONFIG_VOLUME = "rayturn-config"
# Ray's well-known ports on the head: the GCS, the dashboard (and Serve's REST API), the Ray client.
HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001))


@dataclass(frozen=True, slots=True)
class PodShape:
    """What one pod of a group offers Ray."""

    num_cpus: int
    num_gpus: int
    memory_bytes: int
    resources: Mapping[str, int] = field(default_factory=dict)
    group: str = ""

    def ray_start_params(self) -> dict[str, str]:
        params = {"num-cpus": str(self.num_cpus)}
        if self.num_gpus:
            params["num-gpus"] = str(self.num_gpus)
        if self.resources:
            # Quoted for the shell line KubeRay builds; KubeRay and Ray's autoscaler strip the outer quotes.
            params["resources"] = f"'{json.dumps(dict(self.resources), sort_keys=True)}'"
        return params

    def container_resources(self) -> dict[str, dict[str, str]]:
        amounts = {"cpu": str(self.num_cpus), "memory": f"{math.ceil(self.memory_bytes / MIB)}Mi"}
        if self.num_gpus:
            amounts["nvidia.com/gpu"] = str(self.num_gpus)
        return {"requests": amounts, "limits": dict(amounts)}


@dataclass(frozen=True, slots=True)
class PodWiring:
    """What every pod of one RayService shares: the image, the ports, the config volume, the keys' Secret."""

    name: str
    image: str
    http_port: int
    grpc_port: int
    config_map: str
    config_dir: str
    secret: str
    secret_key: str
    keys_env: str

    def serve_ports(self) -> list[tuple[str, int]]:
        return [("serve", self.http_port), ("serve-grpc", self.grpc_port), ("metrics", METRICS_PORT)]


def head_group(wiring: PodWiring, shape: PodShape) -> dict[str, Any]:
    return {
        "rayStartParams": {"dashboard-host": "0.0.0.0", **shape.ray_start_params()},
        "template": _template(wiring, shape, "ray-head", [*HEAD_PORTS, *wiring.serve_ports()], worker=False),
    }


def worker_group(wiring: PodWiring, shape: PodShape) -> dict[str, Any]:
    return {
        "rayStartParams": shape.ray_start_params(),
        "template": _template(wiring, shape, "ray-worker", wiring.serve_ports(), worker=True),
    }


def _template(
    wiring: PodWiring, shape: PodShape, container_name: str, ports: list[tuple[str, int]], worker: bool
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": container_name,
        "image": wiring.image,
        "env": [
            {"name": wiring.keys_env, "valueFrom": {"secretKeyRef": {"name": wiring.secret, "key": wiring.secret_key}}}
        ],
        "ports": [{"name": name, "containerPort": port} for name, port in ports],
        "resources": shape.container_resources(),
        "volumeMounts": [{"name": CONFIG_VOLUME, "mountPath": wiring.config_dir, "readOnly": True}],
    }
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": CONFIG_VOLUME, "configMap": {"name": wiring.config_map}}],
    }
    if worker:
        # A worker leaves Ray before its pod goes, so the autoscaler's scale-down drains it cleanly; a pod is
        # never restarted in place (the autoscaler replaces it), as autoscaler v2 expects.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}}
        spec["restartPolicy"] = "Never"
    labels = {POD_LABEL: wiring.name, "rayturn/group": shape.group}
    return {"metadata": {"labels": labels}, "spec": spec}
