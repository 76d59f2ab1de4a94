"""Model names: presets, model directories, and Hugging Face ids found in the local hub cache, never downloaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hf_cache import REVISION, cache_model

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.model_source import cached_snapshot, checkpoint_dtype, hub_cache_dir
from rayturn.engine.presets import preset_dir, resolve_model, resolve_model_dir

MODEL_ID = "rayturn-test/tiny-copy"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


def test_the_hub_cache_is_found_as_huggingface_hub_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(variable, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "old"))
    assert hub_cache_dir() == tmp_path / "old"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hub_cache_dir() == tmp_path / "new"


def test_a_cached_id_resolves_to_the_snapshot_refs_main_names(hub: Path, tmp_path: Path) -> None:
    older = cache_model(hub, MODEL_ID, preset_dir("tiny"), revision="f" * 40, main=False)
    snapshot = cache_model(hub, MODEL_ID, preset_dir("tiny"))
    os.utime(older, (4_000_000_000, 4_000_000_000))  # the newest snapshot, but not the one main names
    assert cached_snapshot(MODEL_ID) == snapshot and snapshot.name == REVISION
    assert resolve_model(MODEL_ID) == str(snapshot) and resolve_model_dir(MODEL_ID) == snapshot
    (hub / "models--rayturn-test--tiny-copy" / "refs" / "main").unlink()
    assert cached_snapshot(MODEL_ID) == older  # without refs/main: the newest
    assert cached_snapshot("rayturn-test/absent") is None


def test_the_engine_loads_a_cached_id_and_answers_as_the_preset_does(hub: Path) -> None:
    cache_model(hub, MODEL_ID, preset_dir("tiny"))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    cached = LLMEngine.from_pretrained(MODEL_ID, backend="torch", num_pages=32).generate([[1, 2, 3]], params)
    preset = LLMEngine.from_pretrained("tiny", backend="torch", num_pages=32).generate([[1, 2, 3]], params)
    assert cached[0].token_ids == preset[0].token_ids


def test_presets_keep_their_names_and_directories_become_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model("tiny") == "tiny"
    copy = shutil.copytree(preset_dir("tiny"), tmp_path / "models" / "mine")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("models/mine") == str(copy.absolute())


def test_an_id_in_no_cache_names_the_cache_and_how_to_download_it(hub: Path) -> None:
    with pytest.raises(ValueError) as error:
        resolve_model("org/name")
    assert str(error.value) == (
        f"model 'org/name' is neither a preset (tiny, small, tiny-bpe), a directory, nor in the Hugging Face "
        f"cache at {hub}; download it first, e.g. `huggingface-cli download org/name`"
    )
    with pytest.raises(ValueError, match=r"^model '/no/such/dir' is neither .* at \S+$"):  # a path: no download hint
        resolve_model("/no/such/dir")


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_directory_missing_a_file_names_it(tmp_path: Path, missing: str) -> None:
    directory = Path(shutil.copytree(preset_dir("tiny"), tmp_path / "model"))
    (directory / missing).unlink()
    expected = f"{directory}: no weights" if missing == "model.safetensors" else f"{directory / missing}: missing"
    with pytest.raises(ValueError, match="^" + expected):
        resolve_model(str(directory))


def test_a_cached_snapshot_missing_a_file_names_it(hub: Path) -> None:
    snapshot = cache_model(hub, MODEL_ID, preset_dir("tiny"))
    (snapshot / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=f"^{snapshot / 'tokenizer.json'}: missing"):
        resolve_model(MODEL_ID)


def test_the_checkpoint_dtype_is_the_recorded_one_when_supported(tmp_path: Path) -> None:
    assert checkpoint_dtype(preset_dir("tiny")) == "float32"
    for recorded, expected in [({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float16"}, "float16"),
                               ({"torch_dtype": "float64"}, None), ({}, None)]:  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps(recorded))
        assert checkpoint_dtype(tmp_path) == expected
