"""Where a model that is not a preset lives: a directory, or a Hugging Face model id in the local cache.

Nothing here reaches the network. A Hugging Face id (``org/name``, or a bare
``name``) resolves only to a checkpoint already downloaded, found where
``huggingface_hub`` keeps it: the hub cache is ``$HF_HUB_CACHE`` (or the
older ``$HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``; the checkpoint is
``models--org--name/snapshots/<revision>/`` there, the revision that
``refs/main`` names when present (else the newest snapshot). A path that
exists is a directory, never an id.

Either way the directory must hold what the engine loads, or a ValueError
names the missing file by its path in the directory: ``config.json``,
``tokenizer.json`` and safetensors weights (``loader.safetensors_files``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .loader import DTYPES, safetensors_files
from .tokenizer import TOKENIZER_FILE

CONFIG_FILE = "config.json"

# What the hub accepts as a repository id: an optional namespace, then the name.
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as ``huggingface_hub`` finds it."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    home = os.environ.get("HF_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface") / "hub"


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is shaped like a Hugging Face model id (``org/name`` or ``name``)."""
    return _HUB_ID.fullmatch(name) is not None and ".." not in name


def cached_snapshot(model_id: str, cache_dir: Path | None = None) -> Path | None:
    """The cached checkpoint of ``model_id``: the snapshot ``refs/main`` names, else the newest; None when absent."""
    repository = (cache_dir or hub_cache_dir()) / ("models--" + model_id.replace("/", "--"))
    snapshots = repository / "snapshots"
    main_ref = repository / "refs" / "main"
    if main_ref.is_file():
        named = snapshots / main_ref.read_text().strip()
        if named.is_dir():
            return named
    found = sorted(snapshots.iterdir(), key=lambda path: path.stat().st_mtime) if snapshots.is_dir() else []
    found = [path for path in found if path.is_dir()]
    return found[-1] if found else None


def check_model_dir(directory: Path) -> Path:
    """``directory`` when it holds a loadable checkpoint; ValueError naming the first missing file otherwise."""
    for required in (CONFIG_FILE, TOKENIZER_FILE):
        if not (directory / required).is_file():
            raise ValueError(
                f"{directory / required}: missing; a model directory holds {CONFIG_FILE}, {TOKENIZER_FILE} "
                "and safetensors weights"
            )
    safetensors_files(directory)  # raises naming the directory and the weight files it expects
    return directory


def local_model_dir(name: str) -> Path | None:
    """The checked, absolute directory of a model directory or a cached Hugging Face id; None for neither."""
    path = Path(name).expanduser()
    if path.is_dir():
        return check_model_dir(path.absolute())
    if path.exists() or not is_hub_id(name):
        return None
    snapshot = cached_snapshot(name)
    return None if snapshot is None else check_model_dir(snapshot.absolute())


def checkpoint_dtype(directory: Path) -> str | None:
    """The dtype ``config.json`` records (``torch_dtype``, or ``dtype`` in newer files) when rayturn runs it."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    recorded = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    return recorded if isinstance(recorded, str) and recorded in DTYPES else None
