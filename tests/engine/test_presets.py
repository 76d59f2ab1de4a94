"""Built-in presets: built once per cache, reproducible, the advertised size, and loadable by transformers."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

import rayturn.engine.scheduler
from rayturn.engine import LLMEngine, SamplingParams, bpe_tokenizer
from rayturn.engine.llm_engine import model_identity
from rayturn.engine.presets import PRESET_VERSION, PRESETS, TOKENIZER_DIGEST_KEY, preset_dir

PRESET_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_tiny_is_built_once_per_cache_root(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    built = preset_dir("tiny", root=root)
    assert built == root / f"tiny-v{PRESET_VERSION}"
    assert sorted(p.name for p in built.iterdir()) == PRESET_FILES
    assert [p.name for p in root.iterdir()] == [built.name]  # no staging directory left behind
    stamps = {name: (built / name).stat().st_mtime_ns for name in PRESET_FILES}

    assert preset_dir("tiny", root=root) == built
    assert {name: (built / name).stat().st_mtime_ns for name in PRESET_FILES} == stamps
    assert [p.name for p in root.iterdir()] == [built.name]


def test_tiny_is_byte_identical_across_builds(tmp_path: Path) -> None:
    first = preset_dir("tiny", root=tmp_path / "one")
    second = preset_dir("tiny", root=tmp_path / "two")
    assert first != second
    for name in PRESET_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_small_is_a_40m_parameter_gqa_model(tmp_path: Path) -> None:
    built = preset_dir("small", root=tmp_path)
    config = json.loads((built / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (8, 512)
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0

    with safe_open(str(built / "model.safetensors"), framework="pt") as handle:
        shapes = {name: handle.get_slice(name).get_shape() for name in handle.keys()}  # noqa: SIM118
    num_params = sum(math.prod(shape) for shape in shapes.values())
    assert 35_000_000 <= num_params <= 45_000_000

    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    per_layer = 2 * hidden * hidden + 2 * kv_size * hidden + 3 * hidden * inter + 2 * hidden
    untied = 0 if config["tie_word_embeddings"] else vocab * hidden
    assert num_params == vocab * hidden + config["num_hidden_layers"] * per_layer + hidden + untied
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [kv_size, hidden]
    assert len(shapes) == 9 * config["num_hidden_layers"] + 2 + (0 if config["tie_word_embeddings"] else 1)


def test_unknown_preset_lists_known_ones(tmp_path: Path) -> None:
    known = ", ".join(PRESETS)
    assert known == "tiny, small, tiny-bpe"
    with pytest.raises(ValueError, match=f"unknown preset 'huge'; known: {known}"):
        preset_dir("huge", root=tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(
        ValueError, match=r"'huge' is neither a preset \(tiny, small, tiny-bpe\), a directory, nor in the"
    ):
        LLMEngine.from_pretrained("huge")


def test_transformers_loads_tiny_and_agrees_greedily() -> None:
    transformers = pytest.importorskip("transformers")
    engine = LLMEngine.from_pretrained("tiny", backend="torch", dtype="float32", page_size=16, num_pages=32)
    model_dir = preset_dir("tiny")  # the same $RAYTURN_CACHE_DIR the engine used
    assert engine.model_id.startswith(model_dir.name + "@")

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "<|im_start|>user\nhé, <tool_call>?<|im_end|>"
    assert tokenizer.encode(text, add_special_tokens=False) == engine.tokenizer.encode(text)
    assert len(tokenizer) == engine.config.vocab_size
    assert tokenizer.eos_token_id == engine.tokenizer.eos_token_id

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [[72], list(b"def main():\n"), [(13 * i + 5) % 256 for i in range(40)]]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=8,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(out[0, len(prompt) :].tolist())
    assert [len(tokens) for tokens in expected] == [8, 8, 8]

    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(out.token_ids) for out in outs] == expected


def test_tiny_bpe_is_tiny_with_a_128k_context_and_a_trained_vocabulary() -> None:
    built = preset_dir("tiny-bpe")
    assert built.name == f"tiny-bpe-v{PRESET_VERSION}"
    assert sorted(p.name for p in built.iterdir()) == PRESET_FILES
    config = json.loads((built / "config.json").read_text())
    tiny = json.loads((preset_dir("tiny") / "config.json").read_text())
    shape_keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert {key: config[key] for key in shape_keys} == {key: tiny[key] for key in shape_keys}
    assert (config["max_position_embeddings"], config["rope_theta"]) == (131072, 1000000.0)

    tokenizer_config = json.loads((built / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]
    tokenizer_json = (built / "tokenizer.json").read_bytes()
    assert config[TOKENIZER_DIGEST_KEY] == hashlib.sha256(tokenizer_json).hexdigest()

    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    added = {token["content"]: token["id"] for token in json.loads(tokenizer_json)["added_tokens"]}
    assert config["vocab_size"] == len(vocab) + len(added) == bpe_tokenizer.BPE_VOCAB_SIZE
    assert (config["bos_token_id"], config["eos_token_id"]) == (added["<|endoftext|>"], added["<|im_end|>"])
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation == {
        "bos_token_id": added["<|endoftext|>"],
        "eos_token_id": added["<|im_end|>"],
        "pad_token_id": added["<|endoftext|>"],
    }


def test_tiny_bpe_identity_follows_the_standard_library_it_learned_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python releases ship different standard libraries: their presets share a name, not an identity."""
    corpus = bpe_tokenizer.stdlib_corpus(max_corpus_chars=1 << 20)  # enough text for the full vocabulary
    built = []
    for name, texts in (("one", corpus), ("other", corpus[:-1])):
        monkeypatch.setattr(bpe_tokenizer, "stdlib_corpus", lambda texts=texts: texts)
        built.append(preset_dir("tiny-bpe", root=tmp_path / name))
    first, other = built
    assert first.name == other.name
    assert (first / "tokenizer.json").read_bytes() != (other / "tokenizer.json").read_bytes()
    assert (first / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()
    configs = [json.loads((directory / "config.json").read_text()) for directory in built]
    assert configs[0].pop(TOKENIZER_DIGEST_KEY) != configs[1].pop(TOKENIZER_DIGEST_KEY)
    assert configs[0] == configs[1]
    assert model_identity(first) != model_identity(other)


def test_transformers_loads_tiny_bpe_and_agrees_greedily_past_tinys_context() -> None:
    transformers = pytest.importorskip("transformers")
    engine = LLMEngine.from_pretrained("tiny-bpe", backend="torch", dtype="float32", page_size=16, num_pages=512)
    model_dir = preset_dir("tiny-bpe")
    assert engine.model_id.startswith(model_dir.name + "@")
    assert engine.max_model_len == 131072

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "Read notes.txt"}]
    chat = engine.tokenizer.encode_chat(messages)
    assert chat == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    source = inspect.getsource(rayturn.engine.scheduler)
    long_prompt = engine.tokenizer.encode(source * (1 + 5000 * 4 // len(source)))[:5000]  # chunked, past 4096
    prompts = [chat, long_prompt]

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=8,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )
            expected.append(out[0, len(prompt) :].tolist())
    assert [len(tokens) for tokens in expected] == [8, 8]

    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(out.token_ids) for out in outs] == expected


@pytest.mark.parametrize("name", ["tiny", "small", "tiny-bpe"])
def test_the_tokenizer_config_states_the_models_context(name: str) -> None:
    """Clients that read ``tokenizer_config.json`` (as transformers does) see the context ``config.json`` gives."""
    built = preset_dir(name)
    config = json.loads((built / "config.json").read_text())
    tokenizer_config = json.loads((built / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]
    assert AutoTokenizer.from_pretrained(built).model_max_length == config["max_position_embeddings"]
