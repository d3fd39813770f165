"""What every stage's assembly shares: its metrics registry and the exporters of the exact
cache's Redis link and invalidation listener."""

from __future__ import annotations

from collections.abc import Iterable

from tiercache.stages.parts import ExactTiers
from tiercache.triton import metrics as tm


def status_counters(
    metrics: tm.Metrics, name: str, description: str, label: str, values: Iterable[str]
) -> dict[str, tm._DeferredMetric]:
    """One counter per value of `label` (statuses, outcomes, tiers), plus none other."""
    return {value: metrics.counter(name, description, **{label: value}) for value in values}


def export_redis(metrics: tm.Metrics, tiers: ExactTiers) -> bool:
    """Redis health and invalidation-listener metrics for tiers with L3; False (and nothing
    exported) without L3."""
    if tiers.link is None:
        return False
    tm.RedisMetrics(metrics, tiers.link)
    if tiers.listener is not None:
        tm.InvalidationMetrics(metrics, tiers.listener)
    return True
