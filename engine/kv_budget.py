"""How many KV pages an engine gets when it is not told: what fits, and no more than it can use."""

from __future__ import annotations

import torch

from .kv_cache_manager import pages_for
from .model import CausalLM
from .model_runner import ModelRunner

CPU_KV_CACHE_BYTES = 512 << 20  # default KV budget on CPU hosts
GPU_KV_CACHE_FRACTION = 0.85  # of the memory free after loading weights


def default_num_pages(
    model: CausalLM,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """Pages for the memory budget of ``device``, capped at ``max_num_seqs`` full-length sequences."""
    bytes_per_page = ModelRunner.bytes_per_page(model, page_size, dtype)
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = int(free_bytes * GPU_KV_CACHE_FRACTION)
    else:
        budget = CPU_KV_CACHE_BYTES
    useful = max_num_seqs * pages_for(max_model_len, page_size)
    return max(1, min(budget // bytes_per_page, useful))
