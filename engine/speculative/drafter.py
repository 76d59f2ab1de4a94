"""Draft tokens for decoding sequences, from suffix matches over what this engine has seen.

Three places may hold the sequence's last tokens earlier: the sequence's
own tokens (its prompt and output so far: n-gram prompt lookup, growing with
the output), its session's history (earlier calls' prompts and outputs on
this engine, kept for the most recent sessions) and the outputs of recent
requests. The draft continues a match, as long as the match itself (so a
longer match drafts more), capped by ``num_speculative_tokens``, the output
tokens left, the model length, the step's budget and what followed the
match; the longest draft wins, then the longest match, then the sequence
itself.

A sequence's drafting, per step it decodes::

    drafting --acceptance EWMA < min_acceptance--> paused (backoff steps, doubled per pause, capped)
       ^                                              |
       |                                   the pause is over: one probe draft
       |                                              |
       +------ its acceptance lifts the EWMA ---------+---- it does not: paused again, twice as long

An accepted draft lets the back-off start over from ``backoff_steps``.

Histories never cross tenants: sessions are kept by (cache salt, session
id) and recent outputs per cache salt (for the ``MAX_TENANTS`` most recent
salts), so no tenant's decode speed depends on another's text.

Only sequences that may be verified exactly draft: one completion (``n``
of 1), no guide, no repetition, frequency or presence penalty, no logit bias,
``min_tokens`` reached (their logits need no processing that depends on the
tokens before each position, and none that verification leaves out).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from ..sampling_params import SamplingParams
from ..sequence import Sequence
from .config import SpeculativeConfig
from .suffix_index import Match, SuffixIndex

MAX_BACKOFF_FACTOR = 16
MAX_TENANTS = 8


@dataclass(slots=True)
class SpeculationStats:
    num_drafts: int = 0  # sequences verified with a draft, summed over steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens the verifications produced: the accepted ones and one more each

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate}


@dataclass(slots=True)
class SequenceDrafts:
    """One sequence's drafting state (``Sequence.drafts``)."""

    own: SuffixIndex
    own_doc: int
    session_key: tuple[str, str] | None  # (cache salt, session id)
    acceptance: float = 1.0  # EWMA of the accepted share of its drafts
    num_paused_steps: int = 0
    backoff_steps: int = 0
    history: list[SuffixIndex] = field(default_factory=list)  # session history, then recent outputs


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()
        self._recent = IndexCache(MAX_TENANTS, config.min_match_tokens, config.recent_output_tokens)
        self._sessions = IndexCache(config.max_sessions, config.min_match_tokens, config.session_history_tokens)

    def wants(self, params: SamplingParams) -> bool:
        """Whether a request with these parameters speculates (its own switch, else the engine's default)."""
        enabled = self.config.enabled if params.speculative is None else params.speculative
        return (
            enabled
            and params.n == 1
            and params.guide is None
            and params.thinking_budget is None
            and params.repetition_penalty == 1.0
            and not params.penalises_output
            and not params.logit_bias
            and params.allowed_token_ids is None
            and not params.bad_words
        )

    def start(self, seq: Sequence, session_id: str | None) -> None:
        """Give a new sequence its drafting state, when its request speculates."""
        if not self.wants(seq.params):
            return
        own = SuffixIndex(self.config.min_match_tokens)
        session_key = (seq.cache_salt, session_id) if session_id is not None else None
        found = [self._sessions.find(session_key), self._recent.find(seq.cache_salt)]
        seq.drafts = SequenceDrafts(
            own,
            own.track(seq.token_ids),
            session_key,
            backoff_steps=self.config.backoff_steps,
            history=[index for index in found if index is not None],
        )

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to verify after ``seq``'s last token (none when it should not draft)."""
        state = seq.drafts
        if state is None or seq.num_output_tokens < max(seq.params.min_tokens, 1):
            return []
        if state.num_paused_steps > 0:
            state.num_paused_steps -= 1
            return []
        limit = min(
            max_tokens,
            self.config.num_speculative_tokens,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if limit < 1:
            return []
        state.own.catch_up(state.own_doc)
        best = _trimmed(state.own.match(seq.token_ids, limit))
        for index in state.history:
            match = _trimmed(index.match(seq.token_ids, limit))
            if (len(match.draft), match.num_tokens) > (len(best.draft), best.num_tokens):
                best = match
        return best.draft

    def record(self, seq: Sequence, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count a verified draft; pause the sequence's drafting when its acceptance falls too low."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += num_accepted_tokens
        stats.num_emitted_tokens += num_accepted_tokens + 1
        state = seq.drafts
        assert state is not None, "a sequence without drafting state was verified"
        state.acceptance = 0.5 * state.acceptance + 0.5 * num_accepted_tokens / num_draft_tokens
        if state.acceptance < self.config.min_acceptance:  # the draft after the pause is a probe
            state.num_paused_steps = state.backoff_steps
            state.backoff_steps = min(2 * state.backoff_steps, MAX_BACKOFF_FACTOR * self.config.backoff_steps)
        elif num_accepted_tokens:
            state.backoff_steps = self.config.backoff_steps

    def finish(self, seq: Sequence) -> None:
        """File a finished sequence's output (and, for a session, its prompt too) for later drafts."""
        state = seq.drafts
        if state is None:
            return
        seq.drafts = None
        for cache, key, tokens in (
            (self._recent, seq.cache_salt, seq.output_token_ids),
            (self._sessions, state.session_key, seq.token_ids),
        ):
            index = cache.obtain(key) if key is not None else None
            if index is not None:
                index.add(tokens)


class IndexCache:
    """Suffix indexes by key, at most ``capacity`` of them: the least recently used is forgotten first."""

    def __init__(self, capacity: int, min_match: int, max_tokens: int) -> None:
        self.capacity = capacity
        self.min_match = min_match
        self.max_tokens = max_tokens
        self._indexes: OrderedDict[object, SuffixIndex] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._indexes)

    def find(self, key: object) -> SuffixIndex | None:
        """The index kept under ``key``, if any, now the most recently used."""
        index = self._indexes.get(key)
        if index is not None:
            self._indexes.move_to_end(key)
        return index

    def obtain(self, key: object) -> SuffixIndex | None:
        """The index kept under ``key``, made when missing (None with a capacity of 0)."""
        index = self.find(key)
        if index is None and self.capacity > 0:
            index = self._indexes[key] = SuffixIndex(self.min_match, self.max_tokens)
            while len(self._indexes) > self.capacity:
                self._indexes.popitem(last=False)
        return index


def _trimmed(match: Match) -> Match:
    """The match with its draft no longer than the match itself."""
    return Match(match.num_tokens, match.draft[: match.num_tokens])
