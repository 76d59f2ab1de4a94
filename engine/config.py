"""Model configuration read from a Hugging Face ``config.json``: dense Llama-family and mixture-of-experts models
(Mixtral, Qwen3-MoE, GPT-OSS).

Parsed once, at load time, into a frozen ``ModelConfig``; anything the engine
cannot run exactly (an unknown architecture, an unsupported RoPE scaling)
is refused here with an error that names the field, rather than producing
wrong tokens later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayturn.kernels.moe import ClampedSwiGLU

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_QUANTIZATION = ("mxfp4",)
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # scale of cos and sin; None: derived from factor (and mscale)
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2, Llama with attention_bias)
    o_bias: bool  # bias on the output projection (Llama with attention_bias)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None  # a window the engine does not apply: it caps the context (see max_model_len)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    num_experts: int = 0  # 0: every MLP is dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # rescale the top-k routing probabilities to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: a mixture-of-experts MLP rather than a dense one
    moe_bias: bool = False  # biases on the router and on every expert projection (GPT-OSS)
    expert_activation: ClampedSwiGLU | None = None  # None: SwiGLU
    # Per layer: the sliding window its attention applies (a query sees that many keys, itself included), None
    # for full attention; empty when every layer is full.
    attention_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False  # a learned per-head logit in every attention softmax (GPT-OSS)
    quantization: str | None = None  # how the checkpoint stores weights the engine dequantises at load

    def is_moe_layer(self, layer_index: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer_index]

    def attention_window(self, layer_index: int) -> int | None:
        return self.attention_windows[layer_index] if self.attention_windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine runs exactly.

        With a sliding window shorter than the context, full attention equals
        windowed attention only up to the window, so the window caps the length.
        """
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def check_max_model_len(self, max_model_len: int | None) -> int:
        """The context an engine runs: ``max_model_len``, the model's when None; ValueError beyond the model's."""
        if max_model_len is None:
            return self.max_model_len
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_model_len > self.max_model_len:
            windowed = self.sliding_window is not None and self.sliding_window < self.max_position_embeddings
            source = "sliding_window" if windowed else "max_position_embeddings"
            raise ValueError(
                f"max_model_len {max_model_len} is more than the model's context length {self.max_model_len} "
                f"({source} in config.json)"
            )
        return max_model_len

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        return _parse(raw, source)

    @staticmethod
    def from_file(path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: missing; expected a Hugging Face config.json") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON ({err}); expected a Hugging Face config.json") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return _parse(raw, str(path))


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    def need(key: str, kind: type) -> Any:
        if key not in raw:
            raise ValueError(f"{source}: missing required field {key!r}")
        value = raw[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{source}: field {key!r} must be {kind.__name__}, got {value!r}")
        return value

    architectures = raw.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise ValueError(
            f"{source}: field 'architectures' is {architectures!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = SUPPORTED_ARCHITECTURES[architecture]
    hidden_size = need("hidden_size", int)
    num_heads = need("num_attention_heads", int)
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{source}: 'num_attention_heads' ({num_heads}) must be a multiple of "
            f"'num_key_value_heads' ({num_kv_heads})"
        )
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    attention_bias = bool(raw.get("attention_bias", model_type == "gpt_oss"))
    use_sliding = raw.get("use_sliding_window", model_type in ("mistral", "mixtral"))
    if model_type == "gpt_oss":  # its windows are applied per layer (attention_windows), so they cap nothing
        use_sliding = False
    sliding_window = raw.get("sliding_window") if use_sliding else None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    num_layers = need("num_hidden_layers", int)
    moe = _parse_moe(raw, source, model_type, num_layers)
    gpt_oss = _parse_gpt_oss(raw, source, num_layers) if model_type == "gpt_oss" else {}
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=need("vocab_size", int),
        hidden_size=hidden_size,
        intermediate_size=need("intermediate_size", int),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type in ("llama", "mistral", "qwen3_moe", "gpt_oss"),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        quantization=_parse_quantization(raw, source),
        **moe,
        **gpt_oss,
    )


def _parse_moe(raw: dict[str, Any], source: str, model_type: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelConfig``; empty for dense models (router loss settings are
    training-only and ignored)."""
    if model_type not in ("mixtral", "qwen3_moe", "gpt_oss"):
        return {}

    def positive_int(key: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
        return value

    experts_key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    num_experts = positive_int(experts_key, raw.get(experts_key))
    top_k = positive_int("num_experts_per_tok", raw.get("num_experts_per_tok"))
    if top_k > num_experts:
        raise ValueError(f"{source}: 'num_experts_per_tok' ({top_k}) is more than {experts_key!r} ({num_experts})")
    if model_type == "gpt_oss":  # top-k of the router's logits, softmaxed among themselves
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": positive_int("intermediate_size", raw.get("intermediate_size")),
            "norm_topk_prob": True,
            "moe_layers": (True,) * num_layers,
        }
    if model_type == "mixtral":
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": positive_int("intermediate_size", raw.get("intermediate_size")),
            "norm_topk_prob": True,
            "moe_layers": (True,) * num_layers,
        }
    step = positive_int("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
    dense_layers = raw.get("mlp_only_layers") or []
    if not isinstance(dense_layers, list) or not all(isinstance(i, int) for i in dense_layers):
        raise ValueError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, got {dense_layers!r}")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": positive_int("moe_intermediate_size", raw.get("moe_intermediate_size")),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "moe_layers": tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers)),
    }


def _parse_gpt_oss(raw: dict[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """GPT-OSS's fields of ``ModelConfig``: alternating sliding-window and full attention layers with sinks, and
    biased experts with a clamped SwiGLU."""
    # transformers' default: sliding on even layers, full on odd ones.
    layer_types = raw.get("layer_types") or [LAYER_TYPES[(i + 1) % 2] for i in range(num_layers)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or any(kind not in LAYER_TYPES for kind in layer_types)
    ):
        raise ValueError(
            f"{source}: field 'layer_types' must list one of {', '.join(LAYER_TYPES)} per layer "
            f"({num_layers}), got {layer_types!r}"
        )
    window = raw.get("sliding_window")
    if "sliding_attention" in layer_types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{source}: field 'sliding_window' must be a positive integer, got {window!r}")

    def number(key: str, default: float) -> float:
        value = raw.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{source}: field {key!r} must be a positive number, got {value!r}")
        return float(value)

    return {
        "attention_windows": tuple(window if kind == "sliding_attention" else None for kind in layer_types),
        "attention_sinks": True,
        "moe_bias": True,
        "expert_activation": ClampedSwiGLU(alpha=number("swiglu_alpha", 1.702), limit=number("swiglu_limit", 7.0)),
    }


def _parse_quantization(raw: dict[str, Any], source: str) -> str | None:
    quantization = raw.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method not in SUPPORTED_QUANTIZATION:
        raise ValueError(
            f"{source}: quantization_config.quant_method {method!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_QUANTIZATION)}"
        )
    return str(method)


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters" (theta inside); older configs
    # and most published checkpoints use "rope_theta" + "rope_scaling".
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"{source}: field 'rope_scaling' must be an object or null")
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope_scaling.rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    max_positions = raw.get("max_position_embeddings", 8192)
    original_max_positions = int(params.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor")
    if factor is None:  # YaRN without a factor (DeepSeek-V3 style): the ratio of the two context lengths
        factor = max_positions / original_max_positions if rope_type == "yarn" else 1.0
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original_max_positions,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )
