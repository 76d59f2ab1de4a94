"""Hugging Face chat templates, rendered the way ``transformers`` renders them.

A chat template is a Jinja2 program shipped with a model (``chat_template`` in
``tokenizer_config.json`` or a ``chat_template.jinja`` file) that turns a list
of chat messages into the exact prompt text the model was trained on. A model
only behaves well when it sees that text byte for byte, so this module copies
the rendering environment of ``transformers.PreTrainedTokenizerBase.
apply_chat_template`` rather than plain Jinja:

* an ``ImmutableSandboxedEnvironment`` (templates come from the Hub and are
  untrusted) with ``trim_blocks`` and ``lstrip_blocks`` on and the
  ``loopcontrols`` extension (``{% break %}``/``{% continue %}``);
* a ``tojson`` filter that does not HTML-escape and keeps non-ASCII text
  (``ensure_ascii=False``), with ``indent``/``separators``/``sort_keys``;
* the globals ``raise_exception(message)`` and ``strftime_now(format)``, a
  ``namespace`` that refuses underscore attributes, and a no-op
  ``{% generation %}`` block (used by templates that mark assistant spans);
* the variables ``messages``, ``tools``, ``documents``,
  ``add_generation_prompt``, the tokenizer's special tokens (``bos_token``,
  ``eos_token``, ...) and any extra keyword arguments, which override the
  special tokens;
* the same message clean-up: keys whose value is ``None`` are dropped (many
  templates test ``message.content is defined``), reasoning given as
  ``thinking``/``reasoning`` is also exposed as ``reasoning_content`` (and
  vice versa as ``thinking``), and every value is rebuilt from plain JSON types.

Template errors surface as ``ChatTemplateError`` (a ``ValueError``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """A chat template failed to compile, or raised while rendering."""


class _TemplateRaisedError(jinja2.TemplateError):
    """What ``raise_exception`` throws inside the template."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace()`` that rejects underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, positional = args[0], args[1:]
        attributes = dict(*positional, **kwargs)
        for name in attributes:
            _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


class _SafeDict:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


def _raise_exception(message: str) -> None:
    raise _TemplateRaisedError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _build_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _SafeDict()
    environment.globals["namespace"] = _SafeNamespace
    return environment


def plain_template_data(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types; anything else becomes a ``"<TypeName>"`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(key): plain_template_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    return f"<{type(value).__name__}>"


def _without_none_values(message: Message) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    return {key: value for key, value in message.items() if value is not None}


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[field] for field in REASONING_FIELDS if message.get(field) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def prepare_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The messages exactly as ``transformers`` hands them to the template."""
    return [_with_reasoning_aliases(plain_template_data(_without_none_values(message))) for message in messages]


class ChatTemplate:
    """A compiled chat template; compile once per model, render per request."""

    __slots__ = ("_compiled", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self._compiled = _compile(source)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render the prompt text; ``extra`` (e.g. ``bos_token``) becomes template variables."""
        variables = {
            "messages": prepare_messages(messages),
            "tools": None if tools is None else plain_template_data(list(tools)),
            "documents": None if documents is None else plain_template_data(list(documents)),
            "add_generation_prompt": add_generation_prompt,
            **plain_template_data(extra),
        }
        return _render(self._compiled, variables)

    def __repr__(self) -> str:
        return f"ChatTemplate(<{len(self.source)} chars>)"


def _compile(source: str) -> jinja2.Template:
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template syntax error at line {error.lineno}: {error.message}") from error


def _render(compiled: jinja2.Template, variables: dict[str, Any]) -> str:
    try:
        return compiled.render(**variables)
    except _TemplateRaisedError as error:
        raise ChatTemplateError(f"chat template rejected the conversation: {error.message}") from error
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template failed to render: {error}") from error
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as error:
        # Python's own errors from the template's expressions on the values it was given ('a' + 1, a missing
        # key): the conversation's fault, as a template error is.
        raise ChatTemplateError(f"chat template failed to render: {type(error).__name__}: {error}") from error


_ENVIRONMENT = _build_environment()
# What no caller's extra variables may name: what ``ChatTemplate.render`` sets itself, and the environment's
# globals (a variable of the same name would hide ``raise_exception``, ``namespace`` and the like).
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", *_ENVIRONMENT.globals})
