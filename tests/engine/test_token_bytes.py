"""Each token id's raw bytes, read from the vocabulary, for every kind of tokenizer the models use."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models

from rayturn.engine.presets import preset_dir
from rayturn.engine.token_bytes import TokenBytes, byte_level_alphabet, token_display
from rayturn.engine.tokenizer import Tokenizer as ModelTokenizer

TEXT = "héllo wörld — 日本語 🎉 def f(x):\n    return x\t\x00"


def test_the_byte_level_alphabet_covers_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert (alphabet["!"], alphabet["Ġ"], alphabet["ÿ"]) == (ord("!"), ord(" "), 0xFF)


@pytest.mark.parametrize("preset", ["tiny", "tiny-bpe"])
def test_a_texts_tokens_hold_its_bytes(preset: str) -> None:
    tokenizer = ModelTokenizer.from_dir(preset_dir(preset))
    token_bytes = TokenBytes(tokenizer.backend)
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert b"".join(token_bytes(token_id) for token_id in token_ids) == TEXT.encode()
    assert len({token_bytes(token_id) for token_id in range(tokenizer.vocab_size)}) == tokenizer.vocab_size
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None and token_bytes(im_end) == b"<|im_end|>"
    assert token_bytes(tokenizer.vocab_size + 5) == b""  # a padded vocabulary's spare rows stand for nothing


def test_byte_fallback_and_word_pieces() -> None:
    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581hello": 3, "lo": 4}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    token_bytes = TokenBytes(backend)
    assert [token_bytes(token_id) for token_id in range(1, 5)] == [b"\xc3", b"\xa9", b" hello", b"lo"]


def test_display_names_partial_characters_by_their_bytes() -> None:
    assert token_display("é".encode()) == "é"
    assert token_display(b"\xe2\x80") == "bytes:\\xe2\\x80"
    assert token_display(b"") == ""
