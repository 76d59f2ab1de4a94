"""Config -> Ray Serve application: the builder ``rayturn serve`` and KubeRay both use.

One Serve application, ``rayturn``, at route prefix ``/``:

    ingress (HTTP + gRPC)  ->  decode pool  ->  prefill pool
                                     \\            /
                              KV store (master actor + segments in every
                              replica + optional store-node replicas)

The decode and prefill pools route with ``KVAwareRequestRouter``; each pool
has its own replica count or autoscaling and its own Ray resources, so the
pools scale independently and can be pinned to node groups. The KV store's
master is a detached, restartable actor that the first replica to start
creates (``start_master`` is idempotent); store nodes are a Serve deployment
so Serve keeps their count.

``build_app(config)`` returns the application; ``app_builder(args)`` is the
import path for ``serve run`` / a KubeRay ``RayService``
(``rayturn.cluster.app:app_builder`` with ``args: {config: /path.yaml}``).

Redeploying is in place. ``serve.run(build_app(new_config), name="rayturn")``
on a running cluster restarts only the deployments whose replicas are built
differently (other constructor arguments or Ray resources); a pool whose
replica count or autoscaling changed gains or drains replicas while the
others, their KV caches and their store segments stay (see ``_bind``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from rayturn import __version__
from rayturn.api.grpc_service import SERVICER_FUNCTION
from rayturn.api.ingress import Ingress
from rayturn.api.response_keeper import ResponseKeeper
from rayturn.api.settings import IngressSettings
from rayturn.decode.server import DecodeServer
from rayturn.engine.config import ModelConfig
from rayturn.engine.presets import resolve_model, resolve_model_dir
from rayturn.kvstore import StoreNodeReplica
from rayturn.kvstore.settings import StoreMembership
from rayturn.prefill.server import PrefillServer
from rayturn.router.settings import ROUTERS

from .config import ClusterConfig, PoolSpec, load_config
from .listeners import proxy_env

# ``serve.deployment`` is overloaded in ways type checkers do not follow for classes.
_deployment: Any = serve.deployment

APP_NAME = "rayturn"
KV_NAMESPACE = "rayturn"
# The ingress only parses and streams; its replicas' calls wait on the pools, which bound them.
INGRESS_MAX_ONGOING_REQUESTS = 1000
# The shared response store's: each running background response holds one call (its cancel watch) open.
RESPONSES_MAX_ONGOING_REQUESTS = 4096
RESPONSES_NUM_CPUS = 0.25  # a dictionary behind a handle
# ``app_builder``'s argument with the config file's digest, and how long a build waits for the file to match.
CONFIG_DIGEST_ARG = "config_sha256"
CONFIG_SYNC_TIMEOUT_S = 180.0


def model_path(config: ClusterConfig) -> str:
    """The model as every process can load it: a preset name or an absolute directory (a Hugging Face id
    becomes its snapshot in this machine's cache, which other nodes must see at the same path, as any
    directory), checked here so that a bad ``model.name`` fails before anything starts."""
    return resolve_model(config.model.name)


def store_membership(config: ClusterConfig) -> StoreMembership:
    """What each replica needs to start or find the master and join the store."""
    return StoreMembership(config.kvstore, tenant=config.tenant, namespace=KV_NAMESPACE)


def router_config(config: ClusterConfig) -> dict[str, Any]:
    router = config.router
    return {
        "request_router_class": ROUTERS.create(router.policy),
        "request_router_kwargs": {
            "kv_overlap": router.kv_overlap_weight,
            "load": router.load_weight,
            "affinity": router.affinity_weight,
        },
        "request_routing_stats_period_s": router.stats_period_s,
        "request_routing_stats_timeout_s": max(router.stats_period_s, 1.0),
    }


def deployment_options(config: ClusterConfig) -> dict[str, dict[str, Any]]:
    """Each deployment's Serve options (name, replicas or autoscaling, Ray resources, request router), keyed by
    name; a deployment the config leaves out (no prefill pool, no store nodes) is absent. ``build_app`` binds
    these, and a KubeRay ``serveConfigV2`` lists them (``rayturn.cluster.kuberay``)."""
    router = router_config(config)
    options: dict[str, dict[str, Any]] = {}
    if config.prefill.max_replicas > 0:
        options["prefill"] = {"name": "prefill", "request_router_config": router, **config.prefill.serve_options()}
    options["decode"] = {"name": "decode", "request_router_config": router, **config.decode.serve_options()}
    kv = config.kvstore
    if kv.enabled and kv.store_nodes > 0:
        options["kv-store"] = {
            "name": "kv-store",
            "num_replicas": kv.store_nodes,
            "ray_actor_options": {"num_cpus": kv.store_node_num_cpus, "resources": dict(kv.store_node_resources)},
        }
    if config.server.ingress_replicas > 1:  # the response store they share (``api.shared_responses``)
        options["responses"] = {
            "name": "responses",
            "num_replicas": 1,
            "ray_actor_options": {"num_cpus": min(config.server.ingress_num_cpus, RESPONSES_NUM_CPUS)},
            "max_ongoing_requests": RESPONSES_MAX_ONGOING_REQUESTS,
        }
    options["ingress"] = {
        "name": "ingress",
        "num_replicas": config.server.ingress_replicas,
        "ray_actor_options": {"num_cpus": config.server.ingress_num_cpus},
        "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
    }
    return options


def _bind(deployment: Any, *args: object) -> Application:
    """``deployment.bind(*args)`` with a code version derived from what its replicas are built from.

    ``serve.run`` gives a deployment without a version a fresh random one on
    every call, and a new version restarts every replica: resizing one pool
    would restart the ingress and both pools, dropping every KV cache and the
    store pages held in the replicas' segments. The version here hashes the
    deployment's name, its constructor arguments (JSON values; a bound
    deployment enters only as being there) and rayturn's version, so it stays
    the same across redeploys that change replica counts or autoscaling, and
    Serve only adds or drains replicas; a changed argument still rolls them.
    Changed rayturn code under the same version number does not: restart the
    cluster to run it. Serve takes ``version`` only from its own builders, which pass
    ``_internal=True`` as done here.
    """
    built_from = ["<deployment>" if isinstance(arg, Application) else arg for arg in args]
    identity = json.dumps([__version__, deployment.name, *built_from], sort_keys=True, default=_plain)
    version = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return deployment.options(version=version, _internal=True).bind(*args)


def _plain(value: object) -> object:
    """Settings objects enter a deployment's version as their fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
        return {"type": type(value).__name__, **fields}
    if isinstance(value, Mapping):  # read-only mappings in frozen settings
        return dict(value)
    raise TypeError(f"a deployment argument of type {type(value).__name__} has no stable identity")


def pool_engine_kwargs(config: ClusterConfig, pool: PoolSpec) -> dict[str, Any]:
    """The model's engine arguments with the pool's own KV cache size, when it sets one."""
    engine_kwargs = config.model.engine_kwargs()
    if pool.num_pages is not None:
        engine_kwargs["num_pages"] = pool.num_pages
    return engine_kwargs


def check_context(config: ClusterConfig, model: str) -> None:
    """``model.max_model_len`` within the model's context, checked before anything starts (each replica would
    refuse it, one by one, and the deployment fail with no word of why)."""
    model_config = ModelConfig.from_file(resolve_model_dir(model) / "config.json")
    try:
        model_config.check_max_model_len(config.model.max_model_len)
    except ValueError as err:
        raise ValueError(f"model.max_model_len (--max-model-len): {err}") from None


def build_app(config: ClusterConfig) -> Application:
    model = model_path(config)
    check_context(config, model)
    kvstore = store_membership(config) if config.kvstore.enabled else None
    options = deployment_options(config)

    prefill = None
    if "prefill" in options:
        prefill = _bind(
            _deployment(PrefillServer).options(**options["prefill"]),
            model,
            pool_engine_kwargs(config, config.prefill),
            kvstore,
        )
    decode = _bind(
        _deployment(DecodeServer).options(**options["decode"]),
        model,
        pool_engine_kwargs(config, config.decode),
        kvstore,
        prefill,
        config.router.disaggregation_threshold_tokens,
        config.lifecycle,
        config.model.tool_call_parser,
        config.decode.admission_limits(),
        config.router.balance_prefill,
    )
    store_nodes = None
    if kvstore is not None and "kv-store" in options:
        store_nodes = _bind(
            _deployment(StoreNodeReplica).options(**options["kv-store"]), kvstore, config.kvstore.store_node_bytes
        )
    pools = ["ingress", "decode"] + (["prefill"] if prefill is not None else [])
    ingress_settings = IngressSettings(
        model=model,
        served_model_name=config.model.model_name,
        page_size=config.model.page_size,
        keys=config.server.key_table(config.tenant),
        max_request_bytes=config.server.max_request_bytes,
        max_model_len=config.model.max_model_len,
        app_name=APP_NAME,
        pools=tuple(pools + (["kv-store"] if store_nodes is not None else [])),
        tool_call_parser=config.model.tool_call_parser,
        reasoning_parser=config.model.reasoning_parser,
    )
    responses = None
    if "responses" in options:
        responses = _bind(_deployment(ResponseKeeper).options(**options["responses"]))
        ingress_settings = dataclasses.replace(ingress_settings, pools=(*ingress_settings.pools, "responses"))
    ingress = _deployment(Ingress).options(**options["ingress"])
    return _bind(ingress, decode, prefill, store_nodes, ingress_settings, responses)


def serve_logging_config(log_level: int = logging.INFO) -> dict[str, Any]:
    """Serve's logging for its controller, proxies and replicas: a line per request (the access log) only when
    debugging; Serve's own lines from INFO up (below that they are Serve's internals, not rayturn's)."""
    return {
        "log_level": logging.getLevelName(max(log_level, logging.INFO)),
        "enable_access_log": log_level <= logging.DEBUG,
    }


def serve_start_options(config: ClusterConfig, log_level: int = logging.INFO) -> dict[str, Any]:
    """``serve.start`` options: HTTP host/port, the gRPC port with rayturn's servicer, the proxies'
    environment that binds gRPC at the same host and caps its messages (``listeners``), and logging. gRPC
    server reflection is off."""
    server = config.server
    return {
        "http_options": {"host": server.host, "port": server.http_port},
        # No server reflection: it would list the services to any caller, key or none (the API is protos/).
        "grpc_options": {
            "port": server.grpc_port,
            "grpc_servicer_functions": [SERVICER_FUNCTION],
            "enable_reflection": False,
        },
        "controller_options": {"runtime_env": {"env_vars": proxy_env(server.host, server.max_request_bytes)}},
        "logging_config": serve_logging_config(log_level),
    }


def app_builder(args: Mapping[str, Any]) -> Application:
    """Serve's application-builder entry: ``args`` may name a ``config`` file and dotted overrides.

    ``config_sha256`` (what ``rayturn deploy render`` adds) is the digest of the file's text: a changed file
    changes Serve's config, so Serve builds the application again, and the build waits for the mounted file
    to show that text (Kubernetes updates a mounted ConfigMap up to a minute or so after it changed).
    """
    options = dict(args)
    path = options.pop("config", None)
    digest = options.pop(CONFIG_DIGEST_ARG, None)
    if digest is not None:
        if path is None:
            raise ValueError(f"args.{CONFIG_DIGEST_ARG} needs args.config, the file it is the digest of")
        wait_for_config(Path(path), str(digest))
    return build_app(load_config(path, **options))


def config_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def wait_for_config(path: Path, digest: str, timeout_s: float = CONFIG_SYNC_TIMEOUT_S, poll_s: float = 1.0) -> None:
    """Return once the file at ``path`` has the text of ``digest``; ValueError naming both after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = config_digest(path.read_text(encoding="utf-8"))
        except OSError as err:
            found = f"unreadable ({err.strerror})"
        if found == digest:
            return
        if time.monotonic() >= deadline:
            raise ValueError(
                f"config file {str(path)!r} has sha256 {found}, the application expects {digest}: the mounted "
                "ConfigMap did not catch up; apply the rendered ConfigMap together with the RayService"
            )
        time.sleep(poll_s)
