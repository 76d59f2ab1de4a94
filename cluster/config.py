"""The cluster's configuration: one YAML file, parsed once into frozen, validated objects.

    config = load_config("rayturn.yaml", **{"decode.max_replicas": 4})
    engine = LLMEngine.from_pretrained(config.model.name, **config.model.engine_kwargs())
    app = DecodeServer.options(**config.decode.serve_options())

Every key is optional: a key left out, or a section left empty, takes the
default that ``cluster/examples/rayturn.yaml`` documents. Parsing is strict,
because a misspelt key would otherwise run the default without a word:
unknown keys, wrong types and out-of-range values raise ``ValueError`` naming
the full dotted key, e.g. ``unknown key 'decode.min_replica' (did you mean
'min_replicas'?)``. Booleans are not accepted as numbers; integers are
accepted where a float is expected. Byte sizes take an integer or a string
such as ``"512MB"`` (powers of 1000) or ``"256MiB"`` (powers of 1024).

Each spec checks its own ranges in ``__post_init__`` and names the offending
field relative to itself; the parser, which knows where the spec sits in the
file, adds the section prefix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rayturn.api.settings import ServerSettings
from rayturn.api.tenants import TENANT_NAME, TENANT_NAME_RULE
from rayturn.decode.admission import AdmissionLimits
from rayturn.decode.lifecycle.settings import LifecycleSettings
from rayturn.engine.settings import ModelSettings
from rayturn.kvstore.settings import KVStoreSettings
from rayturn.router.settings import RouterSettings
from rayturn.settings import (
    FieldError,
    check,
    check_above,
    check_at_least,
    check_non_empty,
    check_resources,
    frozen_mapping,
)

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_PATTERN = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")

_Spec = TypeVar("_Spec")

API_KEYS_ENV = "RAYTURN_API_KEYS"
# How often Serve's replicas and handles report their load for autoscaling (its ``metrics_interval_s``).
SERVE_METRICS_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    target_ongoing_requests: float = 8.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    # The window each decision averages the pool's ongoing requests over (Ray Serve's own default); Serve
    # wants it longer than the interval its replicas and handles report load at.
    look_back_period_s: float = 30.0

    def __post_init__(self) -> None:
        check_above("target_ongoing_requests", self.target_ongoing_requests, 0)
        check_at_least("upscale_delay_s", self.upscale_delay_s, 0)
        check_at_least("downscale_delay_s", self.downscale_delay_s, 0)
        check_above("look_back_period_s", self.look_back_period_s, SERVE_METRICS_INTERVAL_S)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A pool of identical Ray Serve replicas (the prefill pool or the decode pool)."""

    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict, hash=False)
    max_ongoing_requests: int = 64
    # Calls the pool's callers queue beyond its replicas' ongoing ones; past it, 429 (decode) or, for the
    # prefill pool, the decode replica prefilling the call itself.
    max_queued_requests: int = 256
    # The share of a decode replica's ongoing calls kept for calls that continue a turn (``decode.admission``).
    continuation_reserve: float = 0.25
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    num_pages: int | None = None  # KV cache pages per replica of this pool; None: model.num_pages

    def __post_init__(self) -> None:
        object.__setattr__(self, "resources", frozen_mapping(self.resources))
        check_at_least("num_pages", self.num_pages, 1)
        check_at_least("min_replicas", self.min_replicas, 0)
        check_at_least("max_replicas", self.max_replicas, 0)  # 0: no such pool (prefill only)
        check(
            self.max_replicas >= self.min_replicas,
            "max_replicas",
            f"must be >= min_replicas ({self.min_replicas}), got {self.max_replicas}",
        )
        check(
            self.initial_replicas is None or self.min_replicas <= self.initial_replicas <= self.max_replicas,
            "initial_replicas",
            f"must lie in [min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}], "
            f"got {self.initial_replicas}",
        )
        check_at_least("num_cpus", self.num_cpus, 0)
        check_at_least("num_gpus", self.num_gpus, 0)
        check_resources("resources", self.resources)
        check_at_least("max_ongoing_requests", self.max_ongoing_requests, 1)
        check_at_least("max_queued_requests", self.max_queued_requests, 1)
        self.admission_limits()  # checks continuation_reserve

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas != self.max_replicas

    def ray_actor_options(self) -> dict[str, Any]:
        """Per-replica Ray resources; ``num_cpus`` always, since Ray's default is not ours."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def admission_limits(self) -> AdmissionLimits:
        """What a decode replica of this pool admits (``rayturn.decode.admission``)."""
        return AdmissionLimits(self.max_ongoing_requests, self.continuation_reserve)

    def serve_options(self) -> dict[str, Any]:
        """Ray Serve deployment options: a fixed ``num_replicas`` when min == max, else an ``autoscaling_config``."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "ray_actor_options": self.ray_actor_options(),
        }
        if not self.autoscaled:
            options["num_replicas"] = self.min_replicas
            return options
        options["autoscaling_config"] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.min_replicas if self.initial_replicas is None else self.initial_replicas,
            "target_ongoing_requests": self.autoscaling.target_ongoing_requests,
            "upscale_delay_s": self.autoscaling.upscale_delay_s,
            "downscale_delay_s": self.autoscaling.downscale_delay_s,
            "look_back_period_s": self.autoscaling.look_back_period_s,
        }
        return options


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    prefill: PoolSpec = field(default_factory=PoolSpec)
    decode: PoolSpec = field(default_factory=PoolSpec)
    kvstore: KVStoreSettings = field(default_factory=KVStoreSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    tenant: str = "default"

    def __post_init__(self) -> None:
        check_non_empty("tenant", self.tenant)
        check(TENANT_NAME.fullmatch(self.tenant) is not None, "tenant", TENANT_NAME_RULE)
        check(self.decode.max_replicas >= 1, "decode.max_replicas", f"must be >= 1, got {self.decode.max_replicas}")
        check(
            self.kvstore.enabled or self.prefill.max_replicas == 0,
            "prefill.max_replicas",
            "must be 0 when kvstore.enabled is false (prefill replicas hand pages over through the store)",
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """Parse and validate a config mapping (as ``yaml.safe_load`` returns it)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"the config must be a mapping, got {_describe(data)}")
        return _build(cls, data, "")

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars (YAML-safe); ``from_dict`` turns it back into an equal config."""
        plain = _to_plain(self)
        assert isinstance(plain, dict)
        return plain


def load_config(path: str | Path | None = None, *, keys_from_env: bool = True, **overrides: Any) -> ClusterConfig:
    """Read a YAML config (None: all defaults), take ``server.api_keys`` from ``$RAYTURN_API_KEYS`` when it is
    set, then apply dotted-key overrides.

    ``load_config("rayturn.yaml", **{"model.name": "small", "decode.min_replicas": 2})``.
    An override replaces one value, or a whole section when given a mapping; the
    key splits on every dot, so a resource whose name has dots is set through
    its whole mapping (``{"decode.resources": {"node:10.0.0.1": 0.01}}``).
    ``$RAYTURN_API_KEYS`` holds comma-separated keys (a Kubernetes Secret's value, so that keys stay out of
    config files and manifests); set, even empty, it replaces the file's ``server.api_keys``, unless
    ``keys_from_env`` is false (``rayturn deploy render`` reads the file as written).
    """
    data = {} if path is None else _read_yaml(Path(path))
    env_keys = os.environ.get(API_KEYS_ENV)
    if env_keys is not None and keys_from_env:
        _set_dotted(data, "server.api_keys", [key.strip() for key in env_keys.split(",") if key.strip()])
    for dotted_key, value in overrides.items():
        _set_dotted(data, dotted_key, value)
    return ClusterConfig.from_dict(data)


# -- reading ------------------------------------------------------------


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read config file {str(path)!r}: {err}") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"cannot parse config file {str(path)!r}: {err}") from err
    if data is None:  # an empty (or all-comment) file means all defaults
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level, got {_describe(data)}")
    return data


def _set_dotted(data: dict[str, Any], dotted_key: str, value: Any) -> None:
    *sections, leaf = dotted_key.split(".")
    node = data
    for depth, section in enumerate(sections, start=1):
        child = node.get(section)
        if child is None:
            child = node[section] = {}
        elif not isinstance(child, dict):
            raise ValueError(f"override {dotted_key!r}: {'.'.join(sections[:depth])!r} is not a section")
        node = child
    node[leaf] = copy.deepcopy(value)  # later overrides may write into it


# -- parsing ------------------------------------------------------------


def _build(cls: type[_Spec], data: object, key: str) -> _Spec:
    """Build spec ``cls`` from ``data``, found at dotted ``key`` ("" for the top level)."""
    if data is None:  # a section with every key commented out
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{key} must be a mapping, got {_describe(data)}")
    prefix = f"{key}." if key else ""
    fields = {spec_field.name: spec_field for spec_field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        spec_field = fields.get(name)
        if spec_field is None:
            raise ValueError(_unknown_key(f"{prefix}{name}", str(name), fields))
        field_key = f"{prefix}{name}"
        if spec_field.metadata.get("size"):
            kwargs[name] = _parse_size(value, field_key)
        else:
            kwargs[name] = _convert(value, hints[name], field_key, bool(spec_field.metadata.get("secret")))
    try:
        return cls(**kwargs)
    except FieldError as err:
        raise ValueError(f"{prefix}{err.key} {err.reason}") from None


def _unknown_key(full_key: str, name: str, fields: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(name, list(fields), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(fields)})"
    return f"unknown key {full_key!r}{hint}"


def _convert(value: object, hint: Any, key: str, secret: bool = False) -> Any:
    """Check ``value`` against a field's type hint and return it in the field's own type.

    ``secret``: the value holds credentials, so an error names its type but never shows it.
    """
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if isinstance(hint, types.UnionType):  # the fields' only unions are `X | None`
        if value is None:
            return None
        (inner,) = (arm for arm in typing.get_args(hint) if arm is not type(None))
        return _convert(value, inner, key, secret)
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key} must be a list, got {_describe(value, secret)}")
        item_hint = typing.get_args(hint)[0]
        return tuple(_convert(item, item_hint, f"{key}[{index}]", secret) for index, item in enumerate(value))
    if origin is Mapping:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ValueError(f"{key} must be a mapping, got {_describe(value, secret)}")
        _, value_hint = typing.get_args(hint)
        for name in value:
            if not isinstance(name, str):
                raise ValueError(f"{key} names must be strings, got {_describe(name, secret)}")
        return {name: _convert(item, value_hint, f"{key}.{name}", secret) for name, item in value.items()}
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {_describe(value, secret)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {_describe(value, secret)}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {_describe(value, secret)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number, got {_describe(value, secret)}")
        return float(value)
    raise TypeError(f"no parser for {key}'s type {hint!r}")


def _parse_size(value: object, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        match = _SIZE_PATTERN.fullmatch(value.strip().lower())
        if match is not None and match[2] in _SIZE_UNITS:
            return int(Decimal(match[1]) * _SIZE_UNITS[match[2]])
    raise ValueError(
        f"{key} must be a byte count or a size such as '512MB', '256MiB' or '1GiB', got {_describe(value)}"
    )


def _describe(value: object, secret: bool = False) -> str:
    return f"a value of type {type(value).__name__}" if secret else f"{value!r} ({type(value).__name__})"


def _to_plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {spec_field.name: _to_plain(getattr(value, spec_field.name)) for spec_field in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {name: _to_plain(item) for name, item in value.items()}
    if isinstance(value, tuple):
        return list(value)
    return value
