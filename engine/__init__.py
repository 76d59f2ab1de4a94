"""rayturn.engine: the single-process engine (model, paged KV cache, scheduler, sampler)."""

from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .session_holds import SessionMove

__all__ = ["CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams", "SessionMove"]
