"""Where the tail of a token list occurred before, in a bounded set of token lists, and what followed it.

Every run of ``min_match`` tokens that has a token after it is filed under
its last occurrence (document, position after it). ``match`` looks up the
context's last ``min_match`` tokens, extends the match backwards as far as
the tokens agree (up to ``MAX_MATCH_TOKENS``), and returns the tokens that
followed: the draft. A document may be a live list that keeps growing (a
sequence's own tokens, ``catch_up`` files its new runs); the continuation
then may run into the tail itself, copied the way LZ77 copies an
overlapping match, so a loop of any period drafts its whole length.

Documents added with ``add`` count against ``max_tokens``; the oldest are
evicted (their runs unfiled) to make room. Life of a document::

    add / track --catch_up (tracked ones grow)--> filed --evicted (oldest first) / drop--> gone
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

MAX_MATCH_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Match:
    num_tokens: int  # how many of the context's last tokens matched
    draft: list[int]


NO_MATCH = Match(0, [])


class SuffixIndex:
    def __init__(self, min_match: int, max_tokens: int | None = None) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self.min_match = min_match
        self.max_tokens = max_tokens  # None: unbounded (a sequence's own tokens)
        self.num_tokens = 0
        self._docs: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self._num_filed: dict[int, int] = {}  # document -> how many of its positions are filed
        self._sizes: dict[int, int] = {}  # added (bounded) documents -> their length
        self._runs: dict[tuple[int, ...], tuple[int, int]] = {}  # run -> (document, position after it)
        self._doc_ids = itertools.count()

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tokens: Seq[int]) -> None:
        """File a finished token list (its last ``max_tokens`` when longer), evicting the oldest to make room."""
        if self.max_tokens is not None:
            tokens = tokens[len(tokens) - self.max_tokens :] if len(tokens) > self.max_tokens else tokens
            while self._docs and self.num_tokens + len(tokens) > self.max_tokens:
                self.drop(next(iter(self._docs)))
        if len(tokens) <= self.min_match:
            return
        doc_id = self.track(list(tokens))
        self.catch_up(doc_id)
        self._sizes[doc_id] = len(tokens)
        self.num_tokens += len(tokens)

    def track(self, tokens: list[int]) -> int:
        """Follow a live token list (filed by ``catch_up``); returns its document id."""
        doc_id = next(self._doc_ids)
        self._docs[doc_id] = tokens
        self._num_filed[doc_id] = 0
        return doc_id

    def catch_up(self, doc_id: int) -> None:
        """File the runs of a document that have gained a following token since the last call."""
        tokens = self._docs[doc_id]
        n = self.min_match
        start = max(self._num_filed[doc_id], n)
        for end in range(start, len(tokens)):  # the run tokens[end - n : end], followed by tokens[end]
            self._runs[tuple(tokens[end - n : end])] = (doc_id, end)
        self._num_filed[doc_id] = max(len(tokens), start)

    def drop(self, doc_id: int) -> None:
        """Forget a document and unfile its runs (those a later document did not take over)."""
        tokens = self._docs.pop(doc_id)
        n = self.min_match
        for end in range(n, self._num_filed.pop(doc_id)):
            key = tuple(tokens[end - n : end])
            if self._runs.get(key, (None, 0))[0] == doc_id:
                del self._runs[key]
        self.num_tokens -= self._sizes.pop(doc_id, 0)

    def match(self, context: Seq[int], max_draft: int) -> Match:
        """The longest earlier occurrence of ``context``'s tail filed under its last ``min_match`` tokens."""
        n = self.min_match
        if len(context) < n or max_draft < 1:
            return NO_MATCH
        hit = self._runs.get(tuple(context[-n:]))
        if hit is None:
            return NO_MATCH
        doc_id, end = hit
        tokens = self._docs[doc_id]
        length = n
        limit = min(end, len(context), MAX_MATCH_TOKENS)
        while length < limit and tokens[end - length - 1] == context[-length - 1]:
            length += 1
        return Match(length, continuation(tokens, end, max_draft, overlapping=tokens is context))


def continuation(tokens: Seq[int], start: int, num_tokens: int, overlapping: bool) -> list[int]:
    """Up to ``num_tokens`` tokens from ``tokens[start]`` on.

    ``overlapping``: ``tokens`` is the context being continued, so past its
    end the draft continues its own copy (LZ77 style).
    """
    draft = list(tokens[start : start + num_tokens])
    if not draft or not overlapping:
        return draft
    period = len(tokens) - start
    while len(draft) < num_tokens:
        draft.append(draft[len(draft) - period])
    return draft
