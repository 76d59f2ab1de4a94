"""The scheduler under random load: every step keeps its invariants, and every request finishes.

Random arrivals of every class (some sharing a cached prefix, some with a
first token made elsewhere), few pages so that preemption happens, both
policies (stall-free and the one before it), some with a cap on the prompt
tokens of a step in which streams decode. Each step is checked as the
engine would use it, then "run": chunks computed, a token appended where a
chunk reaches a sequence's end, sequences finished at their length.
"""

from __future__ import annotations

import random

import pytest

from rayturn.engine.kv_cache_manager import KVCacheManager
from rayturn.engine.priority import Priority
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, in_prompt, next_chunk_tokens
from rayturn.engine.sequence import Sequence, SequenceStatus

PAGE = 4
SHARED = list(range(500, 524))  # a prefix many prompts start with (six pages)


def arrival(rng: random.Random, seq_id: int) -> Sequence:
    prompt = (SHARED[: rng.choice((0, 8, 24))] if rng.random() < 0.5 else []) + [
        rng.randrange(1000, 2000) for _ in range(rng.randint(1, 20))
    ]
    max_tokens = rng.randint(1, 8)
    made = Sequence(seq_id, str(seq_id), list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens))
    made.priority = rng.choice(list(Priority))
    if max_tokens > 1 and rng.random() < 0.2:
        made.token_ids.append(rng.randrange(1000, 2000))  # its first token was made elsewhere
    return made


def check_step(scheduler: Scheduler, out: SchedulerOutput, before: list[Sequence]) -> None:
    config = scheduler.config
    seqs = [chunk.seq for chunk in out.chunks]
    assert len(set(seqs)) == len(seqs), "a sequence scheduled twice"
    assert out.num_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    ranks = [seq.priority.rank for seq in scheduler.running]
    assert ranks == sorted(ranks), "the running sequences out of class order"
    for chunk in out.chunks:
        seq = chunk.seq
        assert seq.status is SequenceStatus.RUNNING and seq in scheduler.running and seq not in out.preempted
        assert 1 <= chunk.num_tokens <= next_chunk_tokens(seq, seq.num_computed_tokens)
        assert len(seq.pages) * PAGE >= seq.num_computed_tokens + chunk.num_scheduled_tokens
    for seq in out.preempted:
        assert seq.status is SequenceStatus.WAITING and seq.pages == [] and seq in scheduler.waiting
    decoded = decode_tokens(out, before)
    cap = config.max_prefill_tokens_while_decoding
    if config.stall_free and decoded and cap is not None:
        assert out.num_tokens - decoded <= cap
    if config.stall_free and any(in_prompt(chunk.seq) for chunk in out.chunks):
        # No prompt chunk ran while a stream that was decoding (and still runs) went without its token.
        decoding = [seq for seq in before if not in_prompt(seq)]
        assert all(seq in seqs for seq in decoding if seq.status is SequenceStatus.RUNNING)


def decode_tokens(out: SchedulerOutput, before: list[Sequence]) -> int:
    """The tokens the step gave the sequences that were running and decoding before it (their drafts too)."""
    return sum(chunk.num_scheduled_tokens for chunk in out.chunks if chunk.seq in before and not in_prompt(chunk.seq))


def capped(config: SchedulerConfig, out: SchedulerOutput, before: list[Sequence]) -> bool:
    """Whether the step's prompt tokens reached the cap while streams decoded."""
    decoded = decode_tokens(out, before)
    return bool(decoded) and out.num_tokens - decoded == config.max_prefill_tokens_while_decoding


def run_chunks(scheduler: Scheduler, out: SchedulerOutput, rng: random.Random) -> None:
    for chunk in out.chunks:
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng.randrange(1000, 2000))
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, "length")


def drive(seed: int) -> tuple[list[Sequence], Scheduler, int, int, int]:
    """Run one random load to its end, checking every step; returns its requests, the scheduler, and how many
    preemptions, admissions ahead of a running prompt and steps capped while streams decode happened."""
    rng = random.Random(seed)
    cap = rng.randint(1, 12) if seed % 4 == 1 else None
    num_seqs, budget = rng.randint(1, 6), rng.randint(4, 40)
    config = SchedulerConfig(num_seqs, budget, stall_free=seed % 3 != 0, max_prefill_tokens_while_decoding=cap)
    num_pages = rng.randint(14, 24)  # the longest sequence (44 prompt and 8 output tokens) needs 13
    scheduler = Scheduler(config, KVCacheManager(num_pages, PAGE, "m", enable_prefix_caching=seed % 2 == 0))
    arrivals = [arrival(rng, seq_id) for seq_id in range(rng.randint(10, 40))]
    pending = list(arrivals)
    num_preempted = num_admitted_ahead = num_capped = 0
    for _ in range(3000):
        for _ in range(rng.choice((0, 0, 1, 2))):
            if pending:
                scheduler.add(pending.pop(0))
        if not scheduler.has_work and not pending:
            break
        before = list(scheduler.running)
        waiting = set(scheduler.waiting)
        out = scheduler.schedule()
        check_step(scheduler, out, before)
        num_preempted += len(out.preempted)
        num_capped += capped(config, out, before)
        order = [chunk.seq for chunk in out.chunks]
        prompts = [order.index(seq) for seq in before if seq in order and in_prompt(seq)]
        admitted = [index for index, seq in enumerate(order) if seq in waiting]
        num_admitted_ahead += bool(prompts and admitted and min(admitted) < max(prompts))
        run_chunks(scheduler, out, rng)
    return arrivals, scheduler, num_preempted, num_admitted_ahead, num_capped


@pytest.mark.parametrize("seed", range(60))
def test_random_load_keeps_the_invariants_and_finishes_every_request(seed: int) -> None:
    arrivals, scheduler, *_ = drive(seed)
    assert not scheduler.has_work, "requests left unfinished: the scheduler stalled"
    assert all(seq.status is SequenceStatus.FINISHED for seq in arrivals)
    assert all(seq.num_output_tokens == seq.params.max_tokens for seq in arrivals)
    assert scheduler.kv_cache.num_free_pages == scheduler.kv_cache.pool.num_pages


def test_the_random_loads_preempt_admit_ahead_and_cap() -> None:
    """The loads above reach the paths they are meant to check: preemption, admission ahead of a prompt, and the
    cap on a step's prompt tokens while streams decode."""
    counts = [drive(seed)[2:] for seed in range(60)]
    assert sum(preempted for preempted, _, _ in counts) > 0
    assert sum(ahead for _, ahead, _ in counts) > 0
    assert sum(capped for _, _, capped in counts) > 0
