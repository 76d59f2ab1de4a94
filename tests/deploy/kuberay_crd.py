"""Checks a KubeRay manifest the way the Kubernetes API server and the KubeRay operator would.

The API server, for a custom resource, applies the structural schema's
``default:`` values, then validates against the CRD's ``openAPIV3Schema``, and
prunes fields the schema does not name (here: an error, since a pruned field
is a setting that silently does nothing), except under
``x-kubernetes-preserve-unknown-fields``. The operator then refuses what the
schema cannot say: duplicate group names, replica counts outside their bounds,
custom resources Ray's autoscaler cannot read. (Resource quantities have their
pattern in the schema.)

The CRDs (KubeRay v1.7) are read from ``$RAYTURN_KUBERAY_CRDS``, else ``../shared/kuberay`` beside the repo.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CRDS_ENV = "RAYTURN_KUBERAY_CRDS"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}


def crd_dir() -> Path:
    return Path(os.environ.get(CRDS_ENV) or REPO.parent / "shared" / "kuberay")


def load_schema(kind: str, directory: Path) -> dict[str, Any]:
    """The ``ray.io/v1`` openAPIV3Schema of ``kind``'s CRD."""
    with (directory / CRD_FILES[kind]).open() as crd_file:
        crd = yaml.load(crd_file, Loader=yaml.CSafeLoader)
    (version,) = (version for version in crd["spec"]["versions"] if version["name"] == "v1")
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in where the API server fills them (a copy)."""
    value = copy.deepcopy(value)
    _default(schema, value)
    return value


def _default(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                if key not in schema.get("properties", {}):
                    _default(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(schema["items"], item)


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object that names its fields closed to other fields (a copy)."""
    closed = dict(schema)
    if "properties" in closed and not closed.get("x-kubernetes-preserve-unknown-fields"):
        closed.setdefault("additionalProperties", False)
        closed["properties"] = {key: strict(sub) for key, sub in closed["properties"].items()}
    if isinstance(closed.get("items"), dict):
        closed["items"] = strict(closed["items"])
    if isinstance(closed.get("additionalProperties"), dict):
        closed["additionalProperties"] = strict(closed["additionalProperties"])
    for combinator in ("anyOf", "allOf", "oneOf"):
        if combinator in closed:
            closed[combinator] = [strict(sub) for sub in closed[combinator]]
    return closed


def schema_errors(schema: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """What the API server would refuse in ``manifest``, one ``path: reason`` line each."""
    validator = jsonschema.Draft7Validator(strict(schema))
    errors = sorted(validator.iter_errors(with_defaults(schema, manifest)), key=lambda error: list(error.path))
    return [f"{'.'.join(str(part) for part in error.path) or '<root>'}: {error.message}" for error in errors]


def cluster_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = manifest["spec"]
    return spec["rayClusterConfig"] if manifest["kind"] == "RayService" else spec


def ray_start_resources(params: dict[str, str]) -> dict[str, int]:
    """The custom resources of a ``rayStartParams``, read as Ray's KubeRay autoscaler reads them."""
    text = params.get("resources")
    if text is None:
        return {}
    resources = json.loads(text[1:-1].replace("\\", ""))
    if not isinstance(resources, dict) or not all(isinstance(amount, int) for amount in resources.values()):
        raise ValueError(f"rayStartParams.resources must be a JSON object of integers, got {text!r}")
    return resources


def operator_errors(schema: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """What the KubeRay operator (and Ray's autoscaler) would refuse, after the API server's defaults."""
    spec = cluster_spec(with_defaults(schema, manifest))
    errors = []
    names = [group["groupName"] for group in spec.get("workerGroupSpecs", [])]
    for name in sorted({name for name in names if names.count(name) > 1}):
        errors.append(f"workerGroupSpecs: group name {name!r} is used more than once")
    for group in spec.get("workerGroupSpecs", []):
        low, count, high = group["minReplicas"], group["replicas"], group["maxReplicas"]
        if not low <= count <= high:
            errors.append(
                f"workerGroupSpecs[{group['groupName']}]: needs minReplicas <= replicas <= maxReplicas, "
                f"got {low} <= {count} <= {high}"
            )
    for name, group in _groups(spec):
        try:
            ray_start_resources(group.get("rayStartParams", {}))
        except ValueError as err:
            errors.append(f"{name}.rayStartParams.resources: {err}")
    return errors


def _groups(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "headGroupSpec", spec["headGroupSpec"]
    for group in spec.get("workerGroupSpecs", []):
        yield f"workerGroupSpecs[{group['groupName']}]", group


def all_errors(schemas: dict[str, dict[str, Any]], manifest: dict[str, Any]) -> list[str]:
    """Every refusal of a RayService: its own CRD, the RayCluster CRD for the cluster it makes, then (for a
    manifest the API server takes) the operator's."""
    errors = schema_errors(schemas["RayService"], manifest)
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": manifest["metadata"]["name"]},
        "spec": manifest["spec"]["rayClusterConfig"],
    }
    errors += [f"(as a RayCluster) {error}" for error in schema_errors(schemas["RayCluster"], cluster)]
    return errors or operator_errors(schemas["RayService"], manifest)
