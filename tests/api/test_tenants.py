"""API keys -> tenants, what a caller presents, and what a tenant keeps to itself (no cluster needed)."""

from __future__ import annotations

import pickle

import pytest

from rayturn.api.tenants import KeyTable, key_digest, key_tenant, presented_key
from rayturn.engine.page_hash import salted


def table() -> KeyTable:
    return KeyTable.build(["sk-alice", "sk-bob"], {"team": ["sk-t1", "sk-t2"]}, default_tenant="default")


def test_each_plain_key_is_a_tenant_of_its_own_and_a_named_tenants_keys_share_it() -> None:
    keys = table()
    assert keys.enabled
    assert keys.tenant_of("sk-alice") == key_tenant("sk-alice") == f"key-{key_digest('sk-alice')[:12]}"
    assert keys.tenant_of("sk-bob") not in (None, keys.tenant_of("sk-alice"))
    assert keys.tenant_of("sk-t1") == keys.tenant_of("sk-t2") == "team"
    assert keys.tenant_of("sk-carol") is None and keys.tenant_of(None) is None and keys.tenant_of("") is None


def test_without_keys_everyone_is_the_default_tenant_and_nothing_is_salted_or_scoped() -> None:
    open_door = KeyTable.build([], {}, default_tenant="acme")
    assert not open_door.enabled
    assert open_door.tenant_of(None) == open_door.tenant_of("anything") == "acme"
    assert open_door.cache_salt("acme") == "" and open_door.session("acme", "s1") == "s1"
    assert open_door.cache_salt("acme", "s1") == salted("", "s1") != ""  # a call's own salt still keeps it apart


def test_with_keys_a_tenant_salts_its_pages_and_scopes_its_sessions() -> None:
    keys = table()
    assert keys.cache_salt("team") == keys.cache_salt("team", None) == "team"
    assert keys.cache_salt("team", "s1") == salted("team", "s1") not in ("team", keys.cache_salt("other", "s1"))
    assert keys.session("team", "s1") == "team/s1" != keys.session("other", "s1")
    assert keys.session("team", None) is None


def test_the_ingress_is_built_from_digests_never_from_keys() -> None:
    keys = table()
    stored = pickle.dumps(keys)  # what Serve keeps of the ingress's constructor arguments
    text = repr(stored) + repr(keys)
    for raw in ("sk-alice", "sk-bob", "sk-t1", "sk-t2"):
        assert raw not in text
    assert key_digest("sk-alice") not in repr(keys)  # the repr (logs) holds no digest either
    rebuilt = pickle.loads(stored)
    assert rebuilt.tenant_of("sk-t2") == "team" and rebuilt.default_tenant == "default"


def test_a_key_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="given twice"):
        KeyTable.build(["sk-1"], {"team": ["sk-1"]})


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"Authorization": "Bearer sk-1"}, "sk-1"),
        ({"authorization": "bearer   sk-1  "}, "sk-1"),
        ({"x-api-key": "sk-2"}, "sk-2"),  # what the Anthropic SDK sends
        ({"Authorization": "Bearer sk-1", "X-Api-Key": "sk-2"}, "sk-1"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, None),
        ({"Authorization": "Bearer "}, None),
        ({}, None),
    ],
)
def test_the_presented_key_from_http_headers(headers: dict[str, str], expected: str | None) -> None:
    assert presented_key(headers) == expected


def test_the_presented_key_from_grpc_metadata() -> None:
    assert presented_key([("application", "rayturn"), ("x-api-key", "sk-3")]) == "sk-3"
    assert presented_key([("authorization", "Bearer sk-4"), ("blob-bin", b"\x00")]) == "sk-4"
    assert presented_key([("blob-bin", b"sk-5")]) is None  # binary metadata carries no key
