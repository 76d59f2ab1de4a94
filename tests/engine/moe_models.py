"""Random-weight mixture-of-experts models (Mixtral, Qwen3-MoE, GPT-OSS) for parity tests, built with
``transformers``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hf_models import VOCAB_SIZE

from rayturn.engine.byte_tokenizer import CHATML_TOOLS_TEMPLATE, save_byte_tokenizer

# name -> (config class name, config kwargs)
MOE_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-e4-top2": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "num_key_value_heads": 2, "sliding_window": None},
    ),
    "qwen3moe-e8-top2-norm-step2": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,  # layer 0 dense, layer 1 sparse
            "moe_intermediate_size": 48,
            "num_key_value_heads": 1,
            "head_dim": 32,
        },
    ),
    "qwen3moe-e4-top1-dense0": (
        "Qwen3MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
            "moe_intermediate_size": 32,
            "num_key_value_heads": 2,
        },
    ),
}


# GPT-OSS: name -> config kwargs. Windows shorter than most prompts (and not a multiple of the page size), YaRN,
# sinks on every layer; the small swiglu_limit makes the clamps bite on random weights.
GPT_OSS_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "gptoss-e4-top2-window20": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "sliding_window": 20,
        "swiglu_limit": 1.5,
    },
    "gptoss-e8-top3-window32-gqa4": {
        "num_local_experts": 8,
        "num_experts_per_tok": 3,
        "num_hidden_layers": 3,
        "num_key_value_heads": 1,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
}


def make_gpt_oss_model(arch: str, seed: int = 0) -> Any:
    """A random GPT-OSS with every bias and sink nonzero (transformers starts biases at zero)."""
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 64,  # a multiple of MXFP4's 32-value blocks
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
        "initializer_range": 0.2,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "tie_word_embeddings": False,
    }
    config = transformers.GptOssConfig(**{**fields, **GPT_OSS_ARCHITECTURES[arch]})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            attention, experts = layer.self_attn, layer.mlp.experts
            attention.sinks.normal_(0.0, 1.0)
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
                proj.bias.normal_(0.0, 0.2)
            experts.gate_up_proj_bias.normal_(0.0, 0.5)
            experts.down_proj_bias.normal_(0.0, 0.2)
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    return model.eval()


def make_moe_model(arch: str, seed: int = 0) -> Any:
    import transformers

    if arch in GPT_OSS_ARCHITECTURES:
        return make_gpt_oss_model(arch, seed)
    class_name, overrides = MOE_ARCHITECTURES[arch]
    config = getattr(transformers, class_name)(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if class_name == "Qwen3MoeConfig":  # norms start at one; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def make_moe_checkpoint(arch: str, directory: Path, seed: int = 0) -> tuple[Any, Path]:
    """``make_moe_model(arch, seed)`` saved with ``save_pretrained``, plus a byte tokenizer: (the model, the
    directory)."""
    model = make_moe_model(arch, seed)
    model.save_pretrained(directory)
    save_byte_tokenizer(directory, CHATML_TOOLS_TEMPLATE)
    return model, directory
