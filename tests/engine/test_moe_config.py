"""Mixture-of-experts configs and checkpoints: which layers are sparse, and the errors a bad one gets."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from moe_models import make_moe_checkpoint
from safetensors.torch import load_file, save_file

from rayturn.engine import LLMEngine
from rayturn.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from rayturn.engine.moe import SparseMoeBlock

pytest.importorskip("transformers")

MIXTRAL: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02,
}
QWEN3_MOE: dict[str, Any] = {
    **MIXTRAL,
    "architectures": ["Qwen3MoeForCausalLM"],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}


def test_mixtral_routes_every_layer_and_renormalizes() -> None:
    config = ModelConfig.from_dict(MIXTRAL)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("mixtral", 8, 2)
    assert config.moe_intermediate_size == 96 and config.norm_topk_prob
    assert config.moe_layers == (True,) * 4
    assert not config.qk_norm


@pytest.mark.parametrize(
    "fields,moe_layers",
    [
        ({}, (True, True, True, True)),
        ({"decoder_sparse_step": 2}, (False, True, False, True)),
        ({"mlp_only_layers": [0, 3]}, (False, True, True, False)),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, (False, False, False, True)),
    ],
)
def test_qwen3_moe_dense_layers_follow_sparse_step_and_mlp_only_layers(
    fields: dict[str, Any], moe_layers: tuple[bool, ...]
) -> None:
    config = ModelConfig.from_dict({**QWEN3_MOE, **fields})
    assert config.moe_layers == moe_layers
    assert config.qk_norm and config.norm_topk_prob and config.moe_intermediate_size == 32


def test_qwen3_moe_reads_num_experts_under_either_name() -> None:
    raw = {key: value for key, value in QWEN3_MOE.items() if key != "num_local_experts"}
    assert ModelConfig.from_dict({**raw, "num_experts": 16}).num_experts == 16
    assert not ModelConfig.from_dict({**raw, "num_experts": 16, "norm_topk_prob": False}).norm_topk_prob


def test_dense_models_have_no_experts() -> None:
    config = ModelConfig.from_dict({**MIXTRAL, "architectures": ["LlamaForCausalLM"]})
    assert config.num_experts == 0 and not any(config.is_moe_layer(i) for i in range(config.num_layers))


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"num_experts_per_tok": 9}, "'num_experts_per_tok' (9) is more than 'num_local_experts' (8)"),
        ({"num_experts_per_tok": 0}, "field 'num_experts_per_tok' must be a positive integer, got 0"),
        ({"num_local_experts": None}, "field 'num_local_experts' must be a positive integer, got None"),
        ({"decoder_sparse_step": 0}, "field 'decoder_sparse_step' must be a positive integer, got 0"),
        ({"mlp_only_layers": "0"}, "field 'mlp_only_layers' must be a list of layer indices, got '0'"),
        ({"moe_intermediate_size": -1}, "field 'moe_intermediate_size' must be a positive integer, got -1"),
    ],
)
def test_bad_moe_fields_are_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"test.json: {message}")):
        ModelConfig.from_dict({**QWEN3_MOE, **fields}, source="test.json")


def test_unknown_architecture_names_it_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'architectures' is \['DbrxForCausalLM'\]; supported: .*") as err:
        ModelConfig.from_dict({**MIXTRAL, "architectures": ["DbrxForCausalLM"]})
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    assert "MixtralForCausalLM" in str(err.value) and "Qwen3MoeForCausalLM" in str(err.value)
    assert "GptOssForCausalLM" in str(err.value)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, path = make_moe_checkpoint("qwen3moe-e4-top1-dense0", tmp_path_factory.mktemp("qwen3moe"))
    return path


def test_loaded_model_has_a_sparse_block_only_where_the_config_says(qwen3_moe_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(str(qwen3_moe_dir), backend="torch", dtype="float32")
    layers = engine.runner.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [False, True]


def rewrite_weights(model_dir: Path, tmp_path: Path, edit: Any) -> Path:
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_missing_expert_tensor_is_named(qwen3_moe_dir: Path, tmp_path: Path) -> None:
    model_dir = rewrite_weights(
        qwen3_moe_dir, tmp_path, lambda tensors: tensors.pop("model.layers.1.mlp.experts.2.up_proj.weight")
    )
    with pytest.raises(ValueError, match=r"missing tensors for: model\.layers\.1\.mlp\.experts\.gate_up_proj$"):
        LLMEngine.from_pretrained(str(model_dir), backend="torch")


def test_an_expert_beyond_num_experts_is_unexpected(qwen3_moe_dir: Path, tmp_path: Path) -> None:
    def add_expert(tensors: dict[str, Any]) -> None:
        layer = "model.layers.1.mlp.experts"
        tensors[f"{layer}.4.down_proj.weight"] = tensors[f"{layer}.0.down_proj.weight"].clone()

    model_dir = rewrite_weights(qwen3_moe_dir, tmp_path, add_expert)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.1\.mlp\.experts\.4\.down_proj\.weight'"):
        LLMEngine.from_pretrained(str(model_dir), backend="torch")


def test_a_misshapen_expert_tensor_is_named(qwen3_moe_dir: Path, tmp_path: Path) -> None:
    def shrink(tensors: dict[str, Any]) -> None:
        name = "model.layers.1.mlp.experts.1.gate_proj.weight"
        tensors[name] = tensors[name][:-1].contiguous()

    model_dir = rewrite_weights(qwen3_moe_dir, tmp_path, shrink)
    shape = r"'model\.layers\.1\.mlp\.experts\.1\.gate_proj\.weight' has shape \(31, 64\), expected \(32, 64\)"
    with pytest.raises(ValueError, match=shape):
        LLMEngine.from_pretrained(str(model_dir), backend="torch")
