"""What one request may cost the ingress before it is refused, and work kept off its event loop.

One event loop serves every call of an ingress replica, so a single request
must never hold it for long, however large or odd it is:

- **body size**: ``read_body`` refuses a body over ``max_bytes`` with a 413
  naming the limit, from the ``Content-Length`` header before reading a
  byte, or as soon as a streamed (chunked) body passes the limit;
- **nesting**: JSON nested too deep for Python's parser (about a thousand
  levels: it raises ``RecursionError``) is a 400 (``json_too_deep``), not a
  crash; what parses is only ever walked by code that stops at its own
  limit in the same way (the chat template's ``tojson``: a 400 too), so no
  depth check costs every call a walk of its body;
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
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from .errors import APIError, invalid_request

SAFETY = 4
# Below this many bytes, parsing or tokenizing takes well under a millisecond: not worth a thread hop.
INLINE_BYTES = 64 << 10

_T = TypeVar("_T")


def body_too_large(limit_bytes: int, num_bytes: int | None = None) -> APIError:
    size = f"is {num_bytes} bytes" if num_bytes is not None else "is larger than that"
    message = f"The request body {size}; this server accepts at most {limit_bytes} bytes (server.max_request_bytes)."
    return APIError(413, message, code="request_too_large")


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
    """The JSON value of a body; a 400 in the OpenAI shape when it is not JSON or nests too deep to parse."""
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise invalid_request(f"We could not parse the JSON body of your request: {err}", param=None) from err
    except RecursionError:
        raise invalid_request(
            "The JSON body of your request nests too deeply to parse (arrays and objects about a thousand levels "
            "deep).",
            param=None,
            code="json_too_deep",
        ) from None


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
