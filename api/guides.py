"""What a call's answer must look like, as a decoding guide: forced tool calls and JSON output.

    tool_choice "required" / a named function   (OpenAI chat, Responses)
    tool_choice {"type": "any"} / {"type": "tool"} (Anthropic)   --> a Lark grammar of a tool call in the
                                                                    model's own format (``forced_call_grammar``)
    response_format json_object / json_schema                     --> a JSON guide
    vLLM's structured outputs (JSON, regex, choice, grammar)      --> read with the sampling fields
                                                                    (``structured_outputs``), one guide per call

The decode replica's engine masks every token the guide does not allow, so a
forced call is a well-formed call of a declared tool with arguments valid for
its schema, and a JSON answer parses (``rayturn.engine.guided``). When both are
asked, the tool choice wins: the answer is a call. A guide is checked here, at
the edge, so a bad JSON schema is a 400 naming the field that holds it (the
request builder of each API other than chat puts its path in the format's
``schema_param``: ``text.format.schema``, ``output_config.format.schema``), and
a forced call of a tool whose schema cannot compile is a 400 naming the tool;
neither reaches a replica.

A forced call's arguments keep to the properties its schema declares: an
object schema that lists ``properties`` and says nothing of
``additionalProperties`` takes no others (as OpenAI's strict mode does), so a
call cannot wander into keys the tool never named.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from rayturn.engine.guided import Guide, check_guide
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.tokenizer import Tokenizer
from rayturn.engine.tool_calls import forced_call_grammar, splits_every_answer

from .errors import APIError, invalid_request
from .protocol import ChatRequest
from .structured_outputs import closed_schema, guide_error_reason

# Agents send the same tools on every call: their grammars are made and checked once.
MAX_CACHED_GRAMMARS = 64
# Formats whose tags are special tokens, which detokenizing drops unless told to keep them.
SPECIAL_TAG_PARSERS = ("mistral", "harmony")
# Where a chat request holds its schema; OpenAI names ``response_format`` as the param of a schema error.
CHAT_SCHEMA_PATH, CHAT_SCHEMA_PARAM = "response_format.json_schema.schema", "response_format"


class GuideMaker:
    """Guides for one ingress replica's model: its tool-call format and its tokenizer."""

    __slots__ = ("_grammars", "parser", "tokenizer")

    def __init__(self, parser: str, tokenizer: Tokenizer) -> None:
        self.parser = parser
        self.tokenizer = tokenizer
        self._grammars: OrderedDict[tuple[str, bool], Guide] = OrderedDict()

    def guided(self, params: SamplingParams, chat: ChatRequest) -> SamplingParams:
        """``params`` with the guide ``chat`` asks for (unchanged when it asks none); for a call whose answer is
        split (it offers tools, or the format marks up every answer) by a model whose tags are special tokens
        (Mistral's ``[TOOL_CALLS]``, harmony's channels), the tags kept in the text so the decode replica's parser
        sees them."""
        guide = self.guide(chat)
        if guide is not None:
            params = replace(params, guide=guide)
        split = bool(chat.prompt_tools) or splits_every_answer(self.parser)
        if split and self.parser in SPECIAL_TAG_PARSERS:
            params = replace(params, skip_special_tokens=False)
        return params

    def guide(self, chat: ChatRequest) -> Guide | None:
        tools = chat.prompt_tools
        if tools and (chat.tool_choice == "required" or isinstance(chat.tool_choice, dict)):
            return self._forced_call(tools, chat.parallel_tool_calls)
        form = chat.response_format
        if form is None:
            return None
        if form["type"] == "json_object":
            return Guide.json_object()
        guide = Guide.json_schema(form["json_schema"]["schema"])
        try:
            check_guide(guide)
        except (ValueError, RecursionError) as err:  # a schema nested past Python's stack is bad too
            path = form.get("schema_param")
            message = f"Invalid '{path or CHAT_SCHEMA_PATH}': {guide_error_reason(err)}"
            raise invalid_request(message, param=path or CHAT_SCHEMA_PARAM) from err
        return guide

    def _forced_call(self, tools: list[dict[str, Any]], parallel: bool) -> Guide:
        key = (json.dumps(tools, sort_keys=True), parallel)
        guide = self._grammars.get(key)
        if guide is not None:
            self._grammars.move_to_end(key)
            return guide
        # Mistral's and harmony's tags are special tokens; the other formats' tags match as text.
        token_id = self.tokenizer.token_to_id if self.parser in SPECIAL_TAG_PARSERS else None
        try:
            closed = [_closed_tool(tool) for tool in tools]
            guide = Guide.lark(forced_call_grammar(self.parser, closed, parallel=parallel, token_id=token_id))
            check_guide(guide)
        except (ValueError, RecursionError) as err:  # a schema nested past Python's stack is bad too
            raise _uncallable(tools, err) from err
        self._grammars[key] = guide
        if len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return guide


def _uncallable(tools: list[dict[str, Any]], err: BaseException) -> APIError:
    """The 400 for tools whose call grammar does not compile: the first tool whose parameters schema fails on its
    own, with the compiler's reason; else the grammar's reason. Never the grammar itself, which is ours."""
    for tool in tools:
        function = tool["function"]
        if "parameters" not in function:
            continue
        try:
            check_guide(Guide.json_schema(function["parameters"]))
        except (ValueError, RecursionError) as tool_err:
            message = f"Cannot force a call of tool {function['name']!r}: its parameters schema is invalid: "
            return invalid_request(message + guide_error_reason(tool_err), param="tools")
    return invalid_request(f"Cannot force a call of these tools: {guide_error_reason(err)}", param="tools")


def _closed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    if "parameters" not in function:
        return tool
    return {**tool, "function": {**function, "parameters": closed_schema(function["parameters"])}}
