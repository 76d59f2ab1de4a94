"""Cutting a prompt down to what the caller asked to keep, instead of refusing it for its length.

Without a truncation a prompt that does not fit the context is a 400 (``context_length_exceeded``). With one:

- vLLM's ``truncate_prompt_tokens`` (chat completions, completions; gRPC ``SamplingOptions``): keep at most
  that many tokens of the tokenized prompt, the last ones (``truncation_side: "left"``, vLLM's side for
  generation) or the first (``"right"``). ``-1`` keeps as many as leave room for the answer: the context
  less ``max_tokens`` (less one token where the call names no ``max_tokens``, where vLLM keeps the context
  less one and shortens the answer to fit; here an answer the caller sized still fits). ``0`` would keep
  nothing: refused, as is a number over the context.
- the Responses API's ``truncation: "auto"``: OpenAI drops input items from the middle of the conversation
  until it fits. Here the oldest messages after the leading system ones go, whole, so the template still
  renders a well-formed conversation: the kept part starts at a user or assistant message (never at a tool
  result without its call) and ends with the last message, and a binary search over those starting points
  renders the prompt O(log n) times. A conversation whose last user or assistant message on its own (with the
  system ones) is still too long is refused as before.

The cut is made on the ingress, before the prompt's pages are hashed: what is cached and routed is what the
model reads, and ``usage.prompt_tokens`` counts it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import invalid_request
from .json_fields import Fields, range_error

SIDES = ("left", "right")
# ``Truncation.side`` for the Responses API's ``truncation: "auto"``: whole messages, not tokens.
MESSAGES = "messages"
# Roles a kept conversation may start with (after its system messages): a tool result needs its call.
_LEADING_ROLES = ("system", "developer")
_START_ROLES = ("user", "assistant")

Messages = list[dict[str, object]]


@dataclass(frozen=True, slots=True)
class Truncation:
    """How much of a prompt to keep: ``keep`` tokens (-1: what leaves room for the answer) from ``side``."""

    keep: int = -1
    side: str = "left"
    # The field that asked for it, blamed when it cannot be honoured.
    param: str = "truncate_prompt_tokens"

    def limit(self, max_model_len: int, max_tokens: int | None) -> int:
        """The most prompt tokens to keep; a 400 naming ``param`` when it names more than the context holds."""
        if self.keep > max_model_len:
            message = f"Invalid '{self.param}': at most max_model_len ({max_model_len}) tokens fit, got {self.keep}."
            raise invalid_request(message, param=self.param)
        if self.keep > 0:
            return self.keep
        # At least one token: an answer that cannot fit even then is refused for its max_tokens, not emptied.
        return max(max_model_len - (max_tokens or 1), 1)

    def tokens(self, prompt_ids: list[int], limit: int) -> list[int]:
        """The prompt cut to ``limit`` tokens from its side (unchanged when it fits)."""
        if len(prompt_ids) <= limit:
            return prompt_ids
        return prompt_ids[-limit:] if self.side == "left" else prompt_ids[:limit]


def prompt_truncation(fields: Fields) -> Truncation | None:
    """vLLM's ``truncate_prompt_tokens`` (null: none; -1 or a positive count) and ``truncation_side`` (null:
    ``"left"``) of a body."""
    return checked_truncation(fields.integer("truncate_prompt_tokens", minimum=-1), fields.string("truncation_side"))


def checked_truncation(keep: int | None, side: str | None, prefix: str = "") -> Truncation | None:
    """A truncation from already typed values (under ``prefix`` in error messages: gRPC's ``sampling.``); a side
    other than ``SIDES`` (checked even without a count) and 0 tokens (an empty prompt) are refused naming the field."""
    if side is not None and side not in SIDES:
        raise range_error(f"{prefix}truncation_side", "one of left, right", side)
    param = f"{prefix}truncate_prompt_tokens"
    if keep is None:
        return None
    if keep == 0 or keep < -1:
        raise range_error(param, "-1 (as much as leaves room for the answer) or a positive integer", keep)
    return Truncation(keep, side or "left", param)


def fit_messages(messages: Messages, encode: Callable[[Messages], list[int]], limit: int) -> list[int]:
    """The prompt ids of ``messages`` with the oldest non-system messages dropped until at most ``limit`` tokens
    remain (``MESSAGES``); the whole prompt when it fits or when no cut makes it fit (refused by its length)."""
    whole = encode(messages)
    if len(whole) <= limit:
        return whole
    head = 0
    while head < len(messages) and messages[head].get("role") in _LEADING_ROLES:
        head += 1
    starts = [i for i in range(head + 1, len(messages)) if messages[i].get("role") in _START_ROLES]
    return _first_fit(starts, lambda start: encode(messages[:head] + messages[start:]), limit) or whole


def _first_fit(starts: Sequence[int], encode: Callable[[int], list[int]], limit: int) -> list[int] | None:
    """The ids of the earliest start whose prompt fits ``limit`` (a later start never renders longer)."""
    low, high = 0, len(starts) - 1
    best = None
    while low <= high:
        middle = (low + high) // 2
        ids = encode(starts[middle])
        if len(ids) <= limit:
            best, high = ids, middle - 1
        else:
            low = middle + 1
    return best
