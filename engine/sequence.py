"""One sequence being generated: its tokens, its pages, its progress.

Life cycle::

    WAITING --scheduled--> RUNNING --stop / length / abort--> FINISHED
       ^                      |
       +---- preempted -------+   (pages freed; recomputed when readmitted,
                                    from the prefix cache where it still holds)

``num_computed_tokens`` counts tokens whose KV is in the cache. A sequence is
sampled in the step whose chunk reaches its last token. One that asks for
prompt logprobs scores its prompt chunk by chunk (``prompt_logprobs.py``);
until every prompt position is scored, it computes all of them itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .guided import GuideState
from .page_hash import PageHash
from .page_pool import Page
from .priority import Priority
from .sampling_params import SamplingParams
from .thinking import ThinkingState

if TYPE_CHECKING:
    from .speculative.drafter import SequenceDrafts


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
    # With sliding-window layers (``window_slots.py``): how many leading pages were looked at for giving
    # their slot back, and those among them that kept it, shared when looked at (tried again under pressure).
    window_released: int = 0
    window_kept: list[int] = field(default_factory=list)
    # Hashes of the leading full pages, in order: seeded at arrival when the serving layer
    # computed the prompt's (``LLMEngine.add_request(page_hashes=...)``), extended as pages fill.
    page_hashes: list[PageHash] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    completion_index: int = 0  # which of the request's n completions this is
    priority: Priority = Priority.INTERACTIVE  # its class: admission and step budget go by class (``priority``)
    guide: GuideState | None = None  # where the output stands in its grammar, for a guided request
    thinking: ThinkingState | None = None  # its reasoning under a token budget (``params.thinking_budget``)
    # With params.prompt_logprobs: entry i scores prompt token i given those before it (entry 0 is
    # None), filled as prompt chunks run; forks share their parent's, complete by then.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    drafts: SequenceDrafts | None = None  # its drafting state, while its request speculates (``speculative/``)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs.append(None)  # nothing predicts the first token

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

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some prompt position is not scored yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, first_position: int, entries: list[TokenLogprob]) -> None:
        """Record the scores of prompt positions ``first_position``, ``first_position + 1``, ...

        A prompt recomputed after a preemption scores positions again: those
        already recorded are kept, only the rest appended. Chunks run in
        order from position 0, so the entries never leave a gap.
        """
        num_known = len(self.prompt_logprobs) - first_position
        assert num_known >= 0, f"prompt logprobs from position {first_position} after {len(self.prompt_logprobs)}"
        self.prompt_logprobs.extend(entries[num_known:])
