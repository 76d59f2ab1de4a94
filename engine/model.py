"""Llama-family decoder (Llama 3.x, Mistral, Qwen2/2.5, Qwen3; Mixtral and Qwen3-MoE with mixture-of-experts
MLPs, see ``moe``; GPT-OSS with attention sinks, sliding-window layers and its own experts, see ``gpt_oss``) over
a paged KV cache.

The model sees one flat batch of tokens per step: decode tokens first (one per
sequence), then prefill chunks packed back to back. ``ForwardBatch`` carries
where each token's key/value goes and what each query attends to; the kernel
backend does the rest. The q/k/v projections are fused into one matmul;
``load_weights`` maps Hugging Face tensor names onto that layout.

Only the rows that are sampled need the last layer whole. Given
``SampledRows``, the last layer writes every token's key and value (later
steps read them), then attends, projects and runs its MLP for the sampled
rows alone, each as a one-query attention over its keys so far: a prefill
chunk of thousands of tokens pays one layer's attention and MLP for one row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from rayturn.kernels import DecodeBatch, KernelBackend, PrefillBatch

from . import gpt_oss
from .config import ModelConfig
from .moe import SparseMoeBlock, checkpoint_name, expert_slice


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """Everything a forward pass needs besides token ids and positions."""

    kv_cache: torch.Tensor  # [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each token's key/value
    num_decode_tokens: int
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    # The sliding-window layers' own cache, slots and page tables, where they are kept apart
    # (``window_slots.py``), and each layer's index in its cache; without them, layer i is kv_cache[:, i].
    window: ForwardBatch | None = None
    cache_index: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SampledRows:
    """The rows whose final hidden states a step needs (``index``), and each as one query over its keys so far
    (``decode``; ``window_decode`` over the sliding layers' cache where it is kept apart). ``decode`` is None
    when no row is needed: the last layer then only writes the step's keys and values."""

    index: torch.Tensor  # [num_rows] int64, rows of the step's flat batch
    decode: DecodeBatch | None
    window_decode: DecodeBatch | None = None


class Linear(nn.Module):
    """``nn.Linear``'s parameters (and names), computed by the kernel backend.

    ``prepare`` hands the loaded weight to the backend once, which may keep a
    copy in a faster layout; until then (and for backends that keep none) the
    plain weight is used.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.backend = backend
        self.prepared: torch.Tensor | None = None

    def prepare(self) -> None:
        self.prepared = self.backend.prepare_linear(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias, self.prepared)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: KernelBackend) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.backend = backend
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, config.qkv_bias, backend)
        self.o_proj = Linear(config.q_size, config.hidden_size, config.o_bias, backend)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, backend) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, backend) if config.qk_norm else None
        self.sinks = (
            nn.Parameter(torch.empty(config.num_heads), requires_grad=False) if config.attention_sinks else None
        )
        self.sliding_window = config.attention_window(layer_index)
        self.scale = config.head_dim**-0.5

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, rope_cache: torch.Tensor
    ) -> torch.Tensor:
        query, key_cache, value_cache, batch = self._project_and_write(positions, hidden, batch, rope_cache)
        cfg = self.config
        num_tokens = hidden.shape[0]
        num_decode = batch.num_decode_tokens
        options = (self.scale, self.sinks, self.sliding_window)
        if batch.prefill is None and batch.decode is not None:
            out = self.backend.decode_attention(query, key_cache, value_cache, batch.decode, *options)
        elif batch.decode is None and batch.prefill is not None:
            out = self.backend.prefill_attention(query, key_cache, value_cache, batch.prefill, *options)
        else:
            assert batch.decode is not None and batch.prefill is not None
            out = torch.empty_like(query)
            out[:num_decode] = self.backend.decode_attention(
                query[:num_decode], key_cache, value_cache, batch.decode, *options
            )
            out[num_decode:] = self.backend.prefill_attention(
                query[num_decode:], key_cache, value_cache, batch.prefill, *options
            )
        return self.o_proj(out.reshape(num_tokens, cfg.q_size))

    def forward_rows(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        rope_cache: torch.Tensor,
        rows: SampledRows,
    ) -> torch.Tensor:
        """Every token's key and value written; the attention output of ``rows`` only ([len(rows.index),
        hidden_size])."""
        query, key_cache, value_cache, read = self._project_and_write(positions, hidden, batch, rope_cache)
        if rows.decode is None:
            return hidden[:0]
        decode = rows.window_decode if read is not batch else rows.decode  # the window's cache, or the pages
        assert decode is not None, "a sliding layer with its own cache needs the rows' window page tables"
        options = (self.scale, self.sinks, self.sliding_window)
        out = self.backend.decode_attention(query[rows.index], key_cache, value_cache, decode, *options)
        return self.o_proj(out.reshape(len(rows.index), self.config.q_size))

    def _project_and_write(
        self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, rope_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch]:
        """The step's queries (rotated), this layer's key and value caches with the step's written into them,
        and the batch this layer reads (its window's where it slides)."""
        cfg = self.config
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        query = query.view(num_tokens, cfg.num_heads, cfg.head_dim)
        key = key.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        value = value.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.backend.rotary_embedding(positions, query, key, rope_cache)

        if self.sliding_window is not None and batch.window is not None:
            batch = batch.window
        index = batch.cache_index[self.layer_index] if batch.cache_index else self.layer_index
        key_cache = batch.kv_cache[:, index, 0]
        value_cache = batch.kv_cache[:, index, 1]
        self.backend.write_kv(key, value, key_cache, value_cache, batch.slot_mapping)
        return query, key_cache, value_cache, batch


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.backend = backend
        # Separate gate and up projections: on CPUs two contiguous outputs beat
        # one fused output split in halves (measured ~20% on this MLP).
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, config.mlp_bias, backend)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, config.mlp_bias, backend)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.backend.mlp_chunk_rows(x)
        if rows is None or x.shape[0] <= rows:
            return self._forward(x)
        return torch.cat([self._forward(part) for part in x.split(rows)])

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: KernelBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, backend)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_index):
            router = Linear(config.hidden_size, config.num_experts, config.moe_bias, backend)
            block = gpt_oss.GptOssMoeBlock if config.model_type == "gpt_oss" else SparseMoeBlock
            self.mlp = block(config, backend, router)
        else:
            self.mlp = MLP(config, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, rope_cache: torch.Tensor
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), batch, rope_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_rows(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        rope_cache: torch.Tensor,
        rows: SampledRows,
    ) -> torch.Tensor:
        """``forward``'s output for ``rows`` only; every token's key and value are written all the same."""
        attended = self.self_attn.forward_rows(positions, self.input_layernorm(hidden), batch, rope_cache, rows)
        if not attended.shape[0]:
            return attended
        hidden = hidden[rows.index] + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class CausalLM(nn.Module):
    """The decoder stack plus the LM head; parameter names follow Hugging Face's minus ``model.``."""

    def __init__(self, config: ModelConfig, backend: KernelBackend, rope_cache: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        # [max_positions, head_dim] float32 whatever the weights' dtype; not a
        # parameter, so dtype casts of the model leave it alone.
        self.rope_cache = rope_cache
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False, backend)
        )
        self._tied_head: torch.Tensor | None = None  # prepared embedding matrix when the head is tied
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, rows: SampledRows | None = None
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size]; of ``rows`` only ([len(rows.index), hidden_size]) when
        given."""
        hidden = self.embed_tokens(input_ids)
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]  # a ModuleList of them
        for layer in layers[:-1] if rows is not None else layers:
            hidden = layer(positions, hidden, batch, self.rope_cache)
        if rows is not None:
            hidden = layers[-1].forward_rows(positions, hidden, batch, self.rope_cache, rows)
            if not hidden.shape[0]:
                return hidden
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return self.backend.linear(hidden, self.embed_tokens.weight, None, self._tied_head).float()

    def prepare(self) -> None:
        """Let the backend repack every matmul weight; call again after changing weights."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare()
        if self.lm_head is None:
            self._tied_head = self.backend.prepare_linear(self.embed_tokens.weight)

    def warm_up_linears(self, row_counts: Iterable[int]) -> int:
        """Run each distinct prepared matmul (weight shape, bias or not) once at each of ``row_counts`` rows,
        so that what the backend builds per row count is built now; returns the number of matmuls run."""
        linears: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = [
            (layer.weight, layer.bias, layer.prepared) for layer in self.modules() if isinstance(layer, Linear)
        ]
        linears.append((self.embed_tokens.weight, None, self._tied_head))
        counts = tuple(row_counts)
        distinct = {
            (tuple(weight.shape), bias is not None, weight.dtype): (weight, bias, prepared)
            for weight, bias, prepared in linears
            if prepared is not None
        }
        for weight, bias, prepared in distinct.values():
            for num_rows in counts:
                rows = torch.zeros(num_rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
                self.backend.linear(rows, weight, bias, prepared)
        return len(distinct) * len(counts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in; raise naming any tensor missing or unexpected."""
        cfg = self.config
        params = dict(self.named_parameters())
        # HF name fragment -> (our fused parameter, row offset, row count)
        fused = {
            "q_proj": ("qkv_proj", 0, cfg.q_size),
            "k_proj": ("qkv_proj", cfg.q_size, cfg.kv_size),
            "v_proj": ("qkv_proj", cfg.q_size + cfg.kv_size, cfg.kv_size),
        }
        expected_size: dict[str, int] = {name: p.numel() for name, p in params.items()}
        loaded_size: dict[str, int] = dict.fromkeys(params, 0)
        if cfg.model_type == "gpt_oss":
            weights = gpt_oss.checkpoint_tensors(weights)
        for hf_name, tensor in weights:
            name = checkpoint_name(hf_name.removeprefix("model."))
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints store the head anyway
            if name.endswith("rotary_emb.inv_freq"):
                continue  # older checkpoints store the RoPE table; we compute it
            located = expert_slice(name, params) or _fused_slice(name, fused, params)
            if located is None:
                raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint for {cfg.architecture}")
            target, dest = located
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded_size[target] += dest.numel()
        unfused = {"qkv_proj": "q_proj/k_proj/v_proj"}
        missing = [
            ("" if name.startswith("lm_head") else "model.") + ".".join(unfused.get(p, p) for p in name.split("."))
            for name, n in loaded_size.items()
            if n != expected_size[name]
        ]
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(sorted(missing))}")


def _fused_slice(
    name: str, fused: dict[str, tuple[str, int, int]], params: dict[str, nn.Parameter]
) -> tuple[str, torch.Tensor] | None:
    """The parameter a checkpoint tensor fills and the slice of it: its rows of a fused projection, else all of it."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in fused:
            fused_name, offset, rows = fused[part]
            target = ".".join([*parts[:i], fused_name, *parts[i + 1 :]])
            return (target, params[target].data[offset : offset + rows]) if target in params else None
    return (name, params[name].data) if name in params else None
