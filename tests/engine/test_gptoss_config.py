"""GPT-OSS configs: per-layer windows, sinks and experts read from config.json, YaRN tables equal transformers',
and the errors a bad config gets."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from rayturn.engine.config import ModelConfig
from rayturn.engine.rope import attention_factor, cos_sin_cache, inverse_frequencies
from rayturn.kernels.moe import ClampedSwiGLU

transformers = pytest.importorskip("transformers")

GPT_OSS: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


def test_gpt_oss_alternates_windows_and_has_sinks_and_biased_experts() -> None:
    config = ModelConfig.from_dict(GPT_OSS)
    assert config.model_type == "gpt_oss"
    assert config.attention_windows == (128, None, 128, None)  # transformers' default: sliding on even layers
    assert config.attention_sinks and config.moe_bias and config.qkv_bias and config.o_bias
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 64)
    assert config.norm_topk_prob and config.moe_layers == (True,) * 4
    assert config.expert_activation == ClampedSwiGLU(alpha=1.702, limit=7.0)
    # The windows are applied, so they do not cap the context.
    assert config.sliding_window is None and config.max_model_len == 131072
    assert config.rope.rope_type == "yarn" and not config.rope.truncate


def test_layer_types_and_swiglu_fields_are_read() -> None:
    config = ModelConfig.from_dict(
        {
            **GPT_OSS,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            "swiglu_alpha": 2.0,
            "swiglu_limit": 3.5,
            "attention_bias": False,
        }
    )
    assert config.attention_windows == (None, 128, 128, None)
    assert config.attention_window(1) == 128 and config.attention_window(3) is None
    assert config.expert_activation == ClampedSwiGLU(alpha=2.0, limit=3.5)
    assert not config.qkv_bias and not config.o_bias


def test_other_models_have_no_windows_or_sinks() -> None:
    config = ModelConfig.from_dict({**GPT_OSS, "architectures": ["MixtralForCausalLM"], "sliding_window": None})
    assert config.attention_windows == () and config.attention_window(0) is None
    assert not config.attention_sinks and not config.moe_bias and config.expert_activation is None


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"layer_types": ["sliding_attention"]}, "field 'layer_types' must list one of full_attention, sliding"),
        ({"layer_types": ["local"] * 4}, "field 'layer_types' must list one of full_attention, sliding"),
        ({"sliding_window": 0}, "field 'sliding_window' must be a positive integer, got 0"),
        ({"sliding_window": None}, "field 'sliding_window' must be a positive integer, got None"),
        ({"swiglu_limit": -1}, "field 'swiglu_limit' must be a positive number, got -1"),
        ({"num_experts_per_tok": 9}, "'num_experts_per_tok' (9) is more than 'num_local_experts' (8)"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            "quantization_config.quant_method 'fp8' is not supported; supported: mxfp4",
        ),
    ],
)
def test_bad_gpt_oss_fields_are_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"test.json: {message}")):
        ModelConfig.from_dict({**GPT_OSS, **fields}, source="test.json")


def test_mxfp4_quantization_is_accepted() -> None:
    config = ModelConfig.from_dict({**GPT_OSS, "quantization_config": {"quant_method": "mxfp4"}})
    assert config.quantization == "mxfp4"
    assert ModelConfig.from_dict(GPT_OSS).quantization is None


@pytest.mark.parametrize(
    "rope_parameters",
    [
        GPT_OSS["rope_parameters"],
        {**GPT_OSS["rope_parameters"], "truncate": True},
        {**GPT_OSS["rope_parameters"], "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0},
        {**GPT_OSS["rope_parameters"], "attention_factor": 1.3},
        {**GPT_OSS["rope_parameters"], "mscale": 1.0, "mscale_all_dim": 0.5},
    ],
    ids=["gpt-oss", "truncate", "betas", "attention-factor", "mscale"],
)
def test_yarn_matches_transformers(rope_parameters: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**GPT_OSS, "rope_parameters": rope_parameters}
    hf_config = transformers.GptOssConfig(**{key: value for key, value in raw.items() if key != "architectures"})
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    rope = ModelConfig.from_dict(raw).rope
    torch.testing.assert_close(inverse_frequencies(rope, 16), expected_inv_freq, rtol=0, atol=0)
    assert attention_factor(rope) == pytest.approx(expected_factor, rel=1e-12)
    table = cos_sin_cache(rope, 16, 8, torch.device("cpu"))
    angles = torch.arange(8, dtype=torch.float32)[:, None] * expected_inv_freq[None, :]
    torch.testing.assert_close(table[:, :8], angles.cos() * expected_factor)
