"""The model's vocabulary as llguidance sees it: each token's bytes, and how text tokenizes.

llguidance matches a grammar against token bytes. Read straight from a
``tokenizer.json`` it marks every added token special (a 0xFF byte before its
text), also those the tokenizer treats as text (``"special": false``, such as
a ``<tool_call>`` tag). A grammar literal ``"<tool_call>"`` is then forced as
that token, and consuming the token fails. So the vocabulary is rebuilt here:
every token's bytes as llguidance reads them, the marker only on tokens that
are special, and text tokenized by a copy of the tokenizer that spells special
tokens out as text, as their marked bytes expect.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from typing import Any

import tokenizers
from llguidance import LLTokenizer, TokenizerWrapper

from .tokenizer import Tokenizer

SPECIAL_TOKEN_MARKER = b"\xff"


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, special ids, EOS/BOS, and a text encoder."""

    def __init__(
        self,
        tokens: list[bytes],
        special_token_ids: list[int],
        eos_token_id: int,
        bos_token_id: int | None,
        encoder: tokenizers.Tokenizer,
    ) -> None:
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self._encoder = encoder

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # the wrapper probes with bytes; refusing makes it pass text
            raise TypeError("the vocabulary encodes text, not bytes")
        ids: list[int] = self._encoder.encode(text, add_special_tokens=False).ids
        return ids


def build_guide_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Seq[int]) -> LLTokenizer:
    """An llguidance tokenizer for ``tokenizer``'s vocabulary, ``vocab_size`` ids wide (the model's logits).

    Raises ``ValueError`` when the vocabulary does not fit ``vocab_size`` or
    llguidance cannot read it.
    """
    num_tokens = tokenizer.vocab_size
    if num_tokens > vocab_size:
        raise ValueError(
            f"guided decoding is unavailable: the tokenizer has {num_tokens} tokens, "
            f"more than the model's vocab_size of {vocab_size}"
        )
    description = json.loads(tokenizer.backend.to_str())
    description["padding"] = description["truncation"] = None  # llguidance reads the vocabulary only
    as_text = json.dumps(description)
    eos = list(eos_token_ids) or None
    try:
        return _rebuild(description, as_text, vocab_size, eos, tokenizer.bos_token_id)
    except Exception as error:  # an unusual tokenizer: refuse guides, not the engine
        raise ValueError(f"guided decoding is unavailable for this tokenizer: {error}") from error


def _rebuild(
    description: dict[str, Any], as_text: str, vocab_size: int, eos: list[int] | None, bos_token_id: int | None
) -> LLTokenizer:
    """The vocabulary as llguidance reads it, the special marker kept only on special tokens."""
    as_read = LLTokenizer(as_text, n_vocab=vocab_size, eos_token=eos, slices=[])  # read, never masks
    plain_added = {int(added["id"]) for added in description.get("added_tokens", []) if not added.get("special")}
    token_bytes: list[bytes] = []
    special_ids: list[int] = []
    for token_id in range(vocab_size):
        raw = as_read.decode_bytes([token_id])  # without the marker
        if as_read.is_special_token(token_id) and token_id not in plain_added:
            special_ids.append(token_id)
            raw = SPECIAL_TOKEN_MARKER + raw
        token_bytes.append(raw)
    encoder = tokenizers.Tokenizer.from_str(as_text)
    encoder.encode_special_tokens = True
    vocabulary = _Vocabulary(token_bytes, special_ids, as_read.eos_token, bos_token_id, encoder)
    return LLTokenizer(TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=eos)
