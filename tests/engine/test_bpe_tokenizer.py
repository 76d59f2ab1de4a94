"""The standard-library BPE tokenizer: a reproducible build, a useful vocabulary, Qwen2.5-style chat prompts."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rayturn.engine.llm_engine
from rayturn.engine.bpe_tokenizer import (
    ADDED_TOKENS,
    BPE_VOCAB_SIZE,
    QWEN_TOOLS_TEMPLATE,
    stdlib_corpus,
)
from rayturn.engine.byte_tokenizer import CHATML_TOOLS_TEMPLATE
from rayturn.engine.detokenizer import IncrementalDetokenizer
from rayturn.engine.presets import preset_dir
from rayturn.engine.tokenizer import Tokenizer

# Trains on a slice of the corpus, so two fresh interpreters build in seconds.
TRAIN_AND_SAVE = """\
import sys
from pathlib import Path
from rayturn.engine.bpe_tokenizer import save_bpe_tokenizer, stdlib_corpus, train_bpe_tokenizer
tokenizer = train_bpe_tokenizer(stdlib_corpus(max_corpus_chars=1 << 19), vocab_size=4000)
save_bpe_tokenizer(Path(sys.argv[1]), tokenizer, model_max_length=131072)
"""

ENGLISH = (
    "Coding agents send long prompts: the system prompt alone describes every tool, the rules the agent "
    "must follow, and the state of the repository it works in. A serving system that counts one token per "
    "byte would fill its context with the first request, so the preset trains a small vocabulary instead. "
    "The scheduler then sees prompts of a realistic length, and the cache holds them for the next turn."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the local filesystem and return its lines with line numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "file_path": {"type": "string", "description": "The absolute path of the file to read"},
                    "offset": {"type": "number", "description": "The line number to start reading from"},
                    "limit": {"type": "number", "description": "The number of lines to read"},
                },
                "required": ["file_path"],
                "additionalProperties": False,
            },
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "What is in notes.txt?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": '{"file_path": "n"}'}}],
    },
    {"role": "tool", "content": "1\tbuy milk"},
    {"role": "tool", "content": "2\tcall home"},
]


@pytest.fixture(scope="module")
def tiny_bpe_dir() -> Path:
    return preset_dir("tiny-bpe")


@pytest.fixture(scope="module")
def ours(tiny_bpe_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_bpe_dir)


@pytest.fixture(scope="module")
def hf(tiny_bpe_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_bpe_dir)


def test_training_is_byte_identical_in_fresh_interpreters(tmp_path: Path) -> None:
    targets = [tmp_path / "one", tmp_path / "two"]
    runs = [subprocess.Popen([sys.executable, "-c", TRAIN_AND_SAVE, str(target)]) for target in targets]
    assert [run.wait(timeout=120) for run in runs] == [0, 0]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (targets[0] / name).read_bytes() == (targets[1] / name).read_bytes(), name
    assert json.loads((targets[0] / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_corpus_is_the_head_of_each_library_module_in_path_order(tmp_path: Path) -> None:
    for relative, text in {
        "b.py": "b" * 10,
        "a/z.py": "z" * 3,
        "a/y.txt": "not python",
        "test/t.py": "a test",
        "site-packages/p.py": "a package",
        "c.py": "c" * 10,
        "bad.py": "\udcff",
    }.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    assert stdlib_corpus(tmp_path, max_chars_per_file=4, max_corpus_chars=11) == ["zzz", "bbbb", "cccc"]
    assert stdlib_corpus(tmp_path, max_chars_per_file=4, max_corpus_chars=10) == ["zzz", "bbbb"]


def test_vocabulary_is_trained_ids_then_added_tokens(ours: Tokenizer, hf: Any) -> None:
    assert ours.vocab_size == len(hf) == BPE_VOCAB_SIZE
    first_added = BPE_VOCAB_SIZE - len(ADDED_TOKENS)
    assert [ours.token_to_id(token) for token, _ in ADDED_TOKENS] == list(range(first_added, BPE_VOCAB_SIZE))
    special = {token for token, is_special in ADDED_TOKENS if is_special}
    hf_special = {added.content for added in hf.added_tokens_decoder.values() if added.special}
    assert hf_special == special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert (ours.eos_token, ours.bos_token) == ("<|im_end|>", None)
    assert (ours.eos_token_id, ours.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert hf.pad_token == "<|endoftext|>"


@pytest.mark.parametrize(
    "text",
    [
        ENGLISH,
        json.dumps(TOOLS),
        "    def f(self) -> None:\n        return None\n",
        "emoji 🙂👍🏽, 中文, mixé ünïcödé\x00\r\n",
        '<|im_start|>user\nhi<|im_end|><tool_call>\n{"name": "f"}\n</tool_call><tool_response>ok</tool_response>',
        "",
    ],
    ids=["english", "json", "python", "unicode", "markers", "empty"],
)
def test_encode_decode_match_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf.encode(text) == ours.encode(text, add_special_tokens=False)
    for skip_special_tokens in (True, False):
        decoded = ours.decode(ids, skip_special_tokens=skip_special_tokens)
        assert decoded == hf.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_markers_are_single_tokens_and_tool_tags_survive_decoding(ours: Tokenizer) -> None:
    text = "<|im_start|>assistant\n<tool_call>x</tool_call><tool_response>y</tool_response><|im_end|>"
    ids = ours.encode(text)
    assert sum(1 for token, _ in ADDED_TOKENS if ours.token_to_id(token) in ids) == 6
    assert ours.decode(ids) == "assistant\n<tool_call>x</tool_call><tool_response>y</tool_response>"


def test_streamed_deltas_concatenate_to_the_full_decode(ours: Tokenizer) -> None:
    text = "emoji 🙂👍🏽 中文 <tool_call>\n" + json.dumps(TOOLS) + "\n</tool_call>"
    ids = ours.encode(text)
    assert len(ids) < len(text.encode())  # tokens of many bytes ...
    assert any("\ufffd" in ours.decode([token_id]) for token_id in ids)  # ... and characters split across tokens
    detokenizer = IncrementalDetokenizer(ours)
    deltas = [detokenizer.add_token(token_id) for token_id in ids]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == ours.decode(ids) == text


@pytest.mark.parametrize(
    "text,floor",
    [
        (ENGLISH, 3.5),
        (json.dumps(TOOLS), 3.2),
        (inspect.getsource(rayturn.engine.llm_engine), 3.0),  # Python outside the training corpus
    ],
    ids=["english", "json-tools", "python"],
)
def test_characters_per_token_stay_above_a_floor(ours: Tokenizer, text: str, floor: float) -> None:
    assert len(text) / len(ours.encode(text)) >= floor


def test_template_is_the_byte_presets_chatml_with_a_default_system_turn() -> None:
    assert QWEN_TOOLS_TEMPLATE.endswith(CHATML_TOOLS_TEMPLATE)


def test_chat_with_tools_renders_qwen_style_and_as_transformers_does(ours: Tokenizer, hf: Any) -> None:
    prompt = ours.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOLS[0], ensure_ascii=False)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is in notes.txt?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": {"file_path": "n"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1\tbuy milk\n</tool_response>\n"
        "<tool_response>\n2\tcall home\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt == hf.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(CONVERSATION, tools=TOOLS) == hf.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_without_tools_matches_transformers(ours: Tokenizer, hf: Any, add_generation_prompt: bool) -> None:
    given_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for messages in ([{"role": "user", "content": "Hi"}], given_system):
        prompt = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert prompt == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    assert ours.apply_chat_template(given_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
