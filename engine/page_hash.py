"""Chained page hashes: the name of a KV page everywhere in rayturn.

A full page of ``page_size`` tokens is named by SHA-256 over (the parent
page's hash, the page's token ids, the model id, the tenant salt). Chaining
makes a hash name the whole prefix up to and including the page, so equal
hashes mean equal KV, in any process, after any restart. The encoding is
explicit bytes (not Python's ``hash``), so the router, the KV store and every
worker compute identical keys.

The salt is a tenant's (``rayturn.api.tenants``), and after it, when a call
names one, the call's own ``cache_salt`` (vLLM's field): ``salted`` joins
them, ``salt_owner`` takes the tenant back, whose pages they are in the KV
store (its quotas and its lookups). Tenant names hold no line break, so two
(tenant, call salt) pairs never give the same salt, and a call without a
salt of its own keeps its tenant's.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

import numpy as np

PageHash = NewType("PageHash", bytes)

_DOMAIN = b"rayturn/page/v1"
_CALL_SALT_SEPARATOR = "\n"


def salted(tenant_salt: str, call_salt: str | None) -> str:
    """The page-hash salt of a call: its tenant's, followed by the call's own ``cache_salt`` when it names one."""
    return f"{tenant_salt}{_CALL_SALT_SEPARATOR}{call_salt}" if call_salt else tenant_salt


def salt_owner(salt: str) -> str:
    """The tenant whose pages a salt's pages are (``salted``'s first part): the store's owner of them."""
    return salt.partition(_CALL_SALT_SEPARATOR)[0]


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def hash_page(parent: PageHash | None, token_ids: Sequence[int], model_id: str, salt: str = "") -> PageHash:
    """The hash of one full page given its parent's hash (None for the first page)."""
    digest = hashlib.sha256(_DOMAIN)
    digest.update(_length_prefixed(model_id.encode()))
    digest.update(_length_prefixed(salt.encode()))
    digest.update(parent if parent is not None else bytes(32))
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return PageHash(digest.digest())


def hash_pages(
    token_ids: Sequence[int],
    page_size: int,
    model_id: str,
    salt: str = "",
    parent: PageHash | None = None,
    num_pages: int | None = None,
) -> list[PageHash]:
    """Hashes of the full pages of ``token_ids`` (a trailing partial page gets none).

    ``parent`` continues a chain whose earlier pages are already hashed;
    ``token_ids`` then start at the first unhashed page.
    """
    full_pages = len(token_ids) // page_size
    if num_pages is not None:
        full_pages = min(full_pages, num_pages)
    hashes: list[PageHash] = []
    for i in range(full_pages):
        parent = hash_page(parent, token_ids[i * page_size : (i + 1) * page_size], model_id, salt)
        hashes.append(parent)
    return hashes
