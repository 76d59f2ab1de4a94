"""rayturn.kernels: one interface of ops, a backend per kind of hardware."""

from .backend import DecodeBatch, KernelBackend, PrefillBatch
from .registry import BACKENDS, Registry, default_backend_name, select_backend

__all__ = [
    "BACKENDS",
    "DecodeBatch",
    "KernelBackend",
    "PrefillBatch",
    "Registry",
    "default_backend_name",
    "select_backend",
]
