"""``rayturn serve``: start (or join) Ray, deploy the cluster, serve until told to stop.

Shutdown is complete: the Serve application, Serve itself, the KV store's
detached master and, for an embedded Ray, Ray's own processes all go, so a
Ctrl-C or SIGTERM leaves nothing running.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from .config import ClusterConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    http: str
    grpc: str


@contextmanager
def running_cluster(config: ClusterConfig, address: str | None = None) -> Iterator[Endpoints]:
    """Deploy ``config`` in a Ray session (an embedded one unless ``address`` is given); tear down on exit."""
    import ray
    from ray import serve

    from .app import APP_NAME, KV_NAMESPACE, build_app, serve_start_options

    app = build_app(config)  # validates the model before anything starts
    started_ray = False
    if not ray.is_initialized():
        ray.init(address=address, namespace=KV_NAMESPACE, log_to_driver=False, include_dashboard=False)
        started_ray = address is None
    try:
        serve.start(**serve_start_options(config))
        serve.run(app, name=APP_NAME, route_prefix="/")
        server = config.server
        yield Endpoints(http=f"http://{server.host}:{server.http_port}", grpc=f"{server.host}:{server.grpc_port}")
    finally:
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        except Exception as err:
            logger.warning("Serve shutdown: %s", err)
        with contextlib.suppress(ValueError):  # ValueError: the master never started
            ray.kill(ray.get_actor(config.kvstore.master_name, namespace=KV_NAMESPACE))
        if started_ray:
            ray.shutdown()


def serve_forever(config: ClusterConfig, address: str | None = None) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with running_cluster(config, address) as endpoints:
            print(
                f"rayturn is serving {config.model.model_name!r}\n"
                f"  OpenAI HTTP: {endpoints.http}/v1  (health: {endpoints.http}/health)\n"
                f"  gRPC:        {endpoints.grpc}  (service rayturn.v1.RayTurn)\n"
                "Ctrl-C stops it.",
                flush=True,
            )
            stop.wait()
        print("rayturn stopped.", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
