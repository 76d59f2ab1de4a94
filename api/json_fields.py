"""Typed reads from a JSON request body; every error names the field's dotted path (``messages[2].content``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .errors import APIError, invalid_request

# Every integer field is an int64 at most, what protobuf, torch and the engine hold; past it, a 400.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Fields:
    """Typed reads from one JSON object; null counts as absent, errors name the dotted path."""

    __slots__ = ("_object", "_prefix")

    def __init__(self, value: object, prefix: str) -> None:
        if not isinstance(value, dict):
            raise type_error(prefix, "an object", value)
        self._object: Mapping[str, Any] = value
        self._prefix = prefix

    @property
    def where(self) -> str:
        """This object's own dotted path ("" for the body)."""
        return self._prefix

    def path(self, key: str) -> str:
        return f"{self._prefix}.{key}" if self._prefix else key

    def raw(self, key: str) -> Any:
        return self._object.get(key)

    def names(self) -> list[str]:
        return list(self._object)

    def present(self, key: str) -> Any:
        value = self._object.get(key)
        if value is None:
            raise invalid_request(f"Missing required parameter: '{self.path(key)}'.", param=self.path(key))
        return value

    def string(self, key: str) -> str | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, str):
            raise type_error(self.path(key), "a string", value)
        return value

    def required_string(self, key: str) -> str:
        value = self.present(key)
        if not isinstance(value, str):
            raise type_error(self.path(key), "a string", value)
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, bool):
            raise type_error(self.path(key), "a boolean", value)
        return value

    def integer(self, key: str, *, minimum: int = INT64_MIN, maximum: int = INT64_MAX) -> int | None:
        value = self.raw(key)
        if value is None:
            return None
        if not is_integer(value):
            raise type_error(self.path(key), "an integer", value)
        if not minimum <= value <= maximum:
            raise range_error(self.path(key), f"an integer {_bounds(minimum, maximum, value)}", value)
        return int(value)

    def number(self, key: str, *, minimum: float, maximum: float, exclusive_minimum: bool = False) -> float | None:
        value = self.raw(key)
        if value is None:
            return None
        if not is_number(value):
            raise type_error(self.path(key), "a number", value)
        if value < minimum or (exclusive_minimum and value == minimum) or value > maximum:
            interval = f"({minimum:g}, {maximum:g}]" if exclusive_minimum else f"[{minimum:g}, {maximum:g}]"
            raise range_error(self.path(key), f"a number in {interval}", value)
        return float(value)

    def nested(self, key: str) -> Fields | None:
        value = self.raw(key)
        return None if value is None else Fields(value, self.path(key))

    def required_nested(self, key: str) -> Fields:
        return Fields(self.present(key), self.path(key))

    def array(self, key: str) -> list[Any] | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, list):
            raise type_error(self.path(key), "an array", value)
        return value


def json_in_text(text: str) -> object | None:
    """The JSON value a string field holds (tool-call arguments, Claude Code's ``metadata.user_id``), or None
    when it holds none: not JSON, or nested too deeply for the parser (a 400 is the caller's to raise)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def json_object(param: str, value: object, expected: str) -> dict[str, Any]:
    """An object given as one or as JSON text (a structured output's schema, gRPC's JSON-text fields); a 400
    naming ``param`` when it is neither, saying it ``expected`` one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise invalid_request(f"Invalid '{param}': not valid JSON: {err}.", param=param) from None
        except RecursionError:
            raise invalid_request(f"Invalid '{param}': the JSON nests too deeply to parse.", param=param) from None
    if not isinstance(value, dict):
        raise type_error(param, expected, value)
    return value


def is_integer(value: object) -> bool:
    """An integer as JSON (and JSON Schema) means it: ``2`` and ``2.0`` alike; ``int(value)`` reads it."""
    if isinstance(value, float):
        return math.isfinite(value) and value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bounds(minimum: int, maximum: int, value: float) -> str:
    """The bounds ``value`` breaks, as the field's error names them (the int64 ones only when broken)."""
    if maximum == INT64_MAX and value < minimum:
        return f">= {minimum}"
    if minimum == INT64_MIN and maximum != INT64_MAX:
        return f"<= {maximum}"
    return f"in [{minimum}, {maximum}]"


def json_type(value: object) -> str:
    """What ``value`` is, as an error names it. A number too large for a float (``1e400``) parses as infinity,
    which no number field takes: it is named apart, so "expected a number" never meets "got a number"."""
    if isinstance(value, float) and math.isinf(value):
        return f"a number out of range ({value})"
    if isinstance(value, float) and math.isnan(value):
        return "a non-finite number (nan)"
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def type_error(param: str, expected: str, value: object) -> APIError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}, got {json_type(value)}.", param=param)


def range_error(param: str, expected: str, value: object) -> APIError:
    return invalid_request(f"Invalid '{param}': expected {expected}, got {value!r}.", param=param)


def body_fields(body: object) -> Fields:
    if not isinstance(body, dict):
        raise invalid_request(f"The request body must be a JSON object, got {json_type(body)}.", param=None)
    return Fields(body, "")
