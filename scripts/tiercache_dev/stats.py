"""Summary statistics for every benchmark here: one percentile definition for all of them.

The definition is `tiercache.stats.percentile` (linear interpolation between the closest ranks,
numpy's default), the one the package's own eval command uses too: so p50 is the median
(`statistics.median`), and a benchmark's "p50" and "median" are one figure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tiercache.stats import percentile

__all__ = ["mean", "median", "percentile", "summary"]


def median(values: Iterable[float]) -> float:
    """The 50th percentile: the middle value, or the mean of the two middle ones."""
    return percentile(values, 50.0)


def mean(values: Iterable[float]) -> float:
    """The arithmetic mean (ValueError when there are no values)."""
    items = [float(v) for v in values]
    if not items:
        raise ValueError("mean of no values")
    return math.fsum(items) / len(items)


def summary(
    values: Iterable[float], unit: str = "ms", digits: int | None = None
) -> dict[str, float]:
    """{"n", "p50_<unit>", "p99_<unit>", "max_<unit>"} of `values` (already in `unit`), each
    rounded to `digits` places when given; {"n": 0} when there are none. The shape the
    benchmarks' JSON output uses."""
    items = [float(v) for v in values]
    if not items:
        return {"n": 0}

    def shown(x: float) -> float:
        return x if digits is None else round(x, digits)

    return {
        "n": len(items),
        f"p50_{unit}": shown(percentile(items, 50)),
        f"p99_{unit}": shown(percentile(items, 99)),
        f"max_{unit}": shown(max(items)),
    }
