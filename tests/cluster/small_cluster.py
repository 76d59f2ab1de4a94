"""Settings for a cluster that fits a 2-core test host: the `tiny` model, small caches, fractional CPUs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayturn.cluster.config import ClusterConfig


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


@contextmanager
def serving(config: ClusterConfig, **init_options: Any) -> Iterator[str]:
    """A Ray session of its own with ``config`` deployed, for one test module; yields the HTTP base URL.

    ``init_options`` go to ``ray.init`` (e.g. ``_metrics_export_port``)."""
    import ray

    from rayturn.cluster.runner import running_cluster

    # address="local": a Ray of its own even where another (a ``ray start`` cluster) runs on this host.
    options: dict[str, Any] = {"address": "local", **init_options}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="rayturn", **options)
    try:
        with running_cluster(config) as endpoints:
            yield endpoints.http
    finally:
        ray.shutdown()
