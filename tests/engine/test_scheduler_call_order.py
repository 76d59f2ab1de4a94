"""The scheduler admits waiting calls that continue a turn before waiting new turns — exact queue orders."""

from __future__ import annotations

from rayturn.engine.kv_cache_manager import KVCacheManager
from rayturn.engine.llm_engine import LLMEngine
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.scheduler import Scheduler, SchedulerConfig
from rayturn.engine.sequence import Sequence

PAGE = 4


def make(num_pages: int = 32, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, 64), KVCacheManager(num_pages, PAGE, "m", False))


def seq(seq_id: int, continues_turn: bool = False, num_tokens: int = 4) -> Sequence:
    tokens = list(range(10 * seq_id, 10 * seq_id + num_tokens))
    waiting = Sequence(seq_id, str(seq_id), tokens, num_tokens, SamplingParams(max_tokens=100))
    waiting.continues_turn = continues_turn
    return waiting


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
    scheduler.schedule()  # both run; the replica holds no more sequences
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
