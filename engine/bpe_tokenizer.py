"""A byte-level BPE tokenizer trained at build time on the interpreter's own standard library.

The byte tokenizer of the ``tiny`` preset spends one token per byte, so an
agent's 77k-character first prompt is 77k tokens. This tokenizer has a real
vocabulary (3 to 4 characters a token on Python, English prose and JSON tool
schemas) without shipping one: it is trained when the preset is built, in a
few seconds, on text every machine already has, the ``.py`` sources of
Python's standard library.

The corpus is the first ``MAX_CHARS_PER_FILE`` characters of every UTF-8
``.py`` file under ``sysconfig``'s ``stdlib`` directory, in sorted path order,
up to ``MAX_CORPUS_CHARS`` in all. Installed packages, the test suites and the
codec tables under ``encodings/`` are left out: they differ between
installations or are not code anyone writes. Taking the head of each file
spreads the corpus over the whole library (module docstrings are English
prose) instead of spending it on the first few large modules.

Training is deterministic: the trainer numbers the initial alphabet in sorted
order and each merge in the order it is made, and breaks ties between equally
frequent pairs by those numbers, so the same text gives the same
``tokenizer.json`` byte for byte, whatever the thread count. (A
continuing-subword prefix or end-of-word suffix would break this: the trainer
numbers those tokens in hash-map order. Neither is used.) The standard library
differs between Python releases, and so does the tokenizer; the preset records
the tokenizer's digest in its ``config.json`` so the model identity differs too.

The vocabulary has ``BPE_VOCAB_SIZE`` ids, the added tokens of a Qwen2.5-style
chat template included, after the trained ones: the ChatML markers and
``<|endoftext|>`` are special (``decode`` skips them when asked), the
``<tool_call>`` and ``<tool_response>`` tags are plain added tokens, so they
survive decoding and the tool-call parser finds them in the output text.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .byte_tokenizer import (
    CHATML_TOOLS_TEMPLATE,
    IM_END_TOKEN,
    IM_START_TOKEN,
    TOOL_CALL_END_TOKEN,
    TOOL_CALL_START_TOKEN,
    add_tokens,
    tokenizer_config,
)

END_OF_TEXT_TOKEN = "<|endoftext|>"
TOOL_RESPONSE_START_TOKEN = "<tool_response>"
TOOL_RESPONSE_END_TOKEN = "</tool_response>"
EOS_TOKEN = IM_END_TOKEN
PAD_TOKEN = END_OF_TEXT_TOKEN

# (token, is_special) in id order, right after the trained vocabulary.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (END_OF_TEXT_TOKEN, True),
    (IM_START_TOKEN, True),
    (IM_END_TOKEN, True),
    (TOOL_CALL_START_TOKEN, False),
    (TOOL_CALL_END_TOKEN, False),
    (TOOL_RESPONSE_START_TOKEN, False),
    (TOOL_RESPONSE_END_TOKEN, False),
)

BPE_VOCAB_SIZE = 12000  # all ids, added tokens included
MAX_CHARS_PER_FILE = 8192
MAX_CORPUS_CHARS = 4 << 20
MIN_PAIR_FREQUENCY = 2
SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings"})

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# The ChatML template of the byte presets, with a default system turn when the
# conversation has none: with it, prompts render the way Qwen2.5's do.
QWEN_TOOLS_TEMPLATE = (
    "{%- if not (messages and messages[0].role == 'system') %}\n"
    "    {%- set messages = [{'role': 'system', 'content': '" + DEFAULT_SYSTEM_PROMPT + "'}] + messages %}\n"
    "{%- endif %}\n" + CHATML_TOOLS_TEMPLATE
)


def stdlib_corpus(
    stdlib_dir: Path | None = None,
    *,
    max_chars_per_file: int = MAX_CHARS_PER_FILE,
    max_corpus_chars: int = MAX_CORPUS_CHARS,
) -> list[str]:
    """The training texts: the head of each standard-library ``.py`` file, in sorted path order."""
    root = stdlib_dir or Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    num_chars = 0
    for path in _stdlib_sources(root):
        try:
            text = path.read_bytes().decode("utf-8")[:max_chars_per_file]
        except UnicodeDecodeError:
            continue
        if num_chars + len(text) > max_corpus_chars:
            break
        texts.append(text)
        num_chars += len(text)
    return texts


def _stdlib_sources(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside the skipped directories, sorted by relative path."""
    relative_paths: list[str] = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in SKIPPED_STDLIB_DIRS]
        relative_dir = Path(directory).relative_to(root)
        relative_paths.extend((relative_dir / name).as_posix() for name in files if name.endswith(".py"))
    return [root / relative for relative in sorted(relative_paths)]


def train_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = BPE_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ids (fewer if the corpus runs out of pairs), added tokens last."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=MIN_PAIR_FREQUENCY,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen in the corpus or not
    )
    tokenizer.train_from_iterator(corpus, trainer)
    add_tokens(tokenizer, ADDED_TOKENS)
    return tokenizer


def bpe_tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content: no BOS (the template writes none), ChatML's end of turn as EOS."""
    return tokenizer_config(None, EOS_TOKEN, PAD_TOKEN, QWEN_TOOLS_TEMPLATE, model_max_length)


def save_bpe_tokenizer(directory: Path, tokenizer: Tokenizer, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config_text = json.dumps(bpe_tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n"
    (directory / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
