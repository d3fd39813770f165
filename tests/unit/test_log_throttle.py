"""Logs a caller can drive are throttled (tiercache.log_throttle): one line a minute, saying how
many were let go."""

from __future__ import annotations

import logging

import pytest

from tiercache.log_throttle import LogThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_a_minute_with_the_count_let_go() -> None:
    clock = Clock()
    throttle = LogThrottle(60.0, clock)
    assert throttle.ready() and throttle.suppressed == 0
    assert not any(throttle.ready() for _ in range(500))
    clock.now += 59.9
    assert not throttle.ready()
    clock.now += 0.2
    assert throttle.ready() and throttle.suppressed == 501


def test_the_gateways_unavailable_warnings_do_not_follow_a_caller_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every 503 naming a server address was a WARNING: a keyless loop filled the log."""
    from tiercache.gateway import app

    message = "failed to connect to all addresses; last error: ipv4:10.0.0.5:8001: refused"
    with caplog.at_level(logging.WARNING, logger=app.log.name):
        scrubbed = [app._public(message) for _ in range(1000)]  # noqa: SLF001
    assert set(scrubbed) == {app._public(message)} and "10.0.0.5" not in scrubbed[0]  # noqa: SLF001
    assert caplog.text.count("unavailable: ") <= 1
