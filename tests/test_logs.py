"""The library's loggers: an event below the level costs a level check, nothing more."""

from __future__ import annotations

import logging

import pytest

from harbor_async.core import logs
from harbor_async.core.logs import ROOT_LOGGER, get_logger, quieter


class _Unprintable:
    def __repr__(self) -> str:
        raise AssertionError("a dropped event's field was formatted")

    __str__ = __repr__


@pytest.fixture
def counted(monkeypatch):
    """Every processor call of the library's chain, counted; the stdlib logger's level restored after."""
    calls: list[str] = []

    def count(logger, method, event_dict):
        calls.append(method)
        event_dict.pop("field", None)  # what the renderer would format
        return event_dict

    monkeypatch.setattr(logs, "_PROCESSORS", [count, *logs._PROCESSORS])
    logger = logging.getLogger(ROOT_LOGGER)
    level = logger.level
    yield calls, logger
    logger.setLevel(level)


def test_an_event_below_the_level_runs_no_processor_and_formats_nothing(counted):
    calls, logger = counted
    logger.setLevel(logging.WARNING)
    log = get_logger(sandbox="s").bind(task="t")
    assert not log.is_enabled_for("debug") and log.is_enabled_for("warning")
    log.debug("phase", field=_Unprintable())
    log.info("phase", field=_Unprintable())
    log.log(logging.DEBUG, "phase", field=_Unprintable())
    assert calls == []
    log.warning("phase", field=_Unprintable())
    assert calls == ["warning"]


def test_the_level_is_read_at_each_event(counted):
    calls, logger = counted
    log = get_logger()
    logger.setLevel(logging.DEBUG)
    log.debug("kept")
    with quieter("error"):
        log.warning("dropped")
        assert not log.is_enabled_for("warning")
    log.warning("kept")
    logger.disabled = True
    try:
        log.error("dropped")
    finally:
        logger.disabled = False
    assert calls == ["debug", "warning"]
