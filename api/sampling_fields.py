"""Sampling fields of an OpenAI-shaped body that take more than a typed read: the stop sequences and stop token
ids, the logit bias, vLLM's ``allowed_token_ids`` and ``bad_words`` (tokenized as vLLM does: ``bad_word_ids``),
and vLLM's extensions this server refuses unless they hold their "off" value (``reject_unsupported``).
``protocol.sampling_spec`` reads the rest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rayturn.engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_TOKEN_IDS,
)

from .errors import invalid_request, unsupported
from .json_fields import Fields, is_integer, range_error, type_error

MAX_STOP_SEQUENCES = 4
TOKEN_ID_KEY_DIGITS = 18
MAX_BAD_WORD_CHARS = 256
"""A ``logit_bias`` key longer than this is no token id of any vocabulary (and would be slow to parse)."""


# vLLM's request extensions this server does not honour, each with the value that means "not used": a request
# that sets one to anything else gets a 400 naming it rather than an answer that silently ignored it.
UNSUPPORTED_AT_DEFAULT: dict[str, object] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "logits_processors": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "spaces_between_special_tokens": True,
    "kv_transfer_params": None,
    "vllm_xargs": None,
}
_EMPTY: tuple[object, ...] = (None, [], {}, "")


def reject_unsupported(fields: Fields, table: dict[str, object] = UNSUPPORTED_AT_DEFAULT, where: str = "") -> None:
    """A 400 naming the first field of ``table`` set to anything but its "not used" value (an empty list,
    object or string counts as not used where that value is null)."""
    for name, default in table.items():
        value = fields.raw(name)
        if value is None or value == default or (default is None and value in _EMPTY):
            continue
        hint = (
            " Use 'structured_outputs' or 'response_format' for structured output."
            if name.startswith("guided_")
            else ""
        )
        raise unsupported(f"Unsupported '{name}': this server does not support it{where}.{hint}", param=name)


def logit_bias(fields: Fields) -> tuple[tuple[int, float], ...]:
    """The body's ``logit_bias``: an object from token ids (JSON keys, so strings of digits) to numbers in
    [-100, 100], as (id, bias) pairs sorted by id; null or empty is none."""
    bias = fields.nested("logit_bias")
    if bias is None:
        return ()
    keys = list(fields.raw("logit_bias"))
    if len(keys) > MAX_LOGIT_BIAS_TOKENS:
        message = f"Invalid 'logit_bias': expected at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(keys)}."
        raise invalid_request(message, param="logit_bias")
    pairs = []
    for key in keys:
        if not (key.isascii() and key.isdigit() and len(key) <= TOKEN_ID_KEY_DIGITS):
            message = f"Invalid 'logit_bias': keys must be token ids (strings of digits), got {key[:40]!r}."
            raise invalid_request(message, param="logit_bias")
        value = bias.number(key, minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS)
        if value is None:
            raise type_error(bias.path(key), "a number", None)
        pairs.append((int(key), value))
    if len({token_id for token_id, _ in pairs}) != len(pairs):  # "7" and "07"
        raise invalid_request("Invalid 'logit_bias': a token id appears more than once.", param="logit_bias")
    return tuple(sorted(pairs))


def stop_sequences(fields: Fields) -> tuple[str, ...]:
    """The body's ``stop``: a string or up to ``MAX_STOP_SEQUENCES`` of them, none empty."""
    value = fields.raw("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        entries = [("stop", value)]
    elif isinstance(value, list):
        if len(value) > MAX_STOP_SEQUENCES:
            message = f"Invalid 'stop': expected at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}."
            raise invalid_request(message, param="stop")
        entries = [(f"stop[{i}]", entry) for i, entry in enumerate(value)]
    else:
        raise type_error("stop", "a string or an array of strings", value)
    for param, entry in entries:
        if not isinstance(entry, str):
            raise type_error(param, "a string", entry)
        if not entry:
            raise invalid_request(f"Invalid '{param}': stop sequences must not be empty.", param=param)
    return tuple(entry for _, entry in entries)


def stop_token_ids(fields: Fields) -> tuple[int, ...]:
    """The body's ``stop_token_ids``: up to ``MAX_STOP_TOKEN_IDS`` non-negative integers (the vocabulary bound
    is ``protocol.to_sampling_params``'s, once the model is known)."""
    return _token_ids(fields.array("stop_token_ids") or [], "stop_token_ids", 0, MAX_STOP_TOKEN_IDS)


def allowed_token_ids(fields: Fields) -> tuple[int, ...] | None:
    """The body's ``allowed_token_ids`` (vLLM's): null is every token; else a non-empty array of at most
    ``MAX_ALLOWED_TOKEN_IDS`` non-negative integers (the vocabulary bound is ``protocol.to_sampling_params``'s)."""
    values = fields.array("allowed_token_ids")
    return None if values is None else _token_ids(values, "allowed_token_ids", 1, MAX_ALLOWED_TOKEN_IDS)


def _token_ids(values: list[Any], param: str, least: int, most: int) -> tuple[int, ...]:
    """``least`` to ``most`` non-negative integers, or a 400 naming ``param`` (or the entry at fault)."""
    if not least <= len(values) <= most:
        expected = f"at most {most}" if least == 0 else f"{least} to {most}"
        raise invalid_request(f"Invalid '{param}': expected {expected} token ids, got {len(values)}.", param=param)
    for i, token_id in enumerate(values):
        if not is_integer(token_id) or token_id < 0:
            raise range_error(f"{param}[{i}]", "a non-negative integer", token_id)
    return tuple(int(token_id) for token_id in values)


def bad_words(fields: Fields) -> tuple[str, ...]:
    """The body's ``bad_words`` (vLLM's): null or an array of at most ``MAX_BAD_WORDS`` strings, each with
    something besides leading whitespace, of at most ``MAX_BAD_WORD_CHARS`` characters."""
    values = fields.array("bad_words") or []
    return checked_bad_words(values, "bad_words")


def checked_bad_words(values: Sequence[object], param: str) -> tuple[str, ...]:
    """``bad_words`` of any API (gRPC's ``sampling.bad_words`` too), checked; a 400 naming ``param`` otherwise."""
    if len(values) > MAX_BAD_WORDS:
        message = f"Invalid '{param}': expected at most {MAX_BAD_WORDS} words, got {len(values)}."
        raise invalid_request(message, param=param)
    for i, word in enumerate(values):
        if not isinstance(word, str):
            raise type_error(f"{param}[{i}]", "a string", word)
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            expected = f"a word of 1 to {MAX_BAD_WORD_CHARS} characters, not only whitespace"
            raise invalid_request(f"Invalid '{param}[{i}]': expected {expected}.", param=f"{param}[{i}]")
    return tuple(str(word) for word in values)


def bad_word_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as the token sequences the engine bans, as vLLM makes them: each word with its leading
    whitespace stripped, and again after one space where that gives a different first token and as many
    tokens (the word in the middle of a text)."""
    sequences: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        bare = tuple(encode(word.lstrip()))
        if not 0 < len(bare) <= MAX_BAD_WORD_TOKENS:
            message = f"Invalid 'bad_words[{i}]': expected 1 to {MAX_BAD_WORD_TOKENS} tokens, got {len(bare)}."
            raise invalid_request(message, param=f"bad_words[{i}]")
        sequences.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS:
        message = f"Invalid 'bad_words': the words make {len(sequences)} token sequences; at most {MAX_BAD_WORDS}."
        raise invalid_request(message, param="bad_words")
    return tuple(sequences)
