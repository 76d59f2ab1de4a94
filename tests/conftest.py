"""Session-wide test settings: offline model hubs, and a private cache for built-in presets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _offline_and_cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Never touch a model hub; keep presets in the user's cache unless CI asks otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if "RAYTURN_CACHE_DIR" not in os.environ:
        os.environ["RAYTURN_CACHE_DIR"] = str(Path(tmp_path_factory.getbasetemp()) / "rayturn-cache")
    yield
