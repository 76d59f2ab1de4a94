"""rayturn.engine: the single-process engine (model, paged KV cache, scheduler, sampler)."""

from .guided import Guide, check_guide
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .session_holds import SessionMove

__all__ = ["CompletionOutput", "Guide", "LLMEngine", "RequestOutput", "SamplingParams", "SessionMove", "check_guide"]
