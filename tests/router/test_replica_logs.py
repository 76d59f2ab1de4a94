"""Outside a Serve replica, ``follow_serve_logging`` leaves logging as the caller set it up (a replica's own is
checked on a running cluster: ``tests/cluster/test_faults.py`` reads what its decode replicas logged)."""

from __future__ import annotations

import logging

import pytest

from rayturn.router.replica_logs import ROOT_LOGGER, SERVE_LOGGER, follow_serve_logging


def test_outside_a_replica_nothing_changes(caplog: pytest.LogCaptureFixture) -> None:
    ours = logging.getLogger(ROOT_LOGGER)
    before = (ours.level, list(ours.handlers), ours.propagate)
    serve_logger = logging.getLogger(SERVE_LOGGER)
    handler = logging.NullHandler()
    serve_logger.addHandler(handler)  # as Serve's own logger has, in a driver too
    try:
        assert follow_serve_logging() is False
    finally:
        serve_logger.removeHandler(handler)
    assert (ours.level, list(ours.handlers), ours.propagate) == before
    with caplog.at_level(logging.INFO, logger=ROOT_LOGGER):
        logging.getLogger(f"{ROOT_LOGGER}.decode.server").info("still the caller's")
    assert "still the caller's" in caplog.text
