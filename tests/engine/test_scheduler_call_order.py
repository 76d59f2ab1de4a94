"""The scheduler serves by class: continuations before new turns before background work — exact queue orders."""

from __future__ import annotations

import pytest

from rayturn.engine.kv_cache_manager import KVCacheManager
from rayturn.engine.llm_engine import LLMEngine
from rayturn.engine.priority import Priority
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.scheduler import Scheduler, SchedulerConfig
from rayturn.engine.sequence import Sequence

PAGE = 4


def make(num_pages: int = 32, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, 64), KVCacheManager(num_pages, PAGE, "m", False))


def seq(seq_id: int, continues_turn: bool = False, num_tokens: int = 4, priority: Priority | None = None) -> Sequence:
    tokens = list(range(10 * seq_id, 10 * seq_id + num_tokens))
    waiting = Sequence(seq_id, str(seq_id), tokens, num_tokens, SamplingParams(max_tokens=100))
    waiting.priority = priority or (Priority.CONTINUATION if continues_turn else Priority.INTERACTIVE)
    return waiting


def step(scheduler: Scheduler) -> list[tuple[int, int]]:
    """One step as the engine runs it: each chunk computed, each sampling chunk gains a token; returns the
    (sequence, tokens) chunks."""
    chunks = scheduler.schedule().chunks
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.num_tokens
        if chunk.seq.num_computed_tokens == chunk.seq.num_tokens:
            chunk.seq.token_ids.append(99)
    return [(chunk.seq.seq_id, chunk.num_tokens) for chunk in chunks]


def run_chunks(scheduler: Scheduler) -> list[int]:
    return [seq_id for seq_id, _ in step(scheduler)]


def waiting_ids(scheduler: Scheduler) -> list[int]:
    return [waiting.seq_id for waiting in scheduler.waiting]


def test_continuations_queue_ahead_of_new_turns_in_arrival_order() -> None:
    scheduler = make()
    for seq_id, continues_turn in [(0, False), (1, True), (2, False), (3, True), (4, False)]:
        scheduler.add(seq(seq_id, continues_turn))
    assert waiting_ids(scheduler) == [1, 3, 0, 2, 4]


def test_a_full_replica_admits_the_continuation_first() -> None:
    scheduler = make(max_num_seqs=2)
    scheduler.add(seq(0))
    scheduler.add(seq(1))
    assert run_chunks(scheduler) == [0, 1]  # both run; the replica holds no more sequences
    scheduler.add(seq(2))
    scheduler.add(seq(3))
    scheduler.add(seq(4, continues_turn=True))
    assert waiting_ids(scheduler) == [4, 2, 3]
    scheduler.finish(scheduler.running[0], "stop")
    out = scheduler.schedule()
    assert [chunk.seq.seq_id for chunk in out.chunks] == [1, 4]  # the running one decodes, the continuation joins
    assert waiting_ids(scheduler) == [2, 3]


def test_preempted_sequences_stay_ahead_of_arriving_continuations() -> None:
    scheduler = make(num_pages=3)
    first, second = seq(0, num_tokens=8), seq(1, num_tokens=4)
    scheduler.add(first)
    scheduler.add(second)
    for chunk in scheduler.schedule().chunks:  # 3 pages, all used
        chunk.seq.num_computed_tokens += chunk.num_tokens
        chunk.seq.token_ids.append(99)
    assert [victim.seq_id for victim in scheduler.schedule().preempted] == [1]  # the first needs a 4th page
    scheduler.add(seq(2))
    scheduler.add(seq(3, continues_turn=True))
    assert waiting_ids(scheduler) == [1, 3, 2]


def test_the_engine_hands_the_call_kind_to_the_scheduler() -> None:
    engine = LLMEngine.from_pretrained("tiny", dtype="float32", max_num_seqs=1)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request([1, 2, 3], params, request_id="running")
    engine.step()
    engine.add_request([4, 5, 6], params, request_id="new-turn")
    engine.add_request([7, 8, 9], params, request_id="continuation", continues_turn=True)
    assert [waiting.request_id for waiting in engine.scheduler.waiting] == ["continuation", "new-turn"]
    finished: list[str] = []
    while engine.has_unfinished_requests():
        finished += [output.request_id for output in engine.step() if output.finished]
    assert finished == ["running", "continuation", "new-turn"]


BACKGROUND, INTERACTIVE, CONTINUATION = Priority.BACKGROUND, Priority.INTERACTIVE, Priority.CONTINUATION


def test_background_work_queues_behind_every_other_class() -> None:
    scheduler = make()
    arrivals = [(0, BACKGROUND), (1, INTERACTIVE), (2, BACKGROUND), (3, CONTINUATION), (4, INTERACTIVE)]
    for seq_id, priority in arrivals:
        scheduler.add(seq(seq_id, priority=priority))
    assert waiting_ids(scheduler) == [3, 1, 4, 0, 2]


def test_a_full_replica_admits_a_new_turn_before_background_work_that_waited_longer() -> None:
    scheduler = make(max_num_seqs=2)
    scheduler.add(seq(0, priority=BACKGROUND))
    scheduler.add(seq(1, priority=BACKGROUND))
    assert run_chunks(scheduler) == [0, 1]
    scheduler.add(seq(2, priority=BACKGROUND))
    scheduler.add(seq(3))  # a user's new turn, later
    scheduler.finish(scheduler.running[0], "stop")
    assert run_chunks(scheduler) == [1, 3]  # it joins ...
    assert run_chunks(scheduler) == [3, 1]  # ... and from the next step takes the budget first
    assert waiting_ids(scheduler) == [2]


def test_the_step_budget_goes_to_the_interactive_prompt_before_a_background_prompt() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 16), KVCacheManager(64, PAGE, "m", False))
    scheduler.add(seq(0, num_tokens=40, priority=BACKGROUND))
    assert step(scheduler) == [(0, 16)]
    scheduler.add(seq(1, num_tokens=12))
    # The new turn is admitted ahead of the running prompt's chunk, which gets what is left ...
    assert step(scheduler) == [(1, 12), (0, 4)]
    assert [running.seq_id for running in scheduler.running] == [1, 0]
    assert step(scheduler) == [(1, 1), (0, 15)]  # ... and from then on it decodes first, the prompt gets the rest


def test_out_of_pages_the_background_sequence_is_preempted_and_waits_behind_new_turns() -> None:
    scheduler = make(num_pages=3)
    interactive, background = seq(0, num_tokens=4), seq(1, num_tokens=4, priority=BACKGROUND)
    scheduler.add(background)
    scheduler.add(interactive)
    assert run_chunks(scheduler) == [0, 1]  # 2 of the 3 pages; the interactive one admitted first
    out = scheduler.schedule()  # each needs a page for its 5th token: only one is left
    assert [victim.seq_id for victim in out.preempted] == [1]
    scheduler.add(seq(2))
    scheduler.add(seq(3, priority=BACKGROUND))
    assert waiting_ids(scheduler) == [2, 1, 3]


def test_a_request_names_its_class_and_a_wrong_name_queues_nothing() -> None:
    engine = LLMEngine.from_pretrained("tiny", dtype="float32", max_num_seqs=1)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request([1, 2, 3], params, request_id="running")
    engine.step()
    engine.add_request([4, 5, 6], params, request_id="batch", priority="batch")
    engine.add_request([7, 8, 9], params, request_id="turn", priority="interactive")
    engine.add_request([7, 8, 9], params, request_id="tool", continues_turn=True, priority=BACKGROUND)
    assert [waiting.request_id for waiting in engine.scheduler.waiting] == ["turn", "batch", "tool"]
    with pytest.raises(ValueError, match="priority must be one of continuation, interactive, background, batch"):
        engine.add_request([1], params, request_id="bad", priority="urgent")
    assert [waiting.request_id for waiting in engine.scheduler.waiting] == ["turn", "batch", "tool"]
