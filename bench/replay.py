"""Replay recorded agent traces against a rayturn cluster: ``rayturn replay`` as a script (``rayturn.replay.cli``).

python bench/replay.py [TRACES ...] [--quick] [--compare] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import sys

from rayturn.replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
