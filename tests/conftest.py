"""Session-wide test settings: offline model hubs, a private preset cache, the Triton interpreter on CPU."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton decides at import time whether its kernels run under the interpreter;
# without a GPU they must, so switch it on before any test module imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _offline_and_cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Never touch a model hub; keep presets in the user's cache unless CI asks otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if "RAYTURN_CACHE_DIR" not in os.environ:
        os.environ["RAYTURN_CACHE_DIR"] = str(Path(tmp_path_factory.getbasetemp()) / "rayturn-cache")
    yield
