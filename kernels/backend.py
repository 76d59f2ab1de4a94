"""The kernel backend interface: every op the model and the KV store need.

A backend is a stateless bundle of ops. The engine picks one at start
(``rayturn.kernels.registry.select_backend``) and threads it through the model;
nothing else in rayturn branches on the backend's name.

KV cache layout (shared by all backends and by the KV store)::

    kv_cache: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]

Page-major, so one page holds the keys and values of ``page_size`` tokens for
every layer in one contiguous block: moving a page between processes is one
contiguous copy. A layer's view ``kv_cache[:, layer, 0]`` (keys) and
``kv_cache[:, layer, 1]`` (values) is ``[num_pages, page_size, num_kv_heads,
head_dim]`` with a page stride larger than the view's size; kernels honour
strides. A token at position ``p`` of a sequence lives in slot
``page_table[p // page_size] * page_size + p % page_size``. A model with
sliding-window layers may keep those layers in a second cache of the same
layout (the engine's window slots): their kernels get its views and a page
table of its slots, whose entries before the window are never read.

Attention options (GPT-OSS uses both):

- ``sinks``: one learned logit per query head ([num_heads], float32) that
  joins that head's softmax denominator as one more score with no value: it
  takes probability mass and adds nothing to the output.
- ``sliding_window`` W: a query at position p sees only keys ``p - W + 1 ..
  p`` (W keys, itself included); pages wholly before that need not be read.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import moe


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Sequences that add one query token each, attending to their whole cache.

    ``page_table[i, j]`` is the j-th page of sequence i (entries past the
    sequence's last page are padding and never read); ``seq_lens[i]`` counts
    the sequence's tokens including the new one.
    """

    page_table: torch.Tensor  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_seq_len: int
    seq_lens_host: tuple[int, ...]  # host copy, so host-side planning needs no sync


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Sequences that add a chunk of query tokens after ``context_lens`` cached ones.

    Queries are packed: sequence i owns rows ``query_start_loc[i] :
    query_start_loc[i + 1]``. Query row r of sequence i sits at position
    ``context_lens[i] + r`` and attends causally to keys ``0 ..
    context_lens[i] + r``; ``seq_lens = context_lens + query_lens``.
    """

    page_table: torch.Tensor  # [num_seqs, max_pages] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    max_seq_len: int
    # Host copies of the per-sequence lengths, so host-side loops need no sync.
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]


class KernelBackend(abc.ABC):
    """Ops over tensors on one device. ``name`` is the registry key."""

    name: str = "abstract"

    def describe(self) -> str:
        """How this backend runs on its host, for the start-up log (e.g. the native kernels' vector width);
        empty when there is nothing to say beyond its name."""
        return ""

    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / sqrt(mean(x**2, -1) + eps) * weight``, computed in float32."""

    @abc.abstractmethod
    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style rotary embedding (rotate halves) of ``query`` and ``key``.

        ``query``: [num_tokens, num_heads, head_dim]; ``key``: [num_tokens,
        num_kv_heads, head_dim]; ``cos_sin_cache``: [max_positions, head_dim]
        float32 holding ``cos`` in the first half of the last dim and ``sin``
        in the second. Returns new tensors.
        """

    @abc.abstractmethod
    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate`` and ``up`` of one shape [..., d] (rows may be strided).

        A backend may overwrite ``gate`` (the model passes it fresh from its projection)."""

    @abc.abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store token t's key/value ([num_tokens, num_kv_heads, head_dim]) in slot ``slot_mapping[t]``.

        A negative slot marks a padding token: nothing is written for it.
        """

    @abc.abstractmethod
    def decode_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Attention of one query per sequence over its paged cache.

        ``query``: [num_seqs, num_heads, head_dim]; returns the same shape.
        ``sinks`` and ``sliding_window`` as in the module docstring.
        """

    @abc.abstractmethod
    def prefill_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PrefillBatch,
        scale: float,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of packed query chunks over cached context plus themselves.

        ``query``: [num_tokens, num_heads, head_dim]; returns the same shape.
        The chunk's own keys must already be written to the cache. ``sinks``
        and ``sliding_window`` as in the module docstring.
        """

    @abc.abstractmethod
    def gather_pages(self, kv_cache: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy pages ``page_ids`` of ``kv_cache`` into the contiguous ``out`` ([len(page_ids), *page_shape])."""

    @abc.abstractmethod
    def scatter_pages(self, src: torch.Tensor, kv_cache: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Copy contiguous ``src`` ([len(page_ids), *page_shape]) into pages ``page_ids`` of ``kv_cache``."""

    def prepare_linear(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` ([out, in]) repacked for this backend's ``linear``, or None to use it as it is.

        Called once per weight after loading; the result is passed back to
        every ``linear`` call with that weight.
        """
        return None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prepared: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x`` [num_tokens, in]; ``prepared`` is ``prepare_linear(weight)``."""
        return F.linear(x, weight, bias)

    def compiles_kernels(self) -> bool:
        """Whether the backend compiles a kernel the first time it launches it with a new signature (Triton on
        a GPU): the engine then runs every kind of step once at start (``engine.warm_up``)."""
        return False

    def captures_cuda_graphs(self) -> bool:
        """Whether a decode step of this backend can be recorded as a CUDA graph and replayed: its kernels run
        on a GPU, read every per-step value from tensors (never a host copy), and never wait on the device
        (``engine.decode_graphs``)."""
        return False

    def moe_token_counts_to_compile(
        self, num_experts: int, top_k: int, dtype: torch.dtype, device: torch.device, max_tokens: int
    ) -> list[int]:
        """Token counts, up to ``max_tokens``, at which a warm-up runs a mixture-of-experts layer so that every
        variant of its expert kernels is compiled (one per tile shape); empty where nothing compiles."""
        return []

    def linear_row_counts(self, max_rows: int) -> tuple[int, ...]:
        """The row counts at which ``linear`` on a prepared weight builds and keeps a kernel of its own, for
        inputs of up to ``max_rows`` rows; empty when it keeps none per row count."""
        return ()

    def mlp_chunk_rows(self, x: torch.Tensor) -> int | None:
        """Rows of ``x`` the dense MLP takes per pass, or None for all at once.

        A prefill-sized MLP's intermediate activations (rows x 2 x intermediate) outgrow a CPU's cache;
        in passes of a few hundred rows they stay in it, and each row's result is the same either way.
        """
        return None

    def fused_moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        renormalize: bool,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        activation: moe.ClampedSwiGLU | None = None,
    ) -> torch.Tensor:
        """A mixture-of-experts SwiGLU MLP of ``x`` [num_tokens, hidden] (see ``rayturn.kernels.moe``).

        Each token goes to the ``top_k`` experts of highest softmax(``router_logits``) probability, those
        probabilities rescaled to sum to 1 when ``renormalize``; ``gate_up`` is [num_experts, 2 * intermediate,
        hidden] (gate rows, then up rows), ``down`` is [num_experts, hidden, intermediate], with optional
        per-expert biases [num_experts, 2 * intermediate] and [num_experts, hidden]. ``activation`` replaces
        ``silu_and_mul`` (GPT-OSS's clamped SwiGLU).
        """
        activation_fn = activation or self.silu_and_mul
        return moe.fused_moe(
            x, router_logits, gate_up, down, top_k, renormalize, activation_fn, gate_up_bias, down_bias,
            matmul=self.grouped_matmul,
        )  # fmt: skip

    def grouped_matmul(self, rows: torch.Tensor, weight: torch.Tensor, group_sizes: tuple[int, ...]) -> torch.Tensor:
        """``rows @ weight[e].T`` for each expert e's ``group_sizes[e]`` consecutive rows (``weight``: [num_experts,
        out, in]): the experts' matmuls inside ``fused_moe``."""
        return moe.grouped_matmul(rows, weight, group_sizes)

    def copy_pages(self, kv_cache: torch.Tensor, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor) -> None:
        """Copy whole pages inside the cache (copy-on-write of shared pages)."""
        staging = torch.empty((src_page_ids.numel(), *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
        self.gather_pages(kv_cache, src_page_ids, staging)
        self.scatter_pages(staging, kv_cache, dst_page_ids)
