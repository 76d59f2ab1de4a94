"""What a benchmark reads off a running cluster besides its answers: calls by prefill path, the decode pool's size."""

from __future__ import annotations

import json
import sys
import urllib.request


def prefill_paths(url: str) -> dict[str, float] | None:
    """Calls so far by prefill path (``local`` | ``disaggregated``), from the ingress metrics; None without them."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
    except Exception:
        return None
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rayturn_time_to_first_token_seconds_count":
                counts[sample.labels["path"]] = counts.get(sample.labels["path"], 0) + sample.value
    return counts


def health_capacity_pages(url: str) -> int | None:
    """Decode pages of a running cluster, when ``/health`` reports them per pool; else None."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            details = json.loads(response.read()).get("details", {})
    except Exception as err:
        print(f"no decode pool size from {url}/health: {err}", file=sys.stderr)
        return None
    pages = details.get("decode.total_pages")
    replicas = details.get("decode.num_replicas", details.get("decode.replicas"))
    return pages * replicas if isinstance(pages, int) and isinstance(replicas, int) else None
