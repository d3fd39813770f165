"""The one percentile definition every figure of this project uses (the eval command here, and
the dev package's benchmarks through `tiercache_dev.stats`), and the share of hits the hottest
entries take (`top_share`, the caches' skew metrics).

Linear interpolation between the closest ranks, numpy's default (`np.percentile(...,
method="linear")`, Hyndman and Fan's type 7): for n sorted values x[0] <= ... <= x[n-1] and q in
percent, the rank is h = (n - 1) * q / 100 and the percentile is
x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]). So p0 is the minimum, p100 the
maximum and p50 the median.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence


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


def top_share(counts: Sequence[int], fraction: float = 0.01) -> float:
    """The share of the total of `counts` taken by their largest `fraction` (at least one):
    the seeds' cache-skew-ratio when the counts are hits per held entry. 1.0 when one entry in
    a hundred takes every hit, about `fraction` when hits spread evenly; 0.0 when the total is
    0. O(n log k)."""
    total = sum(counts)
    if total == 0:
        return 0.0
    top = max(1, math.ceil(len(counts) * fraction))
    return sum(heapq.nlargest(top, counts)) / total
