"""Loading Hugging Face checkpoints: sharded weights, config parsing, dtypes, and errors that name the file."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import VOCAB_SIZE, make_hf_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.byte_tokenizer import CHATML_TOOLS_TEMPLATE, save_byte_tokenizer
from rayturn.engine.config import ModelConfig, RopeConfig
from rayturn.engine.loader import INDEX_FILE, SINGLE_FILE

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [(31 * i + 7) % VOCAB_SIZE for i in range(37)]]  # the second spans 3 pages


def load(model_dir: Path, **kwargs: Any) -> LLMEngine:
    return LLMEngine.from_pretrained(str(model_dir), backend="torch", page_size=16, num_pages=32, **kwargs)


def greedy_tokens(engine: LLMEngine) -> list[list[int]]:
    return [list(out.token_ids) for out in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama checkpoint with one ``model.safetensors`` (never modified; tests copy it)."""
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def sharded_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights re-saved by transformers as several shards plus an index."""
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    target = tmp_path_factory.mktemp("llama-sharded")
    model.save_pretrained(target, max_shard_size="100KB")
    save_byte_tokenizer(target, CHATML_TOOLS_TEMPLATE)
    return target


@pytest.fixture
def checkpoint(llama_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the Llama checkpoint that a test may break."""
    return Path(shutil.copytree(llama_dir, tmp_path / "ckpt"))


_DELETE = object()  # edit_config value that removes the field


def edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del raw[key]
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def names(path: Path) -> str:
    """A regex matching the file name in an error message."""
    return re.escape(str(path))


# -- sharded checkpoints ------------------------------------------------------


def test_sharded_checkpoint_matches_single_file(llama_dir: Path, sharded_dir: Path) -> None:
    index = json.loads((sharded_dir / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert all((sharded_dir / shard).is_file() for shard in shards)
    assert not (sharded_dir / SINGLE_FILE).exists()
    assert set(index["weight_map"]) == set(load_file(str(llama_dir / SINGLE_FILE)))

    single = greedy_tokens(load(llama_dir))
    assert [len(tokens) for tokens in single] == [8, 8]
    assert greedy_tokens(load(sharded_dir)) == single


# -- errors name the offending file --------------------------------------------


def test_missing_directory() -> None:
    with pytest.raises(ValueError, match="'/does/not/exist' is neither a preset"):
        LLMEngine.from_pretrained("/does/not/exist")


def test_missing_config(checkpoint: Path) -> None:
    (checkpoint / "config.json").unlink()
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + ": missing"):
        load(checkpoint)


def test_config_not_json(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + ": not valid JSON"):
        load(checkpoint)


def test_config_not_an_object(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + ": expected a JSON object"):
        load(checkpoint)


def test_unsupported_architecture(checkpoint: Path) -> None:
    edit_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + r": field 'architectures'.*GPT2"):
        load(checkpoint)


def test_missing_required_field(checkpoint: Path) -> None:
    edit_config(checkpoint, hidden_size=_DELETE)
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + ": missing required field 'hidden_size'"):
        load(checkpoint)


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type(checkpoint: Path, field: str) -> None:
    longrope = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 256}
    if field == "rope_parameters":
        edit_config(checkpoint, rope_parameters={**longrope, "rope_theta": 10000.0})
    else:
        edit_config(checkpoint, rope_parameters=_DELETE, rope_theta=10000.0, rope_scaling=longrope)
    with pytest.raises(ValueError, match=names(checkpoint / "config.json") + r": .*'longrope' is not supported"):
        load(checkpoint)


def test_no_weights(checkpoint: Path) -> None:
    (checkpoint / SINGLE_FILE).unlink()
    with pytest.raises(ValueError, match=names(checkpoint) + ": no weights"):
        load(checkpoint)


@pytest.mark.parametrize(
    "text",
    ['{"weight_map": ', "[]", '{"metadata": {}}', '{"weight_map": ["model.norm.weight"]}', '{"weight_map": {"a": 1}}'],
    ids=["truncated", "list", "no-weight-map", "weight-map-list", "shard-not-a-string"],
)
def test_malformed_index(checkpoint: Path, text: str) -> None:
    (checkpoint / INDEX_FILE).write_text(text)  # an index wins over model.safetensors
    with pytest.raises(ValueError, match=names(checkpoint / INDEX_FILE) + ": malformed"):
        load(checkpoint)


def test_index_lists_missing_shard(sharded_dir: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(sharded_dir, tmp_path / "sharded"))
    shards = sorted(set(json.loads((broken / INDEX_FILE).read_text())["weight_map"].values()))
    (broken / shards[1]).unlink()
    with pytest.raises(ValueError, match=names(broken / INDEX_FILE) + ": lists shard.*" + re.escape(shards[1])):
        load(broken)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00" * 4, b"this is not a safetensors file, just bytes" * 8],
    ids=["empty", "too-short", "garbage"],
)
def test_corrupt_safetensors(checkpoint: Path, data: bytes) -> None:
    (checkpoint / SINGLE_FILE).write_bytes(data)
    with pytest.raises(ValueError, match=names(checkpoint / SINGLE_FILE) + ": not a readable safetensors file"):
        load(checkpoint)


def test_truncated_shard(sharded_dir: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(sharded_dir, tmp_path / "sharded"))
    shard = broken / sorted(set(json.loads((broken / INDEX_FILE).read_text())["weight_map"].values()))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=names(shard) + ": not a readable safetensors file"):
        load(broken)


def test_missing_tensor(checkpoint: Path) -> None:
    weights = load_file(str(checkpoint / SINGLE_FILE))
    del weights["model.norm.weight"]
    save_file(weights, str(checkpoint / SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=names(checkpoint) + ": checkpoint is missing tensors for: model.norm.weight$"):
        load(checkpoint)


def test_tensor_with_wrong_shape(checkpoint: Path) -> None:
    weights = load_file(str(checkpoint / SINGLE_FILE))
    name = "model.layers.1.self_attn.k_proj.weight"
    assert weights[name].shape == (32, 64)
    weights[name] = torch.zeros(16, 64)
    save_file(weights, str(checkpoint / SINGLE_FILE), metadata={"format": "pt"})
    expected = names(checkpoint / SINGLE_FILE) + re.escape(f": tensor {name!r} has shape (16, 64), expected (32, 64)")
    with pytest.raises(ValueError, match=expected):
        load(checkpoint)


def test_unexpected_tensor(checkpoint: Path) -> None:
    weights = load_file(str(checkpoint / SINGLE_FILE))
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.ones(8, 64)
    save_file(weights, str(checkpoint / SINGLE_FILE), metadata={"format": "pt"})
    expected = names(checkpoint / SINGLE_FILE) + ": unexpected tensor 'model.layers.0.mlp.extra_proj.weight'"
    with pytest.raises(ValueError, match=expected):
        load(checkpoint)


def test_missing_tokenizer(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=names(checkpoint / "tokenizer.json") + ": missing"):
        load(checkpoint)


# -- config parsing -----------------------------------------------------------

BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}

LLAMA3_SCALING: dict[str, Any] = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
LLAMA3_ROPE = RopeConfig(
    theta=500000.0,
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=128,
)


@pytest.mark.parametrize(
    "new_style,legacy,expected",
    [
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
            {"rope_theta": 1000000.0, "rope_scaling": None},
            RopeConfig(theta=1000000.0, original_max_position_embeddings=1024),
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
            {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
            RopeConfig(theta=10000.0, rope_type="linear", factor=2.0, original_max_position_embeddings=1024),
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}},
            {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}},
            LLAMA3_ROPE,
        ),
    ],
    ids=["default", "linear", "llama3"],
)
def test_rope_parameters_and_legacy_rope_scaling_agree(
    new_style: dict[str, Any], legacy: dict[str, Any], expected: RopeConfig
) -> None:
    assert ModelConfig.from_dict({**BASE_CONFIG, **new_style}).rope == expected
    assert ModelConfig.from_dict({**BASE_CONFIG, **legacy}).rope == expected


def test_transformers_written_config_matches_legacy_form(llama_dir: Path) -> None:
    raw = json.loads((llama_dir / "config.json").read_text())
    assert "rope_parameters" in raw  # transformers 5 layout
    legacy = {key: value for key, value in raw.items() if key != "rope_parameters"}
    params = dict(raw["rope_parameters"])
    legacy["rope_theta"] = params.pop("rope_theta")
    legacy["rope_scaling"] = params
    parsed = ModelConfig.from_file(llama_dir / "config.json")
    assert parsed.rope == ModelConfig.from_dict(legacy).rope
    assert parsed.rope == dataclasses.replace(LLAMA3_ROPE, theta=50000.0)  # hf_models' llama recipe


def test_qwen2_has_qkv_bias_but_no_output_bias() -> None:
    config = ModelConfig.from_dict(
        {**BASE_CONFIG, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 4096}
    )
    assert (config.model_type, config.qkv_bias, config.o_bias, config.qk_norm) == ("qwen2", True, False, False)
    assert config.sliding_window is None and config.max_model_len == 1024


def test_llama_attention_bias_covers_all_projections() -> None:
    plain = ModelConfig.from_dict(BASE_CONFIG)
    assert (plain.qkv_bias, plain.o_bias, plain.qk_norm) == (False, False, False)
    biased = ModelConfig.from_dict({**BASE_CONFIG, "attention_bias": True})
    assert (biased.qkv_bias, biased.o_bias) == (True, True)


def test_qwen3_has_qk_norm() -> None:
    config = ModelConfig.from_dict({**BASE_CONFIG, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert (config.model_type, config.qk_norm, config.qkv_bias, config.o_bias) == ("qwen3", True, False, False)
    assert (config.head_dim, config.q_size, config.kv_size) == (32, 128, 64)


def test_mistral_sliding_window_caps_max_model_len() -> None:
    mistral = {**BASE_CONFIG, "architectures": ["MistralForCausalLM"]}
    windowed = ModelConfig.from_dict({**mistral, "sliding_window": 64})
    assert (windowed.sliding_window, windowed.max_model_len) == (64, 64)
    unwindowed = ModelConfig.from_dict({**mistral, "sliding_window": None})
    assert (unwindowed.sliding_window, unwindowed.max_model_len) == (None, 1024)
    with pytest.raises(
        ValueError, match=r"max_model_len 65 is more than the model's context length 64 \(sliding_window"
    ):
        windowed.check_max_model_len(65)
    assert (windowed.check_max_model_len(None), windowed.check_max_model_len(32)) == (64, 32)
    assert unwindowed.check_max_model_len(1024) == 1024


def test_heads_must_be_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match=r"my/config.json: 'num_attention_heads' \(6\) .* 'num_key_value_heads' \(4\)"):
        ModelConfig.from_dict({**BASE_CONFIG, "num_attention_heads": 6, "num_key_value_heads": 4}, "my/config.json")


# -- dtypes -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_casts_weights_but_not_rope_cache(llama_dir: Path, dtype: str) -> None:
    engine = load(llama_dir, dtype=dtype)
    expected = getattr(torch, dtype)
    assert engine.dtype == expected
    assert {param.dtype for param in engine.model.parameters()} == {expected}
    assert engine.model.rope_cache.dtype == torch.float32
    with safe_open(str(llama_dir / SINGLE_FILE), framework="pt") as handle:
        embed = handle.get_tensor("model.embed_tokens.weight")
    assert torch.equal(engine.model.embed_tokens.weight, embed.to(expected))
