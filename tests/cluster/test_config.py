"""Cluster config: defaults, the example file, strict validation naming the key, sizes, overrides, Ray options."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.deployment import Application

from rayturn.api.settings import ServerSettings
from rayturn.cluster import config as config_module
from rayturn.cluster.app import build_app
from rayturn.cluster.config import (
    ClusterConfig,
    PoolSpec,
    load_config,
)
from rayturn.engine.settings import ModelSettings
from rayturn.kvstore.settings import KVStoreSettings, UCXSettings

EXAMPLE = Path(config_module.__file__).parent / "examples" / "rayturn.yaml"


def _key_tree(data: dict[str, Any]) -> dict[str, Any]:
    """Keys only, down to the leaves; mappings that hold user data (resources) count as leaves."""
    return {key: _key_tree(value) if isinstance(value, dict) and value else None for key, value in data.items()}


# -- defaults and the example file ------------------------------------------


def test_defaults() -> None:
    config = ClusterConfig()
    assert config.model == ModelSettings("tiny", None, "float32", 16, None, None, 64, 2048, None, None)
    assert config.prefill == config.decode == PoolSpec()
    assert (config.decode.min_replicas, config.decode.max_replicas, config.decode.initial_replicas) == (1, 1, None)
    assert (config.decode.num_cpus, config.decode.num_gpus, dict(config.decode.resources)) == (0.5, 0.0, {})
    assert config.decode.max_ongoing_requests == 64
    assert dataclasses.astuple(config.decode.autoscaling) == (8.0, 10.0, 60.0, 30.0)
    assert config.kvstore.segment_bytes == 256 << 20
    assert config.kvstore.store_node_bytes == 1 << 30
    assert (config.kvstore.store_nodes, config.kvstore.replicas, config.kvstore.transport) == (0, 1, "auto")
    assert (config.kvstore.high_watermark, config.kvstore.low_watermark) == (0.90, 0.80)
    assert config.kvstore.ucx == UCXSettings(None, None, 0)
    assert dataclasses.astuple(config.router) == ("kv_aware", 1.0, 1.0, 0.5, 512, True, 1.0)
    assert config.server == ServerSettings("127.0.0.1", 8000, 9000, (), {}, 8 << 20, 1, 0.25)
    assert config.tenant == "default"
    assert load_config() == ClusterConfig.from_dict({}) == config


def test_example_file_loads_to_the_defaults() -> None:
    assert load_config(EXAMPLE) == ClusterConfig()


def test_example_file_shows_and_comments_every_key() -> None:
    text = EXAMPLE.read_text()
    assert _key_tree(yaml.safe_load(text)) == _key_tree(ClusterConfig().to_dict())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for previous, line in itertools.pairwise(lines):
        if re.match(r"\w+:", line):
            assert previous.startswith("#"), f"no comment above {line!r}"


def test_empty_file_and_empty_sections_mean_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    sections = tmp_path / "sections.yaml"
    sections.write_text("model:\ndecode:\n  resources:\n  autoscaling:\n")
    assert load_config(empty) == load_config(sections) == ClusterConfig()


# -- validation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        # unknown keys, with a suggestion when one is close
        ({"decode": {"min_replica": 1}}, r"unknown key 'decode\.min_replica' \(did you mean 'min_replicas'\?\)"),
        ({"modle": {}}, r"unknown key 'modle' \(did you mean 'model'\?\)"),
        ({"kvstore": {"ucx": {"tsl": "tcp"}}}, r"unknown key 'kvstore\.ucx\.tsl' \(did you mean 'tls'\?\)"),
        ({"prefill": {"autoscaling": {"zzz": 1}}}, r"unknown key 'prefill\.autoscaling\.zzz' \(known keys: target_"),
        # wrong types
        ({"decode": {"min_replicas": True}}, r"decode\.min_replicas must be an integer, got True \(bool\)"),
        ({"decode": {"min_replicas": 1.5}}, r"decode\.min_replicas must be an integer"),
        ({"decode": {"min_replicas": "2"}}, r"decode\.min_replicas must be an integer"),
        ({"decode": {"num_cpus": True}}, r"decode\.num_cpus must be a number"),
        ({"decode": {"num_cpus": "1"}}, r"decode\.num_cpus must be a number"),
        ({"model": {"name": 7}}, r"model\.name must be a string"),
        ({"model": {"served_name": ["a"]}}, r"model\.served_name must be a string"),
        ({"model": "tiny"}, r"model must be a mapping, got 'tiny' \(str\)"),
        ({"kvstore": {"ucx": []}}, r"kvstore\.ucx must be a mapping"),
        ({"decode": {"resources": ["gpu"]}}, r"decode\.resources must be a mapping"),
        ({"decode": {"resources": {"gpu": "1"}}}, r"decode\.resources\.gpu must be a number"),
        ({"decode": {"resources": {1: 1}}}, r"decode\.resources names must be strings"),
        ({"server": {"api_keys": "sk-1"}}, r"server\.api_keys must be a list"),
        ({"server": {"api_keys": ["sk-1", 2]}}, r"server\.api_keys\[1\] must be a string"),
        ({"kvstore": {"segment_bytes": 1.5}}, r"kvstore\.segment_bytes must be a byte count"),
        ({"kvstore": {"store_node_bytes": "1 gigabyte"}}, r"kvstore\.store_node_bytes must be a byte count"),
        ({"tenant": None}, r"tenant must be a string"),
        # model ranges and choices
        ({"model": {"name": ""}}, r"model\.name must not be empty"),
        ({"model": {"served_name": " "}}, r"model\.served_name must not be empty"),
        ({"model": {"page_size": 0}}, r"model\.page_size must be >= 1, got 0"),
        ({"model": {"num_pages": 0}}, r"model\.num_pages must be >= 1"),
        ({"model": {"num_window_slots": -1}}, r"model\.num_window_slots must be >= 0"),
        ({"model": {"max_num_seqs": 0}}, r"model\.max_num_seqs must be >= 1"),
        ({"model": {"max_num_batched_tokens": 0}}, r"model\.max_num_batched_tokens must be >= 1"),
        (
            {"model": {"max_prefill_tokens_while_decoding": 0}},
            r"model\.max_prefill_tokens_while_decoding must be >= 1",
        ),
        ({"model": {"max_model_len": -1}}, r"model\.max_model_len must be >= 1"),
        ({"model": {"dtype": "fp8"}}, r"model\.dtype must be one of float32, bfloat16, float16, got 'fp8'"),
        (
            {"model": {"tool_call_parser": "pythonic"}},
            r"model\.tool_call_parser must be one of hermes, qwen3_coder, llama3_json, mistral, harmony, "
            r"got 'pythonic'",
        ),
        # pool replicas and resources
        ({"decode": {"min_replicas": -1}}, r"decode\.min_replicas must be >= 0, got -1"),
        ({"decode": {"min_replicas": 0, "max_replicas": 0}}, r"decode\.max_replicas must be >= 1, got 0"),
        ({"prefill": {"min_replicas": 3, "max_replicas": 2}}, r"prefill\.max_replicas must be >= min_replicas \(3\)"),
        (
            {"decode": {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 5}},
            r"decode\.initial_replicas must lie in \[min_replicas, max_replicas\] = \[1, 4\], got 5",
        ),
        ({"decode": {"min_replicas": 2, "max_replicas": 4, "initial_replicas": 1}}, r"decode\.initial_replicas"),
        ({"decode": {"num_cpus": -0.5}}, r"decode\.num_cpus must be >= 0"),
        ({"decode": {"num_gpus": -1}}, r"decode\.num_gpus must be >= 0"),
        ({"decode": {"resources": {"rayturn-decode": 0}}}, r"decode\.resources\.rayturn-decode must be > 0, got 0"),
        ({"decode": {"resources": {"": 1}}}, r"decode\.resources must not hold an empty resource name"),
        ({"decode": {"max_ongoing_requests": 0}}, r"decode\.max_ongoing_requests must be >= 1"),
        ({"decode": {"max_queued_requests": 0}}, r"decode\.max_queued_requests must be >= 1"),
        ({"decode": {"continuation_reserve": 1.0}}, r"decode\.continuation_reserve must lie in \[0, 1\)"),
        ({"prefill": {"continuation_reserve": -0.1}}, r"prefill\.continuation_reserve must lie in \[0, 1\)"),
        ({"decode": {"max_queued_requests": "many"}}, r"decode\.max_queued_requests must be an integer"),
        ({"decode": {"autoscaling": {"target_ongoing_requests": 0}}}, r"decode\.autoscaling\.target_ongoing_requests"),
        ({"prefill": {"autoscaling": {"upscale_delay_s": -1}}}, r"prefill\.autoscaling\.upscale_delay_s must be >= 0"),
        ({"prefill": {"autoscaling": {"downscale_delay_s": -1}}}, r"prefill\.autoscaling\.downscale_delay_s"),
        (
            {"decode": {"autoscaling": {"look_back_period_s": 10}}},
            r"decode\.autoscaling\.look_back_period_s must be > 10",
        ),
        # kv store
        ({"kvstore": {"master_name": ""}}, r"kvstore\.master_name must not be empty"),
        ({"kvstore": {"segment_bytes": 0}}, r"kvstore\.segment_bytes must be >= 1"),
        ({"kvstore": {"store_nodes": -1}}, r"kvstore\.store_nodes must be >= 0"),
        ({"kvstore": {"store_node_bytes": "0GiB"}}, r"kvstore\.store_node_bytes must be >= 1"),
        ({"kvstore": {"store_node_num_cpus": -1}}, r"kvstore\.store_node_num_cpus must be >= 0"),
        ({"kvstore": {"store_node_resources": {"store": -1}}}, r"kvstore\.store_node_resources\.store must be > 0"),
        ({"kvstore": {"replicas": 0}}, r"kvstore\.replicas must be >= 1, got 0"),
        ({"kvstore": {"high_watermark": 1.5}}, r"kvstore\.high_watermark must lie in \(0, 1\], got 1\.5"),
        ({"kvstore": {"low_watermark": 0}}, r"kvstore\.low_watermark must lie in \(0, high_watermark\)"),
        ({"kvstore": {"low_watermark": 0.9, "high_watermark": 0.9}}, r"kvstore\.low_watermark must lie in"),
        ({"kvstore": {"transport": "tcp"}}, r"kvstore\.transport must be one of auto, ucx, got 'tcp'"),
        ({"kvstore": {"snapshot_dir": ""}}, r"kvstore\.snapshot_dir must not be empty"),
        ({"kvstore": {"ucx": {"port": 70000}}}, r"kvstore\.ucx\.port must be a port number in 0-65535, got 70000"),
        ({"kvstore": {"ucx": {"tls": ""}}}, r"kvstore\.ucx\.tls must not be empty"),
        # router
        ({"router": {"kv_overlap_weight": -1}}, r"router\.kv_overlap_weight must be >= 0"),
        ({"router": {"load_weight": -0.1}}, r"router\.load_weight must be >= 0"),
        ({"router": {"affinity_weight": -1}}, r"router\.affinity_weight must be >= 0"),
        ({"router": {"disaggregation_threshold_tokens": -1}}, r"router\.disaggregation_threshold_tokens must be >= 0"),
        ({"router": {"stats_period_s": 0}}, r"router\.stats_period_s must be > 0"),
        ({"router": {"balance_prefill": "maybe"}}, r"router\.balance_prefill must be true or false, got 'maybe'"),
        # server
        ({"server": {"http_port": -1}}, r"server\.http_port must be a port number in 0-65535, got -1"),
        ({"server": {"grpc_port": 65536}}, r"server\.grpc_port must be a port number"),
        ({"server": {"http_port": 8000, "grpc_port": 8000}}, r"server\.grpc_port must differ from http_port"),
        ({"server": {"api_keys": ["sk-1", ""]}}, r"server\.api_keys\[1\] must not be empty"),
        ({"server": {"host": ""}}, r"server\.host must not be empty"),
        ({"server": {"ingress_replicas": 0}}, r"server\.ingress_replicas must be >= 1"),
        ({"server": {"ingress_num_cpus": -1}}, r"server\.ingress_num_cpus must be >= 0"),
        ({"tenant": ""}, r"tenant must not be empty"),
        ({"tenant": "team/a"}, r"tenant must be 1-64 letters, digits"),
        ({"server": {"tenant_keys": {"team a": ["sk-1"]}}}, r"server\.tenant_keys\.team a must be 1-64 letters"),
        ({"server": {"tenant_keys": {"team": []}}}, r"server\.tenant_keys\.team must list at least one key"),
        ({"server": {"tenant_keys": {"team": ["sk-1", " "]}}}, r"server\.tenant_keys\.team\[1\] must not be empty"),
        ({"server": {"tenant_keys": {"team": "sk-1"}}}, r"server\.tenant_keys\.team must be a list"),
        (
            {"server": {"api_keys": ["sk-1"], "tenant_keys": {"team": ["sk-1"]}}},
            r"server\.api_keys must not hold a key twice",
        ),
        ({"server": {"max_request_bytes": 100}}, r"server\.max_request_bytes must be >= 1024, got 100"),
        ({"server": {"max_request_bytes": "lots"}}, r"server\.max_request_bytes must be a byte count"),
    ],
)
def test_invalid_values_raise_naming_the_key(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_dict(data)


def test_accepted_edge_values() -> None:
    config = ClusterConfig.from_dict(
        {
            "decode": {"num_cpus": 1, "min_replicas": 0, "max_replicas": 1, "initial_replicas": 0},
            "kvstore": {"low_watermark": 0.5, "high_watermark": 1},
            "server": {"http_port": 0, "grpc_port": 0},
        }
    )
    assert config.decode.num_cpus == 1.0 and isinstance(config.decode.num_cpus, float)
    assert config.kvstore.high_watermark == 1.0
    assert (config.server.http_port, config.server.grpc_port) == (0, 0)  # two "any free port"s never collide


def test_direct_construction_is_validated_with_the_field_name() -> None:
    with pytest.raises(ValueError, match=r"^min_replicas must be >= 0, got -1$"):
        PoolSpec(min_replicas=-1)


def test_config_is_frozen_and_owns_its_mappings() -> None:
    resources = {"rayturn-decode": 1.0}
    pool = PoolSpec(resources=resources)
    resources["rayturn-decode"] = 5.0
    assert pool.resources == {"rayturn-decode": 1.0}
    with pytest.raises(TypeError):
        pool.resources["other"] = 1.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        pool.min_replicas = 2  # type: ignore[misc]
    assert hash(ClusterConfig(decode=pool)) == hash(ClusterConfig(decode=PoolSpec(resources={"rayturn-decode": 1.0})))


def test_api_keys_stay_out_of_the_repr() -> None:
    config = ClusterConfig.from_dict({"server": {"api_keys": ["sk-secret"], "tenant_keys": {"team": ["sk-team"]}}})
    assert "sk-secret" not in repr(config) and "sk-team" not in repr(config)


@pytest.mark.parametrize(
    "server",
    [
        {"api_keys": "sk-SECRET-1"},
        {"api_keys": ["sk-1", {"key": "sk-SECRET-1"}]},
        {"tenant_keys": {"t": "sk-SECRET-1"}},
    ],
)
def test_errors_about_keys_never_show_a_key(server: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"must be a (list|string), got a value of type") as err:
        ClusterConfig.from_dict({"server": server})
    assert "SECRET" not in str(err.value)


def test_a_named_tenant_cannot_pass_for_a_keys_own() -> None:
    with pytest.raises(ValueError, match=r"server\.tenant_keys\.key-abc must not start with 'key-'"):
        ClusterConfig.from_dict({"server": {"tenant_keys": {"key-abc": ["sk-1"]}}})


def test_keys_become_tenants_for_the_ingress() -> None:
    config = ClusterConfig.from_dict(
        {"server": {"api_keys": ["sk-a"], "tenant_keys": {"team": ["sk-t1", "sk-t2"]}, "max_request_bytes": "2MiB"}}
    )
    keys = config.server.key_table(config.tenant)
    assert keys.tenant_of("sk-t1") == keys.tenant_of("sk-t2") == "team" and keys.tenant_of("sk-a") != "team"
    assert keys.tenant_of("sk-nope") is None and config.server.max_request_bytes == 2 << 20
    assert ClusterConfig().server.key_table("default").tenant_of(None) == "default"  # no keys: one tenant


# -- files -------------------------------------------------------------------


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- decode\n")
    with pytest.raises(ValueError, match=r"list\.yaml' must hold a mapping at the top level, got \['model'"):
        load_config(path)
    with pytest.raises(ValueError, match=r"the config must be a mapping, got \[\] \(list\)"):
        ClusterConfig.from_dict([])  # type: ignore[arg-type]


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read config file '.*missing\.yaml'"):
        load_config(tmp_path / "missing.yaml")


def test_unparseable_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  name: [tiny\n")
    with pytest.raises(ValueError, match=r"cannot parse config file '.*broken\.yaml'"):
        load_config(path)


def test_yaml_tags_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "tagged.yaml"
    path.write_text("model: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ValueError, match=r"cannot parse config file"):
        load_config(path)


# -- sizes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("4096B", 4096),
        ("512MB", 512 * 10**6),
        ("256MiB", 256 << 20),
        ("256 MiB", 256 << 20),
        ("1GiB", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("2gib", 2 << 30),
        ("64KiB", 64 << 10),
        ("3kb", 3000),
        ("1TB", 10**12),
        ("1TiB", 1 << 40),
    ],
)
def test_size_strings(size: int | str, expected: int) -> None:
    config = ClusterConfig.from_dict({"kvstore": {"segment_bytes": size, "store_node_bytes": size}})
    assert config.kvstore.segment_bytes == config.kvstore.store_node_bytes == expected


@pytest.mark.parametrize("size", ["", "MiB", "1 XB", "-1MiB", "1e9", "one GiB", True, None, [1]])
def test_bad_sizes(size: object) -> None:
    with pytest.raises(ValueError, match=r"kvstore\.segment_bytes must be a byte count or a size such as"):
        ClusterConfig.from_dict({"kvstore": {"segment_bytes": size}})


# -- overrides and round trips -------------------------------------------------


def test_overrides_apply_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rayturn.yaml"
    path.write_text("model:\n  name: tiny\n  dtype: bfloat16\ndecode:\n  max_replicas: 4\n")
    config = load_config(
        path,
        **{
            "model.name": "small",
            "decode.min_replicas": 2,
            "decode.resources.rayturn-decode": 1,
            "kvstore.ucx.tls": "tcp,self",
            "server": {"api_keys": ["sk-1"]},
            "tenant": "team-a",
        },
    )
    assert (config.model.name, config.model.dtype) == ("small", "bfloat16")
    assert (config.decode.min_replicas, config.decode.max_replicas) == (2, 4)
    assert config.decode.resources == {"rayturn-decode": 1.0}
    assert config.kvstore.ucx.tls == "tcp,self"
    assert config.server.api_keys == ("sk-1",)
    assert config.tenant == "team-a"
    assert config.prefill == PoolSpec()


def test_overrides_without_a_file() -> None:
    assert load_config(**{"model.page_size": 32}) == ClusterConfig(model=ModelSettings(page_size=32))


def test_bad_overrides_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'decode\.min_replica' \(did you mean 'min_replicas'\?\)"):
        load_config(**{"decode.min_replica": 2})
    with pytest.raises(ValueError, match=r"override 'model\.name\.first': 'model\.name' is not a section"):
        load_config(**{"model.name": "tiny", "model.name.first": "x"})
    with pytest.raises(ValueError, match=r"decode\.max_replicas must be >= min_replicas \(3\)"):
        load_config(**{"decode.min_replicas": 3})


def test_to_dict_round_trips() -> None:
    config = ClusterConfig.from_dict(
        {
            "model": {"name": "/models/qwen/", "served_name": "qwen", "dtype": "bfloat16", "num_pages": 1024},
            "prefill": {"min_replicas": 1, "max_replicas": 3, "num_gpus": 1, "resources": {"rayturn-prefill": 1}},
            "decode": {"autoscaling": {"target_ongoing_requests": 4}},
            "kvstore": {"segment_bytes": "1GiB", "store_nodes": 2, "snapshot_dir": "/tmp/kv", "ucx": {"port": 13337}},
            "router": {"affinity_weight": 2},
            "server": {"api_keys": ["sk-1", "sk-2"], "host": "0.0.0.0"},
            "tenant": "team-a",
        }
    )
    plain = config.to_dict()
    assert plain["kvstore"]["segment_bytes"] == 1 << 30
    assert plain["prefill"]["resources"] == {"rayturn-prefill": 1.0}
    assert plain["server"]["api_keys"] == ["sk-1", "sk-2"]
    assert ClusterConfig.from_dict(plain) == config
    assert ClusterConfig.from_dict(yaml.safe_load(yaml.safe_dump(plain))) == config
    assert ClusterConfig().to_dict() == load_config(EXAMPLE).to_dict()


# -- helpers for the rest of the cluster ----------------------------------------


def test_serve_options_for_a_fixed_pool() -> None:
    pool = PoolSpec(min_replicas=3, max_replicas=3, num_cpus=2, max_ongoing_requests=16)
    assert pool.serve_options() == {
        "num_replicas": 3,
        "max_ongoing_requests": 16,
        "max_queued_requests": 256,
        "ray_actor_options": {"num_cpus": 2},
    }


def test_serve_options_for_an_autoscaled_pool() -> None:
    pool = ClusterConfig.from_dict(
        {
            "decode": {
                "min_replicas": 1,
                "max_replicas": 8,
                "num_gpus": 1,
                "autoscaling": {
                    "target_ongoing_requests": 4,
                    "upscale_delay_s": 5,
                    "downscale_delay_s": 120,
                    "look_back_period_s": 15,
                },
            }
        }
    ).decode
    assert pool.serve_options() == {
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": 8,
            "initial_replicas": 1,
            "target_ongoing_requests": 4.0,
            "upscale_delay_s": 5.0,
            "downscale_delay_s": 120.0,
            "look_back_period_s": 15.0,
        },
        "max_ongoing_requests": 64,
        "max_queued_requests": 256,
        "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1.0},
    }
    started_at_two = PoolSpec(min_replicas=0, max_replicas=4, initial_replicas=2)
    assert started_at_two.serve_options()["autoscaling_config"]["initial_replicas"] == 2
    assert "num_replicas" not in started_at_two.serve_options()


def test_balance_prefill_is_on_unless_turned_off_and_reaches_the_decode_replicas() -> None:
    assert ClusterConfig.from_dict({}).router.balance_prefill is True
    assert ClusterConfig.from_dict({"router": {"balance_prefill": False}}).router.balance_prefill is False
    for balance in (True, False):
        config = ClusterConfig.from_dict({"router": {"balance_prefill": balance}})
        ingress = build_app(config)._bound_deployment
        pools = {
            app._bound_deployment.name: app._bound_deployment
            for app in ingress.init_args
            if isinstance(app, Application)
        }
        assert pools["decode"].init_args[-1] is balance


def test_ray_actor_options_with_custom_resources() -> None:
    pool = ClusterConfig.from_dict({"decode": {"num_gpus": 0.5, "resources": {"rayturn-decode": 1}}}).decode
    options = pool.ray_actor_options()
    assert options == {"num_cpus": 0.5, "num_gpus": 0.5, "resources": {"rayturn-decode": 1.0}}
    assert type(options["resources"]) is dict  # Ray wants a plain dict
    assert PoolSpec(num_cpus=0).ray_actor_options() == {"num_cpus": 0.0}  # 0 CPUs must be said, Ray's default is 1


def test_ucx_config_sets_only_given_options() -> None:
    assert KVStoreSettings().ucx_config() == {}
    both = KVStoreSettings(ucx=UCXSettings(tls="rc,tcp,self", net_devices="mlx5_0:1", port=5000))
    assert both.ucx_config() == {"UCX_TLS": "rc,tcp,self", "UCX_NET_DEVICES": "mlx5_0:1"}
    assert KVStoreSettings(ucx=UCXSettings(net_devices="eth0")).ucx_config() == {"UCX_NET_DEVICES": "eth0"}


def test_kv_transports_match_the_store() -> None:
    from rayturn.kvstore.transports import TRANSPORTS

    for name in TRANSPORTS.names():
        assert load_config(**{"kvstore.transport": name}).kvstore.transport == name
    with pytest.raises(ValueError, match=r"kvstore\.transport must be one of auto, ucx, got 'rdma'"):
        load_config(**{"kvstore.transport": "rdma"})


def test_engine_kwargs_match_the_engine() -> None:
    from rayturn.engine import LLMEngine
    from rayturn.engine.speculative import SpeculativeConfig

    spec = ModelSettings(dtype="bfloat16", num_pages=128, num_window_slots=96, max_model_len=4096, backend="torch")
    kwargs = spec.engine_kwargs()
    assert kwargs == {
        "backend": "torch",
        "dtype": "bfloat16",
        "page_size": 16,
        "num_pages": 128,
        "num_window_slots": 96,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "max_prefill_tokens_while_decoding": None,
        "max_model_len": 4096,
        "speculative": SpeculativeConfig(),
        "enforce_eager": False,
    }
    assert ModelSettings(enforce_eager=True).engine_kwargs()["enforce_eager"] is True
    assert load_config(**{"model.enforce_eager": True}).model.enforce_eager is True
    inspect.signature(LLMEngine.from_pretrained).bind("tiny", **kwargs)
    assert set(kwargs) <= set(inspect.signature(LLMEngine.__init__).parameters)


@pytest.mark.parametrize(
    ("name", "served_name", "expected"),
    [
        ("tiny", None, "tiny"),
        ("small", None, "small"),
        ("/models/Qwen2.5-Coder-7B/", None, "Qwen2.5-Coder-7B"),
        ("./checkpoints/llama", None, "llama"),
        ("Qwen/Qwen2.5-Coder-7B-Instruct", None, "Qwen/Qwen2.5-Coder-7B-Instruct"),  # a Hugging Face id, as vLLM
        ("/models/Qwen2.5-Coder-7B", "qwen-coder", "qwen-coder"),
    ],
)
def test_model_name(name: str, served_name: str | None, expected: str) -> None:
    assert ModelSettings(name=name, served_name=served_name).model_name == expected


def test_pools_and_store_switches() -> None:
    config = load_config(**{"prefill.min_replicas": 0, "prefill.max_replicas": 0, "kvstore.enabled": False})
    assert config.prefill.max_replicas == 0 and not config.kvstore.enabled
    with pytest.raises(ValueError, match=r"prefill\.max_replicas.*kvstore\.enabled"):
        load_config(**{"kvstore.enabled": False})
    with pytest.raises(ValueError, match=r"decode\.max_replicas"):
        load_config(**{"decode.min_replicas": 0, "decode.max_replicas": 0})
    with pytest.raises(ValueError, match=r"kvstore\.enabled must be true or false"):
        load_config(**{"kvstore.enabled": "yes"})
    with pytest.raises(ValueError, match=r"router\.policy"):
        load_config(**{"router.policy": "random"})
    assert load_config(**{"router.policy": "round_robin"}).router.policy == "round_robin"


def test_idle_predictors_match_the_registry() -> None:
    from rayturn.decode.lifecycle.predictors import PREDICTORS

    # The config accepts every registered predictor name, and those are the ones it documents.
    accepted = [load_config(**{"lifecycle.predictor": name}).lifecycle.predictor for name in PREDICTORS.names()]
    assert set(accepted) == set(PREDICTORS.names()) == {"hazard", "session", "prior"}


def test_lifecycle_settings_reach_the_decode_planner() -> None:
    from rayturn.decode.lifecycle.settings import LifecycleSettings

    config = load_config(**{"lifecycle.time_scale": 0.01, "lifecycle.enabled": False})
    assert config.lifecycle == LifecycleSettings(enabled=False, time_scale=0.01)
    assert load_config().lifecycle == LifecycleSettings()
    with pytest.raises(ValueError, match=r"unknown key 'lifecycle\.time_scael'"):
        load_config(**{"lifecycle.time_scael": 1.0})
    with pytest.raises(ValueError, match=r"lifecycle\.time_scale must be > 0"):
        load_config(**{"lifecycle.time_scale": 0})
    with pytest.raises(ValueError, match=r"lifecycle\.tool_hold_max_s must be >= tool_hold_min_s"):
        load_config(**{"lifecycle.tool_hold_min_s": 10, "lifecycle.tool_hold_max_s": 5})
    # The choices are the predictor registry's names, in its (sorted) order.
    with pytest.raises(ValueError, match=r"lifecycle\.predictor must be one of hazard, session, prior"):
        load_config(**{"lifecycle.predictor": "oracle"})
    held = load_config(**{"lifecycle.composing_hold_s": 30}).lifecycle
    assert held.composing_hold_s == 30.0
    with pytest.raises(ValueError, match=r"lifecycle\.composing_hold_s must be > 0"):
        load_config(**{"lifecycle.composing_hold_s": 0})


def test_a_pool_may_size_its_own_kv_cache() -> None:
    from rayturn.cluster.app import pool_engine_kwargs

    config = load_config(**{"model.num_pages": 512, "decode.num_pages": 64})
    assert pool_engine_kwargs(config, config.decode)["num_pages"] == 64
    assert pool_engine_kwargs(config, config.prefill)["num_pages"] == 512
    with pytest.raises(ValueError, match=r"decode\.num_pages must be >= 1"):
        load_config(**{"decode.num_pages": 0})
