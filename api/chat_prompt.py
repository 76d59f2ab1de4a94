"""A chat's prompt: the text the model's chat template renders, and how much of it a cache breakpoint keeps.

Every API that takes a chat (chat completions, Messages, Responses, gRPC,
vLLM's ``/tokenize``) renders it here, so one conversation is one prompt
whichever door it came through.
"""

from __future__ import annotations

from collections.abc import Sequence

from rayturn.engine.prefix_pins import Retention
from rayturn.engine.tokenizer import Tokenizer

from .errors import APIError, invalid_request
from .protocol import JSON, ChatRequest


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[JSON],
    tools: Sequence[JSON] | None,
    template_kwargs: JSON | None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of a chat; a 400 naming ``messages`` when the template cannot render it."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except (ValueError, RecursionError) as err:
        raise invalid_request(f"cannot apply the chat template: {err}", param="messages") from err


def retained_prefix(tokenizer: Tokenizer, chat: ChatRequest, prompt_ids: Sequence[int]) -> Retention | None:
    """The retention contract of a chat's cache breakpoints: one pin per call, of the prompt up to its last
    breakpoint, for the longest TTL any breakpoint asks (a shorter-lived tail is kept longer, never less).

    The prefix is measured in tokens by rendering the messages up to the breakpoint and keeping what that
    rendering shares with the whole prompt, so it holds for any chat template."""
    points = chat.cache_points
    if not points:
        return None
    last = max(point.num_messages for point in points)
    ttl_s = max(point.ttl_s for point in points)
    if last >= len(chat.messages):
        return Retention(len(prompt_ids), ttl_s)
    try:
        text = render_chat(
            tokenizer, chat.messages[:last], chat.prompt_tools, chat.template_kwargs, add_generation_prompt=False
        )
    except APIError:  # a template that cannot render the prefix alone: no contract, nothing breaks
        return None
    num_tokens = common_prefix(tokenizer.encode(text, add_special_tokens=False), prompt_ids)
    return Retention(num_tokens, ttl_s) if num_tokens > 0 else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token sequences share."""
    length = min(len(a), len(b))
    for i in range(length):
        if a[i] != b[i]:
            return i
    return length
