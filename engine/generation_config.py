"""The end-of-turn tokens a checkpoint's ``generation_config.json`` names beside ``config.json``'s.

A model's ``config.json`` names one ``eos_token_id``, but chat models often
end a turn with more than one token, and list them all in
``generation_config.json`` (GPT-OSS ends a turn with ``<|return|>`` after its
answer and with ``<|call|>`` after a tool call, and names only the first in
``config.json``). Generation stops at any of them, as ``transformers``'
``generate`` and vLLM stop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

GENERATION_CONFIG_FILE = "generation_config.json"


def generation_eos_token_ids(model_dir: Path) -> frozenset[int]:
    """The ``eos_token_id`` (one id or a list) of ``model_dir/generation_config.json``; none when the file is
    missing or names none. A file that is not a JSON object raises ``ValueError`` naming it."""
    path = model_dir / GENERATION_CONFIG_FILE
    if not path.is_file():
        return frozenset()
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0 for token_id in ids):
        raise ValueError(f"{path}: field 'eos_token_id' must be a token id or a list of token ids, got {eos!r}")
    return frozenset(ids)


def end_of_turn_ids(config_ids: Iterable[int], tokenizer_eos_id: int | None, model_dir: Path) -> frozenset[int]:
    """Every token a turn may end with: ``config.json``'s, the tokenizer's end token and
    ``generation_config.json``'s (GPT-OSS: ``<|return|>``, and ``<|call|>`` after a tool call)."""
    tokenizer_ids = {tokenizer_eos_id} if tokenizer_eos_id is not None else set()
    return frozenset(config_ids) | tokenizer_ids | generation_eos_token_ids(model_dir)
