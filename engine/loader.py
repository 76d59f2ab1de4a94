"""Load a Hugging Face model directory: ``config.json`` and ``*.safetensors``.

Accepts one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; MXFP4-quantised experts are dequantised as
they are read (``mxfp4``). Every failure names the file and what was
expected, because the person reading it is usually pointing rayturn at a
directory they downloaded by hand.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rayturn.kernels import KernelBackend

from .config import ModelConfig
from .model import CausalLM
from .mxfp4 import dequantize_checkpoint
from .rope import cos_sin_cache

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint, shards in index order."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise ValueError(
                f"{index_path}: malformed; expected a JSON object with a 'weight_map' of tensor name -> shard file"
            ) from None
        shards = sorted(set(weight_map.values()))
        missing = [name for name in shards if not (model_dir / name).is_file()]
        if missing:
            raise ValueError(f"{index_path}: lists shard(s) that do not exist: {', '.join(missing)}")
        return [model_dir / name for name in shards]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise ValueError(f"{model_dir}: no weights; expected {SINGLE_FILE} or {INDEX_FILE} with its shards")


class UnreadableWeightsError(ValueError):
    """A weight file safetensors cannot read; the message names the file."""


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    yield name, handle.get_tensor(name)
        except SafetensorError as err:
            raise UnreadableWeightsError(f"{path}: not a readable safetensors file ({err})") from None


def load_model(
    model_dir: Path,
    config: ModelConfig,
    backend: KernelBackend,
    dtype: torch.dtype,
    device: torch.device,
) -> CausalLM:
    """Build the model on ``device`` in ``dtype`` and fill it from the checkpoint."""
    files = safetensors_files(model_dir)
    rope = cos_sin_cache(config.rope, config.head_dim, config.max_position_embeddings, device)
    with torch.device("meta"):  # no time spent on random init of weights we overwrite
        model = CausalLM(config, backend, rope)
    model = model.to_empty(device=device).to(dtype=dtype)
    source = [model_dir]  # the file being read, so errors can name it

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for path in files:
            source[0] = path
            yield from iter_weights([path])
        source[0] = model_dir  # missing tensors are noticed after the last file, so name the checkpoint

    tensors = weights()
    if config.quantization == "mxfp4":
        tensors = dequantize_checkpoint(tensors, dtype)
    try:
        model.load_weights(tensors)  # every parameter is checked to be loaded
    except UnreadableWeightsError:
        raise
    except ValueError as err:  # an unexpected, misshapen or missing tensor
        raise ValueError(f"{source[0]}: {err}") from None
    model.prepare()
    return model.eval()
