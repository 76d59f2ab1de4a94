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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .config import ClusterConfig
from .listeners import check_listening_only_at, check_ports_free

logger = logging.getLogger(__name__)

# Serve's own ``serve.shutdown()`` waits as long for its controller.
SERVE_SHUTDOWN_TIMEOUT_S = 30.0
# ``serve.delete`` waits as long for the application to go.
APP_DELETE_TIMEOUT_S = 60.0
# While the application starts, a line says how far its replicas are this often.
START_REPORT_EVERY_S = 10.0
START_POLL_S = 0.5  # Serve's own wait asks every second
# An actor in these states has no process running its code yet (no node has taken it, or its
# dependencies are not ready).
UNPLACED_ACTOR_STATES = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION"})


@dataclass(frozen=True)
class Endpoints:
    http: str
    grpc: str


@contextmanager
def running_cluster(
    config: ClusterConfig, address: str | None = None, log_level: int = logging.INFO
) -> Iterator[Endpoints]:
    """Deploy ``config`` in a Ray session (an embedded one unless ``address`` is given); tear down on exit.

    ``log_level`` is the command's: Ray's and Serve's lines from INFO up (``logging_level``), and below
    INFO, every Ray process's output on this console, Serve's access log among it.
    """
    import ray
    from ray import serve

    from .app import APP_NAME, KV_NAMESPACE, build_app, serve_logging_config, serve_start_options

    server = config.server
    ports = {"server.http_port": server.http_port, "server.grpc_port": server.grpc_port}
    # Before anything starts: Serve's proxies would share ports another server holds. A caller that
    # started Serve in its own Ray already (with options of its own) owns the ports it listens on.
    serve_was_running = ray.is_initialized() and _serve_controller() is not None
    if not serve_was_running:
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
            log_to_driver=log_level < logging.INFO,
            logging_level=max(log_level, logging.INFO),
            include_dashboard=False,
        )
        if sigterm_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm_handler)
        started_ray = address is None
    logging.getLogger("ray.serve").setLevel(max(log_level, logging.INFO))
    try:
        if not serve_was_running:
            serve.start(**serve_start_options(config, log_level))
        with _without_serve_restart_notice(drop=not serve_was_running):
            serve._run(
                app, _blocking=False, name=APP_NAME, route_prefix="/", logging_config=serve_logging_config(log_level)
            )
        _wait_until_running(APP_NAME)
        check_listening_only_at(server.host, ray.util.get_node_ip_address(), ports.items())
        yield Endpoints(http=f"http://{server.host}:{server.http_port}", grpc=f"{server.host}:{server.grpc_port}")
    finally:
        try:
            # The application first: its replicas leave the KV store while its master still runs.
            _delete_app(APP_NAME)
            _shut_down_serve()
        except Exception as err:
            logger.warning("Serve shutdown: %s", err)
        with contextlib.suppress(ValueError):  # ValueError: the master never started
            ray.kill(ray.get_actor(config.kvstore.master_name, namespace=KV_NAMESPACE))
        if started_ray:
            ray.shutdown()


def _wait_until_running(app_name: str) -> None:
    """Wait for the application to run, as ``serve.run`` does, saying every ``START_REPORT_EVERY_S`` how far its
    replicas are (a replica may wait a long time: a model to load, a node to join, a resource nobody offers);
    RuntimeError if Serve gives the deployment up."""
    from ray import serve

    started = time.monotonic()
    report_at = started + START_REPORT_EVERY_S
    while True:
        status = serve.status().applications.get(app_name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"Deploying application {app_name} failed: {status.message}")
        if time.monotonic() >= report_at:
            logger.info("still starting after %.0f s: %s", time.monotonic() - started, _replicas_so_far(status))
            report_at += START_REPORT_EVERY_S
        time.sleep(START_POLL_S)


def _replicas_so_far(status: Any) -> str:
    """Each deployment's replicas by state (``decode: 0 running, 1 starting``), and what Serve says of one that
    is not healthy (a replica it cannot place names the resources it asks for)."""
    if status is None:
        return "the application is not deployed yet"
    parts = []
    for name, deployment in sorted(status.deployments.items()):
        states = {
            str(getattr(state, "value", state)).lower(): count for state, count in deployment.replica_states.items()
        }
        counts = [f"{states.pop('running', 0)} running"] + [
            f"{count} {state}" for state, count in sorted(states.items())
        ]
        said = f" ({deployment.message})" if deployment.message and deployment.status != "HEALTHY" else ""
        parts.append(f"{name}: {', '.join(counts)}{said}")
    return "; ".join(parts)


def _delete_app(app_name: str) -> None:
    """``serve.delete(app_name)``, without waiting out the grace period of replicas that never started.

    Serve stops a replica by asking its actor to shut down and waits up to the deployment's
    ``graceful_shutdown_timeout_s`` (20 s) for the answer. An actor still waiting for a node (a
    resource nobody has, a node group still growing) never answers, so a stop during start-up,
    or while an autoscaled replica waits for its node, would take that long for nothing: such a
    replica has served nothing and has nothing to drain. So while Serve deletes the application,
    those actors are ended; replicas that run still stop gracefully. (Ending them until the
    application is gone: a replica ended before Serve takes in the deletion is replaced.)
    """
    from ray import serve

    serve.delete(app_name, _blocking=False)
    deadline = time.monotonic() + APP_DELETE_TIMEOUT_S
    while app_name in serve.status().applications:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Serve's application {app_name!r} still runs {APP_DELETE_TIMEOUT_S:.0f} s after its deletion"
            )
        _kill_unplaced_replicas(app_name)
        time.sleep(0.2)


def _kill_unplaced_replicas(app_name: str) -> None:
    """End the application's replica actors that Ray has not created yet (see ``_delete_app``)."""
    import ray
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX
    from ray.serve._private.constants import SERVE_NAMESPACE

    prefix = f"{REPLICA_ID_FULL_ID_STR_PREFIX}{app_name}#"  # replica actors: ``SERVE_REPLICA::<app>#<deployment>#<id>``
    try:
        actors = list(ray._private.state.actors().values())
    except Exception as err:  # the GCS's actor table is Ray's own; without it Serve's wait stands
        logger.debug("actor table unreadable: %s", err)
        return
    for actor in actors:
        name = str(actor.get("Name") or "")
        if name.startswith(prefix) and actor.get("State") in UNPLACED_ACTOR_STATES:
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(name, namespace=SERVE_NAMESPACE), no_restart=True)
                logger.info("stopped %s before Ray placed it", name)


def _serve_controller() -> Any | None:
    """The handle of Serve's controller in the connected Ray; None when Serve does not run there."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None


class _ServeRestartNotice(logging.Filter):
    """Drops Serve's notice that ``serve.run`` found a running Serve whose options it will not change.

    ``serve.run`` always starts Serve over again, and finding the Serve that ``serve.start`` has just
    started with rayturn's options, it says "New http_options/controller_options will not be applied":
    untrue then (they were, by ``serve.start``), so that one line goes; when the Serve was a caller's,
    the line is true and stays.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Connecting to existing Serve app")


@contextmanager
def _without_serve_restart_notice(drop: bool) -> Iterator[None]:
    """Serve's logger without the line ``_ServeRestartNotice`` drops, when ``drop``, for the ``with`` block."""
    serve_logger = logging.getLogger("ray.serve")
    notice = _ServeRestartNotice()
    if drop:
        serve_logger.addFilter(notice)
    try:
        yield
    finally:
        serve_logger.removeFilter(notice)


def _shut_down_serve(timeout_s: float = SERVE_SHUTDOWN_TIMEOUT_S) -> None:
    """``serve.shutdown()``, without Ray reporting the shutdown call as failed.

    Serve's controller ends its own shutdown by killing itself. ``serve.shutdown()`` waits on
    a ``graceful_shutdown`` call that is still running at that moment, and as the controller's
    calls are retried for ever, Ray prints "Task ServeController.graceful_shutdown failed ...
    the task will be retried". Asked with ``wait=False``, the call returns at once; waiting
    for the controller to be gone then ends Serve the same way, with no call in flight.
    """
    import ray
    from ray.serve import context

    controller = _serve_controller()
    if controller is None:
        return
    ray.get(controller.graceful_shutdown.remote(wait=False), timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while _serve_controller() is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve's controller still runs {timeout_s:.0f} s after it was asked to stop")
        time.sleep(0.1)
    context._set_global_client(None)  # the client ``serve.start`` kept, for the controller now gone


class _StopDuringStartup(KeyboardInterrupt):
    """A stop signal came before the cluster served: abandon the start-up and tear down what started.

    A ``KeyboardInterrupt``: Ray's blocking calls (``ray.get`` and the waits inside ``serve.run``)
    check for signals and end early on a ``KeyboardInterrupt`` only. Any other exception raised by
    a signal handler there is held until the call returns, which for a start-up waiting on a
    resource nobody has is never. Ray re-raises a plain ``KeyboardInterrupt``, so the subclass is
    what arrives only when the signal lands in Python code; ``serve_forever`` goes by ``stop``.
    """


def serve_forever(config: ClusterConfig, address: str | None = None, log_level: int = logging.INFO) -> int:
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
        try:
            with running_cluster(config, address, log_level) as endpoints:
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
        except KeyboardInterrupt:
            # ``_StopDuringStartup`` as raised, or the plain ``KeyboardInterrupt`` Ray turns it into;
            # one that no stop signal caused (a ``KeyboardInterrupt`` raised by hand) goes on up.
            if not stop.is_set() or serving.is_set():
                raise
            logger.info("start-up abandoned")
        print("rayturn stopped.", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
