"""One sequence being generated: its tokens, its pages, its progress.

Life cycle::

    WAITING --scheduled--> RUNNING --stop / length / abort--> FINISHED
       ^                      |
       +---- preempted -------+   (pages freed; recomputed when readmitted,
                                    from the prefix cache where it still holds)

``num_computed_tokens`` counts tokens whose KV is in the cache. A sequence is
sampled in the step whose chunk reaches its last token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .guided import GuideState
from .page_hash import PageHash
from .page_pool import Page
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely alternatives, best first


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    cache_salt: str = ""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission; None until then.
    num_cached_prompt_tokens: int | None = None
    # Of those, tokens whose pages were loaded from the KV store at arrival.
    num_loaded_prompt_tokens: int = 0
    pages: list[Page] = field(default_factory=list)
    # Hashes of the leading full pages, in order: seeded at arrival when the serving layer
    # computed the prompt's (``LLMEngine.add_request(page_hashes=...)``), extended as pages fill.
    page_hashes: list[PageHash] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    completion_index: int = 0  # which of the request's n completions this is
    guide: GuideState | None = None  # where the output stands in its grammar, for a guided request

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
