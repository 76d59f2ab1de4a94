"""The energy ledger: accounts per request and session, alone and fed by the offline engine on ``tiny``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import pytest
import torch

from rayturn.engine import LLMEngine, SamplingParams
from rayturn.engine.energy import (
    CostCoefficients,
    EnergyLedger,
    ModelMeter,
    OnlineCalibrator,
    RequestWork,
    StepAttribution,
    select_meter,
)
from rayturn.engine.outputs import CompletionOutput, RequestOutput
from rayturn.engine.scheduler import ScheduledChunk
from rayturn.engine.sequence import Sequence

MODEL = CostCoefficients(
    fixed_j=1.0, token_j=0.01, knee_tokens=64, request_j=0.05, context_j=1e-4, attention_j=1e-5, page_move_j=0.05
)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def joule_per_read_meter() -> ModelMeter:
    """Each read one second later on a 1 W clock: every step measures exactly 1 J."""
    ticks = itertools.count()
    return ModelMeter(lambda: float(next(ticks)), power_w=1.0)


def fixed_ledger(page_size: int = 16) -> EnergyLedger:
    """A ledger on a 1 J-per-step meter whose model never refits (its split is ``MODEL``'s)."""
    calibrator = OnlineCalibrator(MODEL, window_steps=10**6, min_steps=10**6)
    return EnergyLedger(joule_per_read_meter(), page_size, calibrator)


def output(request_id: str, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, [1], "a", "length" if finished else None, None, None)
    return RequestOutput(request_id, [1, 2], 0, (completion,), finished)


def test_step_joules_are_split_among_requests_and_summed_per_session() -> None:
    ledger = EnergyLedger(
        ModelMeter(lambda: 0.0, 1.0), 16, OnlineCalibrator(MODEL, min_steps=10**3, window_steps=10**3)
    )
    ledger.open("a", "s1")
    ledger.open("b", "s1")
    ledger.open("c", None)
    works = [RequestWork.chunk("a", 3000, 1), RequestWork.chunk("b", 10, 1), RequestWork.chunk("c", 0, 200)]
    first = ledger.record(works, energy_j=10.0, step_s=0.1)
    second = ledger.record(works[:2], energy_j=4.0, step_s=0.1)
    assert first.exact and sum(first.shapley_j) == pytest.approx(10.0) and sum(second.shapley_j) == pytest.approx(4.0)
    assert first.shapley_j[0] > first.shapley_j[1]  # a long context costs more to attend
    assert list(first.proportional_j) == pytest.approx([10 / 202, 10 / 202, 2000 / 202])
    accounts = {rid: ledger.request_energy(rid) for rid in "abc"}
    energy_j = {rid: account.shapley_j for rid, account in accounts.items() if account is not None}
    assert sum(energy_j.values()) == pytest.approx(14.0)
    assert ledger.session_energy_j("s1") == pytest.approx(energy_j["a"] + energy_j["b"])

    reported = ledger.annotate([output("a", finished=False), output("b", finished=True), output("z", finished=True)])
    assert reported[0].energy_j == pytest.approx(energy_j["a"]) and reported[0].energy_meter == "model"
    assert reported[2].energy_j == 0.0  # never ran a step
    assert ledger.request_energy("b") is None and ledger.request_energy("a") is not None
    ledger.close("a")
    assert ledger.request_energy("a") is None
    assert ledger.session_energy_j("s1") > 0.0  # the session keeps what its requests spent


def test_sessions_beyond_the_bound_forget_the_least_recent() -> None:
    ledger = fixed_ledger()
    ledger.max_sessions = 2
    for session in ("s1", "s2", "s3"):
        ledger.open(session, session)
        ledger.record([RequestWork.chunk(session, 0, 1)], energy_j=1.0, step_s=0.01)
    assert ledger.session_energy_j("s1") == 0.0
    assert ledger.session_energy_j("s3") == pytest.approx(1.0)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", backend="torch", dtype="float32", page_size=16)


def test_the_engine_reports_each_requests_energy_and_its_sessions(engine: LLMEngine) -> None:
    assert engine.energy.meter.name == select_meter(torch.device("cpu")).name
    engine.energy = fixed_ledger(engine.page_size)
    long_id = engine.add_request([3] * 900, GREEDY, session_id="agent")
    short_id = engine.add_request([4] * 20, GREEDY, session_id="agent")
    other_id = engine.add_request([5] * 20, GREEDY)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.energy_meter == "model" and out.energy_j is not None
            if out.finished:
                finished[out.request_id] = out
    energy = {rid: out.energy_j or 0.0 for rid, out in finished.items()}
    assert sum(energy.values()) == pytest.approx(engine.energy.energy_j) and engine.energy.energy_j > 0
    assert energy[long_id] > energy[short_id] > 0  # the long prompt's prefill and its long-context decodes
    assert engine.energy.session_energy_j("agent") == pytest.approx(energy[long_id] + energy[short_id])
    assert engine.energy.request_energy(long_id) is None  # reported finished: account dropped
    assert other_id in energy


def test_an_aborted_request_leaves_no_account_but_its_session_keeps_its_joules(engine: LLMEngine) -> None:
    engine.energy = fixed_ledger(engine.page_size)
    request_id = engine.add_request([6] * 40, SamplingParams(max_tokens=50, temperature=0.0), session_id="gone")
    engine.step()
    engine.step()
    assert engine.energy.request_energy(request_id) is not None
    engine.abort(request_id)
    assert engine.energy.request_energy(request_id) is None
    assert engine.energy.session_energy_j("gone") == pytest.approx(2.0)


def test_forked_completions_are_charged_to_their_request(engine: LLMEngine) -> None:
    engine.energy = fixed_ledger(engine.page_size)
    (out,) = engine.generate([[7] * 30], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True))
    assert len(out.completions) == 3
    assert out.energy_j == pytest.approx(engine.energy.energy_j)
    assert engine.energy.stats()["steps"] == engine.energy.num_steps == 4


class WorkLog(EnergyLedger):
    """A ledger that keeps the works it was given."""

    def __init__(self) -> None:
        super().__init__(joule_per_read_meter(), 16, OnlineCalibrator(MODEL), moves_pages=True)
        self.works: list[list[RequestWork]] = []

    def record(self, works: Seq[RequestWork], energy_j: float, step_s: float) -> StepAttribution:
        self.works.append(list(works))
        return super().record(works, energy_j, step_s)


def test_a_chunk_charges_its_store_loads_once_and_its_prompt_pages_saved_once() -> None:
    ledger = WorkLog()
    seq = Sequence(seq_id=0, request_id="r", token_ids=list(range(80)), num_prompt_tokens=80, params=GREEDY)
    seq.num_cached_prompt_tokens = seq.num_computed_tokens = 32
    seq.num_loaded_prompt_tokens = 20  # two pages, the second partly filled
    with ledger.step([ScheduledChunk(seq, 48)]):  # the rest of the prompt: it samples, its 5 - 2 new pages saved
        seq.num_computed_tokens += 48
    seq.token_ids.append(1)
    with ledger.step([ScheduledChunk(seq, 1)]):
        seq.num_computed_tokens += 1
    assert ledger.works == []  # both steps queued (fewer than flush_steps), recorded together below
    ledger.flush()
    assert ledger.works == [[RequestWork.chunk("r", 32, 48, pages_moved=2 + 3)], [RequestWork.chunk("r", 80, 1)]]


def varying_ledger(page_size: int, flush_steps: int) -> EnergyLedger:
    """A ledger whose meter measures a different, known number of joules each step and whose model refits every
    few steps: a step's split depends on the steps recorded before it."""
    ticks = itertools.count()
    readings = itertools.accumulate(1.0 + (next(ticks) % 7) * 0.25 for _ in itertools.count())
    calibrator = OnlineCalibrator(MODEL, window_steps=64, refit_every=4, min_steps=4)
    return EnergyLedger(ModelMeter(lambda: next(readings), 1.0), page_size, calibrator, flush_steps=flush_steps)


def run_calls(engine: LLMEngine, ledger: EnergyLedger, token: int) -> list[list[RequestOutput]]:
    """Three calls of two sessions, one aborted halfway, their prompts made of ``token`` (another for each run: no
    prefix of one run is cached for the next, so the runs' steps are the same); every step's outputs."""
    engine.energy = ledger
    short, gone = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 60))
    engine.add_request([token] * 300, GREEDY, request_id="long", session_id="agent")
    engine.add_request([token + 1] * 20, short, request_id="short", session_id="agent")
    engine.add_request([token + 2] * 40, gone, request_id="gone", session_id="other")
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
        if len(steps) == 12:
            engine.abort("gone")
    return steps


def test_queued_steps_are_recorded_as_they_would_be_one_by_one(engine: LLMEngine) -> None:
    queued, immediate = varying_ledger(engine.page_size, 8), varying_ledger(engine.page_size, 1)
    queued_steps, immediate_steps = run_calls(engine, queued, 11), run_calls(engine, immediate, 21)
    assert len(queued_steps) == len(immediate_steps) > 2 * queued.flush_steps
    assert queued.calibrator.num_fits == immediate.calibrator.num_fits > 2
    seen: dict[str, float] = {}
    lagged = 0
    for queued_outputs, immediate_outputs in zip(queued_steps, immediate_steps):
        assert [out.request_id for out in queued_outputs] == [out.request_id for out in immediate_outputs]
        for out, exact in zip(queued_outputs, immediate_outputs):
            assert out.energy_j is not None and exact.energy_j is not None
            if out.finished:  # a finished output carries every step of its request
                assert out.energy_j == exact.energy_j
            else:  # a running one may lag, never ahead and never going back
                assert seen.get(out.request_id, 0.0) <= out.energy_j <= exact.energy_j
                lagged += out.energy_j < exact.energy_j
            seen[out.request_id] = out.energy_j
    assert lagged > 0  # the steps were queued
    assert {out.request_id for outputs in queued_steps for out in outputs if out.finished} == {"long", "short"}
    for session in ("agent", "other"):  # the aborted call's steps count for its session too
        assert queued.session_energy_j(session) == immediate.session_energy_j(session) > 0
    assert queued.calibrator.coefficients == immediate.calibrator.coefficients
    assert queued.energy_j == immediate.energy_j and queued.num_steps == immediate.num_steps
    assert queued.request_energy("gone") is None


def test_reading_an_account_records_the_queued_steps_first() -> None:
    ledger = fixed_ledger()
    ledger.open("a", "s")
    for _ in range(3):
        ledger.queue([RequestWork.chunk("a", 0, 4)], energy_j=1.0, step_s=0.01)
    assert ledger.num_steps == 0
    account = ledger.request_energy("a")
    assert account is not None and account.shapley_j == pytest.approx(3.0) and ledger.num_steps == 3
    ledger.queue([RequestWork.chunk("a", 4, 1)], energy_j=2.0, step_s=0.01)
    assert ledger.session_energy_j("s") == pytest.approx(5.0)
    ledger.queue([RequestWork.chunk("a", 5, 1)], energy_j=1.0, step_s=0.01)
    assert ledger.stats()["steps"] == 5 and ledger.energy_j == pytest.approx(6.0)
    ledger.queue([RequestWork.chunk("a", 6, 1)], energy_j=1.0, step_s=0.01)
    ledger.close("a")
    assert ledger.session_energy_j("s") == pytest.approx(7.0) and ledger.request_energy("a") is None
    with pytest.raises(ValueError, match="flush_steps"):
        EnergyLedger(joule_per_read_meter(), 16, OnlineCalibrator(MODEL), flush_steps=0)
