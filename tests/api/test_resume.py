"""``CallResumer``: what follows a decode replica's death, by what the call had streamed (``api/resume``'s rule)."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from rayturn.api.call_result import CallResult, CompletionState
from rayturn.api.resume import MAX_REFUSALS, MAX_RESUMES, CallResumer, capacity_refusal, replica_died
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.sequence import TokenLogprob
from rayturn.messages import Call, ReplicaAtCapacity, ResumePoint

DIED = ActorDiedError()
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1)


def streamed(*pieces: str, finish_reason: str | None = None, logprobs: bool = False, n: int = 1) -> CallResult:
    """A call's result after its completions streamed ``pieces`` (a token per character)."""
    result = CallResult(completions={})
    for index in range(n):
        text = "".join(pieces)
        entries = [TokenLogprob(ord(char), -0.5, ()) for char in text] if logprobs else []
        tokens = [ord(char) for char in text]
        result.completions[index] = CompletionState(tokens, text, entries, finish_reason)
    return result


def resumer_after(params: SamplingParams, *pieces: str) -> CallResumer:
    resumer = CallResumer(Call("r1", (1, 2, 3), params))
    for piece in pieces:
        resumer.record(0, piece)
        resumer.record(1, "another completion's text")
    return resumer


def test_a_greedy_stream_resumes_after_what_it_streamed_without_asking_prompt_logprobs_again() -> None:
    resumer = resumer_after(GREEDY, "ab", "c")
    loss = resumer.after_death(DIED, streamed("ab", "c"))
    assert loss.outcome == "resumed" and loss.call is not None
    assert loss.call.resume == ResumePoint((97, 98, 99), None, ("ab", "c"))
    assert loss.call.request_id == "r1-resume1" and loss.call.params.prompt_logprobs is None
    assert loss.call.prompt_token_ids == (1, 2, 3) and loss.call.params.max_tokens == 8


def test_logprobs_travel_with_the_tokens_and_an_unseeded_sample_resumes() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.8, logprobs=2)
    loss = resumer_after(params, "xy").after_death(DIED, streamed("xy", logprobs=True))
    assert loss.outcome == "resumed" and loss.call is not None and loss.call.resume is not None
    assert [entry.token_id for entry in loss.call.resume.logprobs or ()] == [120, 121]
    mismatched = streamed("xy", logprobs=True)
    mismatched.completions[0].logprobs.pop()
    assert resumer_after(params, "xy").after_death(DIED, mismatched).outcome == "failed"


def test_nothing_streamed_is_sent_again_as_it_was_whatever_it_asked() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=3)
    loss = resumer_after(params).after_death(DIED, CallResult(completions={}))
    assert loss.outcome == "retried" and loss.call is not None
    assert loss.call.resume is None and loss.call.params == params


def test_what_cannot_continue_exactly_fails_and_a_finished_answer_ends_normally() -> None:
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=7)
    assert resumer_after(seeded, "a").after_death(DIED, streamed("a")).outcome == "failed"
    several = SamplingParams(max_tokens=8, temperature=0.0, n=2)
    assert resumer_after(several, "a").after_death(DIED, streamed("a", n=2)).outcome == "failed"
    loss = resumer_after(GREEDY, "ab").after_death(DIED, streamed("ab", finish_reason="stop"))
    assert loss.outcome == "finished" and loss.call is None


def test_a_call_loses_at_most_max_resumes_replicas() -> None:
    resumer = resumer_after(GREEDY, "a")
    outcomes = [resumer.after_death(DIED, streamed("a")).outcome for _ in range(MAX_RESUMES + 1)]
    assert outcomes == ["resumed"] * MAX_RESUMES + ["failed"]


def test_only_a_replica_s_death_or_absence_counts() -> None:
    assert replica_died(DIED) and replica_died(ActorUnavailableError("gone", None))
    assert replica_died(RayTaskError("generate", "trace", DIED))
    assert not replica_died(ValueError("bad request")) and not replica_died(
        RayTaskError("generate", "trace", ValueError())
    )


def test_a_call_refused_for_capacity_goes_to_replicas_that_have_not_refused_it() -> None:
    call = Call("r1", (1, 2, 3), GREEDY)
    resumer = CallResumer(call)
    sent, refusers = call, []
    for replica_id in ["a", "b", "c", "d"]:
        refusal = capacity_refusal(RayTaskError("generate", "trace", ReplicaAtCapacity("full", replica_id)))
        assert refusal is not None and refusal.replica_id == replica_id
        sent_again = resumer.after_refusal(refusal, sent)
        if sent_again is None:
            break
        refusers.append(replica_id)
        assert sent_again.refused_by == tuple(refusers) and sent_again.prompt_token_ids == call.prompt_token_ids
        sent = sent_again
    # MAX_REFUSALS replicas tried, then the refusal stands (429).
    assert len(refusers) == MAX_REFUSALS - 1
    # A replica that refuses again was the only one left with room for nobody.
    again = ReplicaAtCapacity("full", "a")
    assert resumer.after_refusal(again, CallResumer(call).after_refusal(again, call) or call) is None
    # A refusal from outside a Serve replica names none: nowhere else to send it.
    assert resumer.after_refusal(ReplicaAtCapacity("full"), call) is None
    assert capacity_refusal(DIED) is None and capacity_refusal(ValueError("bad request")) is None


def test_a_refusal_keeps_its_replica_across_processes() -> None:
    import pickle

    refusal = pickle.loads(pickle.dumps(ReplicaAtCapacity("the replica is full", "replica-7")))
    assert str(refusal) == "the replica is full" and refusal.replica_id == "replica-7"
