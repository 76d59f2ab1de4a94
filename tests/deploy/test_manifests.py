"""The KubeRay manifests: committed ones fresh, every one valid for the API server, the operator, Ray's autoscaler
and Ray Serve, and the application they point at builds from the config they carry."""

from __future__ import annotations

import copy
import hashlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kuberay_crd import REPO, all_errors, cluster_spec, crd_dir, load_schema, ray_start_resources
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from rayturn.cluster import kuberay
from rayturn.cluster.config import load_config
from rayturn.cluster.render import output_path, render_text

CONFIG_DIR = REPO / "deploy" / "kuberay" / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
RELATIVE = [str(path.relative_to(REPO)) for path in CONFIGS]


def _documents(text: str) -> dict[str, dict[str, Any]]:
    return {document["kind"]: document for document in yaml.safe_load_all(text) if document}


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict[str, Any]]:
    directory = crd_dir()
    if not (directory / "ray.io_rayservices.yaml").exists():
        pytest.skip(f"no KubeRay CRDs in {directory}; set $RAYTURN_KUBERAY_CRDS to the folder holding them")
    return {kind: load_schema(kind, directory) for kind in ("RayService", "RayCluster")}


@pytest.fixture(scope="module")
def rendered(monkeypatch_module: pytest.MonkeyPatch) -> dict[str, dict[str, dict[str, Any]]]:
    """Each example config's manifests, rendered as `make deploy` renders them (run from the repo root)."""
    monkeypatch_module.chdir(REPO)
    return {relative: _documents(render_text(relative, None)) for relative in RELATIVE}


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_three_examples_are_there() -> None:
    assert {path.stem for path in CONFIGS} == {"rayservice", "rayservice-cpu", "rayservice-kvstore"}


@pytest.mark.parametrize("relative", RELATIVE)
def test_committed_manifest_is_fresh(relative: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    committed = output_path(relative, "deploy/kuberay")
    assert committed.exists(), f"{committed} is missing; run `make deploy`"
    assert committed.read_text() == render_text(relative, None), (
        f"{committed} is stale against {relative}; run `make deploy` "
        f"(rayturn deploy render --config {relative} --out deploy/kuberay)"
    )


@pytest.mark.parametrize("relative", RELATIVE)
def test_rayservice_passes_the_api_server_and_the_operator(
    relative: str, rendered: dict[str, Any], schemas: dict[str, Any]
) -> None:
    assert all_errors(schemas, rendered[relative]["RayService"]) == []


@pytest.mark.parametrize("relative", RELATIVE)
def test_groups_follow_the_pools(relative: str, rendered: dict[str, Any]) -> None:
    config = load_config(REPO / relative)
    spec = cluster_spec(rendered[relative]["RayService"])
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["version"] == "v2"
    groups = {group["groupName"]: group for group in spec["workerGroupSpecs"]}
    expected = {"prefill", "decode"} | ({"kvstore"} if config.kvstore.store_nodes else set())
    assert set(groups) == expected
    for name in ("prefill", "decode"):
        pool = getattr(config, name)
        group = groups[name]
        assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (
            pool.min_replicas,
            pool.min_replicas,
            pool.max_replicas,
        )
        assert ray_start_resources(group["rayStartParams"]) == {f"rayturn-{name}": 1}
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits.get("nvidia.com/gpu") == (str(int(pool.num_gpus)) if pool.num_gpus else None)
    if "kvstore" in groups:
        store = groups["kvstore"]
        assert store["minReplicas"] == store["replicas"] == store["maxReplicas"] == config.kvstore.store_nodes
        assert ray_start_resources(store["rayStartParams"]) == {"rayturn-kvstore": 1}


@pytest.mark.parametrize("relative", RELATIVE)
def test_ray_autoscaler_reads_the_groups(relative: str, rendered: dict[str, Any]) -> None:
    service = rendered[relative]["RayService"]
    ray_cluster = {"metadata": {"name": "rayturn", "namespace": "default"}, "spec": cluster_spec(service)}
    node_types = _derive_autoscaling_config_from_ray_cr(ray_cluster)["available_node_types"]
    for group in cluster_spec(service)["workerGroupSpecs"]:
        node_type = node_types[group["groupName"]]
        assert (node_type["min_workers"], node_type["max_workers"]) == (group["minReplicas"], group["maxReplicas"])
        assert node_type["resources"]["CPU"] == int(group["rayStartParams"]["num-cpus"])
        for resource, amount in ray_start_resources(group["rayStartParams"]).items():
            assert node_type["resources"][resource] == amount


@pytest.mark.parametrize("relative", RELATIVE)
def test_every_resource_a_deployment_asks_for_is_offered(relative: str, rendered: dict[str, Any]) -> None:
    service = rendered[relative]["RayService"]
    spec = cluster_spec(service)
    offers = [
        {"CPU": int(group["rayStartParams"]["num-cpus"]), "GPU": int(group["rayStartParams"].get("num-gpus", 0))}
        | ray_start_resources(group["rayStartParams"])
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    ]
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    for deployment in serve_config["applications"][0]["deployments"]:
        options = deployment["ray_actor_options"]
        asked = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0)} | options.get("resources", {})
        assert any(all(offer.get(name, 0) >= amount for name, amount in asked.items()) for offer in offers), (
            f"no group offers what deployment {deployment['name']} asks for: {asked}"
        )


@pytest.mark.parametrize("relative", RELATIVE)
def test_serve_config_builds_the_application_it_describes(
    relative: str, rendered: dict[str, Any], tmp_path: Path
) -> None:
    documents = rendered[relative]
    serve_config = yaml.safe_load(documents["RayService"]["spec"]["serveConfigV2"])
    (application,) = ServeDeploySchema.model_validate(serve_config).applications
    assert application.import_path == kuberay.IMPORT_PATH and application.route_prefix == "/"
    config_text = documents["ConfigMap"]["data"][kuberay.CONFIG_FILE]
    assert application.args == {
        "config": f"{kuberay.CONFIG_DIR}/{kuberay.CONFIG_FILE}",
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
    }
    # The ConfigMap's file, where the pods mount it.
    config_file = tmp_path / kuberay.CONFIG_FILE
    config_file.write_text(config_text)
    module_name, _, attribute = application.import_path.partition(":")
    builder = getattr(importlib.import_module(module_name), attribute)
    built = _deployments(builder({**application.args, "config": str(config_file)}))
    listed = {entry["name"]: entry for entry in serve_config["applications"][0]["deployments"]}
    assert set(built) == set(listed)
    for name, deployment in built.items():
        entry = listed[name]
        assert deployment.ray_actor_options == entry["ray_actor_options"], name
        for option in ("max_ongoing_requests", "max_queued_requests"):
            if option in entry:
                assert getattr(deployment, option) == entry[option], (name, option)
        scaling = deployment._deployment_config.autoscaling_config
        if "autoscaling_config" in entry:
            bounds = entry["autoscaling_config"]
            assert (scaling.min_replicas, scaling.max_replicas) == (bounds["min_replicas"], bounds["max_replicas"])
            assert scaling.target_ongoing_requests == bounds["target_ongoing_requests"], name
        else:
            assert scaling is None and deployment.num_replicas == entry["num_replicas"], name
        router = deployment._deployment_config.request_router_config
        if "request_router_config" in entry:
            assert router.request_router_class == entry["request_router_config"]["request_router_class"], name
            assert router.request_router_kwargs == entry["request_router_config"]["request_router_kwargs"], name


def _deployments(app: Application) -> dict[str, Any]:
    """The deployments an application binds, itself and every one among its constructor arguments."""
    found: dict[str, Any] = {}
    pending = [app]
    while pending:
        deployment = pending.pop()._bound_deployment
        found[deployment.name] = deployment
        pending.extend(arg for arg in deployment.init_args if isinstance(arg, Application))
    return found


def test_grpc_service_and_serve_ports(rendered: dict[str, Any]) -> None:
    documents = rendered["deploy/kuberay/configs/rayservice.yaml"]
    (port,) = documents["Service"]["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("serve-grpc", 9000, 9000)
    assert documents["Service"]["spec"]["selector"]["ray.io/serve"] == "true"
    head = cluster_spec(documents["RayService"])["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"serve": 8000, "serve-grpc": 9000}.items() <= {p["name"]: p["containerPort"] for p in head["ports"]}.items()
    serve_config = yaml.safe_load(documents["RayService"]["spec"]["serveConfigV2"])
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert serve_config["grpc_options"]["port"] == 9000


def test_keys_come_from_the_secret_only(rendered: dict[str, Any]) -> None:
    for documents in rendered.values():
        assert yaml.safe_load(documents["ConfigMap"]["data"][kuberay.CONFIG_FILE])["server"]["api_keys"] == []
        spec = cluster_spec(documents["RayService"])
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            (env,) = group["template"]["spec"]["containers"][0]["env"]
            assert env == {
                "name": "RAYTURN_API_KEYS",
                "valueFrom": {"secretKeyRef": {"name": kuberay.API_KEYS_SECRET, "key": kuberay.API_KEYS_SECRET_KEY}},
            }


def _broken(rendered: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(rendered["deploy/kuberay/configs/rayservice-cpu.yaml"]["RayService"])


def test_an_unknown_field_is_refused(rendered: dict[str, Any], schemas: dict[str, Any]) -> None:
    manifest = _broken(rendered)
    cluster_spec(manifest)["workerGroupSpecs"][0]["maxReplica"] = 3
    errors = all_errors(schemas, manifest)
    assert any("workerGroupSpecs.0" in error and "'maxReplica' was unexpected" in error for error in errors), errors


def test_a_replica_count_out_of_bounds_is_refused(rendered: dict[str, Any], schemas: dict[str, Any]) -> None:
    manifest = _broken(rendered)
    cluster_spec(manifest)["workerGroupSpecs"][1]["replicas"] = 7
    errors = all_errors(schemas, manifest)
    assert errors == ["workerGroupSpecs[decode]: needs minReplicas <= replicas <= maxReplicas, got 1 <= 7 <= 3"]


def test_a_duplicate_group_is_refused(rendered: dict[str, Any], schemas: dict[str, Any]) -> None:
    manifest = _broken(rendered)
    groups = cluster_spec(manifest)["workerGroupSpecs"]
    groups.append(copy.deepcopy(groups[0]))
    errors = all_errors(schemas, manifest)
    assert errors == ["workerGroupSpecs: group name 'prefill' is used more than once"]


def test_a_wrong_type_is_refused(rendered: dict[str, Any], schemas: dict[str, Any]) -> None:
    manifest = _broken(rendered)
    cluster_spec(manifest)["workerGroupSpecs"][0]["minReplicas"] = "1"
    errors = all_errors(schemas, manifest)
    assert "spec.rayClusterConfig.workerGroupSpecs.0.minReplicas: '1' is not of type 'integer'" in errors, errors


def test_a_bad_quantity_is_refused(rendered: dict[str, Any], schemas: dict[str, Any]) -> None:
    manifest = _broken(rendered)
    container = cluster_spec(manifest)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["memory"] = "2 GiB"
    errors = all_errors(schemas, manifest)
    assert any("resources.limits.memory" in error and "'2 GiB'" in error for error in errors), errors


def test_defaults_are_applied_before_the_bounds_are_checked(rendered: dict[str, Any], schemas: dict[str, Any]) -> None:
    manifest = _broken(rendered)
    del cluster_spec(manifest)["workerGroupSpecs"][0]["replicas"]  # defaults to 0, below minReplicas 1
    errors = all_errors(schemas, manifest)
    assert errors == ["workerGroupSpecs[prefill]: needs minReplicas <= replicas <= maxReplicas, got 1 <= 0 <= 2"]
