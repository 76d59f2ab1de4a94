"""Native CPU kernels: built once per host with the system C compiler, loaded with ctypes.

The source (``paged_attention_cpu.c``) needs no Python or PyTorch headers, so
a build takes a second or two. The library is cached under
``$RAYTURN_CACHE_DIR/kernels`` (default ``~/.cache/rayturn/kernels``), keyed
by the source, the compiler, its flags and the CPU, so a host with another
CPU (a Kubernetes pod moved to another node type) builds its own. Building
and loading are ``rayturn.native_build``'s: concurrent builds (several Ray
actors starting at once) are safe, and a library is loaded only from a folder
and a file that are this user's alone (one others may write is skipped).

Where no compiler is found or the build fails, ``load()`` returns None and
``unavailable_reason()`` says why; the ``cpu`` backend then is not chosen by
default and the plain ``torch`` backend runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import subprocess
from pathlib import Path

from rayturn import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
# -march=native: vector width and FMA of the host; the cache key includes the CPU model.
# -ffp-contract=fast: a * b + c as one fused multiply-add (ISO C mode would keep the two roundings).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")
PORTABLE_FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")


class NativeKernels:
    """The loaded library with its function signatures set."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.paged_decode_attention_f32 = library.paged_decode_attention_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.paged_decode_attention_f32.argtypes = [
            ptr, ptr, ptr,  # q, k_cache, v_cache
            i64, i64, i64,  # page, token and head strides (elements)
            ptr, i64, ptr,  # page_table, its row stride, seq_lens
            ptr, i64,  # sinks (NULL for none), window (0 for none)
            ptr, i64, i64, i64, i64,  # out, num_seqs, num_heads, num_kv_heads, head_dim
            i64, ctypes.c_float, ctypes.c_int,  # page_size, scale, num_threads
        ]  # fmt: skip
        self.paged_decode_attention_f32.restype = ctypes.c_int
        self.paged_prefill_attention_f32 = library.paged_prefill_attention_f32
        self.paged_prefill_attention_f32.argtypes = [
            ptr, ptr, ptr,  # q, k_cache, v_cache
            i64, i64, i64,  # page, token and head strides (elements)
            ptr, i64, i64,  # the sequence's pages, context_len, query_len
            ptr, ptr, i64, i64, i64,  # out, lse (NULL for none), num_heads, num_kv_heads, head_dim
            i64, ctypes.c_float, i64, ctypes.c_int,  # page_size, scale, chunk_keys (0: default), num_threads
        ]  # fmt: skip
        self.paged_prefill_attention_f32.restype = ctypes.c_int
        self.grouped_matmul_f32 = library.grouped_matmul_f32
        self.grouped_matmul_f32.argtypes = [
            ptr, ptr, ptr, ptr,  # rows, weight, group_ends (int64), out
            i64, i64, i64, ctypes.c_int,  # num_experts, out_features, in_features, num_threads
        ]  # fmt: skip
        self.grouped_matmul_f32.restype = ctypes.c_int
        self.rotary_neox_f32 = library.rotary_neox_f32
        self.rotary_neox_f32.argtypes = [
            ptr, i64, i64, ptr, ptr,  # x, its token and head strides, out, positions (int64)
            ptr, i64,  # cos_sin, max_positions
            i64, i64, i64, ctypes.c_int,  # num_tokens, num_heads, head_dim, num_threads
        ]  # fmt: skip
        self.rotary_neox_f32.restype = ctypes.c_int
        self.rms_norm_f32 = library.rms_norm_f32
        self.rms_norm_f32.argtypes = [
            ptr, i64, i64, i64,  # x, its group stride, rows per group, row stride
            ptr, ptr, i64, i64,  # weight, out, num_rows, dim
            ctypes.c_float, ctypes.c_int, ctypes.c_int,  # eps, PyTorch's float lanes, num_threads
        ]  # fmt: skip
        self.rms_norm_f32.restype = ctypes.c_int
        self.moe_permute_f32 = library.moe_permute_f32
        self.moe_permute_f32.argtypes = [
            ptr, i64, ptr, i64, i64, i64, i64,  # x, its row stride, expert_ids, tokens, top_k, experts, hidden
            ptr, ptr, ptr, ctypes.c_int,  # group_sizes, slot_index (int64), rows, num_threads
        ]  # fmt: skip
        self.moe_permute_f32.restype = ctypes.c_int
        self.moe_unpermute_f32 = library.moe_unpermute_f32
        self.moe_unpermute_f32.argtypes = [
            ptr, ptr, ptr, i64, i64, i64,  # expert_out, slot_index, weights, tokens, top_k, hidden
            ptr, ctypes.c_int,  # out, num_threads
        ]  # fmt: skip
        self.moe_unpermute_f32.restype = ctypes.c_int
        library.native_vector_bits.argtypes = []
        library.native_vector_bits.restype = ctypes.c_int
        self.vector_bits: int = library.native_vector_bits()
        """The vector width the library was built for: 512 (AVX-512), 256 (AVX, AVX2) or 128."""


def _compiler() -> str | None:
    return native_build.compiler()


def _cpu_model() -> str:
    """The CPU's model and instruction-set flags: a library built with -march=native runs only where both match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return f"{model}\n{flags}" if model or flags else platform.processor()


_unavailable: list[str] = []


@functools.lru_cache(maxsize=1)
def load() -> NativeKernels | None:
    """The native kernels for this host, built on first use; None when they cannot be built."""
    compiler = _compiler()
    if compiler is None:
        _unavailable.append("no C compiler found (set $CC)")
        return None
    errors = []
    try:
        version = native_build.compiler_version(compiler)
        for flags in (FLAGS, PORTABLE_FLAGS):
            key = [SOURCE.read_text(), compiler, version, *flags, platform.machine(), _cpu_model()]
            try:
                target = native_build.built(
                    "kernels", "paged_attention_cpu", key, compiler, [*flags, str(SOURCE)], ["-lm"]
                )
            except native_build.BuildFailed as err:  # these flags do not build here: the portable ones may
                errors.append(str(err))
                continue
            try:
                return NativeKernels(native_build.load(target), target)
            except OSError as err:  # built but not loadable (not this user's alone, or not for this host)
                errors.append(str(err))
    # No writable cache, a compiler that hangs: the torch backend serves instead.
    except (OSError, subprocess.SubprocessError) as err:
        errors.append(f"{type(err).__name__}: {err}")
    _unavailable.append(f"build failed: {'; '.join(errors)}")
    logger.warning("rayturn native CPU kernels unavailable: %s", _unavailable[-1])
    return None


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None (after it did), else None."""
    return _unavailable[-1] if _unavailable else None
