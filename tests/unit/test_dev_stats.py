"""tiercache_dev.stats: the one percentile definition every benchmark reports (linear
interpolation between closest ranks, numpy's default), checked against known values."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from tiercache_dev.stats import mean, median, percentile, summary


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),  # the mean of the two middle values, not 2 (nearest rank)
        ([1, 2, 3, 4], 0, 1.0),
        ([1, 2, 3, 4], 100, 4.0),
        ([1, 2, 3, 4], 25, 1.75),
        ([10, 20, 30, 40, 50], 90, 46.0),
        (list(range(1, 101)), 99, 99.01),  # rank 98.01 between 99 and 100
        ([7.5], 99, 7.5),
        ([3, 1, 2], 50, 2.0),  # unsorted input
    ],
)
def test_percentile_known_values(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_matches_numpy_default_and_median() -> None:
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 64, 1001):
        values = rng.lognormal(size=n).tolist()
        for q in (0, 1, 37.5, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
        assert median(values) == pytest.approx(statistics.median(values))


def test_percentile_rejects_no_values_and_q_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        mean([])


def test_summary_shape() -> None:
    values = [float(v) for v in range(1, 101)]
    assert summary(values) == {"n": 100, "p50_ms": 50.5, "p99_ms": 99.01, "max_ms": 100.0}
    assert summary((v / 3 for v in values), unit="us", digits=1) == {
        "n": 100,
        "p50_us": 16.8,
        "p99_us": 33.0,
        "max_us": 33.3,
    }
    assert summary([]) == {"n": 0}
    assert mean([1, 2, 6]) == 3.0
