"""Where the benchmarks read traces and write results by default.

Run from a source checkout (the package installed in editable mode, so its
root is the repository, ``bench/`` included), the defaults are the
repository's: traces in ``shared/traces/weka`` next to the repository, results
under its ``bench/results``. Installed from a wheel, with no checkout around
it, the same relative paths are taken from the current directory. An explicit
option overrides either.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent

CHECKOUT: Path | None = _PACKAGE_ROOT if (_PACKAGE_ROOT / "bench").is_dir() else None
if CHECKOUT is not None:
    DEFAULT_TRACES = CHECKOUT.parent / "shared" / "traces" / "weka"
    RESULTS_DIR = CHECKOUT / "bench" / "results"
else:
    DEFAULT_TRACES = Path("..", "shared", "traces", "weka")
    RESULTS_DIR = Path("bench", "results")
