"""A Hugging Face hub cache laid out as ``huggingface_hub`` writes it, holding a copy of a model directory."""

from __future__ import annotations

import hashlib
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_model(hub: Path, model_id: str, source: Path, revision: str = REVISION, main: bool = True) -> Path:
    """``hub/models--org--name/snapshots/<revision>/``: one symlink per file of ``source`` into ``blobs/``;
    ``refs/main`` names the revision when ``main``. Returns the snapshot directory."""
    repository = hub / ("models--" + model_id.replace("/", "--"))
    snapshot = repository / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repository / "blobs").mkdir(exist_ok=True)
    for item in sorted(source.iterdir()):
        data = item.read_bytes()
        blob = repository / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / item.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if main:
        (repository / "refs").mkdir(exist_ok=True)
        (repository / "refs" / "main").write_text(revision)
    return snapshot
