"""How often the stages send their metric updates to Triton (tiercache.triton.metrics): every
second unless $TIERCACHE_METRICS_FLUSH_S says otherwise; a value that is not a usable number of
seconds is logged and the default used (the stage still starts)."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import pytest


@pytest.fixture
def metrics(pb_utils: ModuleType) -> ModuleType:
    return importlib.import_module("tiercache.triton.metrics")


def test_the_default_is_one_second_and_the_environment_can_change_it(
    metrics: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert metrics.configured_flush_s({}) == metrics.DEFAULT_FLUSH_S == 1.0
    assert metrics.configured_flush_s({metrics.FLUSH_ENV: " 0.25 "}) == 0.25
    assert metrics.configured_flush_s({metrics.FLUSH_ENV: "60"}) == 60.0
    monkeypatch.setenv(metrics.FLUSH_ENV, "2.5")
    stage_metrics = metrics.Metrics("prompt_cache")
    assert stage_metrics._interval_s == 2.5  # noqa: SLF001 - what the flusher waits between flushes
    assert metrics.Metrics("llm", flush_interval_s=0.1)._interval_s == 0.1  # noqa: SLF001


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "61", "nan", "inf"])
def test_an_unusable_value_is_logged_and_the_default_used(
    metrics: ModuleType, raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        assert metrics.configured_flush_s({metrics.FLUSH_ENV: raw}) == metrics.DEFAULT_FLUSH_S
    assert metrics.FLUSH_ENV in caplog.text and repr(raw) in caplog.text


def test_a_metric_that_fails_to_send_keeps_its_updates_and_holds_up_no_other(
    metrics: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """One metric whose send raises: the metrics after it are flushed all the same (before,
    the flush stopped there, every tick, freezing the rest), and what it held is sent by the
    next flush (before, it was lost)."""
    stage_metrics = metrics.Metrics("prompt_cache_flush_test")
    broken = stage_metrics.counter("tiercache_test_broken_total", "a counter whose send fails")
    after = stage_metrics.counter("tiercache_test_after_total", "a counter flushed after it")
    send = broken._metric.increment  # noqa: SLF001 - Triton's metric behind the deferred one
    failures = [RuntimeError("the core refused the update")]

    def flaky(value: float) -> None:
        if failures:
            raise failures.pop()
        send(value)

    broken._metric.increment = flaky  # noqa: SLF001
    broken.increment(3)
    after.increment(2)
    with caplog.at_level(logging.ERROR, logger="tiercache"):
        stage_metrics.flush()
    assert after._metric.value() == 2  # noqa: SLF001
    assert broken._metric.value() == 0  # noqa: SLF001
    assert "flushing a metric failed" in caplog.text
    stage_metrics.flush()
    assert broken._metric.value() == 3  # noqa: SLF001
