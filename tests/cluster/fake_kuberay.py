"""A RayService's nodes as an autoscaling Ray cluster on this host (Ray's fake multi-node provider).

``cluster_shape(rayservice)`` reads the head and worker groups the way
KubeRay's autoscaler does (Ray's own ``_derive_autoscaling_config_from_ray_cr``),
so the fake nodes carry the resources and replica bounds the RayService's pods
would. ``FakeKubeRayCluster`` runs Ray's autoscaler (v2) over them: a head
started with ``ray start --head --block`` in a temporary directory of its own,
and worker nodes that the autoscaler starts and stops as Ray processes here.

    created --start()--> running --shutdown()--> stopped

``shutdown`` ends every process this cluster started, found by process id
(the head's descendants, its process group, and every process whose command
line names the cluster's temporary directory), never by name: other Ray
sessions on the host keep running.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

# Ray derives node resources from these; the fake provider starts nodes with the rest.
_K8S_ONLY_RESOURCES = ("memory",)
# Per fake node: Ray's default object store would take 30% of this host's memory each.
OBJECT_STORE_BYTES = 80 * 1024 * 1024
HEAD_NODE_TYPE = "ray.head.default"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class ClusterShape:
    """What a RayService's nodes offer Ray: the head's resources and the worker groups as autoscaler node types."""

    head: dict[str, float]
    workers: dict[str, dict[str, Any]]


def read_manifests(path: Path) -> tuple[dict[str, Any], str]:
    """The RayService in a multi-document manifest file, and the rayturn config its ConfigMap carries."""
    documents = [document for document in yaml.safe_load_all(path.read_text(encoding="utf-8")) if document]
    rayservices = [document for document in documents if document.get("kind") == "RayService"]
    config_maps = [document for document in documents if document.get("kind") == "ConfigMap"]
    if len(rayservices) != 1 or len(config_maps) != 1:
        raise ValueError(
            f"{path}: expected one RayService and one ConfigMap, found {len(rayservices)} and {len(config_maps)}"
        )
    (config_text,) = config_maps[0]["data"].values()
    return rayservices[0], config_text


def cluster_shape(rayservice: Mapping[str, Any]) -> ClusterShape:
    """The nodes of ``rayservice`` as KubeRay's autoscaler sees them.

    The RayService's cluster goes through the function KubeRay's autoscaler runs on a RayCluster
    (CPU and GPU from ``rayStartParams`` or the container's limits, rounded up; custom resources from
    ``rayStartParams.resources``; bounds from ``minReplicas``/``maxReplicas``). Ray's ``memory``
    resource stays out: it is a pod limit here, and the fake provider starts nodes without it.
    """
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    metadata = rayservice.get("metadata", {})
    ray_cluster = {
        "metadata": {"name": metadata.get("name", "rayturn"), "namespace": metadata.get("namespace", "default")},
        "spec": rayservice["spec"]["rayClusterConfig"],
    }
    derived = _derive_autoscaling_config_from_ray_cr(ray_cluster)
    head_type = derived["head_node_type"]
    head: dict[str, float] = {}
    workers: dict[str, dict[str, Any]] = {}
    for name, node_type in derived["available_node_types"].items():
        resources = {key: value for key, value in node_type["resources"].items() if key not in _K8S_ONLY_RESOURCES}
        if name == head_type:
            head = resources
            continue
        workers[name] = {
            "resources": resources,
            "min_workers": node_type["min_workers"],
            "max_workers": node_type["max_workers"],
            "node_config": {},
        }
    return ClusterShape(head=head, workers=workers)


def _provider_config(
    worker_types: Mapping[str, Mapping[str, Any]],
    head_resources: Mapping[str, float],
    gcs_address: str,
    idle_timeout_s: float,
) -> dict[str, Any]:
    """The autoscaling config ``ray start --autoscaling-config`` reads, for the fake provider and autoscaler v2."""
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

    available = {
        name: {**node_type, "resources": {**node_type["resources"], "object_store_memory": OBJECT_STORE_BYTES}}
        for name, node_type in worker_types.items()
    }
    available[HEAD_NODE_TYPE] = {"resources": dict(head_resources), "node_config": {}, "max_workers": 0}
    return {
        "cluster_name": "rayturn-fake-kuberay",
        "max_workers": sum(node_type["max_workers"] for node_type in worker_types.values()),
        "provider": {
            # The fake provider itself, named by class: its ``fake_multinode`` type reads default settings
            # from a file (fake_multi_node/example.yaml) that Ray's wheel does not ship.
            "type": "external",
            "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "launch_multiple": True,
            "head_node_id": FAKE_HEAD_NODE_ID,
            "gcs_address": gcs_address,
        },
        "available_node_types": available,
        "head_node_type": HEAD_NODE_TYPE,
        "idle_timeout_minutes": idle_timeout_s / 60.0,
        "upscaling_speed": 1000,
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class FakeKubeRayCluster:
    """A head node on ``port`` and worker nodes of ``worker_types`` that Ray's autoscaler (v2) adds and removes."""

    def __init__(self, shape: ClusterShape, port: int, idle_timeout_s: float) -> None:
        import ray

        self.shape = shape
        self.address = f"{ray.util.get_node_ip_address()}:{port}"
        self._port = port
        self._config = _provider_config(shape.workers, shape.head, self.address, idle_timeout_s)
        self._temp_dir = Path(tempfile.mkdtemp(prefix="rayturn-as-"))
        self._head: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the head (and with it the autoscaler); returns once it is up."""
        from ray._private.authentication.authentication_token_setup import (
            enable_token_auth_by_default,
            ensure_token_if_auth_enabled,
        )
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        # As ``ray.init`` does for a cluster of its own: token authentication (unless RAY_AUTH_MODE says
        # otherwise), here and in the head, with the token in Ray's default place. A driver connecting to
        # an address uses it only when this process is in token mode.
        enable_token_auth_by_default()
        ensure_token_if_auth_enabled(create_token_if_missing=True)

        config_path = self._temp_dir / "autoscaling.json"
        config_path.write_text(json.dumps(self._config))
        env = {
            **os.environ,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "RAY_enable_autoscaler_v2": "1",
            "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
            "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
        }
        command = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={self._port}",
            *_resource_flags(self.shape.head),
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--autoscaling-config={config_path}",
            f"--temp-dir={self._temp_dir}",
            "--include-dashboard=false",
            "--dashboard-agent-listen-port=0",
            f"--ray-client-server-port={self._port + 1}",
            "--disable-usage-stats",
        ]
        with (self._temp_dir / "head.log").open("wb") as output:
            # A session of its own: the head's process group holds the processes it starts, and only those.
            self._head = subprocess.Popen(
                command,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        # ``ray start`` writes the cluster's address into its temporary directory once the head is up.
        while not (self._temp_dir / "ray_current_cluster").exists():
            if self._head.poll() is not None or time.monotonic() > deadline:
                head_output = (self._temp_dir / "head.log").read_text(errors="replace")[-4000:]
                self.shutdown()
                raise RuntimeError(f"the fake cluster's head did not start; its output ends with:\n{head_output}")
            time.sleep(0.5)

    def autoscaler_events(self) -> list[str]:
        """What the autoscaler decided so far (nodes added and removed, and why), from its log."""
        log = self._temp_dir / "session_latest" / "logs" / "monitor.log"
        if not log.exists():
            return []
        return [line for line in log.read_text(errors="replace").splitlines() if "event_logger" in line]

    def alive_nodes(self) -> Counter[str]:
        """Alive worker nodes per node type (told apart by the custom resource only that type offers)."""
        import ray

        markers = {name: _marker(name, self.shape.workers) for name in self.shape.workers}
        counts: Counter[str] = Counter({name: 0 for name in self.shape.workers})
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            for name, marker in markers.items():
                if marker in node["Resources"]:
                    counts[name] += 1
        return counts

    def _owned_processes(self) -> list[psutil.Process]:
        """Every process this cluster started: the head's tree, its process group, and what names our temp dir."""
        assert self._head is not None
        owned: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            head = psutil.Process(self._head.pid)
            owned.update({process.pid: process for process in head.children(recursive=True)})
        marker = str(self._temp_dir)
        for process in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if process.pid == os.getpid() or process.pid == self._head.pid:
                    continue
                if os.getpgid(process.pid) == self._head.pid or marker in " ".join(process.info["cmdline"] or ()):
                    owned[process.pid] = process
        return list(owned.values())

    def shutdown(self) -> None:
        """End every process this cluster started: SIGTERM to all at once, SIGKILL to what outlives the grace.

        Not the head's own SIGTERM path alone: it drains the head node first, for up to 30 s.
        """
        if self._head is None:
            return
        owned = self._owned_processes()
        self._head.terminate()
        for process in owned:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        _, alive = psutil.wait_procs(owned, timeout=STOP_GRACE_S)
        # Workers a raylet started while it was going down.
        for process in alive + self._owned_processes():
            with contextlib.suppress(psutil.Error):
                process.kill()
        if self._head.poll() is None:
            self._head.kill()
        self._head.wait()
        self._head = None
        shutil.rmtree(self._temp_dir, ignore_errors=True)


def _marker(name: str, worker_types: Mapping[str, Mapping[str, Any]]) -> str:
    """The custom resource that only node type ``name`` offers."""
    others = {key for other, node_type in worker_types.items() if other != name for key in node_type["resources"]}
    unique = [key for key in worker_types[name]["resources"] if key not in others and key not in ("CPU", "GPU")]
    if not unique:
        raise ValueError(f"worker group {name!r} offers no custom resource of its own to tell its nodes apart")
    return unique[0]


def _resource_flags(resources: Mapping[str, float]) -> list[str]:
    """``ray start`` flags for a node's resources."""
    custom = {key: value for key, value in resources.items() if key not in ("CPU", "GPU")}
    flags = [f"--num-cpus={resources.get('CPU', 0)}", f"--num-gpus={resources.get('GPU', 0)}"]
    return flags + ([f"--resources={json.dumps(custom)}"] if custom else [])
