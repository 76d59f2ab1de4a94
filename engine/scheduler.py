"""Decides what runs each step: continuous batching with chunked prefill.

Each step has a token budget (``max_num_batched_tokens``). Running sequences
that decode go first, one token each (stall-free batching: a long prompt being
computed never stalls a stream), then the running prompts' chunks, by class
(``priority.py``: continuations, interactive, background) and in admission
order within one: an unfinished prompt gets the next chunk that fits (never
past the prompt's end: output tokens made elsewhere, such as a prefill
server's first token, are computed one per step, as decodes,
``next_chunk_tokens``). A waiting sequence that goes before a running prompt
is admitted ahead of that prompt's chunk: one of a higher class (a tool's
result arriving while a new turn's long prompt is computed), or one of the
same class with little left to compute: at most a page (a prompt loaded from
the KV store, a prefill server's answer) or at most an eighth of what the
running prompt has left (a new turn of a session whose history is cached),
which spares the short one the whole wait (each such call delays the prompt
by at most an eighth). Those that go ahead may pass waiting sequences that do
not (among the first ``LOOKAHEAD`` of the queue). Other waiting sequences
are admitted in queue order with whatever budget, sequence slots and pages
remain. When pages run out, the last running sequence (the newest of the
lowest class) is preempted (its pages freed, its chunk of this step dropped,
to be recomputed later — cheaply, since its full pages stay in the prefix cache until evicted)
until the earlier one fits; none are admitted in a step that had to preempt.
The queue goes by class too, so under load the agents already working keep
going (a tool's result coming back continues a turn) while new turns wait,
and background work waits for room; a sequence preempted after it ran waits
ahead of every new arrival but background ones ahead only of background::

    waiting = [preempted (last preempted first)] + [continuations] + [interactive]
              + [background: preempted (last first), new], new ones oldest first

In a step where streams decode, the prompt chunks and admissions share at
most ``max_prefill_tokens_while_decoding`` tokens (None: the whole budget):
a step's time is each stream's time between two tokens, and a long prompt's
chunk sets it; a step without decodes has the whole budget, so a replica that
only computes prompts keeps its big chunks.

``SchedulerConfig.stall_free=False`` keeps the earlier policy (every running
sequence in class order, then the waiting ones), a benchmark's baseline.

With a drafter (speculative decoding), a running sequence that decodes may
run a draft after its token (``ScheduledChunk.draft``): its tokens count
against the budget, all drafts of a step together take at most half of it,
and each leaves a token of budget and a page for every running sequence
not yet scheduled, so prompt chunks still progress and no draft causes a preemption.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .priority import Priority
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Decodes before prompt chunks, and a waiting sequence that goes before a running prompt admitted ahead of it;
    # False: every running sequence in class order, then the waiting ones (the policy before it).
    stall_free: bool = True
    # The prompt tokens of a step in which a running sequence decodes (with stall_free); None: no cap.
    max_prefill_tokens_while_decoding: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and cap < 1:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 1, got {cap}")


# On a CPU, where a 2,048-token chunk of ``small`` takes about 2 s, a step in which streams decode computes at most
# this many prompt tokens: a long prompt takes as long in such chunks, and the streams wait a quarter as long
# between tokens (BENCHMARKS.md, ``bench/stall_free.py``).
CPU_PREFILL_TOKENS_WHILE_DECODING = 512


def prefill_cap(setting: int | None, device_type: str) -> int | None:
    """``max_prefill_tokens_while_decoding``: the setting, or where none is set CPU_PREFILL_TOKENS_WHILE_DECODING on
    a CPU, else None (no cap: an accelerator computes a whole budget's chunk in a fraction of a CPU's time; not
    measured)."""
    if setting is not None:
        return setting
    return CPU_PREFILL_TOKENS_WHILE_DECODING if device_type == "cpu" else None


# A waiting sequence goes ahead of a running prompt of its class with at most 1/SHORT_FACTOR of the tokens that
# prompt has left to compute (or at most a page).
SHORT_FACTOR = 8
# How many waiting sequences (from the queue's head) are looked at for admission ahead of a running prompt.
LOOKAHEAD = 16


# Up to the given number of draft tokens to verify after a decoding sequence's last token.
ProposeDraft = Callable[[Sequence, int], list[int]]


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # of the sequence's own tokens
    draft: list[int] = field(default_factory=list)  # draft tokens run after them, to verify

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_tokens + len(self.draft)

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
        return sum(chunk.num_scheduled_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, propose_draft: ProposeDraft | None = None
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.propose_draft = propose_draft
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
        """Queue a new sequence: behind every waiting one of its class or a higher one."""
        key = _queue_key(seq)
        self._enqueue(seq, lambda other: _queue_key(other) > key)

    def add_running(self, seq: Sequence) -> None:
        """Add a fork whose pages are already shared with a running sibling."""
        seq.status = SequenceStatus.RUNNING
        self._run(seq)

    def _enqueue(self, seq: Sequence, goes_before: Callable[[Sequence], bool]) -> None:
        position = next((index for index, other in enumerate(self.waiting) if goes_before(other)), len(self.waiting))
        self.waiting.insert(position, seq)

    def _run(self, seq: Sequence, ahead_of: Sequence | None = None) -> None:
        """Add to the running sequences: behind every one of its class or a higher one (but ahead of ``ahead_of``,
        the running prompt it was admitted before)."""
        rank = seq.priority.rank
        position = next(
            (index for index, other in enumerate(self.running) if other.priority.rank > rank or other is ahead_of),
            len(self.running),
        )
        self.running.insert(position, seq)

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
        step = _Step(self.config.max_num_batched_tokens)
        running = list(self.running)
        if self.config.stall_free:
            self._schedule_running(step, [seq for seq in running if not in_prompt(seq)])
            cap = self.config.max_prefill_tokens_while_decoding
            if step.out.chunks and cap is not None:
                step.cap(cap)
            self._schedule_running(step, [seq for seq in running if in_prompt(seq)], admit_ahead=True)
        else:
            self._schedule_running(step, running)
        if not step.out.preempted:
            self._admit(step)
        return step.out

    def _schedule_running(self, step: _Step, seqs: list[Sequence], admit_ahead: bool = False) -> None:
        """Give each of ``seqs`` (running, in order) its next chunk while budget lasts; with ``admit_ahead``,
        first admit the waiting sequences that go before it."""
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an earlier one
            if admit_ahead and not step.out.preempted:
                self._admit(step, ahead_of=seq)
            if step.budget <= 0:
                return
            num_new = min(next_chunk_tokens(seq, seq.num_computed_tokens), step.budget)
            if not self._allocate(step, seq, num_new):
                return  # it was the last one left: every later one was preempted first
            chunk = ScheduledChunk(seq, num_new)
            if num_new == 1 and self.propose_draft is not None:
                num_after = len(self.running) - len(step.out.chunks) - 1  # running ones not scheduled yet
                self._add_draft(chunk, min(step.draft_budget, step.budget - 1 - num_after), num_after)
            step.add(chunk)

    def _allocate(self, step: _Step, seq: Sequence, num_new: int) -> bool:
        """Pages for ``seq``'s next ``num_new`` tokens, preempting from the end of the running sequences (dropping
        a chunk this step gave one) until they fit; False when ``seq`` itself had to go."""
        while not self.kv_cache.allocate(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            step.drop(victim)
            step.out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, step: _Step, ahead_of: Sequence | None = None) -> None:
        """Admit waiting sequences in queue order while budget, slots and pages last; with ``ahead_of`` (a running
        prompt), those among the first LOOKAHEAD that go before it, passing over the others."""
        if ahead_of is None:
            while self.waiting and step.budget > 0 and self._try_admit(step, self.waiting[0]):
                pass
            return
        for seq in list(itertools.islice(self.waiting, LOOKAHEAD)):
            if step.budget <= 0:
                return
            self._try_admit(step, seq, ahead_of)

    def _try_admit(self, step: _Step, seq: Sequence, ahead_of: Sequence | None = None) -> bool:
        """Admit the waiting ``seq`` with its next chunk if slots and pages allow (and, with ``ahead_of``, if it
        goes before that running prompt)."""
        # A fresh request reserves slots for all n completions it will fork into.
        slots = seq.params.n if seq.num_output_tokens == 0 else 1
        if len(self.running) + slots > self.config.max_num_seqs:
            return False
        if ahead_of is not None and seq.priority.rank > ahead_of.priority.rank:
            return False
        hits = self.kv_cache.match_prefix(seq) if seq.num_computed_tokens == 0 else []
        num_cached = len(hits) * self.kv_cache.page_size
        num_left = seq.num_tokens - seq.num_computed_tokens - num_cached
        if ahead_of is not None and seq.priority is ahead_of.priority and not self._short(num_left, ahead_of):
            return False
        num_new = min(next_chunk_tokens(seq, seq.num_computed_tokens + num_cached), step.budget)
        if not self.kv_cache.allocate(seq, num_new, hits):
            return False
        self.waiting.remove(seq)
        seq.num_computed_tokens += num_cached
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RUNNING
        self._run(seq, ahead_of)
        step.add(ScheduledChunk(seq, num_new))
        return True

    def _short(self, num_tokens: int, prompt: Sequence) -> bool:
        """Whether ``num_tokens`` to compute are few enough to go ahead of the running ``prompt`` of the same class."""
        rest = prompt.num_prompt_tokens - prompt.num_computed_tokens
        return num_tokens <= max(self.kv_cache.page_size, rest // SHORT_FACTOR)

    def _add_draft(self, chunk: ScheduledChunk, max_tokens: int, num_pages_spare: int) -> None:
        """Give a decoding chunk a draft of up to ``max_tokens``, with pages that leave ``num_pages_spare`` free."""
        assert self.propose_draft is not None
        if max_tokens < 1 or chunk.seq.num_computed_tokens + 1 != chunk.seq.num_tokens:
            return
        draft = self.propose_draft(chunk.seq, max_tokens)
        if draft and self.kv_cache.allocate_draft(chunk.seq, len(draft), num_pages_spare):
            chunk.draft = draft

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        key = _queue_key(seq)
        self._enqueue(seq, lambda other: _queue_key(other) >= key)  # ahead of its class's others


class _Step:
    """A step being planned: its chunks and preempted sequences, and the budgets left."""

    def __init__(self, budget: int) -> None:
        self.out = SchedulerOutput()
        self.draft_budget = budget // 2
        self._left = budget
        # Once capped (``cap``): the tokens left under the cap, and how many chunks came before it (uncapped).
        self._capped_left: int | None = None
        self._num_uncapped = 0

    @property
    def budget(self) -> int:
        """The tokens the next chunk may take."""
        return self._left if self._capped_left is None else min(self._left, self._capped_left)

    def cap(self, tokens: int) -> None:
        """Let the chunks from now on take at most ``tokens`` together."""
        self._capped_left = tokens
        self._num_uncapped = len(self.out.chunks)

    def add(self, chunk: ScheduledChunk) -> None:
        self.out.chunks.append(chunk)
        self._left -= chunk.num_scheduled_tokens
        self.draft_budget -= len(chunk.draft)
        if self._capped_left is not None:
            self._capped_left -= chunk.num_scheduled_tokens

    def drop(self, seq: Sequence) -> None:
        """Take back the chunk ``seq`` was given this step (it was preempted), if any."""
        index = next((index for index, chunk in enumerate(self.out.chunks) if chunk.seq is seq), None)
        if index is None:
            return
        chunk = self.out.chunks.pop(index)
        self._left += chunk.num_scheduled_tokens
        self.draft_budget += len(chunk.draft)
        if self._capped_left is None:
            return
        if index < self._num_uncapped:
            self._num_uncapped -= 1
        else:
            self._capped_left += chunk.num_scheduled_tokens


def in_prompt(seq: Sequence) -> bool:
    """Whether the sequence's next chunk is part of its prompt (not a one-token decode)."""
    return seq.num_computed_tokens < seq.num_prompt_tokens


def _queue_key(seq: Sequence) -> tuple[int, int]:
    """Where a sequence waits (lower first): the preempted (admitted before) ahead of every new arrival, but
    background ones only ahead of background; the new by class."""
    preempted = seq.num_cached_prompt_tokens is not None
    if seq.priority is Priority.BACKGROUND:
        return seq.priority.rank, 0 if preempted else 1
    return (-1, 0) if preempted else (seq.priority.rank, 1)


def next_chunk_tokens(seq: Sequence, computed: int) -> int:
    """How many tokens after the first ``computed`` the sequence's next chunk may take (before the budget): the
    rest of its prompt, else one.

    Output tokens not computed yet (an output prefix made elsewhere: a prefill server's first token, the tokens
    a resumed stream had sent; or a preempted sequence's output past its cached pages) go one per step, as the
    decode steps that made them did: prefill and decode attention round differently, and a greedy choice
    between two nearly tied logits must come out as it did there.
    """
    if computed < seq.num_prompt_tokens:
        return seq.num_prompt_tokens - computed
    return min(seq.num_tokens - computed, 1)
