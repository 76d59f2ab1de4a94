"""Lets the tests here import their helper module, ``agent_clis``, by name."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
