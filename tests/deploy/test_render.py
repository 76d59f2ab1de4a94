"""``rayturn deploy render``: what it derives from a config, what it refuses, and keys from the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rayturn import __version__
from rayturn.cli import main
from rayturn.cluster.app import app_builder, config_digest, wait_for_config
from rayturn.cluster.config import API_KEYS_ENV, ClusterConfig, load_config
from rayturn.cluster.kuberay import RenderError, default_image, deploy_config, render, serve_config, worker_groups
from rayturn.cluster.render import render_text


def _config(**sections: Any) -> ClusterConfig:
    return ClusterConfig.from_dict(sections)


def test_inline_keys_are_refused_with_where_they_belong() -> None:
    for server in ({"api_keys": ["sk-alice"]}, {"tenant_keys": {"team-a": ["sk-a1"]}}):
        with pytest.raises(RenderError, match=r"keys do not go into manifests.*Secret 'rayturn-api-keys'"):
            render(_config(server=server), "img")


def test_render_command_refuses_a_config_with_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = tmp_path / "keys.yaml"
    config_file.write_text("server:\n  api_keys: [sk-secret-value]\n")
    assert main(["deploy", "render", "--config", str(config_file)]) == 2
    captured = capsys.readouterr()
    assert "rayturn: error: server.api_keys / server.tenant_keys: keys do not go into manifests" in captured.err
    assert "sk-secret-value" not in captured.err + captured.out


def test_render_reads_the_file_not_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, "sk-from-env")
    assert "sk-from-env" not in render_text(None, "img")


def test_keys_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "rayturn.yaml"
    config_file.write_text("server:\n  api_keys: [sk-file]\n")
    monkeypatch.setenv(API_KEYS_ENV, " sk-a, sk-b ,,")
    assert load_config(config_file).server.api_keys == ("sk-a", "sk-b")
    assert load_config(config_file, keys_from_env=False).server.api_keys == ("sk-file",)
    monkeypatch.setenv(API_KEYS_ENV, "")
    assert load_config(config_file).server.api_keys == ()
    monkeypatch.delenv(API_KEYS_ENV)
    assert load_config(config_file).server.api_keys == ("sk-file",)


def test_each_pool_asks_for_its_own_group() -> None:
    config = deploy_config(_config())
    assert dict(config.prefill.resources) == {"rayturn-prefill": 1.0}
    assert dict(config.decode.resources) == {"rayturn-decode": 1.0}
    assert dict(config.kvstore.store_node_resources) == {}  # no store nodes: no store group
    assert config.server.host == "0.0.0.0"


def test_a_pool_naming_its_resources_keeps_them_and_gets_whole_units() -> None:
    config = deploy_config(
        _config(decode={"num_cpus": 2.5, "num_gpus": 0.5, "resources": {"accelerator-a100": 0.5}, "max_replicas": 4})
    )
    decode = next(group for group in worker_groups(config) if group.name == "decode")
    assert (decode.min_replicas, decode.replicas, decode.max_replicas) == (1, 1, 4)
    assert (decode.shape.num_cpus, decode.shape.num_gpus, dict(decode.shape.resources)) == (
        3,
        1,
        {"accelerator-a100": 1},
    )
    params = decode.shape.ray_start_params()
    assert params == {"num-cpus": "3", "num-gpus": "1", "resources": """'{"accelerator-a100": 1}'"""}
    assert decode.shape.container_resources()["limits"]["nvidia.com/gpu"] == "1"


def test_no_prefill_pool_no_prefill_group_or_deployment() -> None:
    config = deploy_config(_config(prefill={"min_replicas": 0, "max_replicas": 0}))
    assert [group.name for group in worker_groups(config)] == ["decode"]
    deployments = serve_config(config, "")["applications"][0]["deployments"]
    assert [deployment["name"] for deployment in deployments] == ["decode", "ingress"]


def test_several_ingress_replicas_share_one_responses_deployment() -> None:
    config = deploy_config(_config(server={"ingress_replicas": 3, "ingress_num_cpus": 2}))
    deployments = {d["name"]: d for d in serve_config(config, "")["applications"][0]["deployments"]}
    assert deployments["ingress"]["num_replicas"] == 3
    assert deployments["responses"] == {
        "name": "responses",
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0.25},
        "max_ongoing_requests": 4096,
    }
    one = serve_config(deploy_config(_config(server={"ingress_replicas": 1})), "")
    assert "responses" not in {d["name"] for d in one["applications"][0]["deployments"]}


def test_store_nodes_get_a_group_of_their_own() -> None:
    config = deploy_config(_config(kvstore={"store_nodes": 3, "store_node_bytes": "4GiB"}))
    store = next(group for group in worker_groups(config) if group.name == "kvstore")
    assert (store.min_replicas, store.replicas, store.max_replicas) == (3, 3, 3)
    assert dict(store.shape.resources) == {"rayturn-kvstore": 1}
    assert store.shape.memory_bytes == (2 + 4) << 30
    kv_store = next(d for d in serve_config(config, "")["applications"][0]["deployments"] if d["name"] == "kv-store")
    assert kv_store["ray_actor_options"]["resources"] == {"rayturn-kvstore": 1.0}


def test_render_command_writes_the_file_or_prints_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = tmp_path / "laptop.yaml"
    config_file.write_text("model:\n  name: tiny\ndecode:\n  max_replicas: 2\n")
    argv = ["deploy", "render", "--config", str(config_file), "--image", "reg/rayturn:1"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "would write the manifests over the config" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    written = (tmp_path / "out" / "laptop.yaml").read_text()
    assert written == render_text(str(config_file), "reg/rayturn:1")
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().out == written
    kinds = [document["kind"] for document in yaml.safe_load_all(written) if document]
    assert kinds == ["ConfigMap", "RayService", "Service"]
    assert f"rayturn deploy render --config {config_file} --image reg/rayturn:1" in written.splitlines()[0]


def test_default_image_follows_the_gpus() -> None:
    assert default_image(_config()) == f"rayturn:{__version__}"
    assert default_image(_config(decode={"num_gpus": 1})) == f"rayturn:{__version__}-gpu"


def test_a_build_waits_for_the_mounted_config_it_was_rendered_with(tmp_path: Path) -> None:
    config_file = tmp_path / "rayturn.yaml"
    config_file.write_text("model:\n  name: tiny\n")
    wait_for_config(config_file, config_digest("model:\n  name: tiny\n"), timeout_s=0)
    stale = config_digest("model:\n  name: small\n")
    with pytest.raises(
        ValueError, match=f"has sha256 {config_digest(config_file.read_text())}, the application expects {stale}"
    ):
        wait_for_config(config_file, stale, timeout_s=0)
    with pytest.raises(ValueError, match=r"needs args\.config"):
        app_builder({"config_sha256": stale})
