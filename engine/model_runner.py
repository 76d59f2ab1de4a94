"""Turns a scheduled step into tensors, runs the model, returns logits.

Token order in the flat batch: one-token chunks first (decodes, and
one-token prompt chunks, which attend exactly like a decode), then longer
chunks packed back to back: prefill chunks, and decodes with a draft to
verify (their last token, then the draft tokens). Only chunks that reach their
sequence's last token produce logits to sample: one row, or one row per
position for a chunk with a draft. A chunk of a sequence that asks for
prompt logprobs also scores its prompt positions (``prompt_logprobs.py``).

A model with sliding-window layers, given window slots (``window_slots.py``),
keeps those layers' keys and values in a cache of their own, addressed by the
pages' window slots: they get a page table and slot mapping of their own
(``ForwardBatch.window``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import numpy as np
import torch

from rayturn.kernels import DecodeBatch, KernelBackend, PrefillBatch

from .decode_graphs import DecodeGraphs
from .model import CausalLM, ForwardBatch, SampledRows
from .page_pool import Page
from .page_views import PageViews
from .prompt_logprobs import PromptScores, score_prompt, scored_positions
from .scheduler import ScheduledChunk
from .sequence import Sequence


@dataclass(frozen=True, slots=True)
class RunOutput:
    sampled: list[ScheduledChunk]  # the chunks that sample, in the order of ``logits``' rows
    logits: torch.Tensor  # [rows, vocab] float32: per sampled chunk, 1 + len(chunk.draft) rows
    prompt_scores: list[PromptScores]  # one per chunk that scored prompt positions


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: KernelBackend,
        num_pages: int,
        page_size: int,
        device: torch.device,
        num_window_slots: int = 0,
    ) -> None:
        cfg = model.config
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.device = device
        dtype = next(model.parameters()).dtype
        layers = range(cfg.num_layers)
        self.sliding = tuple(num_window_slots > 0 and cfg.attention_window(i) is not None for i in layers)
        num_sliding = sum(self.sliding)
        # Each layer's index in its cache: the window cache's for sliding layers, the page cache's for the others.
        self.cache_index = tuple(
            sum(self.sliding[:i]) if s else i - sum(self.sliding[:i]) for i, s in enumerate(self.sliding)
        )
        page_shape = (2, page_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: padded attention reads multiply garbage by zero weights, and NaN * 0 is NaN.
        self.kv_cache = torch.zeros((num_pages, cfg.num_layers - num_sliding, *page_shape), dtype=dtype, device=device)
        self.window_cache = (
            torch.zeros((num_window_slots, num_sliding, *page_shape), dtype=dtype, device=device)
            if num_sliding
            else None
        )
        self.page_views = PageViews(self.kv_cache, self.window_cache, self.sliding)
        # Decode steps replayed from CUDA graphs, once the warm-up has captured them (``decode_graphs.py``).
        self.decode_graphs: DecodeGraphs | None = None

    @staticmethod
    def bytes_per_page(model: CausalLM, page_size: int, dtype: torch.dtype) -> int:
        cfg = model.config
        return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    def apply_page_copies(self, copies: Seq[tuple[int, int]], window_copies: Seq[tuple[int, int]] = ()) -> None:
        for cache, pairs in ((self.kv_cache, copies), (self.window_cache, window_copies)):
            if pairs and cache is not None:
                src = torch.tensor([s for s, _ in pairs], device=self.device)
                dst = torch.tensor([d for _, d in pairs], device=self.device)
                self.backend.copy_pages(cache, src, dst)

    def page_table_of(
        self, chunks: list[ScheduledChunk], num_tokens_after: list[int], window: bool = False
    ) -> torch.Tensor:
        """[len(chunks), pages of the longest] page ids (window slots with ``window``) of the chunks' sequences,
        holding ``num_tokens_after`` tokens each once the step has run; zeros past a sequence's pages."""
        max_pages = max((n + self.page_size - 1) // self.page_size for n in num_tokens_after)
        table = np.zeros((len(chunks), max_pages), dtype=np.int32)
        for row, chunk in enumerate(chunks):
            pages = chunk.seq.pages[:max_pages]
            # A page that gave its window slot back lies before the window: never read, any slot will do.
            ids = [max(page.window_slot, 0) for page in pages] if window else [page.page_id for page in pages]
            table[row, : len(ids)] = ids
        return torch.from_numpy(table).to(self.device)

    def _window_batch(
        self,
        decodes: list[ScheduledChunk],
        prefills: list[ScheduledChunk],
        decode: DecodeBatch | None,
        prefill: PrefillBatch | None,
        window_slots: list[int],
    ) -> ForwardBatch:
        """The sliding layers' part of a step: their cache, the window slots written, page tables of slots."""
        assert self.window_cache is not None
        if decode is not None:
            decode = replace(decode, page_table=self.page_table_of(decodes, list(decode.seq_lens_host), True))
        if prefill is not None:
            prefill = replace(prefill, page_table=self.page_table_of(prefills, list(prefill.seq_lens_host), True))
        return ForwardBatch(
            kv_cache=self.window_cache,
            slot_mapping=torch.tensor(window_slots, dtype=torch.int64, device=self.device),
            num_decode_tokens=len(decodes),
            decode=decode,
            prefill=prefill,
            cache_index=self.cache_index,
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> RunOutput:
        """Run one step: the chunks that sample with their logits, and the prompt positions scored."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(chunks):
            return RunOutput(list(chunks), graphs.run(chunks), [])
        decodes = [c for c in chunks if c.num_scheduled_tokens == 1]
        prefills = [c for c in chunks if c.num_scheduled_tokens > 1]
        ordered = decodes + prefills
        page_size = self.page_size

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        window_slots: list[int] = []
        logit_rows: list[int] = []
        logit_chunks: list[ScheduledChunk] = []  # the chunk of each of logit_rows
        scored: list[tuple[Sequence, range, int]] = []  # (sequence, positions, row of the first)
        for chunk in ordered:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_tokens
            prompt_positions = scored_positions(seq, start, end)
            if prompt_positions:
                scored.append((seq, prompt_positions, len(input_ids)))
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(chunk.draft)
            end += len(chunk.draft)
            positions.extend(range(start, end))
            pages = seq.pages  # only the pages this chunk writes are touched: a decode costs O(1) here
            slots.extend(pages[p // page_size].page_id * page_size + p % page_size for p in range(start, end))
            if self.window_cache is not None:
                window_slots.extend(_window_slots(pages, start, end, page_size))
            if chunk.samples:
                logit_rows.extend(range(len(input_ids) - 1 - len(chunk.draft), len(input_ids)))
                logit_chunks.extend([chunk] * (1 + len(chunk.draft)))

        decode_batch = None
        if decodes:
            seq_lens = [c.seq.num_computed_tokens + 1 for c in decodes]
            decode_batch = DecodeBatch(
                page_table=self.page_table_of(decodes, seq_lens),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                max_seq_len=max(seq_lens),
                seq_lens_host=tuple(seq_lens),
            )
        prefill_batch = None
        if prefills:
            query_lens = [c.num_scheduled_tokens for c in prefills]
            seq_lens = [c.seq.num_computed_tokens + c.num_scheduled_tokens for c in prefills]
            context_lens = [c.seq.num_computed_tokens for c in prefills]
            prefill_batch = PrefillBatch(
                page_table=self.page_table_of(prefills, seq_lens),
                query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32).to(
                    self.device
                ),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                query_lens_host=tuple(query_lens),
                seq_lens_host=tuple(seq_lens),
            )
        window = None
        if self.window_cache is not None:
            window = self._window_batch(decodes, prefills, decode_batch, prefill_batch, window_slots)
        batch = ForwardBatch(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decode_tokens=len(decodes),
            decode=decode_batch,
            prefill=prefill_batch,
            window=window,
            cache_index=self.cache_index,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        sampled = [c for c in ordered if c.samples]
        if not scored and len(logit_rows) < len(input_ids):
            # Rows nobody samples or scores skip the last layer's attention and MLP.
            hidden = self.model(ids, pos, batch, self._sampled_rows(logit_chunks, logit_rows, positions))
            return RunOutput(sampled, self.model.compute_logits(hidden), [])
        hidden = self.model(ids, pos, batch)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        prompt_scores = [
            score_prompt(self.model.compute_logits, hidden[row : row + len(positions)], seq, positions)
            for seq, positions, row in scored
        ]
        return RunOutput(sampled, self.model.compute_logits(hidden[rows]), prompt_scores)

    def _sampled_rows(self, chunks: list[ScheduledChunk], rows: list[int], positions: list[int]) -> SampledRows:
        """``rows`` (of ``chunks``' sequences) as one query each over its keys so far."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if not rows:
            return SampledRows(index, None)
        seq_lens = [positions[row] + 1 for row in rows]
        decode = DecodeBatch(
            page_table=self.page_table_of(chunks, seq_lens),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            max_seq_len=max(seq_lens),
            seq_lens_host=tuple(seq_lens),
        )
        window = None
        if self.window_cache is not None:
            window = replace(decode, page_table=self.page_table_of(chunks, seq_lens, True))
        return SampledRows(index, decode, window)


def _window_slots(pages: list[Page], start: int, end: int, page_size: int) -> list[int]:
    """The window-cache slots of positions ``start .. end - 1``, whose pages must still hold a window slot."""
    out = []
    for p in range(start, end):
        slot = pages[p // page_size].window_slot
        if slot < 0:
            raise RuntimeError(f"position {p} is written to a page without a window slot")
        out.append(slot * page_size + p % page_size)
    return out
