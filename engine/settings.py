"""The engine's settings (the ``model`` section of the cluster config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayturn.kernels.registry import BACKENDS
from rayturn.settings import check_at_least, check_choice, check_non_empty

from .loader import DTYPES
from .model_source import is_hub_id
from .reasoning import REASONING_PARSERS
from .speculative import SpeculativeConfig
from .tool_calls import TOOL_CALL_PARSERS


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """The ``model`` section: which checkpoint, its dtype, the engine's paging and batching limits, and the
    format its answers call tools in (``tool_call_parser``; None: the one its chat template teaches), where their
    reasoning ends (``reasoning_parser``), and speculative decoding (``speculative``)."""

    name: str = "tiny"
    served_name: str | None = None
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int | None = None
    # Slots of the sliding-window layers' own cache (``window_slots.py``); None: enough for every sequence's
    # window, twice over; 0: those layers stay in the pages, for all positions.
    num_window_slots: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # The prompt tokens of a step in which streams decode (``scheduler.py``); None: 512 on a CPU, else no cap.
    max_prefill_tokens_while_decoding: int | None = None
    max_model_len: int | None = None
    backend: str | None = None
    tool_call_parser: str | None = None
    # Where the model's reasoning ends in its answers (vLLM's --reasoning-parser, ``reasoning.REASONING_PARSERS``);
    # None: answers are not split into reasoning and the rest.
    reasoning_parser: str | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # No CUDA graphs of decode steps, even where the backend could replay them (vLLM's --enforce-eager).
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        check_non_empty("name", self.name)
        check_non_empty("served_name", self.served_name)
        check_choice("dtype", self.dtype, DTYPES)
        check_at_least("page_size", self.page_size, 1)
        check_at_least("num_pages", self.num_pages, 1)
        check_at_least("num_window_slots", self.num_window_slots, 0)
        check_at_least("max_num_seqs", self.max_num_seqs, 1)
        check_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_at_least("max_prefill_tokens_while_decoding", self.max_prefill_tokens_while_decoding, 1)
        check_at_least("max_model_len", self.max_model_len, 1)
        if self.backend is not None:
            check_choice("backend", self.backend, BACKENDS)
        if self.tool_call_parser is not None:
            check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)

    @property
    def model_name(self) -> str:
        """The id clients send in the OpenAI ``model`` field: a preset's name, a Hugging Face id as given
        (``org/name``, as vLLM serves it), or a model directory's basename."""
        if self.served_name:
            return self.served_name
        if is_hub_id(self.name) and not Path(self.name).expanduser().exists():
            return self.name
        return Path(self.name).name

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``LLMEngine.from_pretrained(self.name, **kwargs)``."""
        return {
            "backend": self.backend,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "num_window_slots": self.num_window_slots,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_prefill_tokens_while_decoding": self.max_prefill_tokens_while_decoding,
            "max_model_len": self.max_model_len,
            "speculative": self.speculative,
            "enforce_eager": self.enforce_eager,
        }
