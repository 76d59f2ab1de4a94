"""The ``input`` of ``POST /v1/responses`` turned into chat messages, the form the chat template renders.

    "text"                                  --> one user message
    {"type": "message", role, content}      --> a message (``developer`` becomes ``system``; text parts joined)
    {"type": "function_call", call_id, ...} --> a tool call on the assistant message before it (or a new one)
    {"type": "function_call_output", ...}   --> a ``tool`` message answering ``call_id``
    {"type": "reasoning", content, ...}     --> ``reasoning_content`` of the assistant message after it

A model's answer arrives back as its reasoning item (from a model whose
format marks reasoning apart), an assistant message item and its function
calls; they are folded into one assistant message with ``tool_calls`` and
``reasoning_content``, the shape the model produced them in, so the
re-rendered history matches the tokens already cached (the chat template
decides where the reasoning goes, or leaves it out). A reasoning item's text is
its ``reasoning_text`` content, else its summary; one with neither (only
``encrypted_content``, which this server cannot read) adds nothing, and one
that no assistant message follows is dropped. Images and files are a 400 that
names the item; item references were replaced by the items they name before
(``responses_items``).
"""

from __future__ import annotations

from .chat_request import decoded_arguments
from .errors import invalid_request, unsupported
from .json_fields import Fields, type_error
from .protocol import JSON

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PART_TYPES = ("input_text", "output_text")
ITEM_STATUSES = ("in_progress", "completed", "incomplete")
# The content parts that carry something other than text; named so their 400 says why.
MEDIA_PART_TYPES = ("input_image", "input_file", "input_audio")


def input_messages(fields: Fields) -> list[JSON]:
    """The request's ``input`` as chat messages, in order."""
    value = fields.present("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise type_error("input", "a string or an array of input items", value)
    messages: list[JSON] = []
    reasoning: list[str] = []  # reasoning items' text, waiting for the assistant message they precede
    for i, item in enumerate(value):
        item_fields = Fields(item, f"input[{i}]")
        item_type = _item_type(item_fields)
        if item_type == "message":
            messages.append(_message(item_fields))
            _attach_reasoning(messages, reasoning)
        elif item_type == "function_call":
            _add_tool_call(messages, _tool_call(item_fields))
            _attach_reasoning(messages, reasoning)
        elif item_type == "function_call_output":
            messages.append(_tool_output(item_fields))
            reasoning.clear()
        elif item_type == "reasoning":
            text = _reasoning_text(item_fields)
            if text:
                reasoning.append(text)
        else:
            param = item_fields.path("type")
            message = (
                f"Unsupported '{param}': {item_type!r} items are not supported; "
                "send message, function_call, function_call_output or reasoning items."
            )
            raise unsupported(message, param=param)
    if not messages:
        raise invalid_request("Invalid 'input': expected at least one message or function call output.", param="input")
    return messages


def _reasoning_text(item: Fields) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts, else its ``summary_text`` parts, joined."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.raw(key)
        if parts is None:
            continue
        path = item.path(key)
        if not isinstance(parts, list):
            raise type_error(path, "an array of parts", parts)
        texts = []
        for i, part in enumerate(parts):
            part_fields = Fields(part, f"{path}[{i}]")
            if part_fields.required_string("type") == part_type:
                texts.append(part_fields.required_string("text"))
        if texts:
            return "\n\n".join(texts)
    return ""


def _attach_reasoning(messages: list[JSON], reasoning: list[str]) -> None:
    """Reasoning items seen since the last message go to the assistant message just made or joined (dropped
    before any other)."""
    if reasoning and messages[-1]["role"] == "assistant" and "reasoning_content" not in messages[-1]:
        messages[-1]["reasoning_content"] = "\n\n".join(reasoning)
    reasoning.clear()


def _item_type(item: Fields) -> str:
    """An item's type; a bare ``{"role", "content"}`` (the easy input message) is a message. Its ``id`` and
    ``status``, kept as its stored response lists it, are checked here."""
    item.string("id")
    status = item.string("status")
    if status is not None and status not in ITEM_STATUSES:
        param = item.path("status")
        raise invalid_request(
            f"Invalid '{param}': expected one of {', '.join(ITEM_STATUSES)}, got {status!r}.", param=param
        )
    item_type = item.string("type")
    if item_type is None:
        if item.raw("role") is None:
            raise invalid_request(f"Missing required parameter: '{item.path('type')}'.", param=item.path("type"))
        return "message"
    return item_type


def _message(item: Fields) -> JSON:
    role = item.required_string("role")
    if role not in MESSAGE_ROLES:
        param = item.path("role")
        raise invalid_request(
            f"Invalid '{param}': expected one of {', '.join(MESSAGE_ROLES)}, got {role!r}.", param=param
        )
    return {"role": "system" if role == "developer" else role, "content": _text(item, "content")}


def _text(item: Fields, key: str) -> str:
    """A string, or the text of an array of content parts joined with newlines (as the chat API joins them)."""
    value = item.present(key)
    if isinstance(value, str):
        return value
    path = item.path(key)
    if not isinstance(value, list):
        raise type_error(path, "a string or an array of content parts", value)
    texts = []
    for i, part in enumerate(value):
        part_fields = Fields(part, f"{path}[{i}]")
        part_type = part_fields.required_string("type")
        param = part_fields.path("type")
        if part_type in TEXT_PART_TYPES:
            texts.append(part_fields.required_string("text"))
        elif part_type == "refusal":
            texts.append(part_fields.required_string("refusal"))
        elif part_type in MEDIA_PART_TYPES:
            raise unsupported(f"Unsupported '{param}': {part_type!r} content is not supported; send text.", param=param)
        else:
            raise unsupported(f"Unsupported '{param}': expected a text content part, got {part_type!r}.", param=param)
    return "\n".join(texts)


def _tool_call(item: Fields) -> JSON:
    return {
        "id": item.required_string("call_id"),
        "type": "function",
        "function": {
            "name": item.required_string("name"),
            "arguments": decoded_arguments(item.required_string("arguments")),
        },
    }


def _add_tool_call(messages: list[JSON], call: JSON) -> None:
    """A call joins the assistant message just before it (its prose, or the calls made beside it)."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "tool_calls": [call]})


def _tool_output(item: Fields) -> JSON:
    return {"role": "tool", "tool_call_id": item.required_string("call_id"), "content": _text(item, "output")}
