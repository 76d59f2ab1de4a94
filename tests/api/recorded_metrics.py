"""A stand-in for ``ray.util.metrics`` that records what is exported, for the replicas' and the ingress's tests.

It keeps the last value of every gauge series, the increments of every
counter series (refusing what Ray refuses: an increment <= 0, a tag set other
than the declared keys) and the observations of every histogram series.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

Series = tuple[str, frozenset[tuple[str, str]]]


class RecordedMetrics:
    """A stand-in for ``ray.util.metrics`` that records what is exported."""

    def __init__(self) -> None:
        self.gauges: dict[Series, float] = {}
        self.increments: dict[Series, list[float]] = defaultdict(list)
        self.observations: dict[Series, list[float]] = defaultdict(list)
        recorder = self

        class _Metric:
            def __init__(self, name: str, description: str = "", tag_keys: Sequence[str] = (), **_: Any) -> None:
                self.name, self.tag_keys = name, set(tag_keys)

            def key(self, tags: Mapping[str, str]) -> Series:
                assert set(tags) == self.tag_keys, f"{self.name}: tags {sorted(tags)}"
                return self.name, frozenset(tags.items())

        class Gauge(_Metric):
            def set(self, value: float, tags: Mapping[str, str]) -> None:
                recorder.gauges[self.key(tags)] = value

        class Counter(_Metric):
            def inc(self, value: float, tags: Mapping[str, str]) -> None:
                if value <= 0:
                    raise ValueError(f"value must be >0, got {value}")
                recorder.increments[self.key(tags)].append(value)

        class Histogram(_Metric):
            def observe(self, value: float, tags: Mapping[str, str]) -> None:
                recorder.observations[self.key(tags)].append(value)

        self.Gauge, self.Counter, self.Histogram = Gauge, Counter, Histogram
