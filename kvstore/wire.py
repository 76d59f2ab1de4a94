"""Control messages of the KV store: small msgpack maps, validated against a declarative schema.

Every control message is a msgpack map with a string field ``"type"`` that names a registered
message type. :data:`SCHEMAS` maps each type to its required fields (field name -> Python type, or
a tuple of types), :data:`OPTIONAL_FIELDS` to the fields it may carry, and each type may add
validators for constraints a type alone cannot say (ranges in bounds, keys short enough). Other
modules add their own message types with :func:`register`.

Network bytes are never unpickled: :func:`decode` only ever runs msgpack, with ``raw=False``,
``strict_map_key=True``, no extension types, and per-container limits, so a hostile peer can get a
:class:`WireError` out of us but not arbitrary objects or unbounded allocations. Fields that no
schema names are kept, not refused, so a newer peer can add optional fields without breaking an
older one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias

import msgpack

from .access import NONCE_BYTES, PROOF_BYTES

__all__ = [
    "MAX_CONTROL_BYTES",
    "MAX_ERROR_CHARS",
    "MAX_KEYS",
    "MAX_KEY_BYTES",
    "MAX_RANGES",
    "OPTIONAL_FIELDS",
    "SCHEMAS",
    "FieldType",
    "Validator",
    "WireError",
    "decode",
    "encode",
    "register",
    "truncate_error",
    "validate",
    "validate_keys",
    "validate_ranges",
]

MAX_CONTROL_BYTES: Final = 1 << 20
"""Largest encoded control message, in bytes: bulk data never travels inside a control message."""
MAX_RANGES: Final = 1 << 16
"""Most (offset, length) ranges one request may name."""
MAX_KEYS: Final = 1 << 16
"""Most object keys one request may name."""
MAX_KEY_BYTES: Final = 4096
"""Longest object key, in bytes."""
MAX_ERROR_CHARS: Final = 4096
"""Longest error text a reply may carry; senders truncate (see :func:`truncate_error`)."""
_MAX_MAP_FIELDS: Final = 64
# An offset or a length must fit a signed 64-bit integer: no segment is that big, and it keeps
# the arithmetic on offset + length far from any overflow in whatever reads the message next.
_MAX_INT64: Final = (1 << 63) - 1

FieldType: TypeAlias = type | tuple[type, ...]
Validator: TypeAlias = Callable[[dict[str, Any]], None]

SCHEMAS: dict[str, dict[str, FieldType]] = {}
"""Message type -> required field -> type. Extend it through :func:`register`, not by hand."""
OPTIONAL_FIELDS: dict[str, dict[str, FieldType]] = {}
"""Message type -> optional field -> type (checked only when the field is present)."""
_VALIDATORS: dict[str, tuple[Validator, ...]] = {}


class WireError(ValueError):
    """A control message that cannot be encoded or that arrived malformed, oversized or unknown."""


# -- schema registry ---------------------------------------------------------------------------


def register(
    type_name: str,
    fields: Mapping[str, FieldType],
    *,
    optional: Mapping[str, FieldType] | None = None,
    validators: Sequence[Validator] = (),
) -> None:
    """Declare message type ``type_name``: its required ``fields``, ``optional`` fields and extra checks.

    ``validators`` run after the field types have been checked; each raises :class:`WireError`
    and may normalise fields in place (the ranges validator turns pairs into tuples). Registering
    the same type twice is allowed only with the identical schema, so a module imported twice is
    harmless while two modules claiming one name is an error (ValueError).
    """
    if not isinstance(type_name, str) or not type_name:
        raise ValueError(f"message type name must be a non-empty string, got {type_name!r}")
    required = dict(fields)
    optional_fields = dict(optional or {})
    if "type" in required or "type" in optional_fields:
        raise ValueError('"type" is implicit in every message; do not declare it as a field')
    if set(required) & set(optional_fields):
        raise ValueError(f"fields both required and optional: {sorted(set(required) & set(optional_fields))}")
    entry = (required, optional_fields, tuple(validators))
    if type_name in SCHEMAS:
        if entry != (SCHEMAS[type_name], OPTIONAL_FIELDS[type_name], _VALIDATORS[type_name]):
            raise ValueError(f"message type {type_name!r} is already registered with a different schema")
        return
    SCHEMAS[type_name], OPTIONAL_FIELDS[type_name], _VALIDATORS[type_name] = entry


# -- encode / decode ---------------------------------------------------------------------------


def encode(message: Mapping[str, Any]) -> bytes:
    """Validate ``message`` against its schema and pack it; WireError if it is invalid or too large."""
    checked = validate(dict(message))
    try:
        data: bytes = msgpack.packb(checked, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as error:
        raise WireError(f"{checked['type']} message cannot be packed: {error}") from error
    if len(data) > MAX_CONTROL_BYTES:
        raise WireError(
            f"{checked['type']} message encodes to {len(data)} bytes, over the {MAX_CONTROL_BYTES}-byte "
            "control message limit; split the request"
        )
    return data


def decode(data: bytes | bytearray | memoryview, expected_type: str | None = None) -> dict[str, Any]:
    """Unpack and validate one control message; WireError naming the problem if it is not acceptable.

    ``expected_type``, when given, is the only message type accepted.
    """
    num_bytes = memoryview(data).nbytes
    if num_bytes == 0:
        raise WireError("empty control message")
    if num_bytes > MAX_CONTROL_BYTES:
        raise WireError(f"control message of {num_bytes} bytes exceeds the {MAX_CONTROL_BYTES}-byte limit")
    message = _unpack(data)
    if not isinstance(message, dict):
        raise WireError(f"control message must be a msgpack map, got {type(message).__name__}")
    checked = validate(message)
    if expected_type is not None and checked["type"] != expected_type:
        raise WireError(f"expected a {expected_type!r} message, got {checked['type']!r}")
    return checked


def _unpack(data: bytes | bytearray | memoryview) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_CONTROL_BYTES,
            max_bin_len=MAX_CONTROL_BYTES,
            max_array_len=max(MAX_RANGES, MAX_KEYS),
            max_map_len=_MAX_MAP_FIELDS,
            max_ext_len=0,  # no extension types at all: nothing but plain data crosses the wire
        )
    except msgpack.ExtraData as error:
        raise WireError(f"control message has {len(error.extra)} trailing bytes after the msgpack map") from None
    # Unpacking untrusted bytes: whatever msgpack raises (format, depth, limit, unicode errors and
    # the like) means the peer sent something we refuse, never a bug to propagate.
    except Exception as error:
        raise WireError(f"control message is not valid msgpack: {type(error).__name__}: {error}") from None


# -- validation --------------------------------------------------------------------------------


def validate(message: dict[str, Any]) -> dict[str, Any]:
    """Check ``message`` against its registered schema and validators; returns it (normalised in place)."""
    type_name = message.get("type")
    if not isinstance(type_name, str):
        raise WireError(f'control message needs a string field "type", got {_type_label(type_name)}')
    if type_name not in SCHEMAS:
        raise WireError(f"unknown control message type {type_name[:64]!r}")
    for name, expected in SCHEMAS[type_name].items():
        if name not in message:
            raise WireError(f"{type_name} message is missing field {name!r}")
        _check_field(type_name, name, message[name], expected)
    for name, expected in OPTIONAL_FIELDS[type_name].items():
        if name in message:
            _check_field(type_name, name, message[name], expected)
    for validator in _VALIDATORS[type_name]:
        validator(message)
    return message


def _check_field(type_name: str, name: str, value: object, expected: FieldType) -> None:
    if not _is_instance(value, expected):
        raise WireError(
            f"{type_name} message field {name!r} must be {_expected_label(expected)}, got {_type_label(value)}"
        )


def _is_instance(value: object, expected: FieldType) -> bool:
    types = expected if isinstance(expected, tuple) else (expected,)
    # bool is a subclass of int, but True is no request id: only accept it where bool is asked for.
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def _expected_label(expected: FieldType) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(t.__name__ for t in types)


def _type_label(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


def validate_ranges(value: object, *, what: str = "ranges") -> list[tuple[int, int]]:
    """``value`` as a list of ``(offset, length)`` tuples; WireError unless 1..MAX_RANGES valid pairs.

    Offsets are non-negative, lengths positive, both below 2**63. Bounds against a particular
    buffer are the receiver's business (it alone knows the buffer).
    """
    if not isinstance(value, (list, tuple)):
        raise WireError(f"{what} must be a list of [offset, length] pairs, got {_type_label(value)}")
    if not value:
        raise WireError(f"{what} must name at least one range")
    if len(value) > MAX_RANGES:
        raise WireError(f"{what} names {len(value)} ranges, more than the limit of {MAX_RANGES}")
    return [_check_range(index, pair, what) for index, pair in enumerate(value)]


def _check_range(index: int, pair: object, what: str) -> tuple[int, int]:
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise WireError(f"{what}[{index}] must be an [offset, length] pair, got {pair!r:.80}")
    offset, length = pair
    for name, number in (("offset", offset), ("length", length)):
        if isinstance(number, bool) or not isinstance(number, int):
            raise WireError(f"{what}[{index}] {name} must be an int, got {_type_label(number)}")
    if not 0 <= offset <= _MAX_INT64:
        raise WireError(f"{what}[{index}] offset {offset} is negative or beyond 2**63")
    if not 0 < length <= _MAX_INT64:
        raise WireError(f"{what}[{index}] length {length} must be positive (and below 2**63)")
    return (offset, length)


def validate_keys(value: object, *, what: str = "keys") -> list[bytes]:
    """``value`` as a list of byte-string keys; WireError unless at most MAX_KEYS keys of <= MAX_KEY_BYTES."""
    if not isinstance(value, (list, tuple)):
        raise WireError(f"{what} must be a list of bytes, got {_type_label(value)}")
    if len(value) > MAX_KEYS:
        raise WireError(f"{what} names {len(value)} keys, more than the limit of {MAX_KEYS}")
    for index, key in enumerate(value):
        if not isinstance(key, bytes):
            raise WireError(f"{what}[{index}] must be bytes, got {_type_label(key)}")
        if len(key) > MAX_KEY_BYTES:
            raise WireError(f"{what}[{index}] is {len(key)} bytes, longer than the limit of {MAX_KEY_BYTES}")
    return list(value)


def truncate_error(text: str) -> str:
    """``text`` cut to fit a reply's ``error`` field."""
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _ranges_field(message: dict[str, Any]) -> None:
    message["ranges"] = validate_ranges(message["ranges"])


def _keys_field(message: dict[str, Any]) -> None:
    message["keys"] = validate_keys(message["keys"])


def _reply_fields(message: dict[str, Any]) -> None:
    if message["total_bytes"] < 0:
        raise WireError(f"reply field 'total_bytes' must be >= 0, got {message['total_bytes']}")
    error = message.get("error")
    if error is not None and len(error) > MAX_ERROR_CHARS:
        raise WireError(f"reply field 'error' is {len(error)} characters, over the limit of {MAX_ERROR_CHARS}")


def _nonce_field(message: dict[str, Any]) -> None:
    if len(message["nonce"]) != NONCE_BYTES:
        raise WireError(f"{message['type']} nonce must be {NONCE_BYTES} bytes, got {len(message['nonce'])}")


def _proof_field(message: dict[str, Any]) -> None:
    if "proof" in message and len(message["proof"]) != PROOF_BYTES:
        raise WireError(f"{message['type']} proof must be {PROOF_BYTES} bytes, got {len(message['proof'])}")


def _fast_port_field(message: dict[str, Any]) -> None:
    if "fast_port" in message and not 0 < message["fast_port"] <= 0xFFFF:
        raise WireError(f"reply field 'fast_port' must be a port in 1..65535, got {message['fast_port']}")


# -- peer authentication, on every store socket (see rayturn.kvstore.access) ------------------

register("challenge", {"nonce": bytes}, validators=[_nonce_field])
register("auth", {"nonce": bytes, "proof": bytes}, validators=[_nonce_field, _proof_field])

# -- the transport's message types -------------------------------------------------------------

# ``grant``: the master's grant for these ranges (``access.ReadGrant`` / ``WriteGrant`` on the wire).
register("read_request", {"request_id": int, "ranges": list, "grant": list}, validators=[_ranges_field])
register(
    "write_request",
    {"request_id": int, "ranges": list, "keys": list, "tenant": str, "grant": list},
    validators=[_ranges_field, _keys_field],
)
# ``proof``: on the reply that accepts a connection, the server's own proof of the store secret;
# ``fast_port``: on that reply too, the port of the segment's native reader (``ucx_native``), if it runs one.
register(
    "reply",
    {"request_id": int, "ok": bool, "total_bytes": int},
    optional={"error": str, "proof": bytes, "fast_port": int},
    validators=[_reply_fields, _proof_field, _fast_port_field],
)
