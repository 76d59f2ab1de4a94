"""Recorded conversations as a replay reads them: trace files and folders, each conversation's shared prefix.

Every trace format the replay reads comes through ``load_traces``; a weka file
also gives the real-token length of its shared tool/system prefix
(``tool_tokens + system_tokens``, else ``DEFAULT_SHARED_PREFIX_TOKENS``), a
Mooncake file none (its global hash ids already mark shared blocks), a
TraceLab file the default.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rayturn.replay.trace_files import TRACE_SUFFIXES, load_traces
from rayturn.replay.traces import Conversation

DEFAULT_SHARED_PREFIX_TOKENS = 15_000


@dataclass(frozen=True, slots=True)
class TracedConversation:
    """A conversation and the real-token length of its shared tool/system prefix."""

    conversation: Conversation
    shared_prefix_tokens: int

    @property
    def conversation_id(self) -> str:
        return self.conversation.conversation_id


def read_traces(paths: Iterable[str | Path]) -> list[TracedConversation]:
    """Conversations of trace files or folders (folders: their trace files in name order), via ``load_traces``."""
    traced: list[TracedConversation] = []
    for path in _trace_files(paths):
        for conversation in load_traces([path]):
            if conversation.trace_format == "weka":
                prefix = _weka_prefix_tokens(path)
            elif conversation.trace_format == "mooncake":
                prefix = 0
            else:
                prefix = DEFAULT_SHARED_PREFIX_TOKENS
            traced.append(TracedConversation(conversation, prefix))
    return traced


def _trace_files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES)))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path}: no such trace file or folder")
    return files


def _weka_prefix_tokens(path: Path) -> int:
    """``tool_tokens + system_tokens`` of a weka file; the default when either is absent."""
    data = json.loads(path.read_text())
    counts = []
    for key in ("tool_tokens", "system_tokens"):
        value = data.get(key)
        if value is None:
            return DEFAULT_SHARED_PREFIX_TOKENS
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: {key}: expected a non-negative integer, got {value!r}")
        counts.append(value)
    return sum(counts)


def pick_conversations(
    traced: Sequence[TracedConversation], limit: int | None, busiest_within_s: float | None = None
) -> list[TracedConversation]:
    """The first ``limit`` conversations, or (``busiest_within_s``) those opening the most turns that soon, in order."""
    if limit is None or limit >= len(traced):
        return list(traced)
    if busiest_within_s is None:
        return list(traced[:limit])

    def turns_in_window(item: TracedConversation) -> int:
        return sum(1 for call in item.conversation.calls if call.starts_turn and call.arrival_s <= busiest_within_s)

    chosen = set(heapq.nlargest(limit, range(len(traced)), key=lambda i: (turns_in_window(traced[i]), -i)))
    return [item for i, item in enumerate(traced) if i in chosen]
