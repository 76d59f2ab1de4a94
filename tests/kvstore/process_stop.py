"""SIGSTOP that has taken hold: a test of a silent peer must not race the signal.

``kill`` returns as soon as the signal is queued; each thread of the target stops when it next comes
back to user space. On two busy cores that can be after the test's next request has been answered,
so a test that wants the peer silent waits until every thread shows the stopped state.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def thread_states(pid: int) -> list[str]:
    """The scheduler state of each thread of ``pid`` (``/proc/<pid>/task/*/stat``, the field after the name)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
        states.append(stat[stat.rindex(")") + 2])
    return states


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """Send SIGSTOP to ``pid`` and return once every one of its threads is stopped (``T``)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = thread_states(pid)
        if states and all(state == "T" for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout_s} s: thread states {states}")
        time.sleep(0.002)
