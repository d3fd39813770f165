"""Triton boundary, metrics: families created once per model, updates deferred to a flusher
thread, and the exporters that turn the core's stats snapshots into Prometheus series.

The core knows nothing of Prometheus: it exposes stats snapshots (monotonic totals and levels).
An exporter reads one on the flusher thread; a total becomes a counter through `DeltaCounter`
(the one place that turns "a total that grew" into an increment).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import triton_python_backend_utils as pb_utils

from tiercache.exact.invalidation import InvalidatorStats, ListenerStats
from tiercache.exact.leases import LeaseStats
from tiercache.exact.redis_tier import SIGNED, RedisHealth
from tiercache.exact.stores import StoreStats
from tiercache.exact.watermarks import Invalidation
from tiercache.log_throttle import LogThrottle
from tiercache.threads import NamedThread
from tiercache.vocabulary import InvalidationKind, Tier, choices

log = logging.getLogger("tiercache")

# Histogram buckets, in seconds.
LATENCY_BUCKETS_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0]
# Engine time: a CPU generation under load takes longer than 5 s (past the last bucket, a
# quantile only reads "over 5 s").
GENERATION_BUCKETS_S = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
# Invalidation lag buckets, in seconds: a message crosses Redis pub/sub in about a millisecond; a
# tag, tenant or adapter sweep of a large L2 takes longer (docs/replicas.md).
LAG_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0]


_FOLD_AT = 4096  # appended updates summed on the request's thread past this (no flush lately)

FLUSH_ENV = "TIERCACHE_METRICS_FLUSH_S"
DEFAULT_FLUSH_S = 1.0
MAX_FLUSH_S = 60.0


def configured_flush_s(environ: Mapping[str, str] | None = None) -> float:
    """How often each stage sends its metric updates to Triton: $TIERCACHE_METRICS_FLUSH_S
    (seconds, above 0 and at most MAX_FLUSH_S), else DEFAULT_FLUSH_S. Each flush sends one
    round trip to the server per series that moved, which the server's threads answer between
    requests: at 0.25 s, about one a request on `make bench`'s hits at concurrency 1, and the
    server CPU per hit was 1 to 5 % higher than at 1 s or more (docs/observability.md). A value
    that is not such a number is logged and the default used."""
    raw = (os.environ if environ is None else environ).get(FLUSH_ENV, "").strip()
    if not raw:
        return DEFAULT_FLUSH_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_FLUSH_S:
        log.warning(
            "%s=%r is not a number of seconds above 0 and at most %g; flushing every %g s",
            FLUSH_ENV,
            raw,
            MAX_FLUSH_S,
            DEFAULT_FLUSH_S,
        )
        return DEFAULT_FLUSH_S
    return value


class _DeferredMetric:
    """A Triton metric whose updates are recorded locally and applied by the flusher thread.

    Each pb_utils metric call is a round trip from the stub process to the server; three of them
    on the hit path cost more than the whole cache lookup, so requests only touch local numbers.
    """

    __slots__ = ("_metric", "_lock", "_delta", "_value", "_sent", "_increments")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._lock = threading.Lock()
        self._delta = 0.0
        self._value: float | None = None
        self._sent: float | None = None  # the gauge value last sent (a flush sends changes)
        # increments not yet summed: a request appends (atomic, no lock: a lock taken with the
        # CPU caches cold cost 9 us in process, an append 4), the flush sums them
        self._increments: deque[float] = deque()

    @property
    def metric(self) -> Any:
        """The underlying pb_utils metric (what a scrape reads after the next flush)."""
        return self._metric

    def increment(self, amount: float) -> None:
        increments = self._increments
        increments.append(amount)
        if len(increments) > _FOLD_AT:  # no flush lately (a flusher stopped): kept bounded
            self._fold()

    def _fold(self) -> None:
        """Sum the appended increments into the delta (each taken once: pops are atomic)."""
        increments = self._increments
        with self._lock:
            while increments:
                self._delta += increments.popleft()

    def set(self, value: float) -> None:
        with self._lock:
            self._value = value

    def flush(self) -> None:
        """Send what changed since the last flush; what a failed send held is kept for the
        next one (it was lost)."""
        self._fold()
        with self._lock:
            delta, value = self._delta, self._value
            self._delta, self._value = 0.0, None
        try:
            if delta:
                self._metric.increment(delta)
                delta = 0.0
            if value is not None and value != self._sent:  # flush hooks set gauges every time
                self._metric.set(value)
                self._sent = value
        except BaseException:
            with self._lock:
                self._delta += delta
                if self._value is None:
                    self._value = value
            raise


class _LocalHistogram:
    """A histogram kept in the stage process and exported as Prometheus histogram series
    (`<name>_bucket{le=...}`, `<name>_sum`, `<name>_count`, each a counter family), so a flush
    sends one increment per bucket that moved instead of one `observe` round trip per
    observation: on the exact-hit path that round trip was one per request. PromQL reads the
    series as it reads a native histogram's (`histogram_quantile(q, rate(<name>_bucket[5m]))`).
    """

    __slots__ = (
        "buckets",
        "_bucket_metrics",
        "_sum",
        "_count",
        "_lock",
        "_counts",
        "_total_s",
        "_pending",
    )

    def __init__(self, buckets: list[float], bucket_metrics: list[Any], sum_: Any, count: Any):
        self.buckets = list(buckets)  # upper bounds, ascending; +Inf is the last bucket metric
        self._bucket_metrics = bucket_metrics  # one per bound, then +Inf
        self._sum, self._count = sum_, count
        self._lock = threading.Lock()
        self._counts = [0] * (len(buckets) + 1)  # observations per bucket (not cumulative)
        self._total_s = 0.0
        self._pending: deque[float] = deque()  # observed, not yet counted (as increments)

    @property
    def metric(self) -> Any:
        """The `_count` counter (what a scrape reads after the next flush)."""
        return self._count

    def observe(self, value: float) -> None:
        pending = self._pending
        pending.append(value)
        if len(pending) > _FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        """Count the observations appended since (each taken once)."""
        pending, buckets = self._pending, self.buckets
        with self._lock:
            while pending:
                value = pending.popleft()
                if not math.isfinite(value):
                    continue  # a NaN or infinite duration is a bug upstream; never poison the sum
                self._counts[bisect.bisect_left(buckets, value)] += 1  # le: value <= bound
                self._total_s += value

    def flush(self) -> None:
        self._fold()
        with self._lock:
            counts, total_s = self._counts, self._total_s
            self._counts, self._total_s = [0] * len(counts), 0.0
        observed = sum(counts)
        if not observed:
            return
        cumulative = 0
        for metric, count in zip(self._bucket_metrics, counts, strict=True):
            cumulative += count
            if cumulative:
                metric.increment(cumulative)
        self._count.increment(observed)
        if total_s > 0:
            self._sum.increment(total_s)


class Metrics:
    """Metric families created once per model (in initialize), one label set per model, and a
    flusher thread (started by `start`, joined by `close` in finalize) that applies the deferred
    updates every `flush_interval_s`, so a scrape sees them at most that much later."""

    def __init__(
        self, model_name: str, flush_interval_s: float | None = None, instance: str | None = None
    ) -> None:
        """`instance` adds an `instance` label (for models that run several instances);
        `flush_interval_s` None: `configured_flush_s()` ($TIERCACHE_METRICS_FLUSH_S,
        default 1 s)."""
        self.labels = {"model": model_name}
        if instance is not None:
            self.labels["instance"] = instance
        self._families: dict[str, Any] = {}
        self._metrics: list[_DeferredMetric | _LocalHistogram] = []
        self._hook_log = LogThrottle()
        self._flush_log = LogThrottle()
        self._flush_lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        if flush_interval_s is None:
            flush_interval_s = configured_flush_s()
        self._interval_s = flush_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def counter(self, name: str, description: str, **labels: str) -> _DeferredMetric:
        return self._metric(name, description, pb_utils.MetricFamily.COUNTER, labels)

    def gauge(self, name: str, description: str, **labels: str) -> _DeferredMetric:
        return self._metric(name, description, pb_utils.MetricFamily.GAUGE, labels)

    def histogram(
        self, name: str, description: str, buckets: list[float] = LATENCY_BUCKETS_S, **labels: str
    ) -> _LocalHistogram:
        """A histogram aggregated here and flushed as `<name>_bucket`, `_sum` and `_count`
        counters (`_LocalHistogram`); `buckets` ascending upper bounds, +Inf added."""
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram {name}: buckets must be ascending and distinct")
        counter = pb_utils.MetricFamily.COUNTER
        series = {**self.labels, **labels}
        bucket_family = self._family(f"{name}_bucket", f"{description} (cumulative)", counter)
        bounds = [*(format(b, "g") for b in buckets), "+Inf"]
        histogram = _LocalHistogram(
            list(buckets),
            [bucket_family.Metric(labels={**series, "le": le}) for le in bounds],
            self._family(f"{name}_sum", f"{description} (sum)", counter).Metric(labels=series),
            self._family(f"{name}_count", f"{description} (count)", counter).Metric(labels=series),
        )
        self._metrics.append(histogram)
        return histogram

    def on_flush(self, hook: Callable[[], None]) -> None:
        """Run `hook` on the flusher thread before each flush (e.g. to refresh gauges)."""
        self._hooks.append(hook)

    def start(self) -> None:
        self._thread = NamedThread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def flush(self, timeout_s: float = -1) -> None:
        """Run the hooks, each on its own (one that fails no longer stopped the flush, freezing
        every metric of the stage: it is logged at most once a minute), then flush; one flusher
        at a time, hooks included (close's last flush and the thread's: the hooks' delta
        counters have one updater). `timeout_s` (>= 0): give up if another flush holds on."""
        if not self._flush_lock.acquire(timeout=timeout_s):
            log.warning("metrics not flushed: another flush still runs after %.0f s", timeout_s)
            return
        try:
            self._flush_locked()
        finally:
            self._flush_lock.release()

    def _flush_locked(self) -> None:
        for hook in self._hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - the other hooks and the metrics go on
                if self._hook_log.ready():
                    log.exception(
                        "a metrics hook failed (%d more failures not logged)",
                        self._hook_log.suppressed,
                    )
        for metric in self._metrics:
            try:
                metric.flush()
            except Exception:  # noqa: BLE001 - one metric's failure must not freeze the rest
                if self._flush_log.ready():
                    log.exception(
                        "flushing a metric failed; a counter's or gauge's updates are kept "
                        "for the next flush, a histogram's lost (%d more failures not "
                        "logged)",
                        self._flush_log.suppressed,
                    )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush(timeout_s=10)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - metrics must never take a model down; logged
                log.exception("metrics flush failed")

    def _metric(
        self, name: str, description: str, kind: Any, labels: dict[str, str]
    ) -> _DeferredMetric:
        return self._track(
            self._family(name, description, kind).Metric(labels={**self.labels, **labels})
        )

    def _track(self, metric: Any) -> _DeferredMetric:
        deferred = _DeferredMetric(metric)
        self._metrics.append(deferred)
        return deferred

    def _family(self, name: str, description: str, kind: Any) -> Any:
        if name not in self._families:
            self._families[name] = pb_utils.MetricFamily(
                name=name, description=description, kind=kind
            )
        return self._families[name]


REJECTED_HELP = (
    "Entries not stored: larger than the tier's whole budget, or (L2) a write that met a full "
    "disk even after evicting"
)


class DeltaCounter:
    """A counter fed from a monotonically increasing total in a stats snapshot: each `update`
    increments it by what the total grew since the last one. Not thread-safe: one updater."""

    __slots__ = ("counter", "seen")

    def __init__(self, counter: _DeferredMetric, seen: float = 0) -> None:
        self.counter = counter
        self.seen = seen

    @property
    def metric(self) -> Any:
        """The underlying pb_utils metric (what a scrape reads after the next flush)."""
        return self.counter.metric

    def update(self, total: float) -> None:
        if total > self.seen:
            self.counter.increment(total - self.seen)
            self.seen = total


def delta_counters(
    metrics: Metrics, name: str, description: str, label: str, values: Iterable[str], **labels: str
) -> dict[str, DeltaCounter]:
    """One DeltaCounter per value of `label` (e.g. per invalidation kind or per tier)."""
    return {
        value: DeltaCounter(metrics.counter(name, description, **{label: value}, **labels))
        for value in values
    }


def update_all(counters: Mapping[str, DeltaCounter], totals: Mapping[str, float]) -> None:
    """Each counter from its total in `totals` (absent: 0)."""
    for key, counter in counters.items():
        counter.update(totals.get(key, 0))


# ---- exporters of the core's stats (protocols: what each exporter reads) ------------------------


class StatsSource(Protocol):
    def stats(self) -> Any: ...


class TieredStores(Protocol):
    def stores(self) -> Sequence[tuple[Tier, StatsSource]]: ...


class RedisHealthSource(Protocol):
    def health(self) -> RedisHealth: ...


class ListenerSource(Protocol):
    def stats(self) -> ListenerStats: ...

    def on_received(self, callback: Callable[[Invalidation, float], None]) -> None: ...


class InvalidatorSource(Protocol):
    def stats(self) -> InvalidatorStats: ...


class LeaseSource(Protocol):
    def stats(self) -> LeaseStats: ...


class StoreMetrics:
    """Gauges of entries and bytes, and a counter of evictions, for each tier of a cache; for a
    tier that counts hits per entry (L1; L2 with values), what eviction gave up and how skewed
    its hits are."""

    def __init__(self, metrics: Metrics, cache: TieredStores) -> None:
        self._cache = cache
        self._gauges: dict[Tier, tuple[_DeferredMetric, _DeferredMetric, DeltaCounter]] = {}
        self._value: dict[Tier, tuple[DeltaCounter, DeltaCounter, DeltaCounter, _DeferredMetric]]
        self._value = {}
        self._early: dict[Tier, DeltaCounter] = {}
        for tier, store in cache.stores():
            if tier is Tier.L2:
                self._early[tier] = DeltaCounter(
                    metrics.counter(
                        "tiercache_cache_early_evictions_total",
                        "L2 evictions run on its own thread ahead of the writes (the others in "
                        "the write that reached the mark, which waited for them)",
                        tier=tier.value,
                    )
                )
            self._gauges[tier] = (
                metrics.gauge("tiercache_cache_entries", "Entries per tier", tier=tier.value),
                metrics.gauge("tiercache_cache_bytes", "Bytes per tier", tier=tier.value),
                DeltaCounter(
                    metrics.counter("tiercache_cache_evictions_total", "Evictions", tier=tier.value)
                ),
            )
            if store.stats().hit_skew is None:
                continue
            self._value[tier] = (
                DeltaCounter(
                    metrics.counter(
                        "tiercache_cache_evicted_hits_total",
                        "Hits the evicted entries had had while held (the value eviction gave "
                        "up; over evictions, the mean)",
                        tier=tier.value,
                    )
                ),
                DeltaCounter(
                    metrics.counter(
                        "tiercache_cache_rejected_total",
                        REJECTED_HELP,
                        tier=tier.value,
                    )
                ),
                DeltaCounter(
                    metrics.counter(
                        "tiercache_cache_removed_total",
                        "Entries deleted other than by eviction (invalidations, expiry)",
                        tier=tier.value,
                    )
                ),
                metrics.gauge(
                    "tiercache_cache_hit_skew_ratio",
                    "Share of the held entries' hits taken by the hottest 1 % of them (the "
                    "seeds' cache-skew-ratio; about 0.01 when hits are even)",
                    tier=tier.value,
                ),
            )
        metrics.on_flush(self.update)

    def update(self) -> None:
        for tier, store in self._cache.stores():
            entries, nbytes, evictions = self._gauges[tier]
            stats: StoreStats = store.stats()
            entries.set(stats.entries)
            nbytes.set(stats.bytes)
            evictions.update(stats.evictions)
            early = self._early.get(tier)
            if early is not None:
                early.update(stats.early_evictions)
            value = self._value.get(tier)
            if value is not None:
                evicted_hits, rejected, removed, skew = value
                evicted_hits.update(stats.evicted_hits)
                rejected.update(stats.rejected)
                removed.update(stats.removed)
                skew.set(stats.hit_skew or 0.0)


INVALIDATION_KINDS = choices(InvalidationKind)
DROPPED_ENTRIES = (
    "tiercache_invalidation_dropped_entries_total",
    "Entries invalidations deleted, once per tier (source received: this process's L1/L2 on "
    "another's message; issued: the issuer's L1/L2 and L3)",
)


def _by_kind(
    metrics: Metrics, name: str, description: str, **labels: str
) -> dict[str, DeltaCounter]:
    return delta_counters(metrics, name, description, "kind", INVALIDATION_KINDS, **labels)


class RedisMetrics:
    """The health of one process's Redis link (`tiercache.exact.redis_tier.RedisLink.health`),
    and what it refused from Redis as forged, by what it was (`what`: redis_values,
    invalidations, semantic_rows: the signers' purposes)."""

    def __init__(self, metrics: Metrics, link: RedisHealthSource) -> None:
        self._link = link
        self._up = metrics.gauge(
            "tiercache_redis_up",
            "1 while the Redis link's breaker is closed (Redis in use), else 0",
        )
        self._errors = DeltaCounter(
            metrics.counter("tiercache_redis_errors_total", "Redis calls that failed")
        )
        self._opens = DeltaCounter(
            metrics.counter(
                "tiercache_redis_breaker_opens_total", "Outages: the breaker went closed -> open"
            )
        )
        self._refused = DeltaCounter(
            metrics.counter(
                "tiercache_redis_short_circuits_total", "Calls refused while the breaker was open"
            )
        )
        self._forged = {
            purpose: DeltaCounter(
                metrics.counter(
                    "tiercache_redis_forged_total",
                    "Values read from Redis and refused because their signature did not verify "
                    "(written without the fleet's secret, or by an older release): L3 values are "
                    "misses, invalidations and semantic rows are ignored",
                    what=purpose.replace(" ", "_"),
                )
            )
            for purpose in SIGNED
        }
        metrics.on_flush(self.update)

    def update(self) -> None:
        health = self._link.health()
        self._up.set(1.0 if health.available else 0.0)
        self._errors.update(health.errors)
        self._opens.update(health.outages)
        self._refused.update(health.short_circuits)
        update_all(self._forged, health.forged)


class InvalidationMetrics:
    """What one process's invalidation listener applied, by kind, and the lag of each message
    from another process (publish -> applied here)."""

    def __init__(self, metrics: Metrics, listener: ListenerSource) -> None:
        self._listener = listener
        self._received = _by_kind(
            metrics,
            "tiercache_invalidations_received_total",
            "Invalidation messages received from other processes",
        )
        self._applied = _by_kind(
            metrics,
            "tiercache_invalidations_applied_total",
            "Invalidations that raised a watermark here (live or read back from Redis)",
        )
        self._replayed = _by_kind(
            metrics,
            "tiercache_invalidations_replayed_total",
            "Invalidations missed while disconnected, applied from Redis on a reconnect",
        )
        self._dropped = _by_kind(metrics, *DROPPED_ENTRIES, source="received")
        self._reconnects = DeltaCounter(
            metrics.counter(
                "tiercache_invalidation_reconnects_total",
                "Times the invalidation listener lost Redis and had to reconnect",
            )
        )
        self._connected = metrics.gauge(
            "tiercache_invalidation_listener_connected",
            "1 while the invalidation listener is subscribed, else 0",
        )
        self._lag_s = metrics.histogram(
            "tiercache_invalidation_lag_seconds",
            "From an invalidation's publish to its being applied here (watermark and sweep)",
            buckets=LAG_BUCKETS_S,
        )
        listener.on_received(lambda _inv, lag_s: self._lag_s.observe(lag_s))
        metrics.on_flush(self.update)

    def update(self) -> None:
        stats = self._listener.stats()
        self._connected.set(1.0 if stats.connected else 0.0)
        self._reconnects.update(stats.reconnects)
        update_all(self._received, stats.received_by_kind)
        update_all(self._applied, stats.applied_by_kind)
        update_all(self._replayed, stats.replayed_by_kind)
        update_all(self._dropped, stats.dropped_by_kind)


class InvalidatorMetrics:
    """Invalidations issued by this process (`tiercache.exact.invalidation.Invalidator`)."""

    def __init__(self, metrics: Metrics, invalidator: InvalidatorSource) -> None:
        self._invalidator = invalidator
        self._issued = _by_kind(
            metrics, "tiercache_invalidations_issued_total", "Invalidations issued here"
        )
        self._published = DeltaCounter(
            metrics.counter(
                "tiercache_invalidations_published_total",
                "Invalidations issued here and sent to every replica through Redis",
            )
        )
        self._dropped = _by_kind(metrics, *DROPPED_ENTRIES, source="issued")
        metrics.on_flush(self.update)

    def update(self) -> None:
        stats = self._invalidator.stats()
        self._published.update(stats.published)
        update_all(self._issued, stats.issued_by_kind)
        update_all(self._dropped, stats.dropped_by_kind)


class LeaseMetrics:
    """Cross-replica generation leases of the llm stage: `tiercache.exact.leases.LeaseStats`
    and the waits in the llm stage's stats (`stage_stats` returns them)."""

    def __init__(
        self, metrics: Metrics, leases: LeaseSource, stage_stats: Callable[[], Any]
    ) -> None:
        self._leases = leases
        self._stage_stats = stage_stats
        self._acquisitions = delta_counters(
            metrics,
            "tiercache_lease_acquisitions_total",
            "Lease attempts by result (held_elsewhere: another replica generates)",
            "result",
            ("acquired", "held_elsewhere", "unavailable"),
        )
        self._active = metrics.gauge("tiercache_leases_active", "Leases held by this process")
        self._lost = DeltaCounter(
            metrics.counter(
                "tiercache_lease_lost_total", "Leases found expired or taken while generating"
            )
        )
        self._waits = DeltaCounter(
            metrics.counter(
                "tiercache_lease_waits_total", "Misses that waited for another replica's answer"
            )
        )
        self._remote_hits = DeltaCounter(
            metrics.counter(
                "tiercache_lease_remote_hits_total",
                "Waits served by the answer another replica generated",
            )
        )
        self._takeovers = delta_counters(
            metrics,
            "tiercache_lease_takeovers_total",
            "Waits that generated here: lease freed without an answer, or wait_s passed",
            "reason",
            ("lease_free", "wait_timeout"),
        )
        metrics.on_flush(self.update)

    def update(self) -> None:
        leases = self._leases.stats()
        update_all(
            self._acquisitions,
            {
                "acquired": leases.acquired,
                "held_elsewhere": leases.held_elsewhere,
                "unavailable": leases.unavailable,
            },
        )
        self._active.set(leases.active)
        self._lost.update(leases.lost)
        stage = self._stage_stats()
        self._waits.update(stage.remote_waits)
        self._remote_hits.update(stage.remote_hits)
        update_all(
            self._takeovers,
            {"lease_free": stage.lease_takeovers, "wait_timeout": stage.lease_wait_timeouts},
        )
