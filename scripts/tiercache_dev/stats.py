"""Summary statistics for every benchmark here: one percentile definition for all of them.

The definition: linear interpolation between the closest ranks, numpy's default
(`np.percentile(..., method="linear")`, Hyndman and Fan's type 7). For n sorted values
x[0] <= ... <= x[n-1] and q in percent, the rank is h = (n - 1) * q / 100 and the percentile is
x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]). So p0 is the minimum, p100 the
maximum and p50 the median (`statistics.median`): a benchmark's "p50" and "median" are one
figure. Pure Python (no numpy), so a script can use it under any interpreter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in percent, 0..100) of `values`, by linear interpolation (see the
    module docstring). ValueError when there are no values or q is outside 0..100."""
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


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
