"""Random-weight Hugging Face checkpoints for parity tests, built with ``transformers`` itself."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.byte_tokenizer import CHATML_TOOLS_TEMPLATE, save_byte_tokenizer

VOCAB_SIZE = 300

# name -> (config class name, config kwargs); together they vary GQA ratio,
# tied embeddings, rope_theta, rope scaling, qkv bias and q/k norm.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    "qwen2": (
        "Qwen2Config",
        {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True, "rope_theta": 1000000.0},
    ),
    "qwen3": (
        "Qwen3Config",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
        },
    ),
    "mistral": (
        "MistralConfig",
        {"num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": False, "sliding_window": None},
    ),
}


def make_hf_checkpoint(arch: str, directory: Path, seed: int = 0) -> Path:
    import transformers

    class_name, overrides = ARCHITECTURES[arch]
    config_cls = getattr(transformers, class_name)
    config = config_cls(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if arch == "qwen2":  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.2)
    if arch == "qwen3":  # norms start at one; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    save_byte_tokenizer(directory, CHATML_TOOLS_TEMPLATE)
    return directory


def check_greedy_parity(
    path: Path,
    prompts: list[list[int]],
    expected: list[list[int]],
    backend: str,
    prefix_caching: bool,
    max_batched: int,
    max_new_tokens: int,
) -> None:
    """The engine on ``path`` generates ``expected`` (transformers' greedy tokens) for ``prompts``, and again
    with the prompts' full pages served from its prefix cache when that is on."""
    engine = LLMEngine.from_pretrained(
        str(path),
        backend=backend,
        dtype="float32",
        page_size=16,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=max_batched,
    )
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    assert [list(o.token_ids) for o in engine.generate(prompts, params)] == expected
    # Same prompts again: now the prefix cache serves all but the last page, outputs unchanged.
    again = engine.generate(prompts, params)
    assert [list(o.token_ids) for o in again] == expected
    cached = [o.num_cached_prompt_tokens for o in again]
    assert cached == ([(len(p) - 1) // 16 * 16 for p in prompts] if prefix_caching else [0] * len(prompts))


def parity_prompts(seed: int = 0) -> list[list[int]]:
    """11 prompts of 1-300 tokens; two share long prefixes with others (250 tokens, and 3 full pages)."""
    rng = random.Random(seed)
    lengths = [1, 7, 16, 33, 64, 100, 150, 213, 300]
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for n in lengths]
    prompts.append(prompts[-1][:250] + [rng.randrange(VOCAB_SIZE) for _ in range(20)])
    prompts.append(prompts[4][:48] + [5, 6, 7])
    return prompts


def transformers_reference(
    model: Any, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``model``'s (a transformers model's) greedy continuations and last-position prompt logits, one prompt at
    a time (no padding)."""
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logits.append(model(ids).logits[0, -1])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens, logits
