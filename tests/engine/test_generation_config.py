"""The end-of-turn tokens of a checkpoint's generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayturn.engine.generation_config import generation_eos_token_ids


def _write(directory: Path, config: object) -> Path:
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_a_list_of_end_tokens_is_read_whole(tmp_path: Path) -> None:
    # GPT-OSS: <|return|>, <|endoftext|>, and <|call|>, which its config.json does not name.
    config = {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999}
    assert generation_eos_token_ids(_write(tmp_path, config)) == {200002, 199999, 200012}


def test_one_id_none_or_no_file(tmp_path: Path) -> None:
    assert generation_eos_token_ids(tmp_path) == frozenset()
    assert generation_eos_token_ids(_write(tmp_path, {"eos_token_id": 2})) == {2}
    assert generation_eos_token_ids(_write(tmp_path, {"do_sample": True})) == frozenset()


@pytest.mark.parametrize("config", [{"eos_token_id": "</s>"}, {"eos_token_id": [2, None]}, [2]])
def test_a_bad_file_names_itself(tmp_path: Path, config: object) -> None:
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        generation_eos_token_ids(_write(tmp_path, config))
