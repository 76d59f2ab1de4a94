"""Closed-loop coding-agent sessions against a cluster: ``rayturn bench`` as a script.

The benchmark is ``rayturn.replay.agent_sessions``.

    python bench/agent_sessions.py [--quick] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import sys

from rayturn.replay.agent_sessions import main

if __name__ == "__main__":
    sys.exit(main())
