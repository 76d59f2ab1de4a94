"""The CPU manifest's ``serveConfigV2`` deployed the way KubeRay deploys it: Serve's declarative API (what the
dashboard's ``PUT /api/serve/applications/`` calls) on a real Ray whose node offers the worker groups' custom
resources, the application built from the ConfigMap's file, API keys from ``$RAYTURN_API_KEYS`` as the Secret
sets it; then the official clients call it over HTTP and gRPC.

Only the ports change (each test module has its own) and the host (this host's loopback, not every interface).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")

from kuberay_crd import REPO, cluster_spec, ray_start_resources  # noqa: E402

from rayturn.cluster.config import API_KEYS_ENV  # noqa: E402
from rayturn.protos import rayturn_pb2 as pb  # noqa: E402
from rayturn.protos import rayturn_pb2_grpc as pb_grpc  # noqa: E402

HTTP_PORT, GRPC_PORT = 28691, 29691
MANIFEST = REPO / "deploy" / "kuberay" / "rayservice-cpu.yaml"
API_KEY = "sk-from-the-secret"
# Building the app and starting three replicas on a loaded 2-core host; Serve's own proxy check allows 5 s.
DEPLOY_TIMEOUT_S = 300.0
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    documents = {document["kind"]: document for document in yaml.safe_load_all(MANIFEST.read_text()) if document}
    config_file = Path(tmp_path_factory.mktemp("configmap")) / "rayturn.yaml"
    config_file.write_text(documents["ConfigMap"]["data"]["rayturn.yaml"])
    serve_config = yaml.safe_load(documents["RayService"]["spec"]["serveConfigV2"])
    serve_config["http_options"] = {"host": "127.0.0.1", "port": HTTP_PORT}
    serve_config["grpc_options"]["port"] = GRPC_PORT
    serve_config["applications"][0]["args"]["config"] = str(config_file)
    offered: dict[str, float] = {}
    for group in cluster_spec(documents["RayService"])["workerGroupSpecs"]:
        offered.update(ray_start_resources(group["rayStartParams"]))

    saved = {name: os.environ.get(name) for name in (API_KEYS_ENV, PROXY_READY_ENV)}
    os.environ[API_KEYS_ENV] = API_KEY  # what the Secret sets in every pod, so in Ray's workers too
    os.environ[PROXY_READY_ENV] = "60"
    # "local": without it Ray joins a Ray another process started with `ray start` on this host.
    ray.init(
        address="local",
        num_cpus=4,
        resources=offered,
        include_dashboard=False,
        log_to_driver=False,
        namespace="rayturn",
    )
    try:
        client = serve_start(
            http_options=serve_config["http_options"],
            grpc_options=serve_config["grpc_options"],
            controller_options=serve_config["controller_options"],
            global_logging_config=serve_config["logging_config"],
        )
        client.deploy_apps(ServeDeploySchema.model_validate(serve_config))
        deadline = time.monotonic() + DEPLOY_TIMEOUT_S
        status = serve.status().applications.get("rayturn")
        while (status is None or status.status not in ("RUNNING", "DEPLOY_FAILED")) and time.monotonic() < deadline:
            time.sleep(2)
            status = serve.status().applications.get("rayturn")
        assert status is not None and status.status == "RUNNING", status
        yield {"status": status, "serve_config": serve_config}
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_every_deployment_of_the_manifest_runs(deployed: dict[str, Any]) -> None:
    listed = [entry["name"] for entry in deployed["serve_config"]["applications"][0]["deployments"]]
    deployments = deployed["status"].deployments
    assert sorted(deployments) == sorted(listed)
    for name in listed:
        assert deployments[name].status == "HEALTHY", (name, deployments[name])


def test_the_openai_client_calls_it_with_the_secret_key(deployed: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key=API_KEY)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="sk-not-in-the-secret")
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def test_grpc_serves_with_the_secret_key(deployed: dict[str, Any]) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.RayTurnStub(channel)
        metadata = (("application", "rayturn"), ("authorization", f"Bearer {API_KEY}"))
        assert stub.Health(pb.HealthRequest(), metadata=metadata).status == "ok"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Health(pb.HealthRequest(), metadata=(("application", "rayturn"),))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
