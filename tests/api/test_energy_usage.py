"""A call's energy at the ingress: folded from its steps (kept across a resend), settled once into its session's
total and the per-meter counter, and reported as the same ``energy`` object in every API's usage."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from rayturn.api.call_result import CallResult
from rayturn.api.energy import EnergyAccounts, SessionEnergy, energy_usage, summed_energy_usage
from rayturn.messages import Delta, Step


def step(energy_j: float, meter: str | None = "rapl", finished: bool = False) -> Step:
    delta = Delta(index=0, token_ids=(1,), text="a", logprobs=None, finish_reason="stop" if finished else None)
    return Step(
        deltas=(delta,),
        prompt_tokens=4,
        cached_tokens=0,
        loaded_tokens=0,
        finished=finished,
        path="local",
        replica_id=None,
        energy_j=energy_j,
        energy_meter=meter,
    )


def counter() -> Counter:
    return Counter("energy_joules", "test", ["meter"], registry=CollectorRegistry())


def counted_j(energy_counter: Counter, meter: str) -> float | None:
    """What the counter exposes for ``meter`` (None: no sample)."""
    for sample in energy_counter.collect()[0].samples:
        if sample.name == "energy_joules_total" and sample.labels == {"meter": meter}:
            return sample.value
    return None


def test_a_call_carries_its_latest_cumulative_joules_and_keeps_an_earlier_sends() -> None:
    result = CallResult(completions={})
    result.fold(step(0.5))
    result.fold(step(1.25))
    assert (result.energy_j, result.energy_meter) == (1.25, "rapl")
    result.send_again()  # its replica died: the next replica counts from zero
    result.fold(step(0.25, meter="nvml"))
    assert result.energy_j == 1.5
    assert result.energy_meter == "nvml+rapl"
    assert result.usage()["energy"] == {"joules": 1.5, "meter": "nvml+rapl", "session_joules": None}
    assert result.usage()["completion_tokens"] == 3


def test_a_session_total_sums_its_calls_and_only_the_most_recent_sessions_are_kept() -> None:
    sessions = SessionEnergy(max_sessions=2)
    assert sessions.add("t/a", 1.0) == 1.0
    assert sessions.add("t/b", 2.0) == 2.0
    assert sessions.add("t/a", 0.5) == 1.5  # "t/a" is now the most recent
    sessions.add("t/c", 4.0)  # evicts "t/b", the least recent
    assert (sessions.total_j("t/a"), sessions.total_j("t/b"), sessions.total_j("t/c")) == (1.5, 0.0, 4.0)
    assert len(sessions) == 2
    with pytest.raises(ValueError, match="max_sessions"):
        SessionEnergy(max_sessions=0)


def test_a_call_is_settled_once_into_its_session_and_its_meters_counter() -> None:
    energy_counter = counter()
    accounts = EnergyAccounts(energy_counter)
    first, second, alone = CallResult(completions={}), CallResult(completions={}), CallResult(completions={})
    first.fold(step(0.75, finished=True))
    accounts.settle("t/s", first)
    accounts.settle("t/s", first)  # the pipeline's ``finally`` after the last step: nothing more
    second.fold(step(0.5, finished=True))
    accounts.settle("t/s", second)
    alone.fold(step(0.25, meter="model", finished=True))
    accounts.settle(None, alone)
    assert (first.session_energy_j, second.session_energy_j, alone.session_energy_j) == (0.75, 1.25, None)
    assert second.energy() == {"joules": 0.5, "meter": "rapl", "session_joules": 1.25}
    assert (counted_j(energy_counter, "rapl"), counted_j(energy_counter, "model")) == (1.25, 0.25)


def test_a_call_that_measured_nothing_counts_under_no_meter() -> None:
    energy_counter = counter()
    result = CallResult(completions={})
    EnergyAccounts(energy_counter).settle("t/s", result)
    assert result.session_energy_j == 0.0
    assert counted_j(energy_counter, "rapl") is None and list(energy_counter.collect()[0].samples) == []


def test_a_request_of_several_calls_adds_their_joules_and_reports_the_sessions_latest_total() -> None:
    accounts = EnergyAccounts(counter())
    calls = [CallResult(completions={}) for _ in range(3)]
    for joules, result in zip((0.25, 0.5, 1.0), calls):
        result.fold(step(joules, finished=True))
        accounts.settle("t/s", result)
    assert summed_energy_usage(calls) == energy_usage(1.75, "rapl", 1.75)
    assert summed_energy_usage([]) == energy_usage(0, None, None)
