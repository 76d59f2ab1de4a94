"""The ``rayturn`` command as the tests run it: the console script installed beside this interpreter, else the
module (a checkout run without installing)."""

from __future__ import annotations

import sys
from pathlib import Path


def rayturn_command() -> list[str]:
    script = Path(sys.executable).with_name("rayturn")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rayturn.cli"]
