"""Streaming detokenization: token ids in, text deltas out.

A streamed response must send text as tokens arrive, but a single token is not
always a whole character: byte-level vocabularies split multi-byte UTF-8
characters (emoji, CJK) across tokens, and decoders such as SentencePiece's
decide spacing from the neighbouring tokens. Decoding each token on its own
therefore gives wrong text, and re-decoding everything at every step costs
O(n) per token.

``IncrementalDetokenizer`` uses the scheme of vLLM's detokenizer. It keeps
two offsets into the token ids: ``read_offset``, up to where text has been
emitted, and ``prefix_offset``, a few tokens before it. Each step decodes only
the window ``ids[prefix_offset:]`` and the already-emitted part
``ids[prefix_offset:read_offset]``; the delta is the difference. If the window
ends in U+FFFD (the decoder's stand-in for an incomplete UTF-8 sequence) the
delta is held back until later tokens complete the character. Once text is
emitted both offsets move forward, so the window stays a handful of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Tokens of prompt context kept before the first generated token, so that
# decoders which depend on the previous token (leading-space rules) see it.
PROMPT_CONTEXT_TOKENS = 5


class TokenDecoder(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time."""

    __slots__ = ("_decoder", "_ids", "_prefix_offset", "_read_offset", "_skip_special_tokens", "_text_pieces")

    def __init__(
        self,
        decoder: TokenDecoder,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = decoder
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text_pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (held-back partial characters excluded)."""
        if len(self._text_pieces) > 1:
            self._text_pieces[:] = ["".join(self._text_pieces)]
        return self._text_pieces[0] if self._text_pieces else ""

    @property
    def has_pending(self) -> bool:
        """Whether tokens have been fed whose text is still held back."""
        return self._read_offset < len(self._ids)

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        emitted_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self._ids))
        if len(window_text) <= len(emitted_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text[len(emitted_text) :])

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add_token(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """At the end of generation, emit held-back text as is, replacement chars included."""
        if not self.has_pending:
            return ""
        emitted_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self._ids))
        return self._emit(window_text[len(emitted_text) :])

    def _decode(self, start_token: int, end_token: int) -> str:
        return self._decoder.decode(self._ids[start_token:end_token], skip_special_tokens=self._skip_special_tokens)

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text_pieces.append(delta)
        self._drop_consumed_ids()
        return delta

    def _drop_consumed_ids(self) -> None:
        """Forget ids before the window so memory stays bounded on long generations."""
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
