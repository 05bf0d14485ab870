"""A standby operator replica waits without logging errors: kopf's "failed temporarily"
records of its waiting handlers are dropped, every other record of kopf's is kept; the
once-a-second "tick succeeded" record is dropped too, a failing tick is not."""

from __future__ import annotations

import logging

import pytest
from shardq_operator.handlers import STANDBY_MESSAGE, RoutineTicksAreQuiet, StandbyIsNotAnError


@pytest.fixture
def kopf_objects(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    logger = logging.getLogger("kopf.objects.test-standby")
    logger.addFilter(StandbyIsNotAnError())
    logger.addFilter(RoutineTicksAreQuiet())
    caplog.set_level(logging.DEBUG, logger=logger.name)
    return logger


def test_a_standby_handler_waiting_is_not_logged(
    kopf_objects: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    # As kopf words a TemporaryError of a handler.
    kopf_objects.error("Handler 'queue_changed' failed temporarily: %s", STANDBY_MESSAGE)
    assert caplog.records == []


def test_other_handler_errors_are_still_logged(kopf_objects: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    kopf_objects.error("Handler 'queue_changed' failed temporarily: the API server refused the patch")
    assert [record.levelno for record in caplog.records] == [logging.ERROR]


def test_a_successful_tick_is_not_logged_a_failing_one_is(
    kopf_objects: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    # As kopf words them (kopf/_core/actions/execution.py).
    kopf_objects.info("%s succeeded.", "Timer 'tick_cluster'")
    kopf_objects.error("Timer 'tick_cluster' failed with an exception. Will retry.")
    kopf_objects.info("Handler 'queue_changed' succeeded.")
    assert [record.getMessage() for record in caplog.records] == [
        "Timer 'tick_cluster' failed with an exception. Will retry.",
        "Handler 'queue_changed' succeeded.",
    ]
