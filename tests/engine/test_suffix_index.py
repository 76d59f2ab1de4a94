"""The suffix index that drafts come from, and the drafter's choice of match and its back-off."""

from __future__ import annotations

import pytest

from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.sequence import Sequence
from rayturn.engine.speculative import Drafter, SpeculativeConfig
from rayturn.engine.speculative.suffix_index import SuffixIndex, continuation


def test_match_continues_the_longest_latest_occurrence() -> None:
    index = SuffixIndex(min_match=2)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([9, 2, 3, 7, 8])  # files (2, 3) again, later: it wins the lookup
    match = index.match([0, 2, 3], max_draft=4)
    assert match.draft == [7, 8] and match.num_tokens == 2
    match = index.match([9, 2, 3], max_draft=1)
    assert match.draft == [7] and match.num_tokens == 3  # extended backwards over the 9
    assert index.match([5, 5, 1], max_draft=4).num_tokens == 0  # (5, 1) never occurred
    assert index.match([2], max_draft=4).num_tokens == 0  # shorter than min_match


def test_own_tokens_draft_a_loop_past_their_end() -> None:
    tokens = [7, 1, 2, 3, 1, 2, 3, 1, 2]
    index = SuffixIndex(min_match=2)
    doc = index.track(tokens)
    index.catch_up(doc)
    match = index.match(tokens, max_draft=7)
    assert match.draft == [3, 1, 2, 3, 1, 2, 3]  # the copy overlaps the tail it continues
    assert match.num_tokens == 5
    tokens.append(3)
    index.catch_up(doc)
    assert index.match(tokens, max_draft=2).draft == [1, 2]
    assert continuation([4, 5], 1, 3, overlapping=False) == [5]


def test_bounded_index_evicts_the_oldest_documents() -> None:
    index = SuffixIndex(min_match=2, max_tokens=10)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([7, 8, 9, 10])
    assert index.num_tokens == 10 and len(index) == 2
    index.add([11, 12, 13])  # no room: the first document goes
    assert index.num_tokens == 7 and len(index) == 2
    assert index.match([1, 2], max_draft=2).num_tokens == 0
    assert index.match([7, 8], max_draft=2).draft == [9, 10]
    index.add(list(range(100, 130)))  # longer than the bound: only its last 10 tokens kept
    assert index.num_tokens == 10 and len(index) == 1
    assert index.match([100, 101], max_draft=2).num_tokens == 0
    assert index.match([125, 126], max_draft=2).draft == [127, 128]


def make_seq(prompt: list[int], output: list[int], **params: object) -> Sequence:
    sampling = SamplingParams(max_tokens=64, temperature=0.0, speculative=True, **params)  # type: ignore[arg-type]
    seq = Sequence(seq_id=0, request_id="r", token_ids=list(prompt), num_prompt_tokens=len(prompt), params=sampling)
    seq.token_ids.extend(output)
    return seq


def test_drafter_takes_session_history_and_adapts_the_length() -> None:
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=6), max_model_len=1000)
    earlier = make_seq([1, 2, 3], list(range(40, 60)))
    drafter.start(earlier, "session")
    drafter.finish(earlier)
    seq = make_seq([9, 9, 40, 41, 42], [43])
    drafter.start(seq, "session")
    assert drafter.propose(seq, 100) == [44, 45, 46, 47]  # a 4-token match drafts 4 tokens
    seq.token_ids.extend([44, 45, 46])
    assert drafter.propose(seq, 100) == [47, 48, 49, 50, 51, 52]  # a 7-token match: the cap of 6
    short = make_seq([9, 9, 5, 42], [43])  # matches only (42, 43) + nothing more: below min_match 3
    drafter.start(short, "session")
    assert drafter.propose(short, 100) == []
    medium = make_seq([5, 41, 42], [43])  # a 3-token match drafts 3 tokens
    drafter.start(medium, None)
    assert drafter.propose(medium, 100) == [44, 45, 46]  # recent outputs hold it without a session
    assert drafter.propose(medium, 2) == [44, 45]  # the step's budget caps it


def test_histories_stay_within_their_tenant() -> None:
    drafter = Drafter(SpeculativeConfig(), max_model_len=1000)
    earlier = make_seq([1, 2, 3], list(range(40, 60)))
    earlier.cache_salt = "tenant-a"
    drafter.start(earlier, "session")
    drafter.finish(earlier)
    for salt, expected in (("tenant-b", []), ("tenant-a", [44, 45, 46, 47])):
        seq = make_seq([9, 9, 40, 41, 42], [43])
        seq.cache_salt = salt
        drafter.start(seq, "session")  # the same session id, another tenant: neither history applies
        assert drafter.propose(seq, 100) == expected


UNVERIFIABLE = {
    "n": {"n": 2},
    "penalty": {"repetition_penalty": 1.2},
    "frequency": {"frequency_penalty": 0.5},
    "presence": {"presence_penalty": -0.5},
    "bias": {"logit_bias": {3: 5.0}},
    "default-off": {"speculative": None},
}


@pytest.mark.parametrize("params", list(UNVERIFIABLE.values()), ids=list(UNVERIFIABLE))
def test_drafter_leaves_out_what_it_cannot_verify_exactly(params: dict[str, object]) -> None:
    drafter = Drafter(SpeculativeConfig(), max_model_len=1000)
    sampling = SamplingParams(max_tokens=64, temperature=0.0, **{"speculative": True, **params})  # type: ignore[arg-type]
    seq = Sequence(seq_id=0, request_id="r", token_ids=[1, 2, 3, 1, 2, 3, 1, 2], num_prompt_tokens=7, params=sampling)
    drafter.start(seq, None)
    assert seq.drafts is None and drafter.propose(seq, 8) == []


def test_low_acceptance_pauses_drafting_with_growing_back_off() -> None:
    drafter = Drafter(SpeculativeConfig(backoff_steps=2, min_acceptance=0.3), max_model_len=1000)
    seq = make_seq([1, 2, 3, 1, 2, 3, 1, 2], [3])
    drafter.start(seq, None)
    assert drafter.propose(seq, 8) == [1, 2, 3, 1, 2, 3]  # the 6-token match (1, 2, 3, 1, 2, 3)
    drafter.record(seq, 8, 0)  # acceptance 0.5: still drafting
    assert drafter.propose(seq, 8)
    drafter.record(seq, 8, 0)  # 0.25: paused 2 steps
    assert [drafter.propose(seq, 8) for _ in range(3)] == [[], [], [1, 2, 3, 1, 2, 3]]
    drafter.record(seq, 8, 0)  # the probe failed (0.125): paused again, twice as long
    assert [bool(drafter.propose(seq, 8)) for _ in range(5)] == [False] * 4 + [True]
    drafter.record(seq, 8, 8)  # accepted (0.5625): the back-off starts over
    assert seq.drafts is not None and seq.drafts.backoff_steps == 2
    assert drafter.propose(seq, 8)
    assert drafter.stats.num_draft_tokens == 32 and drafter.stats.num_accepted_tokens == 8
