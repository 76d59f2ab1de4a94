"""Settings for a cluster that fits a 2-core test host: the `tiny` model, small caches, fractional CPUs."""

from __future__ import annotations

from typing import Any


def small_cluster(http_port: int, grpc_port: int, threshold: int, **extra: Any) -> dict[str, Any]:
    """Dotted config overrides (for ``load_config``); ``threshold`` is the disaggregation threshold in tokens.

    Each test module passes its own ports, so modules never collide.
    """
    return {
        "model.name": "tiny",
        "model.num_pages": 512,
        "prefill.num_cpus": 0.25,
        "decode.num_cpus": 0.25,
        "kvstore.segment_bytes": "32MiB",
        "router.disaggregation_threshold_tokens": threshold,
        "router.stats_period_s": 0.5,
        "server.http_port": http_port,
        "server.grpc_port": grpc_port,
        "server.ingress_num_cpus": 0.25,
        **extra,
    }
