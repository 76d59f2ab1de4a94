"""The raw bytes each token id stands for, whatever kind of tokenizer the model has.

Decoding one token as text cannot show them: a byte-level token that holds
half of a UTF-8 character decodes to U+FFFD, so two different tokens read
alike. Logprob answers need the bytes themselves (OpenAI's ``bytes`` field),
so they are read from the vocabulary:

* a byte-level entry (GPT-2 style ``ByteLevel`` decoder): each character is
  the stand-in for one byte (``bytes_to_unicode``), mapped back;
* a byte-fallback entry ``<0xAB>`` (SentencePiece style): that byte;
* a SentencePiece word piece: its text, ``▁`` read as a space;
* an added (control) token: its text in UTF-8;
* an id past the vocabulary (a model's padding rows): no bytes.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

import tokenizers

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


@cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte value, as ``{character: byte}``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + shift)
            shift += 1
    return {chr(character): byte for byte, character in zip(printable, characters)}


class TokenBytes:
    """``token_bytes(token_id)``: the bytes a token stands for; memoised per id, built from the vocabulary."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        description = json.loads(backend.to_str())
        self._byte_level = _has_byte_level_decoder(description.get("decoder"))
        self._added = {int(token["id"]): str(token["content"]) for token in description.get("added_tokens", [])}
        self._memo: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._memo.get(token_id)
        if found is None:
            found = self._memo[token_id] = self._read(token_id)
        return found

    def _read(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        if piece is None:  # a row of the model's padded vocabulary: it stands for no text
            return b""
        if self._byte_level:
            alphabet = byte_level_alphabet()
            if all(character in alphabet for character in piece):
                return bytes(alphabet[character] for character in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback[1], 16)])
        return piece.replace(_METASPACE, " ").encode("utf-8")


def token_display(raw: bytes) -> str:
    """A token as OpenAI's logprobs show it: its text, or ``bytes:\\xe2\\x80`` when it is not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def _has_byte_level_decoder(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level_decoder(inner) for inner in decoder.get("decoders") or [])
