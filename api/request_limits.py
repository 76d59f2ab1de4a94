"""What one request may cost the ingress before it is refused, and work kept off its event loop.

One event loop serves every call of an ingress replica, so a single request
must never hold it for long, however large or odd it is:

- **media type**: a body sent as anything but JSON (``Content-Type`` other
  than ``application/json`` or ``*/*+json``; a missing one counts as JSON)
  is a 415 before it is read;
- **body size**: ``read_body`` refuses a body over ``max_bytes`` with a 413
  naming the limit, from the ``Content-Length`` header before reading a
  byte, or as soon as a streamed (chunked) body passes the limit;
- **nesting**: JSON nested too deep for Python's parser (about a thousand
  levels: it raises ``RecursionError``) is a 400 (``json_too_deep``), not a
  crash; what parses is only ever walked by code that stops at its own
  limit in the same way (the chat template's ``tojson``: a 400 too), so no
  depth check costs every call a walk of its body;
- **JSON that means two things**: an object with a key twice (parsers
  disagree on which one wins; a proxy that checked the first must not see
  the second used) and the ``NaN`` / ``Infinity`` literals (not JSON) are a
  400 naming them;
- **text no tokenizer can encode**: a JSON string may escape half of a
  UTF-16 surrogate pair (``"\\ud800"``); Python decodes it into a string
  that cannot be encoded as UTF-8. Such a body is a 400 naming the field.
  Only a body holding a surrogate escape at all (emoji sent as ASCII) is
  walked to find it;
- **prompt length**: ``PromptBudget`` refuses text that cannot fit the
  context before tokenizing it. One token stands for at most
  ``max_token_chars`` characters of text (the longest vocabulary entry), so
  a text longer than ``max_model_len * max_token_chars * SAFETY`` holds
  more tokens than the context; ``SAFETY`` covers normalizers that merge
  characters (Unicode composition);
- **off the loop**: bodies and prompts over ``INLINE_BYTES`` are parsed and
  tokenized in a worker thread (``tokenizers`` releases the GIL while it
  encodes), so one long prompt delays only its own call.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from .errors import APIError, invalid_request

SAFETY = 4
# Below this many bytes, parsing or tokenizing takes well under a millisecond: not worth a thread hop.
INLINE_BYTES = 64 << 10

_T = TypeVar("_T")

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# In a decoded string, a surrogate is always a lone one: the decoder joins an escaped pair into one character.
_SURROGATE = re.compile("[\ud800-\udfff]")


def body_too_large(limit_bytes: int, num_bytes: int | None = None) -> APIError:
    # A streamed body is refused once it passes the limit, before its size is known.
    size = f"is {num_bytes} bytes" if num_bytes is not None else "passed the limit while it was being read"
    message = f"The request body {size}; this server accepts at most {limit_bytes} bytes (server.max_request_bytes)."
    return APIError(413, message, code="request_too_large")


def check_json_media_type(headers: Mapping[str, str]) -> None:
    """A 415 when the request says its body is something other than JSON."""
    content_type = headers.get("content-type")
    if content_type is None:
        return
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type == "application/json" or (media_type.endswith("+json") and "/" in media_type):
        return
    message = (
        f"Unsupported Content-Type {content_type[:100]!r}: the request body must be JSON, sent with "
        "'Content-Type: application/json'."
    )
    raise APIError(415, message, param=None, code="unsupported_media_type")


async def read_body(headers: Mapping[str, str], chunks: AsyncIterator[bytes], limit_bytes: int) -> bytes:
    """The whole body, or a 413 once it is known to pass ``limit_bytes`` (nothing past the limit is kept)."""
    declared = headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit_bytes:
        raise body_too_large(limit_bytes, int(declared))
    parts: list[bytes] = []
    num_bytes = 0
    async for chunk in chunks:
        num_bytes += len(chunk)
        if num_bytes > limit_bytes:
            raise body_too_large(limit_bytes)
        parts.append(chunk)
    return b"".join(parts)


def parse_json(body: bytes) -> object:
    """The JSON value of a body; a 400 in the OpenAI shape when it is not JSON (invalid UTF-8, an integer
    past Python's 4,300 digits included), nests too deep to parse, or holds a lone surrogate."""
    try:
        value = json.loads(body, object_pairs_hook=_unique_keys, parse_constant=_not_json_number)
    except RecursionError:
        raise invalid_request(
            "The JSON body of your request nests too deeply to parse (arrays and objects about a thousand levels "
            "deep).",
            param=None,
            code="json_too_deep",
        ) from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, and int()'s digit limit
        raise invalid_request(f"We could not parse the JSON body of your request: {err}", param=None) from err
    if _SURROGATE_ESCAPE.search(body):
        _refuse_lone_surrogates(value)
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    value = dict(pairs)
    if len(value) < len(pairs):
        repeated = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise invalid_request(f"Invalid JSON body: the key {repeated[:100]!r} appears twice in one object.", param=None)
    return value


def _not_json_number(literal: str) -> object:
    raise invalid_request(
        f"Invalid JSON body: {literal} is not a JSON number (JSON has no NaN or Infinity).", param=None
    )


def _refuse_lone_surrogates(value: object) -> None:
    """A 400 naming the first string (key or value) of ``value`` that holds a lone UTF-16 surrogate."""
    pending: list[tuple[object, str]] = [(value, "")]
    while pending:
        item, path = pending.pop()
        if isinstance(item, dict):
            for key, entry in item.items():
                entry_path = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    _lone_surrogate(path or "body")
                pending.append((entry, entry_path))
        elif isinstance(item, list):
            pending.extend((entry, f"{path}[{i}]") for i, entry in enumerate(item))
        elif isinstance(item, str) and _SURROGATE.search(item):
            _lone_surrogate(path or "body")


def _lone_surrogate(param: str) -> None:
    message = (
        f"Invalid '{param}': the string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which is "
        "not a Unicode character."
    )
    raise invalid_request(message, param=param, code="invalid_unicode")


async def off_loop(num_bytes: int, work: Callable[[], _T]) -> _T:
    """``work()``, in a worker thread when its input is large; the event loop serves other calls meanwhile."""
    if num_bytes < INLINE_BYTES:
        return work()
    return await asyncio.to_thread(work)


@dataclass(frozen=True, slots=True)
class PromptBudget:
    """The longest prompt text that could still fit the context, to refuse longer ones untokenized."""

    max_model_len: int
    max_token_chars: int

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.max_token_chars * SAFETY

    def check(self, text: str, *, param: str) -> None:
        """A 400 (``context_length_exceeded``) when ``text`` holds more tokens than the context, for sure."""
        if len(text) <= self.max_chars:
            return
        at_least = -(-len(text) // (self.max_token_chars * SAFETY))
        message = (
            f"This model's maximum context length is {self.max_model_len} tokens. However, your '{param}' is "
            f"{len(text)} characters, at least {at_least} tokens. Please reduce the length of the '{param}'."
        )
        raise invalid_request(message, param=param, code="context_length_exceeded")
