"""How many KV pages an engine gets when it is not told: what fits, and no more than it can use.

A model with sliding-window layers keeps them in window slots (``window_slots.py``): enough for every
sequence's window and a step's chunks, twice over (the rest serve prefix-cache hits), within a quarter of
the budget; the pages then hold only the other layers, so more of them fit the rest.
"""

from __future__ import annotations

import torch

from .kv_cache_manager import pages_for
from .model import CausalLM
from .model_runner import ModelRunner
from .window_slots import WindowSlots

CPU_KV_CACHE_BYTES = 512 << 20  # default KV budget on CPU hosts
GPU_KV_CACHE_FRACTION = 0.85  # of the memory free after loading weights
WINDOW_SLOTS_MAX_SHARE = 0.25  # of the budget, for default window slots


def kv_budget_bytes(device: torch.device) -> int:
    """The KV cache's memory budget on ``device``."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes * GPU_KV_CACHE_FRACTION)
    return CPU_KV_CACHE_BYTES


def kept_window(model: CausalLM, page_size: int, max_model_len: int) -> int | None:
    """The longest sliding window of the model's layers, where a sequence can outgrow it; else None."""
    windows = [w for w in model.config.attention_windows if w is not None]
    if not windows or max(windows) + page_size >= max_model_len:
        return None
    return max(windows)


def least_window_slots(window: int, page_size: int, max_num_batched_tokens: int) -> int:
    """The window slots one sequence's step may need: a full chunk, the window before it, a page copied on
    write."""
    return pages_for(max_num_batched_tokens + window, page_size) + 2


def default_window_slots(window: int, page_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Window slots for ``max_num_seqs`` sequences' windows and a step's chunks, twice over."""
    return 2 * (max_num_seqs * (pages_for(window, page_size) + 2) + pages_for(max_num_batched_tokens, page_size))


def check_window_slots(num_slots: int, window: int, page_size: int, max_num_batched_tokens: int) -> int:
    """``num_slots`` when one sequence's step fits; else ``ValueError`` naming the least that does."""
    least = least_window_slots(window, page_size, max_num_batched_tokens)
    if num_slots < least:
        raise ValueError(
            f"num_window_slots must be 0 (sliding layers kept in the pages) or at least {least} (a "
            f"{max_num_batched_tokens}-token chunk and the {window}-token window before it), got {num_slots}"
        )
    return num_slots


def layer_bytes(model: CausalLM, page_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one page of the layers without a window, and of one window slot of those with one."""
    cfg = model.config
    per_layer = ModelRunner.bytes_per_page(model, page_size, dtype) // cfg.num_layers
    num_sliding = sum(w is not None for w in cfg.attention_windows)
    return (cfg.num_layers - num_sliding) * per_layer, num_sliding * per_layer


def default_num_pages(
    model: CausalLM,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    max_model_len: int,
    num_window_slots: int = 0,
) -> int:
    """Pages for the memory budget of ``device`` (less ``num_window_slots`` slots of the sliding layers),
    capped at ``max_num_seqs`` full-length sequences."""
    bytes_per_page = ModelRunner.bytes_per_page(model, page_size, dtype)
    budget = kv_budget_bytes(device)
    useful = max_num_seqs * pages_for(max_model_len, page_size)
    if num_window_slots:
        bytes_per_page, slot_bytes = layer_bytes(model, page_size, dtype)
        budget -= num_window_slots * slot_bytes
        if bytes_per_page == 0:
            return useful
    return max(1, min(budget // bytes_per_page, useful))


def kv_sizes(
    model: CausalLM,
    dtype: torch.dtype,
    device: torch.device,
    page_size: int,
    num_pages: int | None,
    num_window_slots: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> tuple[int, WindowSlots | None]:
    """An engine's page count and its sliding layers' window slots (None where those layers stay in the pages:
    the model has none that a sequence can outgrow, or ``num_window_slots`` is 0); None counts: the defaults."""
    window = kept_window(model, page_size, max_model_len)
    if window is None or num_window_slots == 0:
        return num_pages or default_num_pages(model, page_size, dtype, device, max_num_seqs, max_model_len), None
    if num_window_slots is None:
        slots = default_window_slots(window, page_size, max_num_seqs, max_num_batched_tokens)
        if num_pages is None:  # within a share of the budget, though never fewer than one step needs
            _, slot_bytes = layer_bytes(model, page_size, dtype)
            share = int(kv_budget_bytes(device) * WINDOW_SLOTS_MAX_SHARE) // slot_bytes
            slots = min(slots, max(share, least_window_slots(window, page_size, max_num_batched_tokens)))
    else:
        slots = check_window_slots(num_window_slots, window, page_size, max_num_batched_tokens)
    pages = num_pages or default_num_pages(model, page_size, dtype, device, max_num_seqs, max_model_len, slots)
    if num_window_slots is None:
        slots = min(slots, pages)  # no more than pages to give them to
    return pages, WindowSlots(slots, window, page_size)
