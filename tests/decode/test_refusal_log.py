"""A refused call is one line in a replica's log; a failure keeps Serve's ERROR line and its traceback."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from rayturn.messages import RefusalLog, ReplicaAtCapacity

LOGGER = "rayturn-test.serve"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[Records]:
    logger = logging.getLogger(LOGGER)
    handler = Records()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    RefusalLog.install(LOGGER)
    RefusalLog.install(LOGGER)  # once per process, however often a replica starts
    assert sum(isinstance(f, RefusalLog) for f in logger.filters) == 1
    yield handler
    logger.removeHandler(handler)
    logger.filters.clear()


def failed(error: Exception) -> None:
    """What Serve's replica does with an exception a call raised."""
    try:
        raise error
    except Exception:
        logging.getLogger(LOGGER).exception("Request failed.")


def test_refusals_are_one_line_and_failures_keep_their_traceback(records: Records) -> None:
    failed(ReplicaAtCapacity("the interactive share of 48 slots is taken", "replica-1"))
    failed(ValueError("stop_token_ids out of vocabulary [0, 263): [99999]"))
    failed(RuntimeError("a bug"))
    refused_capacity, refused_value, bug = records.records
    for record, kind in ((refused_capacity, "ReplicaAtCapacity"), (refused_value, "ValueError")):
        assert record.levelno == logging.INFO and record.exc_info is None
        assert record.getMessage().startswith(f"Request refused: {kind}: ")
    assert "48 slots" in refused_capacity.getMessage() and "[99999]" in refused_value.getMessage()
    assert bug.levelno == logging.ERROR and bug.getMessage() == "Request failed." and bug.exc_info is not None


def test_debug_logging_keeps_a_refusals_traceback(records: Records) -> None:
    logging.getLogger(LOGGER).setLevel(logging.DEBUG)
    failed(ValueError("refused"))
    (record,) = records.records
    assert record.levelno == logging.INFO and record.exc_info is not None
