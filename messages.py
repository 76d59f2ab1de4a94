"""What crosses a Ray handle between the cluster's processes, typed.

Built once at the edge (the ingress) and read by attribute everywhere else.
"""

from __future__ import annotations

from typing import Literal

# Where a call sits in its session: a new user message, or a tool's result coming back.
CallKind = Literal["user", "tool_continuation"]
# What follows a call's answer: a tool run (the agent is back in seconds), or the user (minutes).
NextStep = Literal["tool", "user"]
