"""Raw bytes of what callers hand the store, as flat byte views, never copied.

Values and destinations are bytes-like objects, numpy arrays of any
non-object dtype, or CPU tensors (duck-typed through ``.numpy()``: torch is
never imported). They must be C-contiguous; nothing is copied behind the
caller's back.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def as_bytes_view(value: object) -> memoryview:
    """A flat, byte-format (``"B"``) memoryview over the raw bytes of ``value``, without copying.

    ``value`` is a bytes-like object (bytes, bytearray, memoryview, anything with the buffer
    protocol), a numpy array of any non-object dtype, or an object with a ``.numpy()`` method such
    as a CPU torch tensor. It must be C-contiguous: ValueError otherwise (nothing is copied behind
    the caller's back; call ``np.ascontiguousarray`` / ``tensor.contiguous()`` first).
    """
    return flat_uint8(value, writable=False).data


def as_writable_view(dest: object) -> memoryview:
    """Like :func:`as_bytes_view`, for a destination: ValueError if ``dest`` is read-only."""
    return flat_uint8(dest, writable=True).data


def flat_uint8(value: object, *, writable: bool) -> np.ndarray:
    """``value``'s bytes as a 1-D uint8 array sharing its memory."""
    array = _as_array(value)
    _check_viewable(array, writable=writable)
    return array.reshape(-1).view(np.uint8)


def _as_array(value: object) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if callable(getattr(value, "numpy", None)):
        return _tensor_as_array(value)
    try:
        view = memoryview(value)  # type: ignore[arg-type]  # any buffer-protocol object
    except TypeError:
        raise TypeError(
            f"expected a bytes-like object, a numpy array or a CPU tensor, got {type(value).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{type(value).__name__} buffer is not C-contiguous; copy it into a contiguous one first")
    return np.frombuffer(view, dtype=np.uint8)


def _tensor_as_array(tensor: Any) -> np.ndarray:
    """A torch-like tensor's memory as numpy, duck-typed through ``.numpy()`` (torch is never imported)."""
    is_contiguous = getattr(tensor, "is_contiguous", None)
    if callable(is_contiguous) and not is_contiguous():
        raise ValueError(f"{type(tensor).__name__} is not contiguous; pass tensor.contiguous()")
    try:
        array = tensor.numpy()
    except (TypeError, RuntimeError) as error:
        # numpy has no bfloat16 (nor float8): view such a tensor's bytes as uint8. A tensor in
        # hand means its library is imported already, so this looks it up rather than importing.
        library = sys.modules.get(type(tensor).__module__.split(".")[0])
        uint8 = getattr(library, "uint8", None)
        if uint8 is not None and callable(getattr(tensor, "view", None)):
            try:
                return np.asarray(tensor.view(uint8).numpy())
            except (TypeError, RuntimeError):
                pass
        raise TypeError(
            f"cannot view {type(tensor).__name__} through .numpy() ({error}); pass a CPU tensor, "
            "viewed as an integer dtype when numpy lacks its dtype (bfloat16: tensor.view(torch.uint8))"
        ) from error
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{type(tensor).__name__}.numpy() returned {type(array).__name__}, not a numpy array")
    return array


def _check_viewable(array: np.ndarray, *, writable: bool) -> None:
    if array.dtype.hasobject:
        raise ValueError(f"arrays of dtype {array.dtype} hold object pointers, not raw bytes")
    if not array.flags.c_contiguous:
        raise ValueError(f"array of shape {array.shape} is not C-contiguous; pass np.ascontiguousarray(...)")
    if writable and not array.flags.writeable:
        raise ValueError(f"destination {type(array).__name__} of {array.nbytes} bytes is read-only")
