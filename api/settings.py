"""The ingress's settings (the ``server`` section of the cluster config)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from rayturn.engine.priority import PRIORITY_NAMES, Priority
from rayturn.settings import FieldError, check, check_at_least, check_non_empty, check_port

from .tenants import KEY_TENANT, KEY_TENANT_PREFIX, TENANT_NAME, TENANT_NAME_RULE, KeyTable

# A request body this small could not hold a chat request worth serving.
MIN_REQUEST_BYTES = 1024
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The ``server`` section: where the ingress listens, the keys it takes (and the class of each one's calls), how
    big a request may be."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 9000
    # Secrets stay out of logged reprs.
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata={"secret": True})
    tenant_keys: Mapping[str, tuple[str, ...]] = field(
        default_factory=dict, hash=False, repr=False, metadata={"secret": True}
    )
    max_request_bytes: int = field(default=DEFAULT_MAX_REQUEST_BYTES, metadata={"size": True})
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.25
    # Tenant -> the class of its calls that name none (``rayturn.api.priority``): a name of ``tenant_keys``, or
    # ``key-`` and 12 hex digits for a key of ``api_keys`` (its tenant; the key may come from --api-key too).
    tenant_priorities: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(
            self, "tenant_keys", types.MappingProxyType({name: tuple(keys) for name, keys in self.tenant_keys.items()})
        )
        check_non_empty("host", self.host)
        check_port("http_port", self.http_port)
        check_port("grpc_port", self.grpc_port)
        # Port 0 asks the OS for any free port, so two zeros never collide.
        check(
            self.grpc_port != self.http_port or self.grpc_port == 0,
            "grpc_port",
            f"must differ from http_port, both are {self.grpc_port}",
        )
        for index, api_key in enumerate(self.api_keys):
            check_non_empty(f"api_keys[{index}]", api_key)
        for tenant, keys in self.tenant_keys.items():
            check(TENANT_NAME.fullmatch(tenant) is not None, f"tenant_keys.{tenant}", TENANT_NAME_RULE)
            check(
                not tenant.startswith(KEY_TENANT_PREFIX),
                f"tenant_keys.{tenant}",
                f"must not start with {KEY_TENANT_PREFIX!r} (the tenants of api_keys are named so)",
            )
            check(bool(keys), f"tenant_keys.{tenant}", "must list at least one key")
            for index, api_key in enumerate(keys):
                check_non_empty(f"tenant_keys.{tenant}[{index}]", api_key)
        try:
            KeyTable.build(self.api_keys, self.tenant_keys)
        except ValueError:
            raise FieldError("api_keys", "must not hold a key twice (api_keys, tenant_keys, --api-key)") from None
        object.__setattr__(self, "tenant_priorities", types.MappingProxyType(self._checked_priorities()))
        check_at_least("max_request_bytes", self.max_request_bytes, MIN_REQUEST_BYTES)
        check_at_least("ingress_replicas", self.ingress_replicas, 1)
        check_at_least("ingress_num_cpus", self.ingress_num_cpus, 0)

    def key_table(self, default_tenant: str) -> KeyTable:
        """API key digests -> tenants, and tenants -> their calls' class, for the ingress."""
        return KeyTable.build(self.api_keys, self.tenant_keys, default_tenant, self.tenant_priorities)

    def _checked_priorities(self) -> dict[str, str]:
        """``tenant_priorities`` by canonical class name; each entry must name a tenant keys can have."""
        priorities = {}
        for tenant, name in self.tenant_priorities.items():
            key = f"tenant_priorities.{tenant}"
            check(
                tenant in self.tenant_keys or KEY_TENANT.fullmatch(tenant) is not None,
                key,
                f"names no tenant: expected a name of tenant_keys, or {KEY_TENANT_PREFIX}<the first 12 hex digits of "
                "the SHA-256 of a key of api_keys>",
            )
            try:
                priorities[tenant] = Priority.parse(name).value
            except ValueError:
                raise FieldError(key, f"must be one of {', '.join(PRIORITY_NAMES)}, got {name!r}") from None
        return priorities


@dataclass(frozen=True, slots=True)
class IngressSettings:
    """What each ingress replica is built with (by ``rayturn.cluster.app`` from the cluster config)."""

    # A preset's name or the model directory: the ingress loads only its tokenizer and config.
    model: str
    served_model_name: str
    page_size: int
    # Digests of the keys, never the keys: Serve stores these arguments and shows them to its tools.
    keys: KeyTable = field(default_factory=KeyTable)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_model_len: int | None = None
    app_name: str = "rayturn"
    # The Serve deployments whose replicas ``/health`` reports.
    pools: tuple[str, ...] = ()
    # The tool-call format the model writes (``model.tool_call_parser``); None: the one its chat template teaches.
    tool_call_parser: str | None = None
    # Where the model's reasoning ends in its answers (``model.reasoning_parser``); None: answers are not split.
    reasoning_parser: str | None = None
