"""Requests: their ``n`` completions (sequences), stop checks, and the outputs they report.

A request's life in the engine's ``RequestTable``::

    open --output prefix already stops it--> finished on arrival --next step--> reported, forgotten
      |
      +--> its one sequence is scheduled --first sample--> forked into n
             --tokens, stop checks--> every completion finished --> reported, forgotten
      (abort, at any point: forgotten, unfinished sequences finished as "abort")

The fork happens in the step that finishes the prompt, before its sample:
the children share every page of the parent and completion ``i`` draws from a
generator seeded with the request's seed plus ``i``, so each completion is
reproducible on its own and equals a separate request with that seed. The
prompt's logprobs, when asked for, are scored by the first sequence before it
forks (``prompt_logprobs.py``); the children share them. A guided request's
sequence gets its grammar state when the request opens (before any output
prefix, which advances it), and each child a copy of its parent's.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import torch

from .guided import GuideCompiler, GuideState
from .outputs import CompletionOutput, RequestOutput
from .page_hash import PageHash
from .request_limits import RequestLimits
from .sampling_params import SamplingParams
from .sequence import Sequence, SequenceStatus, TokenLogprob
from .stop import StopChecker, Verdict
from .thinking import ThinkingState
from .tokenizer import Tokenizer

# Called when a sequence stops, before its pages are freed: (its request, the sequence, why it stopped).
OnStop = Callable[["Request", Sequence, Verdict], None]
# Called for each fork: (parent, child) — the child shares the parent's pages and runs from here.
OnFork = Callable[[Sequence, Sequence], None]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    session_id: str | None = None
    stops: dict[int, StopChecker] = field(default_factory=dict)  # by seq_id
    # The first sequence's prompt logprobs, frozen once every prompt position is scored.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs) and len(self.seqs) == self.params.n

    def add(self, seq: Sequence, stops: StopChecker) -> None:
        self.seqs.append(seq)
        self.stops[seq.seq_id] = stops

    def forks_at(self, seq: Sequence) -> bool:
        """Whether sampling ``seq`` now first forks it into the request's remaining completions."""
        return seq.num_output_tokens == 0 and len(self.seqs) < self.params.n

    def output(self) -> RequestOutput:
        first = self.seqs[0]
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None and not first.needs_prompt_logprobs:
            self.prompt_logprobs = tuple(first.prompt_logprobs)
        completions = tuple(
            CompletionOutput(
                index=seq.completion_index,
                token_ids=seq.output_token_ids,
                text=self.stops[seq.seq_id].text,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=tuple(seq.logprobs) if self.params.logprobs is not None else None,
            )
            for seq in self.seqs
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            num_cached_prompt_tokens=first.num_cached_prompt_tokens or 0,
            completions=completions,
            finished=self.finished,
            num_loaded_prompt_tokens=min(first.num_loaded_prompt_tokens, first.num_cached_prompt_tokens or 0),
            prompt_logprobs=self.prompt_logprobs,
        )


class RequestTable:
    """The engine's requests by id, from ``open`` until the step that reports them finished."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: AbstractSet[int],
        limits: RequestLimits,
        guides: GuideCompiler | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self.guides = guides or GuideCompiler(tokenizer, limits.vocab_size, eos_token_ids)
        self.max_model_len = limits.max_model_len
        self._requests: dict[str, Request] = {}
        # Requests whose output began on arrival (an output prefix made elsewhere), finished by it or not.
        self._arrived: list[Request] = []
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._requests)

    def open(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str = "",
        session_id: str | None = None,
        output_prefix: Seq[int] = (),
        output_prefix_logprobs: Seq[TokenLogprob] | None = None,
        page_hashes: Seq[PageHash] = (),
    ) -> Request:
        """A new request with its first sequence, checked against the limits (see ``LLMEngine.add_request``).

        ``request_id`` None: the next free number. A request with an output
        prefix is reported by the next ``take_arrived``, so the tokens made
        elsewhere (a prefill replica's first token) stream before the request
        is scheduled; when the prefix finishes it, it is ``finished``,
        otherwise its sequence is the caller's to schedule.
        """
        self.limits.check_request(len(token_ids), params, output_prefix, output_prefix_logprobs, page_hashes)
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        guide = self.guides.start(params.guide) if params.guide is not None else None
        request = Request(request_id, list(token_ids), params, session_id=session_id)
        seq = new_sequence(next(self._seq_ids), request_id, list(token_ids), params, cache_salt, page_hashes, guide)
        if params.thinking_budget is not None:
            end_ids = self.tokenizer.encode(params.thinking_budget.end, add_special_tokens=False)
            seq.thinking = ThinkingState(params.thinking_budget, end_ids)
        request.add(seq, self._stop_checker(request))
        self._requests[request_id] = request
        self._append_output_prefix(request, output_prefix, output_prefix_logprobs)
        return request

    def _append_output_prefix(
        self, request: Request, prefix: Seq[int], prefix_logprobs: Seq[TokenLogprob] | None
    ) -> None:
        """Add tokens generated elsewhere (they count as output) to the request's sequence, checking its stops."""
        seq = request.seqs[0]
        stops = request.stops[seq.seq_id]
        for i, token in enumerate(prefix):
            seq.token_ids.append(token)
            if request.params.logprobs is not None and prefix_logprobs is not None:
                seq.logprobs.append(prefix_logprobs[i])
            verdict = stops.check(seq, self.max_model_len)
            if verdict is not None:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason, seq.stop_reason = verdict
                seq.num_cached_prompt_tokens = 0
                break
        if prefix:
            self._arrived.append(request)

    def pop(self, request_id: str) -> Request | None:
        """Forget a request (an abort); its unfinished sequences are the caller's to finish."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            # Gone before any step: nothing left to report.
            self._arrived = [r for r in self._arrived if r is not request]
        return request

    def take_arrived(self) -> list[RequestOutput]:
        """The outputs of requests that arrived with an output prefix since the last call (finished by it or not)."""
        outputs = self._report(self._arrived)
        self._arrived = []
        return outputs

    def fork_fresh(self, seqs: list[Sequence], on_fork: OnFork) -> tuple[list[Sequence], list[int]]:
        """The sequences to sample: ``seqs``, then the forks of each fresh request; and each one's row in ``seqs``."""
        rows = list(range(len(seqs)))
        with_forks = list(seqs)
        for row, seq in enumerate(seqs):
            request = self._requests[seq.request_id]
            if not request.forks_at(seq):
                continue
            for index in range(len(request.seqs), request.params.n):
                child = fork_sequence(seq, next(self._seq_ids), index)
                on_fork(seq, child)
                request.add(child, self._stop_checker(request))
                with_forks.append(child)
                rows.append(row)
        return with_forks, rows

    def append_samples(
        self,
        seqs: Seq[Sequence],
        tokens: Seq[int],
        logprobs: Seq[TokenLogprob | None],
        on_stop: OnStop,
    ) -> list[RequestOutput]:
        """Add one sampled token to each sequence and check its stops; returns the outputs of the requests touched."""
        return self.append_runs(seqs, [[token] for token in tokens], [[logprob] for logprob in logprobs], on_stop)

    def append_runs(
        self,
        seqs: Seq[Sequence],
        token_runs: Seq[Seq[int]],
        logprob_runs: Seq[Seq[TokenLogprob | None]],
        on_stop: OnStop,
        before_next: Callable[[Sequence], None] | None = None,
    ) -> list[RequestOutput]:
        """Add each sequence's run of tokens one at a time, checking its stops after each; a stop drops the rest.

        ``before_next`` runs before each token of a run after its first (a
        verified draft: the token before it is now computed). Returns the
        outputs of the requests touched.
        """
        touched: dict[str, Request] = {}
        for seq, tokens, logprobs in zip(seqs, token_runs, logprob_runs):
            request = self._requests[seq.request_id]
            touched[request.request_id] = request
            for index, (token, logprob) in enumerate(zip(tokens, logprobs)):
                if index and before_next is not None:
                    before_next(seq)
                seq.token_ids.append(token)
                if logprob is not None:
                    seq.logprobs.append(logprob)
                verdict = request.stops[seq.seq_id].check(seq, self.max_model_len)
                if verdict is not None:
                    on_stop(request, seq, verdict)
                    break
        return self._report(list(touched.values()))

    def _report(self, requests: list[Request]) -> list[RequestOutput]:
        """The requests' outputs; finished requests are forgotten."""
        outputs = [request.output() for request in requests]
        for output in outputs:
            if output.finished:
                del self._requests[output.request_id]
        return outputs

    def _stop_checker(self, request: Request) -> StopChecker:
        return StopChecker(self.tokenizer, request.params, self.eos_token_ids, request.prompt_token_ids)


def new_sequence(
    seq_id: int,
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    cache_salt: str,
    page_hashes: Seq[PageHash] = (),
    guide: GuideState | None = None,
) -> Sequence:
    """A request's first sequence; ``page_hashes``: its prompt's leading page hashes, already computed."""
    return Sequence(
        seq_id=seq_id,
        request_id=request_id,
        token_ids=token_ids,
        num_prompt_tokens=len(token_ids),
        params=params,
        cache_salt=cache_salt,
        page_hashes=list(page_hashes),
        generator=_generator(params, 0),
        guide=guide,
    )


def fork_sequence(parent: Sequence, seq_id: int, completion_index: int) -> Sequence:
    """Completion ``completion_index`` of ``parent``'s request, at ``parent``'s progress (pages not yet shared)."""
    child = Sequence(
        seq_id=seq_id,
        request_id=parent.request_id,
        token_ids=list(parent.token_ids),
        num_prompt_tokens=parent.num_prompt_tokens,
        params=parent.params,
        cache_salt=parent.cache_salt,
        generator=_generator(parent.params, completion_index),
        completion_index=completion_index,
        guide=parent.guide.fork() if parent.guide is not None else None,
        thinking=parent.thinking.fork() if parent.thinking is not None else None,
        prompt_logprobs=parent.prompt_logprobs,
        priority=parent.priority,
    )
    child.num_computed_tokens = parent.num_computed_tokens
    child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
    return child


def _generator(params: SamplingParams, completion_index: int) -> torch.Generator | None:
    """Completion ``i`` of a seeded request draws what a separate request with seed ``seed + i`` would."""
    if params.seed is None or params.greedy:
        return None
    return torch.Generator().manual_seed(_derive_seed(params.seed + completion_index))


def _derive_seed(seed: int) -> int:
    raw = hashlib.sha256(str(seed).encode()).digest()
    return int.from_bytes(raw[:8], "little") & ((1 << 63) - 1)
