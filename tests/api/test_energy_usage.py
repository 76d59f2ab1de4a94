"""A call's energy at the ingress: folded from its steps (kept across a resend), settled once into its session's
total and the per-meter counter, and reported as the same ``energy`` object in every API's usage. With several
ingress replicas the session totals live in the keeper they share."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from rayturn.api.call_result import CallResult
from rayturn.api.energy import EnergyAccounts, SessionEnergy, energy_usage, summed_energy_usage
from rayturn.api.response_keeper import ResponseKeeper
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


def settle(accounts: EnergyAccounts, session_id: str | None, result: CallResult) -> None:
    asyncio.run(accounts.settle(session_id, result))


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
    settle(accounts, "t/s", first)
    settle(accounts, "t/s", first)  # the pipeline's ``finally`` after the last step: nothing more
    second.fold(step(0.5, finished=True))
    settle(accounts, "t/s", second)
    alone.fold(step(0.25, meter="model", finished=True))
    settle(accounts, None, alone)
    assert (first.session_energy_j, second.session_energy_j, alone.session_energy_j) == (0.75, 1.25, None)
    assert second.energy() == {"joules": 0.5, "meter": "rapl", "session_joules": 1.25}
    assert (counted_j(energy_counter, "rapl"), counted_j(energy_counter, "model")) == (1.25, 0.25)


def test_a_call_that_measured_nothing_counts_under_no_meter() -> None:
    energy_counter = counter()
    result = CallResult(completions={})
    settle(EnergyAccounts(energy_counter), "t/s", result)
    assert result.session_energy_j == 0.0
    assert counted_j(energy_counter, "rapl") is None and list(energy_counter.collect()[0].samples) == []


def test_a_request_of_several_calls_adds_their_joules_and_reports_the_sessions_latest_total() -> None:
    accounts = EnergyAccounts(counter())
    calls = [CallResult(completions={}) for _ in range(3)]
    for joules, result in zip((0.25, 0.5, 1.0), calls):
        result.fold(step(joules, finished=True))
        settle(accounts, "t/s", result)
    assert summed_energy_usage(calls) == energy_usage(1.75, "rapl", 1.75)
    assert summed_energy_usage([]) == energy_usage(0, None, None)


class Remote:
    """``handle.method.remote(...)``, as a Serve handle calls the ``responses`` deployment, over a local keeper."""

    def __init__(self, keeper: ResponseKeeper, away: bool = False) -> None:
        self.keeper, self.away = keeper, away

    def __getattr__(self, name: str) -> Any:
        remote = self

        class Method:
            async def remote(self, *args: Any) -> Any:
                if remote.away:
                    raise RuntimeError("the responses replica is restarting")
                await asyncio.sleep(0.01)  # a hop
                return await getattr(remote.keeper, name)(*args)

        return Method()


def finished(energy_j: float) -> CallResult:
    result = CallResult(completions={})
    result.fold(step(energy_j, finished=True))
    return result


def test_with_several_ingress_replicas_a_sessions_total_counts_its_calls_on_every_one() -> None:
    keeper = ResponseKeeper()
    one, other = EnergyAccounts(counter(), keeper=Remote(keeper)), EnergyAccounts(counter(), keeper=Remote(keeper))
    calls = [finished(0.5), finished(0.25), finished(1.0)]

    async def scenario() -> None:
        await one.settle("t/s", calls[0])
        await other.settle("t/s", calls[1])
        await one.settle("t/s", calls[2])
        await other.settle("t/other", finished(2.0))

    asyncio.run(scenario())
    assert [result.session_energy_j for result in calls] == [0.5, 0.75, 1.75]
    assert keeper.session_energy.total_j("t/s") == 1.75 and keeper.session_energy.total_j("t/other") == 2.0
    assert len(one.sessions) == len(other.sessions) == 0  # nothing kept per replica


def test_a_shared_call_cut_off_still_adds_what_it_spent() -> None:
    keeper = ResponseKeeper()
    accounts = EnergyAccounts(counter(), keeper=Remote(keeper))

    async def scenario() -> None:
        cut = CallResult(completions={})
        cut.fold(step(0.5))
        accounts.settle_unanswered("t/s", cut)  # its caller went: nothing waits for the add
        waiting = asyncio.create_task(accounts.settle("t/s", finished(0.25)))
        await asyncio.sleep(0)
        waiting.cancel()  # the caller goes while the add is on its way
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.05)
        assert not accounts._adding

    asyncio.run(scenario())
    assert keeper.session_energy.total_j("t/s") == 0.75


def test_a_shared_total_out_of_reach_is_reported_as_unknown(caplog: pytest.LogCaptureFixture) -> None:
    energy_counter = counter()
    accounts = EnergyAccounts(energy_counter, keeper=Remote(ResponseKeeper(), away=True))
    result = finished(0.5)
    with caplog.at_level("WARNING", logger="rayturn.api.energy"):
        settle(accounts, "t/s", result)
    # Not this replica's own count: that would be a part of the session's total, reported as the whole.
    assert result.session_energy_j is None and result.energy()["joules"] == 0.5
    assert counted_j(energy_counter, "rapl") == 0.5
    assert "session energy not added: RuntimeError: the responses replica is restarting" in caplog.text
