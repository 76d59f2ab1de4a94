"""A process's threads as ``/proc/<pid>/task`` shows them, for tests that watch or freeze a peer process.

``stop_process`` is SIGSTOP that has taken hold: ``kill`` returns as soon as the signal is queued, and
each thread of the target stops when it next comes back to user space. On two busy cores that can be
after the test's next request has been answered, so a test that wants the peer silent waits until
every thread shows the stopped state.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def thread_files(pid: int, name: str) -> Iterator[str]:
    """The text of ``/proc/<pid>/task/<tid>/<name>`` for each thread of ``pid`` (one that ends meanwhile is skipped)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            yield (task / name).read_text()
        except FileNotFoundError:
            continue


def thread_states(pid: int) -> list[str]:
    """The scheduler state of each thread of ``pid`` (from its ``stat``, the field after the name)."""
    return [stat[stat.rindex(")") + 2] for stat in thread_files(pid, "stat")]


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
