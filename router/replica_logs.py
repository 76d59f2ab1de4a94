"""rayturn's own log lines in a Serve replica go where Serve's go: the replica's log file and stderr.

Serve sets up one logger in each replica, ``ray.serve``, from the application's ``logging_config``:
its level, its file under the Ray session's ``logs/serve`` (``replica_<app>_<deployment>_<id>.log``)
and its stderr stream. rayturn's modules log under ``rayturn.*``; left as they are, Python drops
their INFO lines and prints their warnings bare on the worker's stderr, so what a replica says of
itself (the kernel backend and energy meter it chose at start, the session pages it handed to the
store as it stopped) is nowhere an operator looks. ``follow_serve_logging`` gives the ``rayturn``
logger Serve's handlers and level, in a replica only: elsewhere logging is the caller's.
"""

from __future__ import annotations

import logging

from ray import serve
from ray.serve.exceptions import RayServeException

SERVE_LOGGER = "ray.serve"
ROOT_LOGGER = "rayturn"


def follow_serve_logging() -> bool:
    """Send the ``rayturn`` loggers' lines through this replica's Serve handlers, at Serve's level; False (and
    nothing changed) outside a Serve replica."""
    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not serve_logger.handlers:
        return False
    ours = logging.getLogger(ROOT_LOGGER)
    ours.setLevel(serve_logger.level)
    for handler in serve_logger.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = False  # once: not again through the worker's own stderr
    return True
