"""Decode steps replayed from CUDA graphs, one per batch size, captured at start.

On a GPU a small model's decode step is bound by launches, not by the GPU: the `small` preset's
8 layers launch ~100 kernels a step, each costing the host microseconds of Python and driver
time, while the GPU finishes each in a few. Where the kernel backend takes every per-step value
from tensors (``KernelBackend.captures_cuda_graphs``: Triton on a GPU), the start-up warm-up
captures the forward pass and the logits of a decode batch once per size in :func:`bucket_sizes`,
over static input tensors, and a step of decodes alone copies its inputs into the smallest size
that holds it and replays that graph: one launch for the whole step.

A step takes this path when every chunk adds one token (no draft to verify), every chunk
samples, no prompt positions are scored and the batch fits the largest size; any other step runs
eagerly, as every step does with ``enforce_eager`` and in a model whose sliding-window layers keep
a cache of their own (``window_slots.py``: their page tables would need graphs of their own). Padding rows
get token 0 at position 0, slot -1 (the backends write nothing for a negative slot) and one key
(the first slot of whatever page their row of the table still names, page 0 or an earlier step's:
any page will do, nothing of it reaches a real row); their logits are dropped. The page table
spans ``max_model_len``. The logits are copied out of the graph's output, which the next replay
overwrites.

Life cycle: ``DecodeGraphs(runner, ...)`` allocates the static tensors; :meth:`capture` records
each size (largest first, all in one memory pool), after two eager runs of it on a side stream
(which compile what is compiled lazily); the runner then sends each eligible step to
:meth:`run`. ``capture_with`` replaces the CUDA capture (:class:`CudaCapture`; a CPU test replays by
running the recorded step again, over the same static tensors).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rayturn.kernels import DecodeBatch

from .model import ForwardBatch
from .prompt_logprobs import scored_positions

if TYPE_CHECKING:
    from .model_runner import ModelRunner
    from .scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 16, up to and including ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {n for n in (1, 2, 4, 8) if n < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return sorted(sizes)


class CudaCapture:
    """Records a step into a CUDA graph (after two eager runs on a side stream); every graph it records shares
    one memory pool, so record the largest first."""

    def __init__(self) -> None:
        self.pool: Any = None

    def __call__(self, forward: Callable[[], torch.Tensor]) -> Replay:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a KV transfer's copies) neither break nor join the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    def __init__(
        self, runner: ModelRunner, max_num_seqs: int, max_model_len: int, capture_with: Capture | None = None
    ) -> None:
        if runner.window_cache is not None:
            raise ValueError("decode graphs need a model whose sliding-window layers keep no cache of their own")
        self.runner = runner
        self.sizes = bucket_sizes(max_num_seqs)
        self.max_pages = -(-max_model_len // runner.page_size)
        self.capture_with = capture_with or CudaCapture()
        largest, device = self.sizes[-1], runner.device
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.page_table = torch.zeros((largest, self.max_pages), dtype=torch.int32, device=device)
        self._replays: dict[int, Replay] = {}
        self.num_replays = 0

    @property
    def captured(self) -> bool:
        return bool(self._replays)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size's graph; the seconds it took."""
        start_s = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            self._replays[size] = self.capture_with(self._forward_of(size))
        elapsed_s = time.perf_counter() - start_s
        logger.info("rayturn engine: decode steps of %s sequences captured as graphs in %.2f s", self.sizes, elapsed_s)
        return elapsed_s

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this step is one the graphs replay (see the module docstring)."""
        if not self._replays or not chunks or len(chunks) > self.sizes[-1]:
            return False
        page_size = self.runner.page_size
        for chunk in chunks:
            seq = chunk.seq
            start = seq.num_computed_tokens
            if chunk.num_scheduled_tokens != 1 or not chunk.samples:  # a draft to verify counts in the first
                return False
            if start // page_size >= self.max_pages or scored_positions(seq, start, start + 1):
                return False
        return True

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The logits of a step ``can_run`` accepted, one row per chunk in their order (called inside the
        runner's inference mode)."""
        num_seqs = len(chunks)
        size = next(size for size in self.sizes if size >= num_seqs)
        page_size = self.runner.page_size
        ids = np.zeros(size, dtype=np.int64)
        positions = np.zeros(size, dtype=np.int64)
        slots = np.full(size, -1, dtype=np.int64)
        seq_lens = np.ones(size, dtype=np.int32)
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            position = seq.num_computed_tokens
            ids[row] = seq.token_ids[position]
            positions[row] = position
            slots[row] = seq.pages[position // page_size].page_id * page_size + position % page_size
            seq_lens[row] = position + 1
        table = self.runner.page_table_of(chunks, seq_lens[:num_seqs].tolist())
        self.input_ids[:size].copy_(torch.from_numpy(ids))
        self.positions[:size].copy_(torch.from_numpy(positions))
        self.slot_mapping[:size].copy_(torch.from_numpy(slots))
        self.seq_lens[:size].copy_(torch.from_numpy(seq_lens))
        self.page_table[:num_seqs, : table.shape[1]].copy_(table)
        self.num_replays += 1
        return self._replays[size]()[:num_seqs].clone()

    def _forward_of(self, size: int) -> Callable[[], torch.Tensor]:
        """The step a graph of ``size`` rows records: the model over the static inputs, then the logits."""
        runner = self.runner
        max_len = self.max_pages * runner.page_size
        batch = ForwardBatch(
            kv_cache=runner.kv_cache,
            slot_mapping=self.slot_mapping[:size],
            num_decode_tokens=size,
            decode=DecodeBatch(
                page_table=self.page_table[:size],
                seq_lens=self.seq_lens[:size],
                # Host-side bounds only (the capturing backends read lengths from ``seq_lens``).
                max_seq_len=max_len,
                seq_lens_host=(max_len,) * size,
            ),
            prefill=None,
            cache_index=runner.cache_index,
        )
        ids, positions, model = self.input_ids[:size], self.positions[:size], runner.model

        def forward() -> torch.Tensor:
            return model.compute_logits(model(ids, positions, batch))

        return forward
