"""Fixtures shared by the cluster tests."""

from __future__ import annotations

import pytest

from rayturn.engine import LLMEngine


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    """The offline engine on the cluster's model: what every answer through the cluster must equal."""
    return LLMEngine.from_pretrained("tiny", dtype="float32")
