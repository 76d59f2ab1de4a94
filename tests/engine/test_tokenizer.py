"""Tokenizer loading, encode/decode and streaming detokenization, checked against ``transformers``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from rayturn.engine.byte_tokenizer import (
    BOS_TOKEN,
    CHATML_TOOLS_TEMPLATE,
    CONTROL_TOKENS,
    EOS_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    TOOL_CALL_START_TOKEN,
    build_byte_tokenizer,
    byte_tokenizer_config,
    save_byte_tokenizer,
)
from rayturn.engine.detokenizer import IncrementalDetokenizer
from rayturn.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  \n\ttabs",
    "emoji 🙂👍🏽 and ZWJ 👩‍💻",
    "中文字符和日本語のテキスト",
    "mixé ünïcödé — “quotes” ∑",
    f"{BOS_TOKEN}system{IM_START_TOKEN}user\nhi{EOS_TOKEN}{PAD_TOKEN}",
    f'{TOOL_CALL_START_TOKEN}\n{{"name": "f", "arguments": {{"city": "Zürich"}}}}\n</tool_call>',
    "",
]
MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi 🙂"}]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _hf_tokenizer(directory: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def byte_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("byte_tokenizer")
    save_byte_tokenizer(directory, CHATML_TOOLS_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def ours(byte_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(byte_tokenizer_dir)


@pytest.fixture(scope="module")
def hf(byte_tokenizer_dir: Path) -> Any:
    return _hf_tokenizer(byte_tokenizer_dir)


def _write_tokenizer_dir(
    directory: Path,
    config: dict[str, Any] | None,
    *,
    post_processor: processors.PostProcessor | None = None,
    template_file: str | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    backend = build_byte_tokenizer()
    if post_processor is not None:
        backend.post_processor = post_processor
    backend.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return directory


def _config_without(*keys: str) -> dict[str, Any]:
    config = byte_tokenizer_config(CHATML_TOOLS_TEMPLATE, model_max_length=4096)
    for key in keys:
        del config[key]
    return config


# --- the byte tokenizer, against transformers ---


def test_byte_ids_are_byte_values_then_control_tokens(ours: Tokenizer) -> None:
    text = "aé🙂\x00\xff"
    assert ours.encode(text) == list(text.encode("utf-8"))
    assert [ours.token_to_id(token) for token, _ in CONTROL_TOKENS] == list(range(256, 256 + len(CONTROL_TOKENS)))
    assert ours.vocab_size == 256 + len(CONTROL_TOKENS)


def test_byte_tokenizer_metadata_matches_transformers(ours: Tokenizer, hf: Any) -> None:
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.bos_token_id == 256
    assert ours.eos_token_id == ours.token_to_id(EOS_TOKEN)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
    for skip_special_tokens in (True, False):
        decoded = ours.decode(ids, skip_special_tokens=skip_special_tokens)
        assert decoded == hf.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_tool_call_tags_survive_skip_special_tokens(ours: Tokenizer) -> None:
    ids = ours.encode(f"{IM_START_TOKEN}<tool_call>x</tool_call>{EOS_TOKEN}")
    assert ids[0] == ours.token_to_id(IM_START_TOKEN)
    assert len(ids) == 5
    assert ours.decode(ids) == "<tool_call>x</tool_call>"


# --- BOS/EOS come from the tokenizer.json post-processor; config flags are ignored, as in transformers 5 ---

_BOS_TEMPLATE = processors.TemplateProcessing(
    single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 256)]
)


@pytest.mark.parametrize(
    ("post_processor", "config", "expect_bos", "expect_eos"),
    [
        (_BOS_TEMPLATE, _config_without("add_bos_token", "add_eos_token"), True, False),
        (None, _config_without("add_bos_token", "add_eos_token"), False, False),
        (None, {**_config_without("add_eos_token"), "add_bos_token": True}, False, False),
        (_BOS_TEMPLATE, _config_without("add_eos_token"), True, False),
        (None, {**_config_without("add_bos_token"), "add_eos_token": True}, False, False),
    ],
    ids=["json_bos", "none", "config_bos_ignored", "config_no_bos_ignored", "config_eos_ignored"],
)
def test_special_tokens_on_encode_match_transformers(
    tmp_path: Path,
    post_processor: processors.PostProcessor | None,
    config: dict[str, Any],
    expect_bos: bool,
    expect_eos: bool,
) -> None:
    directory = _write_tokenizer_dir(tmp_path, config, post_processor=post_processor)
    ours, hf = Tokenizer.from_dir(directory), _hf_tokenizer(directory)
    ids = ours.encode("hi")
    assert ids == hf.encode("hi")
    assert (ids[0] == ours.bos_token_id, ids[-1] == ours.eos_token_id) == (expect_bos, expect_eos)
    assert ours.encode("hi", add_special_tokens=False) == hf.encode("hi", add_special_tokens=False) == [104, 105]
    assert ours.encode_chat(MESSAGES) == list(hf.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])


def test_special_tokens_given_as_dicts_and_missing_from_vocab(tmp_path: Path) -> None:
    config = {
        **_config_without("add_bos_token", "add_eos_token"),
        "bos_token": {"__type": "AddedToken", "content": BOS_TOKEN, "special": True},
        "eos_token": {"__type": "AddedToken", "content": EOS_TOKEN},
        "unk_token": "<unk>",
    }
    directory = _write_tokenizer_dir(tmp_path, config)
    ours, hf = Tokenizer.from_dir(directory), _hf_tokenizer(directory)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (256, 259)
    assert ours.vocab_size == len(hf)
    assert ours.token_to_id("<unk>") == hf.unk_token_id
    assert ours.encode("a<unk>b") == hf.encode("a<unk>b")
    assert ours.decode(ours.encode("a<unk>b")) == hf.decode(hf.encode("a<unk>b"), skip_special_tokens=True)


# --- chat template sources ---


def test_chat_template_jinja_file_takes_precedence(tmp_path: Path) -> None:
    file_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    directory = _write_tokenizer_dir(tmp_path, _config_without(), template_file=file_template)
    ours, hf = Tokenizer.from_dir(directory), _hf_tokenizer(directory)
    expected = "<system>S<user>Hi 🙂"
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False) == expected


def test_named_chat_templates_pick_default_and_tool_use(tmp_path: Path) -> None:
    config = {
        **_config_without("chat_template"),
        "chat_template": [
            {"name": "default", "template": "plain:{{ messages | length }}"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        ],
    }
    directory = _write_tokenizer_dir(tmp_path, config)
    ours, hf = Tokenizer.from_dir(directory), _hf_tokenizer(directory)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False) == "plain:2"
    assert ours.apply_chat_template(MESSAGES, tools=tools) == "tools:1"
    assert hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False) == "tools:1"
    assert ours.chat_template is not None


def test_no_chat_template_raises(tmp_path: Path) -> None:
    ours = Tokenizer.from_dir(_write_tokenizer_dir(tmp_path, _config_without("chat_template")))
    assert ours.chat_template is None
    with pytest.raises(ValueError, match="no default chat template"):
        ours.apply_chat_template(MESSAGES)


def test_missing_tokenizer_config_is_allowed(tmp_path: Path) -> None:
    ours = Tokenizer.from_dir(_write_tokenizer_dir(tmp_path, None))
    assert (ours.bos_token_id, ours.eos_token_id, ours.chat_template) == (None, None, None)
    assert ours.encode("hé") == [104, 195, 169]


# --- from_dir errors ---


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json: missing"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": ', encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a valid"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("config_text", ['{"bos_token": "<s>",', "[1, 2]"], ids=["truncated", "not_object"])
def test_malformed_tokenizer_config(tmp_path: Path, config_text: str) -> None:
    _write_tokenizer_dir(tmp_path, None)
    (tmp_path / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: .*JSON object"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"bos_token": 5}, '"bos_token" must be a string'),
        ({"chat_template": {"default": "x"}}, '"chat_template" must be a string or a list'),
        ({"chat_template": "{% for %}"}, "chat template 'default': chat template syntax error"),
    ],
)
def test_invalid_tokenizer_config_fields(tmp_path: Path, override: dict[str, Any], match: str) -> None:
    _write_tokenizer_dir(tmp_path, {**_config_without(), **override})
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_dir(tmp_path)


# --- streaming detokenization ---


class _CountingDecoder:
    """Records the longest id window each decode call received."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.longest_window = 0

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.longest_window = max(self.longest_window, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_deltas_concatenate_to_full_decode(ours: Tokenizer, text: str, skip_special_tokens: bool) -> None:
    ids = ours.encode(text)
    detokenizer = IncrementalDetokenizer(ours, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.add_token(token_id) for token_id in ids]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == detokenizer.text == ours.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detokenizer.flush() == ""


def test_detokenizer_holds_back_partial_utf8(ours: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(ours)
    emoji_bytes = list("🙂".encode())
    assert [detokenizer.add_token(byte) for byte in emoji_bytes] == ["", "", "", "🙂"]


def test_detokenizer_window_stays_bounded(ours: Tokenizer) -> None:
    text = "streaming 😀 text 中文 " * 200
    counting = _CountingDecoder(ours)
    detokenizer = IncrementalDetokenizer(counting, prompt_ids=ours.encode("prompt " * 50))
    assert detokenizer.add_tokens(ours.encode(text)) == text
    assert counting.longest_window <= 8


def test_detokenizer_flush_emits_cut_off_character(ours: Tokenizer) -> None:
    ids = list("ok🙂".encode())[:-1]
    detokenizer = IncrementalDetokenizer(ours)
    assert detokenizer.add_tokens(ids) == "ok"
    assert detokenizer.has_pending
    assert detokenizer.text + detokenizer.flush() == ours.decode(ids)
    assert "\ufffd" in detokenizer.text


def _metaspace_tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    backend = BackendTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(backend)


def test_detokenizer_keeps_spaces_of_sentencepiece_style_decoders() -> None:
    tokenizer = _metaspace_tokenizer()
    ids = [1, 2, 3, 4]
    assert tokenizer.decode(ids) == "hello world! again"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add_token(token_id) for token_id in ids] == ["hello", " world", "!", " again"]


def test_detokenizer_prompt_context_gives_leading_space() -> None:
    detokenizer = IncrementalDetokenizer(_metaspace_tokenizer(), prompt_ids=[1])
    assert detokenizer.add_tokens([2, 3]) == " world!"
