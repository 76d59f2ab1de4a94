"""Kernels built before the first request, on the thread that will run every step.

Two kinds of backend build kernels lazily. The CPU backends keep a matmul
kernel per row count (``KernelBackend.linear_row_counts``); ``warm_up_kernels``
runs each prepared matmul at each of those counts. Triton on a GPU compiles a
kernel the first time it launches it with a new signature (dtype, block
sizes, sinks or a window, the tile a mixture-of-experts step picks), which
takes seconds: left to the first requests, it was 2 s of a 4,096-token prompt's
TTFT on an H200 whose compiled step takes 0.05 s. Where the backend compiles
(``KernelBackend.compiles_kernels``), ``warm_up_kernels`` also runs one short
request through a prefill and decode steps, and each mixture-of-experts layer
at a token count for every tile shape it can pick. The integers that change
from step to step (a page table's width, a token count) are not part of a
kernel's signature (``triton_kernels.jit_if_available``), so these few
launches cover every later step.

The warm-up request leaves no trace a client could see or measure: an id and a
cache salt of its own (no prompt can hit its pages; they are the first the
cache evicts), no drafts (the drafter keeps nothing of it), and neither the
energy ledger nor the KV store sees it.

Where the backend's decode step can be recorded as a CUDA graph
(``KernelBackend.captures_cuda_graphs``) and the engine was not told
``enforce_eager``, the warm-up then captures one per batch size
(``capture_decode_graphs``, ``decode_graphs.py``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Iterator

import torch

from .decode_graphs import Capture, DecodeGraphs
from .gpt_oss import GptOssMoeBlock
from .llm_engine import LLMEngine
from .moe import SparseMoeBlock
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The warm-up request: a prompt of this many pages and a half (a partial last page), then decode steps.
_PROMPT_PAGES = 3
_DECODE_TOKENS = 4


def warm_up_kernels(engine: LLMEngine) -> int:
    """Build now every kernel the backend would otherwise build for the first requests: each matmul at each
    row count the backend keeps a kernel for, up to a step's token budget, and where the backend compiles
    per launch signature, every kernel a step launches (``compile_step_kernels``). Returns the number of
    matmuls run.

    Run it before the first request. After it, new prompt lengths and batch sizes build nothing more, so no
    request waits on a build and the memory the kernels take counts from the start.
    """
    row_counts = engine.backend.linear_row_counts(engine.scheduler.config.max_num_batched_tokens)
    with torch.inference_mode():
        num_matmuls = engine.model.warm_up_linears(row_counts)
    if engine.backend.compiles_kernels():
        compile_step_kernels(engine)
    if engine.backend.captures_cuda_graphs() and not engine.enforce_eager:
        capture_decode_graphs(engine)
    return num_matmuls


def capture_decode_graphs(engine: LLMEngine, capture_with: Capture | None = None) -> DecodeGraphs | None:
    """Record a decode step of each batch size as a CUDA graph, which the engine replays from now on for steps
    of decodes alone (``decode_graphs.py``); ``capture_with`` replaces the CUDA capture (tests). A capture that
    fails (a model whose step waits on the device) is logged, and every step stays eager: None."""
    if engine.has_unfinished_requests():
        raise RuntimeError("capture_decode_graphs runs before the first request")
    if engine.runner.window_cache is not None:
        logger.info("rayturn engine: decode steps stay eager: the sliding-window layers keep a cache of their own")
        return None
    graphs = DecodeGraphs(engine.runner, engine.scheduler.config.max_num_seqs, engine.max_model_len, capture_with)
    try:
        graphs.capture()
    except Exception as error:  # the engine runs as well without them
        logger.warning("rayturn engine: decode steps stay eager: capturing them as graphs failed: %s", error)
        return None
    engine.runner.decode_graphs = graphs
    return graphs


def compile_step_kernels(engine: LLMEngine) -> float:
    """Run one short request (prefill, then decode steps) and each mixture-of-experts layer at a token count
    for each of its tile shapes, compiling what they launch; returns the seconds taken."""
    if engine.has_unfinished_requests():
        raise RuntimeError("compile_step_kernels runs before the first request")
    started = time.perf_counter()
    vocab_size = engine.config.vocab_size
    prompt = [(7 * i + 1) % vocab_size for i in range(_PROMPT_PAGES * engine.page_size + engine.page_size // 2)]
    # No drafts: a drafting request would leave its output in the drafter's index (and its statistics) for a
    # cache salt nobody else has; its verify steps launch the kernels this request already does.
    params = SamplingParams(max_tokens=_DECODE_TOKENS, temperature=0.0, ignore_eos=True, speculative=False)
    tag = f"rayturn-warm-up-{secrets.token_hex(8)}"
    with _set_aside_ledger_and_store(engine):
        engine.add_request(prompt, params, request_id=tag, cache_salt=tag)
        while engine.has_unfinished_requests():
            engine.step()
    num_moe_runs = _run_experts_at_each_tile(engine)
    elapsed_s = time.perf_counter() - started
    logger.info(
        "compiled the %s backend's step kernels in %.2f s (one request, %d expert runs)",
        engine.backend.name,
        elapsed_s,
        num_moe_runs,
    )
    return elapsed_s


@contextlib.contextmanager
def _set_aside_ledger_and_store(engine: LLMEngine) -> Iterator[None]:
    """The warm-up's energy goes to a ledger of its own, and its pages neither come from nor go to the store."""
    ledger, transfer = engine.energy, engine.kv_transfer
    engine.energy = ledger.scratch()
    engine.kv_transfer = None
    try:
        yield
    finally:
        engine.energy, engine.kv_transfer = ledger, transfer


def _run_experts_at_each_tile(engine: LLMEngine) -> int:
    """Each distinct mixture-of-experts layer once at the fewest tokens for which the expert kernels pick each
    of their tile shapes, up to a step's token budget; returns the number of runs."""
    max_tokens = engine.scheduler.config.max_num_batched_tokens
    blocks: dict[tuple[object, ...], SparseMoeBlock | GptOssMoeBlock] = {}
    for module in engine.model.modules():
        if isinstance(module, (SparseMoeBlock, GptOssMoeBlock)):
            experts = module.experts
            key = (type(module), module.top_k, tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape))
            blocks.setdefault(key, module)
    runs = 0
    generator = torch.Generator(device=engine.device).manual_seed(0)
    with torch.inference_mode():
        for block in blocks.values():
            num_experts, hidden_size = block.experts.down_proj.shape[:2]
            for num_tokens in engine.backend.moe_token_counts_to_compile(
                num_experts, block.top_k, engine.dtype, engine.device, max_tokens
            ):
                x = torch.randn((num_tokens, hidden_size), generator=generator, device=engine.device)
                block(x.to(engine.dtype))
                runs += 1
    return runs
