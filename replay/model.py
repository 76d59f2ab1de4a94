"""The model a replay serves, as the replayer needs it: its plain token ids and context, or a longer-context copy."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The token ids a synthetic prompt may hold (no special or added tokens) and the model's context."""

    token_ids: tuple[int, ...]
    context_tokens: int


def model_vocabulary(model: str, max_model_len: int | None = None) -> Vocabulary:
    """A preset's or model directory's plain token ids and context (capped at ``max_model_len``)."""
    from rayturn.engine.config import ModelConfig
    from rayturn.engine.presets import resolve_model_dir
    from rayturn.engine.tokenizer import Tokenizer

    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_file(model_dir / "config.json")
    backend = Tokenizer.from_dir(model_dir).backend
    special = set(backend.get_added_tokens_decoder())
    vocab_size = min(config.vocab_size, backend.get_vocab_size(with_added_tokens=True))
    context = config.max_model_len if max_model_len is None else min(config.max_model_len, max_model_len)
    return Vocabulary(tuple(i for i in range(vocab_size) if i not in special), context)


def with_context(model: str, context_tokens: int, root: Path) -> str:
    """A copy of a preset with a longer context (RoPE has no learned positions), under ``root``; its path.

    Long agent conversations outgrow the presets' contexts even at small token
    scales; a random-weight model's costs and KV shapes are what a replay
    measures, so stretching its context changes nothing else.
    """
    from rayturn.engine.presets import PRESETS, preset_dir

    if model not in PRESETS:
        raise ValueError(f"--context stretches a preset's context ({', '.join(PRESETS)}), not {model!r}")
    source = preset_dir(model)
    target = root / f"{source.name}-context{context_tokens}"
    config = json.loads((source / "config.json").read_text())
    if config["max_position_embeddings"] >= context_tokens:
        return model
    if not (target / "config.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            if item.name != "config.json":
                shutil.copy2(item, target / item.name)
        config["max_position_embeddings"] = context_tokens
        (target / "config.json").write_text(json.dumps(config, indent=2))
    return str(target)
