"""Who is calling: API keys, the tenant each belongs to, and what a tenant keeps to itself.

A cluster without keys serves every caller as one tenant (the config's
``tenant``). With keys (``server.api_keys``, ``server.tenant_keys``,
``rayturn serve --api-key``) every call must present one, on HTTP as
``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (what the Anthropic
SDK sends), on gRPC as the same two metadata keys; each key belongs to one
tenant: a key of ``api_keys`` to a tenant of its own (``key-`` and 12 hex
digits of the key's SHA-256), the keys of one ``tenant_keys`` entry to the
tenant named there.

A tenant's calls that name no class run in the class its config gives it
(``server.tenant_priorities``, e.g. a batch key's always ``background``;
``rayturn.api.priority``).

A tenant's cached prefixes are its own on every tier: the ingress salts the
page hashes of a call with its tenant (``cache_salt``), so the device caches,
the store's keys and the routing hints of two tenants never name the same
page, and the store answers a lookup only with the pages of the tenant that
asks. Within a tenant, a call may name a salt of its own (vLLM's
``cache_salt`` field; ``body_cache_salt``): its prefix is then shared only
with the tenant's calls that name the same salt, on every tier, while its
pages still count against the tenant's store quota.

A tenant's session ids are its own too: with keys, the session the cluster
follows is ``<tenant>/<session id>``, so another tenant naming the same id
neither lands on nor learns about it.

Raw keys never leave the process that read the config: the ingress is built
from SHA-256 digests (a ``KeyTable``), so Serve's stored deployment
arguments, Ray's object store and the logs never see a key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rayturn.engine.page_hash import salted

from .errors import invalid_request
from .json_fields import Fields, type_error

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_NAME_RULE = "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
KEY_TENANT_PREFIX = "key-"
# The name of a tenant of a key that names none (``key_tenant``).
KEY_TENANT = re.compile(rf"{KEY_TENANT_PREFIX}[0-9a-f]{{12}}")
API_KEY_HEADER = "x-api-key"
AUTHORIZATION_HEADER = "authorization"


def key_digest(api_key: str) -> str:
    """The hex SHA-256 of a key: what the ingress compares a presented key by."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def key_tenant(api_key: str) -> str:
    """The tenant of a key that names none: one tenant per key, named by the key's digest (never the key)."""
    return f"{KEY_TENANT_PREFIX}{key_digest(api_key)[:12]}"


@dataclass(frozen=True, slots=True)
class KeyTable:
    """Key digests -> tenants, and tenants -> the class of their calls; empty when the cluster takes calls without
    keys."""

    tenants: Mapping[str, str] = field(default_factory=dict, repr=False)  # key digest -> tenant
    default_tenant: str = "default"
    # Tenant -> the class of its calls that name none (a ``rayturn.engine.priority.Priority`` value).
    priorities: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        api_keys: Iterable[str],
        tenant_keys: Mapping[str, Iterable[str]],
        default_tenant: str = "default",
        priorities: Mapping[str, str] | None = None,
    ) -> KeyTable:
        """From the config's keys; ValueError when one key is given twice (it could belong to one tenant only)."""
        tenants: dict[str, str] = {}
        entries = [(key, key_tenant(key)) for key in api_keys]
        entries += [(key, tenant) for tenant, keys in tenant_keys.items() for key in keys]
        for api_key, tenant in entries:
            digest = key_digest(api_key)
            if digest in tenants:
                raise ValueError("an API key is given twice (server.api_keys, server.tenant_keys, --api-key)")
            tenants[digest] = tenant
        return cls(tenants, default_tenant, dict(priorities or {}))

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def tenant_of(self, presented_key: str | None) -> str | None:
        """The caller's tenant, or None when keys are on and ``presented_key`` is missing or unknown."""
        if not self.tenants:
            return self.default_tenant
        if not presented_key:
            return None
        # A dict lookup by SHA-256 digest: what it takes to answer says nothing about any key.
        return self.tenants.get(key_digest(presented_key))

    def default_priority(self, tenant: str) -> str | None:
        """The class of a tenant's calls that name none (``server.tenant_priorities``); None: by each call's kind."""
        return self.priorities.get(tenant)

    def cache_salt(self, tenant: str, call_salt: str | None = None) -> str:
        """The page-hash salt of a tenant's call: the tenant itself (none for a cluster without keys), followed by
        the call's own ``cache_salt`` when it names one (``page_hash.salted``)."""
        return salted(tenant if self.tenants else "", call_salt)

    def session(self, tenant: str, session_id: str | None) -> str | None:
        """The session the cluster follows for a tenant's session id (scoped by tenant when keys are on)."""
        if session_id is None or not self.tenants:
            return session_id
        return f"{tenant}/{session_id}"


def presented_key(headers: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> str | None:
    """The key a caller presents in HTTP headers or gRPC metadata: ``Authorization: Bearer`` first, then
    ``x-api-key``; None when neither holds one."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    by_name = {name.lower(): value for name, value in items if isinstance(value, str)}
    scheme, _, credential = by_name.get(AUTHORIZATION_HEADER, "").strip().partition(" ")
    if scheme.lower() == "bearer" and credential.strip():
        return credential.strip()
    api_key = by_name.get(API_KEY_HEADER, "").strip()
    return api_key or None


CACHE_SALT_FIELD = "cache_salt"
MAX_CACHE_SALT_CHARS = 128
# What vLLM refuses in a salt, so that a salt one server takes the other takes too.
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
CACHE_SALT_RULE = f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters without '@', '/', '\\' or NUL"


def cache_salt_value(value: object, param: str = CACHE_SALT_FIELD) -> str | None:
    """A call's own prefix-cache salt as vLLM takes it: None when absent, else ``CACHE_SALT_RULE`` or a 400."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise type_error(param, CACHE_SALT_RULE, value)
    if not value or len(value) > MAX_CACHE_SALT_CHARS or not CACHE_SALT_FORBIDDEN.isdisjoint(value):
        raise invalid_request(f"Invalid '{param}': expected {CACHE_SALT_RULE}.", param=param)
    return value


def body_cache_salt(fields: Fields) -> str | None:
    """The body's ``cache_salt`` (vLLM's field, on every HTTP API that makes a call)."""
    return cache_salt_value(fields.raw(CACHE_SALT_FIELD))
