"""Decides what runs each step: continuous batching with chunked prefill.

Each step has a token budget (``max_num_batched_tokens``). Running sequences
go first, in admission order: a decode costs one token, an unfinished prompt
gets the next chunk that fits. When pages run out, the most recently admitted
running sequence is preempted (its pages freed, to be recomputed later —
cheaply, since its full pages stay in the prefix cache until evicted) until
the older one fits. Waiting sequences are admitted in queue order with
whatever budget, sequence slots and pages remain; none are admitted in a
step that had to preempt. The queue puts calls that continue an agent's turn
(a tool's result coming back) before new turns, so under load the agents
already working keep going while new work waits::

    waiting = [preempted (last preempted first)] + [continuations, oldest first] + [new turns, oldest first]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token (so it yields logits to sample)."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def load_stats(self) -> dict[str, int]:
        """What a router weighs: queued prompt tokens, running sequences, free and total pages."""
        return {
            "queued_prompt_tokens": sum(seq.num_tokens - seq.num_computed_tokens for seq in self.waiting)
            + sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) for seq in self.running),
            "running_seqs": len(self.running),
            "waiting_seqs": len(self.waiting),
            "max_num_seqs": self.config.max_num_seqs,
            "free_pages": self.kv_cache.num_free_pages,
            "total_pages": self.kv_cache.pool.num_pages,
        }

    def add(self, seq: Sequence) -> None:
        if not seq.continues_turn:
            self.waiting.append(seq)
            return
        # Behind the preempted and the continuations already waiting, ahead of every new turn that never ran.
        position = next(
            (
                index
                for index, other in enumerate(self.waiting)
                if not other.continues_turn and other.num_cached_prompt_tokens is None
            ),
            len(self.waiting),
        )
        self.waiting.insert(position, seq)

    def add_running(self, seq: Sequence) -> None:
        """Add a fork whose pages are already shared with a running sibling."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.kv_cache.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv_cache.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk(seq, num_new))
                budget -= num_new
                index += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # A fresh request reserves slots for all n completions it will fork into.
            slots = seq.params.n if seq.num_output_tokens == 0 else 1
            if len(self.running) + slots > self.config.max_num_seqs:
                break
            hits = self.kv_cache.match_prefix(seq) if seq.num_computed_tokens == 0 else []
            num_cached = len(hits) * self.kv_cache.page_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.kv_cache.allocate(seq, num_new, hits):
                break
            self.waiting.popleft()
            seq.num_computed_tokens += num_cached
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
