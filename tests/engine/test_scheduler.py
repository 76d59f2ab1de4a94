"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption — exact expectations."""

from __future__ import annotations

from rayturn.engine.kv_cache_manager import KVCacheManager
from rayturn.engine.priority import Priority
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, _Step
from rayturn.engine.sequence import Sequence, SequenceStatus

PAGE = 4


def make(num_pages: int, max_num_seqs: int = 8, budget: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget), KVCacheManager(num_pages, PAGE, "m", caching))


def seq(seq_id: int, num_tokens: int, first_token: int = 0) -> Sequence:
    tokens = list(range(first_token, first_token + num_tokens))
    return Sequence(seq_id, str(seq_id), tokens, num_tokens, SamplingParams(max_tokens=100))


def finish_step(scheduler: Scheduler, next_token: int = 7) -> list[tuple[int, int]]:
    """Schedule, pretend the model ran, append a token to sequences that sampled."""
    out = scheduler.schedule()
    plan = [(c.seq.seq_id, c.num_tokens) for c in out.chunks]
    sampling = [c.seq for c in out.chunks if c.samples]
    for chunk in out.chunks:
        chunk.seq.num_computed_tokens += chunk.num_tokens
    for s in sampling:
        s.token_ids.append(next_token)
    return plan


def test_chunked_prefill_respects_token_budget() -> None:
    scheduler = make(num_pages=32, budget=10)
    a, b = seq(0, 23), seq(1, 5, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    assert finish_step(scheduler) == [(0, 10)]  # a's first chunk takes the whole budget
    assert finish_step(scheduler) == [(0, 10)]
    assert finish_step(scheduler) == [(0, 3), (1, 5)]  # a finishes its prompt, b fits beside it
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    assert finish_step(scheduler) == [(0, 1), (1, 1)]  # both decode


def test_max_num_seqs_caps_admission() -> None:
    scheduler = make(num_pages=32, max_num_seqs=2)
    for i in range(3):
        scheduler.add(seq(i, 4, first_token=10 * i))
    assert finish_step(scheduler) == [(0, 4), (1, 4)]
    assert [s.seq_id for s in scheduler.waiting] == [2]
    scheduler.finish(scheduler.running[0], "stop")
    assert finish_step(scheduler) == [(1, 1), (2, 4)]


def test_preempts_newest_when_pages_run_out_and_recomputes_later() -> None:
    scheduler = make(num_pages=4, caching=False)
    a, b = seq(0, 8), seq(1, 4, first_token=50)
    scheduler.add(a)
    scheduler.add(b)
    assert finish_step(scheduler) == [(0, 8), (1, 4)]  # 2 + 1 pages used, 1 free
    assert [p.page_id for p in a.pages] == [0, 1] and [p.page_id for p in b.pages] == [2]
    # a's 9th token needs page 3; b's 5th needs another page: none left -> b (newest) preempted.
    assert finish_step(scheduler) == [(0, 1)]
    assert b.status is SequenceStatus.WAITING and b.pages == [] and b.num_computed_tokens == 0
    assert [s.seq_id for s in scheduler.waiting] == [1]
    assert [p.page_id for p in a.pages] == [0, 1, 3]
    scheduler.finish(a, "stop")
    # b comes back and recomputes its prompt, then its sampled token as a decode (as it was first computed),
    # before decoding on.
    assert finish_step(scheduler) == [(1, 4)]
    assert b.num_output_tokens == 1
    assert finish_step(scheduler) == [(1, 1)]
    assert b.num_output_tokens == 2


def test_output_tokens_made_elsewhere_are_computed_one_per_step_after_the_prompt() -> None:
    """A prefill server's first token, or the tokens a resumed stream had sent: each is computed by a decode-like
    one-token chunk, never in a prompt chunk (prefill and decode attention round differently)."""
    scheduler = make(num_pages=16, budget=64)
    b = seq(0, 12, first_token=50)
    b.token_ids.extend([62, 63])  # two output tokens made elsewhere
    scheduler.add(b)
    assert finish_step(scheduler) == [(0, 12)] and b.num_output_tokens == 2  # the prompt's chunk samples nothing
    assert finish_step(scheduler) == [(0, 1)] and b.num_output_tokens == 2  # token 62: nothing yet
    assert finish_step(scheduler) == [(0, 1)] and b.num_output_tokens == 3  # token 63: the next token is sampled
    assert finish_step(scheduler) == [(0, 1)] and b.num_output_tokens == 4  # decoding on


def test_preempted_sequence_reuses_its_cached_pages() -> None:
    scheduler = make(num_pages=5)
    a, b = seq(0, 8), seq(1, 9, first_token=50)
    scheduler.add(a)
    scheduler.add(b)
    assert finish_step(scheduler) == [(0, 8), (1, 9)]  # 2 + 3 pages: pool full
    assert finish_step(scheduler) == [(0, 1)]  # b preempted to give a a page
    scheduler.finish(a, "stop")
    # b's two full pages (tokens 0-7) are still cached: only 2 tokens recomputed, the rest of its prompt, then
    # its sampled token as a decode.
    assert finish_step(scheduler) == [(1, 1)]
    assert finish_step(scheduler) == [(1, 1)] and b.num_output_tokens == 2
    assert b.num_cached_prompt_tokens == 0  # counted at first admission only


def test_finish_frees_pages_tail_first() -> None:
    scheduler = make(num_pages=6, caching=False)
    a = seq(0, 10)
    scheduler.add(a)
    finish_step(scheduler)
    assert [p.page_id for p in a.pages] == [0, 1, 2]
    scheduler.finish(a, "length")
    assert scheduler.kv_cache.pool.free_queue.page_ids() == [3, 4, 5, 2, 1, 0]
    assert a.finish_reason == "length" and not scheduler.has_work


def classed(seq_id: int, num_tokens: int, priority: Priority, first_token: int = 0) -> Sequence:
    made = seq(seq_id, num_tokens, first_token)
    made.priority = priority
    return made


def test_a_running_decode_goes_before_a_long_prompt_of_a_higher_class() -> None:
    """Stall-free batching: the background stream keeps decoding while the new turn's prompt takes the rest."""
    scheduler = make(num_pages=32, budget=16)
    scheduler.add(classed(0, 4, Priority.BACKGROUND))
    assert finish_step(scheduler) == [(0, 4)]
    scheduler.add(classed(1, 40, Priority.INTERACTIVE, first_token=100))
    assert finish_step(scheduler) == [(0, 1), (1, 15)]
    assert [running.seq_id for running in scheduler.running] == [1, 0]  # the class order stands ...
    assert finish_step(scheduler) == [(0, 1), (1, 15)]  # ... yet the decode is not stalled
    assert finish_step(scheduler) == [(0, 1), (1, 10)]
    assert finish_step(scheduler) == [(1, 1), (0, 1)]  # both decode, in class order


def test_without_stall_free_the_long_prompt_takes_the_whole_budget() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 16, stall_free=False), KVCacheManager(32, PAGE, "m", True))
    scheduler.add(classed(0, 4, Priority.BACKGROUND))
    assert finish_step(scheduler) == [(0, 4)]
    scheduler.add(classed(1, 40, Priority.INTERACTIVE, first_token=100))
    assert finish_step(scheduler) == [(0, 1), (1, 15)]
    assert finish_step(scheduler) == [(1, 16)]  # the background stream waits for the prompt
    assert finish_step(scheduler) == [(1, 9), (0, 1)]


def test_a_continuation_is_admitted_ahead_of_a_running_long_prompt() -> None:
    scheduler = make(num_pages=32, budget=16)
    scheduler.add(classed(0, 40, Priority.INTERACTIVE))
    assert finish_step(scheduler) == [(0, 16)]
    scheduler.add(classed(1, 9, Priority.CONTINUATION, first_token=100))  # a tool's result comes back
    assert finish_step(scheduler) == [(1, 9), (0, 7)]
    assert finish_step(scheduler) == [(1, 1), (0, 15)]


def loaded_arrival(scheduler: Scheduler, seq_id: int) -> Sequence:
    """A sequence whose prompt's three full pages are cached (as pages loaded from the KV store are) and whose
    first output token was made elsewhere (a prefill server's): one token left to compute."""
    cached = seq(90 + seq_id, 12, first_token=200)
    scheduler.add(cached)
    assert finish_step(scheduler)[-1] == (90 + seq_id, 12)
    scheduler.finish(cached, "stop")
    return Sequence(seq_id, str(seq_id), [*range(200, 212), 7], 12, SamplingParams(max_tokens=100))


def test_a_sequence_of_the_same_class_with_at_most_a_page_to_compute_is_admitted_ahead() -> None:
    scheduler = make(num_pages=32, budget=16)
    arrival = loaded_arrival(scheduler, 1)
    scheduler.add(seq(0, 60))
    assert finish_step(scheduler) == [(0, 16)]
    scheduler.add(arrival)
    assert finish_step(scheduler) == [(1, 1), (0, 15)]
    assert arrival.num_cached_prompt_tokens == 12 and arrival.num_output_tokens == 2
    assert finish_step(scheduler) == [(1, 1), (0, 15)]


def test_a_sequence_of_the_same_class_with_more_to_compute_waits_and_a_short_one_behind_it_passes() -> None:
    scheduler = make(num_pages=32, budget=16)
    arrival = loaded_arrival(scheduler, 2)
    scheduler.add(seq(0, 60))
    assert finish_step(scheduler) == [(0, 16)]
    # Seven tokens to compute: more than a page, and more than an eighth of the 44 the running prompt has left.
    scheduler.add(seq(1, 7, first_token=100))
    assert finish_step(scheduler) == [(0, 16)]
    scheduler.add(arrival)
    assert finish_step(scheduler) == [(2, 1), (0, 15)]  # one token to compute: it passes the waiting one
    assert [waiting.seq_id for waiting in scheduler.waiting] == [1]
    assert finish_step(scheduler) == [(2, 1), (0, 13), (1, 2)]  # the prompt's last chunk, then the queue


def test_a_sequence_of_the_same_class_with_an_eighth_of_a_running_prompts_rest_is_admitted_ahead() -> None:
    scheduler = make(num_pages=80, budget=16)
    scheduler.add(seq(0, 200))
    assert finish_step(scheduler) == [(0, 16)]
    scheduler.add(seq(1, 23, first_token=300))  # 23 tokens: an eighth of the 184 the prompt has left
    assert finish_step(scheduler) == [(1, 16)]
    assert finish_step(scheduler) == [(1, 7), (0, 9)]
    scheduler.add(seq(2, 24, first_token=400))  # the prompt has 175 left: 24 tokens are more than an eighth
    assert finish_step(scheduler) == [(1, 1), (0, 15)]
    assert [waiting.seq_id for waiting in scheduler.waiting] == [2]


def test_a_prompt_that_needs_pages_preempts_a_decode_scheduled_before_it_and_takes_back_its_budget() -> None:
    scheduler = make(num_pages=8, budget=16, caching=False)
    background = classed(0, 4, Priority.BACKGROUND)
    scheduler.add(background)
    assert finish_step(scheduler) == [(0, 4)]
    scheduler.add(classed(1, 40, Priority.INTERACTIVE, first_token=100))
    assert finish_step(scheduler) == [(0, 1), (1, 15)]  # 2 + 4 of the 8 pages
    out = scheduler.schedule()  # the prompt's next 15 tokens need 4 more pages: the background one goes
    assert [(chunk.seq.seq_id, chunk.num_tokens) for chunk in out.chunks] == [(1, 15)]
    assert out.preempted == [background] and background.pages == [] and background.num_computed_tokens == 0
    assert [waiting.seq_id for waiting in scheduler.waiting] == [0]


def test_while_streams_decode_a_step_computes_at_most_the_cap_of_prompt_tokens() -> None:
    config = SchedulerConfig(8, 16, max_prefill_tokens_while_decoding=6)
    scheduler = Scheduler(config, KVCacheManager(32, PAGE, "m", True))
    scheduler.add(seq(0, 40))
    assert finish_step(scheduler) == [(0, 16)]  # nothing decodes: the whole budget
    stream = seq(1, 4, first_token=100)
    scheduler.add(stream)
    assert finish_step(scheduler) == [(1, 4), (0, 12)]  # a page's prompt goes ahead; still no decode
    assert finish_step(scheduler) == [(1, 1), (0, 6)]  # a stream decodes: the prompt gets the cap
    scheduler.add(classed(2, 9, Priority.CONTINUATION, first_token=200))
    assert finish_step(scheduler) == [(1, 1), (2, 6)]  # admitted ahead, the continuation takes the cap
    assert finish_step(scheduler) == [(1, 1), (2, 3), (0, 3)]
    scheduler.finish(stream, "stop")
    scheduler.add(seq(3, 30, first_token=300))
    assert finish_step(scheduler) == [(2, 1), (0, 3), (3, 3)]  # the continuation decodes now: still the cap


def test_without_a_cap_a_step_where_streams_decode_gives_the_prompt_the_rest_of_the_budget() -> None:
    scheduler = make(num_pages=32, budget=16)
    scheduler.add(seq(0, 4))
    assert finish_step(scheduler) == [(0, 4)]
    scheduler.add(seq(1, 40, first_token=100))
    assert finish_step(scheduler) == [(0, 1), (1, 15)]


def test_a_dropped_decode_gives_its_tokens_back_to_the_step_but_not_to_the_cap() -> None:
    """A decode preempted after the cap began frees budget, yet the prompt chunks after it stay within the cap."""
    step = _Step(16)
    decode, prompt = seq(0, 4), seq(1, 40, first_token=100)
    step.add(ScheduledChunk(decode, 1, draft=[5, 6]))
    step.cap(6)
    step.add(ScheduledChunk(prompt, 4))
    assert step.budget == 2
    step.drop(decode)
    assert step.budget == 2 and step.draft_budget == 8
    step.drop(prompt)
    assert step.budget == 6 and [chunk.seq for chunk in step.out.chunks] == []
