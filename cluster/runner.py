"""``rayturn serve``: start (or join) Ray, deploy the cluster, serve until told to stop.

Shutdown is complete: the Serve application, Serve itself, the KV store's
detached master and, for an embedded Ray, Ray's own processes all go, so a
Ctrl-C or SIGTERM leaves nothing running, whenever it comes:

    starting --(cluster up)--> serving --(SIGINT/SIGTERM)--> stopping --> stopped (exit 0)
       |                                                        ^
       +-------(SIGINT/SIGTERM: start-up abandoned)-------------+
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
from .listeners import check_listening_only_at, check_ports_free

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

    server = config.server
    ports = {"server.http_port": server.http_port, "server.grpc_port": server.grpc_port}
    # Before anything starts: Serve's proxies would share ports another server holds. A caller that
    # started Serve in its own Ray already (with options of its own) owns the ports it listens on.
    if not (ray.is_initialized() and _serve_running()):
        check_ports_free(server.host, ports)
    app = build_app(config)  # validates the model before anything starts
    started_ray = False
    if not ray.is_initialized():
        # ``ray.init`` installs a SIGTERM handler that exits on the spot (``sys.exit``);
        # the caller's handler, if it set one, stays in charge.
        sigterm_handler = signal.getsignal(signal.SIGTERM)
        # "local": without an address Ray would join any Ray already running on this host
        # (a ``ray start`` head, a test cluster), and the teardown would stop its Serve.
        ray.init(
            address=address or "local",
            namespace=KV_NAMESPACE,
            log_to_driver=False,
            include_dashboard=False,
        )
        if sigterm_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm_handler)
        started_ray = address is None
    try:
        serve.start(**serve_start_options(config))
        serve.run(app, name=APP_NAME, route_prefix="/")
        check_listening_only_at(server.host, ray.util.get_node_ip_address(), ports.items())
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


def _serve_running() -> bool:
    """Whether Serve runs in the connected Ray (its controller actor exists)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


class _StopDuringStartup(Exception):
    """A stop signal came before the cluster served: abandon the start-up and tear down what started."""


def serve_forever(config: ClusterConfig, address: str | None = None) -> int:
    stop = threading.Event()
    serving = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        first = not stop.is_set()
        stop.set()
        # Start-up may wait for a long time (resources, a slow model load); the first
        # signal cuts it short. A later one must not interrupt the teardown.
        if first and not serving.is_set():
            raise _StopDuringStartup

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.suppress(_StopDuringStartup), running_cluster(config, address) as endpoints:
            serving.set()
            print(
                f"rayturn is serving {config.model.model_name!r}\n"
                f"  OpenAI HTTP: {endpoints.http}/v1  (health: {endpoints.http}/health)\n"
                f"    chat: /v1/chat/completions  Anthropic Messages: /v1/messages  Responses: /v1/responses\n"
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
