"""Byte views: flat, uncopied bytes of bytes-likes, numpy arrays and tensor-likes, and what they refuse."""

from __future__ import annotations

import numpy as np
import pytest

from rayturn.kvstore.bytes_view import as_bytes_view, as_writable_view


class FakeTensor:
    """Duck-types the parts of a CPU torch tensor that the byte views use."""

    def __init__(self, array: np.ndarray, *, numpy_error: Exception | None = None) -> None:
        self._array = array
        self._numpy_error = numpy_error

    def is_contiguous(self) -> bool:
        return bool(self._array.flags.c_contiguous)

    def numpy(self) -> np.ndarray:
        if self._numpy_error is not None:
            raise self._numpy_error
        return self._array


@pytest.mark.parametrize(
    "value",
    [
        b"\x00\x01\x02\x03" * 4,
        bytearray(16),
        np.zeros((2, 2), dtype=np.float32).data,
        np.zeros((2, 2), dtype=np.float32),
        np.zeros(2, dtype=[("a", np.int32), ("b", np.float32)]),
        np.zeros(2, dtype="datetime64[ns]"),
        FakeTensor(np.zeros((4,), dtype=np.float32)),
    ],
    ids=["bytes", "bytearray", "memoryview-2d", "numpy-2d", "structured", "datetime", "tensor"],
)
def test_as_bytes_view_is_flat_bytes(value: object) -> None:
    view = as_bytes_view(value)
    assert (view.format, view.ndim, view.nbytes) == ("B", 1, 16)


def test_as_bytes_view_does_not_copy() -> None:
    array = np.zeros(4, dtype=np.int32)
    tensor = FakeTensor(np.zeros(4, dtype=np.int32))
    as_writable_view(array)[0] = 7
    as_writable_view(tensor)[4] = 9
    assert array[0] == 7 and tensor.numpy()[1] == 9
    assert as_bytes_view(array).tobytes()[:1] == b"\x07"


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (np.zeros((4, 4))[:, ::2], ValueError, "contiguous"),
        (memoryview(bytearray(8))[::2], ValueError, "contiguous"),
        (FakeTensor(np.zeros((4, 4))[::2]), ValueError, r"contiguous\(\)"),
        (np.array([object()]), ValueError, "object"),
        (FakeTensor(np.zeros(2), numpy_error=TypeError("Got unsupported ScalarType BFloat16")), TypeError, "bfloat16"),
        (12, TypeError, "bytes-like"),
    ],
    ids=["strided-numpy", "strided-memoryview", "strided-tensor", "object-dtype", "bfloat16-tensor", "int"],
)
def test_as_bytes_view_refuses(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        as_bytes_view(value)


def test_as_writable_view_refuses_read_only() -> None:
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    for value in (b"abc", memoryview(b"abc"), frozen):
        with pytest.raises(ValueError, match="read-only"):
            as_writable_view(value)
    assert not as_writable_view(bytearray(3)).readonly
