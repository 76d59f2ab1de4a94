"""Built-in random-weight models, made on first use and saved in Hugging Face layout.

``tiny`` (a few MB) serves tests and ``make serve``; ``small`` (~40M
parameters: 8 layers, hidden 512, GQA) serves benchmarks. Both use the byte
tokenizer (``byte_tokenizer.py``). ``tiny-bpe`` is ``tiny``'s shape with a
128k context and a BPE tokenizer trained on the standard library
(``bpe_tokenizer.py``), so an agent's long prompts fit in a realistic number
of tokens. Weights come from a fixed seed, so every machine builds
byte-identical checkpoints (``tiny-bpe`` wherever the standard library is the
same; its config names its tokenizer, so a different library gives a different
model identity); the same loader that reads real checkpoints reads these.
The cache directory is ``$RAYTURN_CACHE_DIR/models`` (default
``~/.cache/rayturn/models``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from . import bpe_tokenizer
from .byte_tokenizer import BOS_TOKEN, CHATML_TOOLS_TEMPLATE, EOS_TOKEN, build_byte_tokenizer, save_byte_tokenizer
from .model_source import hub_cache_dir, is_hub_id, local_model_dir

PRESET_VERSION = 2  # bump when a preset's recipe changes, so caches rebuild
TOKENIZER_DIGEST_KEY = "rayturn_tokenizer_sha256"  # config.json entry naming a trained tokenizer


@dataclass(frozen=True, slots=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    seed: int
    tokenizer: str = "byte"  # a key of TOKENIZER_WRITERS


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 128, 2, 4, 2, 4096, 10000.0, False, seed=1234),
    "small": Preset(512, 2816, 8, 8, 2, 8192, 500000.0, False, seed=4321),
    "tiny-bpe": Preset(64, 128, 2, 4, 2, 131072, 1000000.0, False, seed=1234, tokenizer="bpe"),
}


@dataclass(frozen=True, slots=True)
class SavedTokenizer:
    """What the model files need to know of the tokenizer a preset saved."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int | None = None
    # Extra config.json entries: a tokenizer that differs between machines is
    # named there, so that the model identity (a config digest) differs too.
    config_extras: tuple[tuple[str, str], ...] = ()


def cache_root() -> Path:
    base = os.environ.get("RAYTURN_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "rayturn"
    return root / "models"


def preset_dir(name: str, root: Path | None = None) -> Path:
    """The directory of preset ``name``, building it first if needed (safe across processes)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    root = root or cache_root()
    target = root / f"{name}-v{PRESET_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        write_preset(PRESETS[name], staging)
        try:
            staging.rename(target)  # atomic; loses the race harmlessly if another process won
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(model: str | Path) -> str:
    """The model as every process can load it: a preset's name, or the absolute directory of a model
    directory or of a Hugging Face id in the local cache (``model_source``); ValueError for none of them."""
    if isinstance(model, str) and model in PRESETS:
        return model
    directory = local_model_dir(str(model))
    if directory is None:
        hint = f"; download it first, e.g. `huggingface-cli download {model}`" if is_hub_id(str(model)) else ""
        raise ValueError(
            f"model {str(model)!r} is neither a preset ({', '.join(PRESETS)}), a directory, "
            f"nor in the Hugging Face cache at {hub_cache_dir()}{hint}"
        )
    return str(directory)


def resolve_model_dir(model: str | Path) -> Path:
    """The directory of ``resolve_model(model)``, a preset's built on first use."""
    resolved = resolve_model(model)
    return preset_dir(resolved) if resolved in PRESETS else Path(resolved)


def preset_config(preset: Preset, vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.hidden_size // preset.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": preset.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def random_weights(preset: Preset, vocab_size: int) -> dict[str, torch.Tensor]:
    """Weights scaled so activations stay O(1) and logits are peaked enough to be worth sampling."""
    generator = torch.Generator().manual_seed(preset.seed)

    def normal(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) / cols**0.5

    head_dim = preset.hidden_size // preset.num_heads
    hidden, inter = preset.hidden_size, preset.intermediate_size
    weights = {"model.embed_tokens.weight": torch.randn(vocab_size, hidden, generator=generator)}
    for i in range(preset.num_layers):
        prefix = f"model.layers.{i}."
        weights[prefix + "self_attn.q_proj.weight"] = normal(preset.num_heads * head_dim, hidden)
        weights[prefix + "self_attn.k_proj.weight"] = normal(preset.num_kv_heads * head_dim, hidden)
        weights[prefix + "self_attn.v_proj.weight"] = normal(preset.num_kv_heads * head_dim, hidden)
        weights[prefix + "self_attn.o_proj.weight"] = normal(hidden, preset.num_heads * head_dim)
        weights[prefix + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[prefix + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[prefix + "mlp.down_proj.weight"] = normal(hidden, inter)
        weights[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        weights[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    if not preset.tie_word_embeddings:
        weights["lm_head.weight"] = normal(vocab_size, hidden) * 3.0
    return weights


def write_preset(preset: Preset, directory: Path) -> None:
    saved = TOKENIZER_WRITERS[preset.tokenizer](preset, directory)
    config = preset_config(preset, saved.vocab_size, saved.bos_id, saved.eos_id) | dict(saved.config_extras)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": saved.bos_id, "eos_token_id": saved.eos_id}
    if saved.pad_id is not None:
        generation["pad_token_id"] = saved.pad_id
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = random_weights(preset, saved.vocab_size)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_byte_tokenizer(preset: Preset, directory: Path) -> SavedTokenizer:
    save_byte_tokenizer(directory, CHATML_TOOLS_TEMPLATE, model_max_length=preset.max_position_embeddings)
    tokenizer = build_byte_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    return SavedTokenizer(vocab_size, _required_id(tokenizer, BOS_TOKEN), _required_id(tokenizer, EOS_TOKEN))


def write_bpe_tokenizer(preset: Preset, directory: Path) -> SavedTokenizer:
    """Train on this interpreter's standard library; as in Qwen2.5, ``<|endoftext|>`` is BOS and padding."""
    tokenizer = bpe_tokenizer.train_bpe_tokenizer(bpe_tokenizer.stdlib_corpus())
    bpe_tokenizer.save_bpe_tokenizer(directory, tokenizer, preset.max_position_embeddings)
    end_of_text_id = _required_id(tokenizer, bpe_tokenizer.END_OF_TEXT_TOKEN)
    digest = hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()
    return SavedTokenizer(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_id=end_of_text_id,
        eos_id=_required_id(tokenizer, bpe_tokenizer.EOS_TOKEN),
        pad_id=end_of_text_id,
        config_extras=((TOKENIZER_DIGEST_KEY, digest),),
    )


TOKENIZER_WRITERS: dict[str, Callable[[Preset, Path], SavedTokenizer]] = {
    "byte": write_byte_tokenizer,
    "bpe": write_bpe_tokenizer,
}


def _required_id(tokenizer: HFTokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"preset tokenizer lacks {token!r}")
    return int(token_id)
