"""Tool calls in model output: the parsers of each format, one registry, one streaming split for every API.

Models spell tool calls in their own format; ``TOOL_CALL_PARSERS`` names each
one (a model's default comes from its chat template,
``parser_for_chat_template``):

- ``hermes`` (default): ``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3);
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>value</parameter>...`` (Qwen3-Coder);
- ``llama3_json``: the answer is ``{"name": ..., "parameters": {...}}`` calls joined by ``;`` (Llama 3.x);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of calls, or ``NAME[ARGS]{json}`` (Mistral);
- ``harmony``: channelled messages, calls addressed ``to=functions.NAME``, reasoning apart (GPT-OSS).

A format that marks up every answer, not only its calls (``harmony``, whose
prose sits in channels beside the model's reasoning), is split whether or not
the call offered tools (``splits_every_answer``).

``ToolCallStream`` splits text that arrives in pieces (a streamed completion)
into prose and OpenAI-style tool calls, whose ``arguments`` is a JSON *string*
as in the OpenAI chat completions API; ``parse_tool_calls`` is the same split
on the whole text. Parsing never raises: what does not parse as a call stays
prose. Each piece's delta carries the prose that is safe to emit now and the
calls that completed; text that may still turn out to be a call is held::

    push(text)  -> the format's parser decides a prefix of what is held:
                   prose out, calls out (ids drawn in order), the rest held
    finish()    -> what is held is decided as final text (an unclosed call is prose)

An answer that opens in reasoning (``rayturn.engine.reasoning``: Qwen3's and
DeepSeek-R1's ``<think>``) has its reasoning taken apart first, and only what
follows it goes to the tool-call format (``reasoning=``).

``forced_call_grammar`` gives, for a format, the grammar that makes a model
answer with a call (constrained decoding, ``tool_choice`` required or named).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rayturn.registry import Registry

from .reasoning import REASONING_PARSERS, ThinkingSplit
from .tool_call_hermes import TOOL_CALL_END, TOOL_CALL_START
from .tool_call_parser import Reasoning, TokenId, ToolCallParser, ToolSpec

__all__ = [
    "DEFAULT_TOOL_CALL_PARSER",
    "TOOL_CALL_END",
    "TOOL_CALL_PARSERS",
    "TOOL_CALL_START",
    "ParsedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "forced_call_grammar",
    "parse_tool_calls",
    "parser_for_chat_template",
    "random_tool_call_id",
    "splits_every_answer",
    "tool_call_parser",
]

TOOL_CALL_ID_PREFIX = "call_"
TOOL_CALL_ID_RANDOM_HEX_CHARS = 24
DEFAULT_TOOL_CALL_PARSER = "hermes"


def _hermes() -> type[ToolCallParser]:
    from .tool_call_hermes import HermesParser

    return HermesParser


def _qwen3_coder() -> type[ToolCallParser]:
    from .tool_call_qwen3_coder import Qwen3CoderParser

    return Qwen3CoderParser


def _llama3_json() -> type[ToolCallParser]:
    from .tool_call_llama3 import Llama3JsonParser

    return Llama3JsonParser


def _mistral() -> type[ToolCallParser]:
    from .tool_call_mistral import MistralParser

    return MistralParser


def _harmony() -> type[ToolCallParser]:
    from .tool_call_harmony import HarmonyParser

    return HarmonyParser


TOOL_CALL_PARSERS: Registry[type[ToolCallParser]] = Registry("tool-call parser")
TOOL_CALL_PARSERS.register("hermes", _hermes)
TOOL_CALL_PARSERS.register("qwen3_coder", _qwen3_coder)
TOOL_CALL_PARSERS.register("llama3_json", _llama3_json)
TOOL_CALL_PARSERS.register("mistral", _mistral)
TOOL_CALL_PARSERS.register("harmony", _harmony)

# Formats that wrap every answer in their markup: their answers are split even when no tools were offered.
EVERY_ANSWER_PARSERS = ("harmony",)


def tool_call_parser(name: str) -> type[ToolCallParser]:
    """The parser class of format ``name``; ``ValueError`` naming the known ones for an unknown name."""
    return TOOL_CALL_PARSERS.create(name)


def parser_for_chat_template(source: str) -> str:
    """The format a model's chat template (its Jinja source) teaches it to call tools in."""
    if "<|channel|>" in source:
        return "harmony"
    if "<function=" in source:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "tools" in source):
        return "llama3_json"
    return DEFAULT_TOOL_CALL_PARSER


def splits_every_answer(parser: str) -> bool:
    """Whether format ``parser`` marks up every answer, so that even one to a call without tools is split."""
    return parser in EVERY_ANSWER_PARSERS


def forced_call_grammar(
    parser: str, tools: Sequence[ToolSpec], *, parallel: bool, token_id: TokenId | None = None
) -> str:
    """The Lark grammar that forces a call of one of ``tools`` (one or more with ``parallel``) in format
    ``parser``, arguments valid for the tool's schema; ``token_id`` (e.g. ``Tokenizer.token_to_id``) lets
    the format's tags be forced as the tokens the model was trained on (see ``ToolCallParser``)."""
    return tool_call_parser(parser).forced_call_grammar(tools, parallel=parallel, token_id=token_id)


def random_tool_call_id() -> str:
    """``call_`` followed by 24 random hex characters."""
    return TOOL_CALL_ID_PREFIX + secrets.token_hex(TOOL_CALL_ID_RANDOM_HEX_CHARS // 2)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls[i]`` entry of an OpenAI chat completion message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedToolCalls:
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    # The model's reasoning, where its format marks it apart (harmony's analysis channel, ``<think>`` with a
    # reasoning parser); None when none.
    reasoning: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """What one ``ToolCallStream.push`` or ``finish`` decided."""

    content: str  # prose to emit now ("" when none is safe yet)
    tool_calls: tuple[ToolCall, ...]  # calls that completed in this piece, in order
    reasoning: str = ""  # reasoning to emit now


_NOTHING = ToolCallDelta(content="", tool_calls=())


def parse_tool_calls(
    text: str,
    *,
    parser: str = DEFAULT_TOOL_CALL_PARSER,
    tools: Sequence[ToolSpec] | None = None,
    id_factory: Callable[[], str] = random_tool_call_id,
    reasoning: str | None = None,
) -> ParsedToolCalls:
    """Split model output into prose and tool calls (after its reasoning, in format ``reasoning``); malformed
    calls stay in the prose (``ToolCallStream`` on the whole text at once)."""
    stream = ToolCallStream(parser, tools, id_factory=id_factory, reasoning=reasoning)
    pushed, finished = stream.push(text), stream.finish()
    content, reasoning = pushed.content + finished.content, pushed.reasoning + finished.reasoning
    return ParsedToolCalls(content=content or None, tool_calls=stream.tool_calls, reasoning=reasoning or None)


class ToolCallStream:
    """``parse_tool_calls`` on text that arrives piece by piece, in format ``parser``; an answer that opens in
    reasoning (``reasoning``, a name of ``rayturn.engine.reasoning.REASONING_PARSERS``) has it split off first.

    ``tools`` (the call's function tools) let formats that write arguments as
    raw text type them by each tool's schema. Over a whole stream, the
    ``content`` of every delta joined equals ``parse_tool_calls(text).content
    or ""``, their ``reasoning`` joined its ``reasoning or ""``, and their
    ``tool_calls`` joined equal its ``tool_calls`` (ids drawn from
    ``id_factory`` in the same order), however the text was cut. Content and
    reasoning are each stripped as ``parse_tool_calls`` strips them: leading
    whitespace is dropped, trailing whitespace waits for the next non-space
    text of its kind (and is dropped by ``finish``).
    """

    __slots__ = ("_content", "_held", "_id_factory", "_parser", "_reasoning", "_tool_calls", "_wait_for")

    def __init__(
        self,
        parser: str = DEFAULT_TOOL_CALL_PARSER,
        tools: Sequence[ToolSpec] | None = None,
        *,
        id_factory: Callable[[], str] = random_tool_call_id,
        reasoning: str | None = None,
    ) -> None:
        answer = tool_call_parser(parser)(tools)
        self._parser: ToolCallParser | ThinkingSplit = (
            answer if reasoning is None else ThinkingSplit(REASONING_PARSERS.create(reasoning), answer)
        )
        self._id_factory = id_factory
        self._held = ""  # text not decided yet: a possible call, or a possible start of one
        self._wait_for = ""  # the held text stays undecided until one of these characters arrives
        self._content = _Stripper()
        self._reasoning = _Stripper()
        self._tool_calls: list[ToolCall] = []

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """Every call found so far."""
        return tuple(self._tool_calls)

    def push(self, text: str) -> ToolCallDelta:
        """Take the next piece of text; returns what can be decided now."""
        self._held += text
        if self._wait_for and not any(char in text for char in self._wait_for):
            return _NOTHING
        return self._decide(final=False)

    def finish(self) -> ToolCallDelta:
        """The stream ended: decide what is still held (an unclosed call is prose)."""
        return self._decide(final=True)

    def _decide(self, *, final: bool) -> ToolCallDelta:
        split = self._parser.split(self._held, final=final)
        self._held = self._held[split.decided_chars :]
        self._wait_for = split.wait_for
        prose: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        for piece in split.pieces:
            if isinstance(piece, str):
                prose.append(piece)
            elif isinstance(piece, Reasoning):
                reasoning.append(piece.text)
            else:
                calls.append(ToolCall(id=self._id_factory(), name=piece.name, arguments=piece.arguments))
        self._tool_calls.extend(calls)
        return ToolCallDelta(
            content=self._content.strip("".join(prose), final=final),
            tool_calls=tuple(calls),
            reasoning=self._reasoning.strip("".join(reasoning), final=final),
        )


class _Stripper:
    """One kind of streamed text stripped as a whole: leading whitespace dropped, trailing whitespace held until
    more text of the kind follows it (dropped at the end)."""

    __slots__ = ("_started", "_trailing_space")

    def __init__(self) -> None:
        self._started = False
        self._trailing_space = ""

    def strip(self, text: str, *, final: bool) -> str:
        if not self._started:
            text = text.lstrip()
        text = self._trailing_space + text
        body = text.rstrip()
        self._trailing_space = "" if final else text[len(body) :]
        self._started = self._started or bool(body)
        return body
