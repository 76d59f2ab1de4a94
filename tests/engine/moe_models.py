"""Random-weight mixture-of-experts models (Mixtral, Qwen3-MoE) for parity tests, built with ``transformers``."""

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


def make_moe_model(arch: str, seed: int = 0) -> Any:
    import transformers

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


def make_moe_checkpoint(arch: str, directory: Path, seed: int = 0) -> Path:
    """``make_moe_model(arch, seed)`` saved with ``save_pretrained``, plus a byte tokenizer."""
    make_moe_model(arch, seed).save_pretrained(directory)
    save_byte_tokenizer(directory, CHATML_TOOLS_TEMPLATE)
    return directory
