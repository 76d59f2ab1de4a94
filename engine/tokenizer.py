"""Text <-> token ids for a model directory, matching ``transformers``.

A Hugging Face model directory describes its tokenizer in up to three files:

* ``tokenizer.json``: the full ``tokenizers`` pipeline (normalizer,
  pre-tokenizer, model, post-processor, decoder, added tokens). Required.
* ``tokenizer_config.json``: what ``transformers`` layers on top: the named
  special tokens (``bos_token``, ``eos_token``, ... as strings or
  ``{"content": ...}`` dicts) and, before transformers 5, the chat template
  (one string, or a list of ``{"name", "template"}`` entries).
* ``chat_template.jinja`` (plus ``additional_chat_templates/<name>.jinja``):
  where transformers >= 5 saves chat templates; these files replace any
  template in ``tokenizer_config.json``.

``Tokenizer`` reproduces what ``AutoTokenizer.from_pretrained`` with the
``tokenizers`` backend (transformers 5) does with these files:

* special tokens are encoded whether or not they are in the base vocabulary
  (missing ones are added, as transformers does), and ``decode`` skips them
  by default;
* whether ``encode(add_special_tokens=True)`` adds BOS/EOS is decided by the
  ``tokenizer.json`` post-processor alone: transformers drops
  ``add_bos_token``/``add_eos_token`` from the config whenever a
  ``tokenizer.json`` exists, so those flags are ignored here too;
* chat prompts are rendered with the named special tokens as template
  variables and tokenized *without* adding special tokens, because the
  template already writes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from .chat_template import ChatTemplate, ChatTemplateError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATES_DIR = "additional_chat_templates"

DEFAULT_TEMPLATE_NAME = "default"
TOOL_USE_TEMPLATE_NAME = "tool_use"

# The named special tokens transformers passes to chat templates.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

Message = Mapping[str, Any]
Tool = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """The parts of ``tokenizer_config.json`` that change tokenization or chat rendering."""

    special_tokens: dict[str, str]
    chat_templates: dict[str, str]


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat templates of its model."""

    __slots__ = ("_backend", "_chat_templates", "_max_token_chars", "special_tokens")

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, ChatTemplate] | None = None,
    ) -> None:
        self._backend = backend
        self.special_tokens = dict(special_tokens or {})
        self._chat_templates = dict(chat_templates or {})
        _register_special_tokens(backend, self.special_tokens.values())
        self._max_token_chars: int | None = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        """Load ``tokenizer.json``, ``tokenizer_config.json`` and chat templates from a model directory."""
        backend = _load_backend(model_dir / TOKENIZER_FILE)
        config = load_tokenizer_config(model_dir)
        return cls(
            backend,
            special_tokens=config.special_tokens,
            chat_templates=_compile_chat_templates(config.chat_templates, model_dir),
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(tokenizer)`` in transformers)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: no token stands for more characters of text.

        A byte-level entry has one character per byte it stands for, a
        SentencePiece entry one per character; either way a text of ``n``
        characters holds at least ``n / max_token_chars`` tokens (short of a
        normalizer that merges characters).
        """
        if self._max_token_chars is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(token) for token in vocab), default=1)
        return self._max_token_chars

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._chat_templates.get(DEFAULT_TEMPLATE_NAME)

    def token_to_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # A batch of one: the same ids as ``encode``, but tokenizers releases the GIL while it works,
        # so a long prompt tokenized in a worker thread does not stall the thread's event loop.
        ids: list[int] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` encodes to, no special tokens added (e.g. an answer's reasoning)."""
        return len(self.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Render the prompt text; ``extra`` becomes template variables, overriding the special tokens.

        ``continue_final_message``: the prompt ends with the final message's text, left open for the model to go
        on with (an assistant prefill), in place of a new turn; ValueError where the template does not show
        that text.
        """
        template = self._template_for(tools)
        variables = {**self.special_tokens, **extra}
        if continue_final_message:
            text = template.render(messages, tools=tools, add_generation_prompt=False, **variables)
            return _open_final_message(text, messages[-1] if messages else {})
        return template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered prompt; the template writes the special tokens itself."""
        prompt = self.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(prompt, add_special_tokens=False)

    def _template_for(self, tools: Sequence[Tool] | None) -> ChatTemplate:
        """The ``tool_use`` template when tools are given and one exists, else the default one."""
        if tools is not None and TOOL_USE_TEMPLATE_NAME in self._chat_templates:
            return self._chat_templates[TOOL_USE_TEMPLATE_NAME]
        template = self.chat_template
        if template is None:
            available = sorted(self._chat_templates) or "none"
            raise ValueError(f"this tokenizer has no default chat template (templates available: {available})")
        return template


def _register_special_tokens(backend: tokenizers.Tokenizer, special_tokens: Iterable[str]) -> None:
    """Make every named special token encodable as one special token, adding it to the vocab if missing."""
    added = [AddedToken(token, special=True, normalized=False) for token in special_tokens]
    if added:
        backend.add_special_tokens(added)


def _compile_chat_templates(sources: Mapping[str, str], model_dir: Path) -> dict[str, ChatTemplate]:
    compiled: dict[str, ChatTemplate] = {}
    for name, source in sources.items():
        try:
            compiled[name] = ChatTemplate(source)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{model_dir}: chat template {name!r}: {error}") from error
    return compiled


def _load_backend(tokenizer_path: Path) -> tokenizers.Tokenizer:
    if not tokenizer_path.is_file():
        raise ValueError(f"{tokenizer_path}: missing; expected a Hugging Face tokenizers file (tokenizer.json)")
    try:
        return tokenizers.Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:
        raise ValueError(f"{tokenizer_path}: not a valid tokenizers JSON file ({error})") from error


def load_tokenizer_config(model_dir: Path) -> TokenizerConfig:
    """Read ``tokenizer_config.json`` (optional) and the chat template files of ``model_dir``."""
    config_path = model_dir / TOKENIZER_CONFIG_FILE
    raw_config = _read_json_object(config_path) if config_path.is_file() else {}
    template_files = _read_chat_template_files(model_dir)
    return TokenizerConfig(
        special_tokens=_special_tokens(raw_config, config_path),
        chat_templates=template_files or _config_chat_templates(raw_config, config_path),
    )


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: malformed JSON ({error}); expected a JSON object") from error
    if isinstance(parsed, dict):
        return parsed
    raise ValueError(f"{path}: expected a JSON object, got {type(parsed).__name__}")


def _special_tokens(raw_config: Mapping[str, Any], config_path: Path) -> dict[str, str]:
    special_tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = _token_content(raw_config.get(name), name, config_path)
        if token is not None:
            special_tokens[name] = token
    return special_tokens


def _token_content(value: object, name: str, config_path: Path) -> str | None:
    """A special token given as a string or as an AddedToken dict ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ValueError(f'{config_path}: "{name}" must be a string or {{"content": <string>}}, got {value!r}')


def _config_chat_templates(raw_config: Mapping[str, Any], config_path: Path) -> dict[str, str]:
    """``chat_template`` as one string, or as a list of ``{"name", "template"}`` entries."""
    value = raw_config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE_NAME: value}
    if isinstance(value, list) and all(_is_named_template(entry) for entry in value):
        return {entry["name"]: entry["template"] for entry in value}
    raise ValueError(
        f'{config_path}: "chat_template" must be a string or a list of {{"name": ..., "template": ...}} entries'
    )


def _is_named_template(entry: object) -> bool:
    return isinstance(entry, Mapping) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)


def _read_chat_template_files(model_dir: Path) -> dict[str, str]:
    templates: dict[str, str] = {}
    default_path = model_dir / CHAT_TEMPLATE_FILE
    if default_path.is_file():
        templates[DEFAULT_TEMPLATE_NAME] = default_path.read_text(encoding="utf-8")
    named_dir = model_dir / CHAT_TEMPLATES_DIR
    if named_dir.is_dir():
        for template_path in sorted(named_dir.glob("*.jinja")):
            templates[template_path.stem] = template_path.read_text(encoding="utf-8")
    return templates


def _open_final_message(text: str, final: Message) -> str:
    """``text`` cut right after the final message's content, dropping what closes its turn; the content's
    trailing whitespace stays where the template kept it (as transformers' ``continue_final_message`` does)."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("the final message has no text to continue")
    stripped, kept = content.strip(), content.lstrip()
    start = text.rfind(stripped)
    if start < 0:
        raise ValueError("the chat template does not show the final message's text, so it cannot be continued")
    return text[: start + (len(kept) if text.startswith(kept, start) else len(stripped))]
