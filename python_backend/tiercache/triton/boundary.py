"""Triton boundary: reading inputs, building outputs, stage parameters, errors and metrics.

Every model.py imports this module instead of repeating helpers (house style 2). Only this module
imports `triton_python_backend_utils`; the core stays importable without Triton.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import parse_config
from tiercache.errors import (
    CapacityError,
    InvalidRequest,
    NotFound,
    TierCacheError,
    Unavailable,
)
from tiercache.request import RawInputs

log = logging.getLogger("tiercache")

# A stage process that crashes (SIGSEGV, or SIGABRT from a corrupted heap) prints every thread's
# Python stack to stderr, which is tritonserver's log; Triton itself only reports the stub as
# "not healthy" afterwards (docs/faults.md). Imported only by model.py files, i.e. in stubs.
if not faulthandler.is_enabled():
    faulthandler.enable(all_threads=True)
T = TypeVar("T")

# Histogram buckets, in seconds.
LATENCY_BUCKETS_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0]
# Engine time: a CPU generation under load takes longer than 5 s (past the last bucket, a
# quantile only reads "over 5 s").
GENERATION_BUCKETS_S = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]


def load_config(cls: type[T], args: dict[str, str]) -> tuple[T, dict[str, Any]]:
    """Parse `args["model_config"]`'s parameters into `cls`; returns it and the raw model config."""
    model_config = json.loads(args["model_config"])
    raw = model_config.get("parameters", {}) or {}
    values = {key: str(value.get("string_value", "")) for key, value in raw.items()}
    return parse_config(cls, values), model_config


def to_triton_error(exc: BaseException) -> pb_utils.TritonError:
    """The single mapping from the core's errors to Triton codes; unexpected errors are logged
    with their traceback and reach the client as a one-line INTERNAL message."""
    if isinstance(exc, InvalidRequest):
        code = pb_utils.TritonError.INVALID_ARG
    elif isinstance(exc, NotFound):
        code = pb_utils.TritonError.NOT_FOUND
    elif isinstance(exc, (Unavailable, CapacityError)):
        code = pb_utils.TritonError.UNAVAILABLE
    elif isinstance(exc, TierCacheError):
        code = pb_utils.TritonError.INTERNAL
    else:
        log.exception("unexpected error", exc_info=exc)
        return pb_utils.TritonError(
            f"internal: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL
        )
    return pb_utils.TritonError(exc.client_message(), code)


def error_response(exc: BaseException) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=[], error=to_triton_error(exc))


# ---- inputs -----------------------------------------------------------------------------------


class Inputs:
    """One request's input tensors, looked up by name.

    Built once per request: `pb_utils.get_input_tensor_by_name` rebuilds the list of the
    request's tensors on every call, which on the 11-input hit path cost more than the lookup.
    Every reader returns None for an omitted input and raises InvalidRequest naming the input
    for a wrong batch size, shape, dtype or encoding.
    """

    __slots__ = ("_tensors",)

    def __init__(self, request: Any) -> None:
        self._tensors = {tensor.name(): tensor for tensor in request.inputs()}

    def _array(self, name: str) -> np.ndarray | None:
        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        array = tensor.as_numpy()
        if array.ndim >= 2 and array.shape[0] != 1:
            raise InvalidRequest(f"{name}: batch size must be 1, got shape {list(array.shape)}")
        return array

    def batch_strings(self, name: str) -> list[str] | None:
        """All texts of a BYTES input whose batch dimension may exceed 1 (one per row)."""
        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        return [_decode(name, value) for value in tensor.as_numpy().reshape(-1)]

    def vector(self, name: str) -> np.ndarray | None:
        """A numeric tensor as it came (e.g. an embedding), batch dimension included."""
        return self._array(name)

    def string(self, name: str) -> str | None:
        array = self._array(name)
        return None if array is None else _decode(name, _one(name, array))

    def blob(self, name: str) -> bytes | None:
        """One BYTES value as raw bytes (binary payloads such as adapter weights)."""
        array = self._array(name)
        if array is None:
            return None
        value = _one(name, array)
        if isinstance(value, str):
            return value.encode("utf-8")
        if not isinstance(value, (bytes, np.bytes_)):
            raise InvalidRequest(f"{name} must be BYTES, got {type(value).__name__}")
        return bytes(value)

    def strings(self, name: str) -> list[str] | None:
        array = self._array(name)
        if array is None:
            return None
        return [_decode(name, value) for value in array.reshape(-1)]

    def integer(self, name: str) -> int | None:
        array = self._array(name)
        if array is None:
            return None
        if array.dtype.kind not in "iu":
            raise InvalidRequest(f"{name} must be an integer tensor, got {array.dtype}")
        return int(_one(name, array))

    def number(self, name: str) -> float | None:
        array = self._array(name)
        if array is None:
            return None
        if array.dtype.kind != "f":
            raise InvalidRequest(f"{name} must be a float tensor, got {array.dtype}")
        return float(_one(name, array))

    def boolean(self, name: str) -> bool | None:
        array = self._array(name)
        if array is None:
            return None
        if array.dtype.kind != "b":
            raise InvalidRequest(f"{name} must be a BOOL tensor, got {array.dtype}")
        return bool(_one(name, array))


def _one(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _decode(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise InvalidRequest(f"{name} must be BYTES (UTF-8 text), got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid UTF-8 (byte {exc.start})") from exc


def read_raw_inputs(request: Any) -> RawInputs:
    """The public ensemble inputs of one request (TensorRT-LLM's names plus ours)."""
    inputs = Inputs(request)
    return RawInputs(
        text_input=inputs.string("text_input"),
        max_tokens=inputs.integer("max_tokens"),
        stream=inputs.boolean("stream"),
        temperature=inputs.number("temperature"),
        top_p=inputs.number("top_p"),
        top_k=inputs.integer("top_k"),
        seed=inputs.integer("seed"),
        stop_words=inputs.strings("stop_words"),
        tenant=inputs.string("tenant"),
        cache_control=inputs.string("cache_control"),
        lora_name=inputs.string("lora_name"),
    )


# ---- outputs ----------------------------------------------------------------------------------


def bytes_tensor(name: str, values: Sequence[str | bytes], batched: bool = True) -> Any:
    encoded = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    array = np.array(encoded, dtype=np.object_)
    return pb_utils.Tensor(name, array.reshape(1, -1) if batched else array)


def scalar_tensor(name: str, value: Any, dtype: Any, batched: bool = True) -> Any:
    array = np.array([value], dtype=dtype)
    return pb_utils.Tensor(name, array.reshape(1, 1) if batched else array)


def output_string(response: Any, name: str) -> str | None:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    if tensor is None:
        return None
    return _decode(name, tensor.as_numpy().reshape(-1)[0])


def output_blob(response: Any, name: str) -> bytes | None:
    """One BYTES output as raw bytes."""
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    if tensor is None:
        return None
    return bytes(tensor.as_numpy().reshape(-1)[0])


def output_int(response: Any, name: str) -> int | None:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return None if tensor is None else int(tensor.as_numpy().reshape(-1)[0])


# ---- metrics ----------------------------------------------------------------------------------


class StreamKeeper:
    """Holds the response iterators of finished decoupled BLS streams for `hold_s` seconds.

    Triton 2.51's Python stub (python_backend r24.10, and its head as of 2026) erases a finished
    stream from its iterator map on its stub-to-parent thread, without the GIL. When the model
    has already dropped its own reference, that erase destroys the iterator there, with its
    responses' numpy arrays: Python objects freed without the GIL corrupt the interpreter's heap
    and the stub segfaults later (docs/faults.md; `scripts/repro_bls_streams.py`). Handing each
    stream's iterator to `keep()` once it is read (or abandoned) makes the model's reference the
    last one; it is dropped here, by a later `keep()` or `clear()`, holding the GIL.
    """

    def __init__(self, hold_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if hold_s <= 0:
            raise ValueError(f"hold_s must be > 0, got {hold_s}")
        self.hold_s = hold_s
        self._clock = clock
        self._held: deque[tuple[float, object]] = deque()
        self._lock = threading.Lock()

    def keep(self, stream: object) -> None:
        """Hold `stream` for hold_s; drop those held longer (outside the lock: dropping an
        unfinished iterator waits for its remaining responses)."""
        now = self._clock()
        expired = []
        with self._lock:
            self._held.append((now + self.hold_s, stream))
            while self._held and self._held[0][0] <= now:
                expired.append(self._held.popleft())
        expired.clear()

    def read(self, stream: Iterable[Any]) -> Iterator[Any]:
        """Iterate `stream` (a `request.exec(decoupled=True)` result), then keep it: also when
        the reader stops early, raises, or the generator reading it is closed."""
        try:
            yield from stream
        finally:
            self.keep(stream)

    def clear(self) -> None:
        """Drop every held stream (in finalize)."""
        with self._lock:
            held, self._held = self._held, deque()
        held.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class _DeferredMetric:
    """A Triton metric whose updates are recorded locally and applied by the flusher thread.

    Each pb_utils metric call is a round trip from the stub process to the server; three of them
    on the hit path cost more than the whole cache lookup, so requests only touch local numbers.
    """

    __slots__ = ("_metric", "_lock", "_delta", "_value", "_observations")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._lock = threading.Lock()
        self._delta = 0.0
        self._value: float | None = None
        self._observations: list[float] = []

    @property
    def metric(self) -> Any:
        """The underlying pb_utils metric (what a scrape reads after the next flush)."""
        return self._metric

    def increment(self, amount: float) -> None:
        with self._lock:
            self._delta += amount

    def set(self, value: float) -> None:
        with self._lock:
            self._value = value

    def observe(self, value: float) -> None:
        with self._lock:
            self._observations.append(value)

    def flush(self) -> None:
        with self._lock:
            delta, value, observations = self._delta, self._value, self._observations
            self._delta, self._value, self._observations = 0.0, None, []
        if delta:
            self._metric.increment(delta)
        if value is not None:
            self._metric.set(value)
        for observation in observations:
            self._metric.observe(observation)


class Metrics:
    """Metric families created once per model (in initialize), one label set per model, and a
    flusher thread (started by `start`, joined by `close` in finalize) that applies the deferred
    updates every `flush_interval_s`, so a scrape sees them at most that much later."""

    def __init__(
        self, model_name: str, flush_interval_s: float = 0.25, instance: str | None = None
    ) -> None:
        """`instance` adds an `instance` label (for models that run several instances)."""
        self.labels = {"model": model_name}
        if instance is not None:
            self.labels["instance"] = instance
        self._families: dict[str, Any] = {}
        self._metrics: list[_DeferredMetric] = []
        self._hooks: list[Callable[[], None]] = []
        self._interval_s = flush_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def counter(self, name: str, description: str, **labels: str) -> _DeferredMetric:
        return self._metric(name, description, pb_utils.MetricFamily.COUNTER, labels)

    def gauge(self, name: str, description: str, **labels: str) -> _DeferredMetric:
        return self._metric(name, description, pb_utils.MetricFamily.GAUGE, labels)

    def histogram(
        self, name: str, description: str, buckets: list[float] = LATENCY_BUCKETS_S, **labels: str
    ) -> _DeferredMetric:
        family = self._family(name, description, pb_utils.MetricFamily.HISTOGRAM)
        return self._track(family.Metric(labels={**self.labels, **labels}, buckets=buckets))

    def on_flush(self, hook: Callable[[], None]) -> None:
        """Run `hook` on the flusher thread before each flush (e.g. to refresh gauges)."""
        self._hooks.append(hook)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        for hook in self._hooks:
            hook()
        for metric in self._metrics:
            metric.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush()

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


class StoreMetrics:
    """Gauges of entries and bytes, and a counter of evictions, for each tier of a cache;
    refreshed on the metrics flusher thread."""

    def __init__(self, metrics: Metrics, cache: Any) -> None:
        self._cache = cache
        self._gauges = {}
        for tier, _ in cache.stores():
            self._gauges[tier] = (
                metrics.gauge("tiercache_cache_entries", "Entries per tier", tier=tier.value),
                metrics.gauge("tiercache_cache_bytes", "Bytes per tier", tier=tier.value),
                metrics.counter("tiercache_cache_evictions_total", "Evictions", tier=tier.value),
            )
        self._evictions_seen = {tier: 0 for tier in self._gauges}
        metrics.on_flush(self.update)

    def update(self) -> None:
        for tier, store in self._cache.stores():
            entries, nbytes, evictions = self._gauges[tier]
            stats = store.stats()
            entries.set(stats.entries)
            nbytes.set(stats.bytes)
            if stats.evictions > self._evictions_seen[tier]:
                evictions.increment(stats.evictions - self._evictions_seen[tier])
                self._evictions_seen[tier] = stats.evictions


# Invalidation lag buckets, in seconds: a message crosses Redis pub/sub in about a millisecond; a
# tag, tenant or adapter sweep of a large L2 takes longer (docs/replicas.md).
LAG_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0]
INVALIDATION_KINDS = ("key", "tag", "tenant", "adapter")  # tiercache.invalidation.InvalidationKind


class _Growth:
    """A counter fed from a monotonically increasing total in a stats snapshot: each update
    increments it by what the total grew since the last one."""

    __slots__ = ("counter", "seen")

    def __init__(self, counter: _DeferredMetric) -> None:
        self.counter = counter
        self.seen = 0

    def update(self, total: int) -> None:
        if total > self.seen:
            self.counter.increment(total - self.seen)
            self.seen = total


def _by_kind(metrics: Metrics, name: str, description: str, **labels: str) -> dict[str, _Growth]:
    return {
        kind: _Growth(metrics.counter(name, description, kind=kind, **labels))
        for kind in INVALIDATION_KINDS
    }


DROPPED_ENTRIES = (
    "tiercache_invalidation_dropped_entries_total",
    "Entries invalidations deleted, once per tier (source received: this process's L1/L2 on "
    "another's message; issued: the issuer's L1/L2 and L3)",
)


class RedisMetrics:
    """The health of one process's Redis link (`tiercache.redis_tier.RedisLink.health`):
    refreshed on the metrics flusher thread."""

    def __init__(self, metrics: Metrics, link: Any) -> None:
        self._link = link
        self._up = metrics.gauge(
            "tiercache_redis_up",
            "1 while the Redis link's breaker is closed (Redis in use), else 0",
        )
        self._errors = _Growth(
            metrics.counter("tiercache_redis_errors_total", "Redis calls that failed")
        )
        self._opens = _Growth(
            metrics.counter(
                "tiercache_redis_breaker_opens_total", "Outages: the breaker went closed -> open"
            )
        )
        self._refused = _Growth(
            metrics.counter(
                "tiercache_redis_short_circuits_total", "Calls refused while the breaker was open"
            )
        )
        metrics.on_flush(self.update)

    def update(self) -> None:
        health = self._link.health()
        self._up.set(1.0 if health.available else 0.0)
        self._errors.update(health.errors)
        self._opens.update(health.outages)
        self._refused.update(health.short_circuits)


class InvalidationMetrics:
    """What one process's `InvalidationListener` applied, by kind, and the lag of each message
    from another process (publish -> applied here)."""

    def __init__(self, metrics: Metrics, listener: Any) -> None:
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
        self._reconnects = _Growth(
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
        for counters, totals in (
            (self._received, stats.received_by_kind),
            (self._applied, stats.applied_by_kind),
            (self._replayed, stats.replayed_by_kind),
            (self._dropped, stats.dropped_by_kind),
        ):
            for kind, counter in counters.items():
                counter.update(totals.get(kind, 0))


class InvalidatorMetrics:
    """Invalidations issued by this process (`tiercache.invalidation.Invalidator.stats`)."""

    def __init__(self, metrics: Metrics, invalidator: Any) -> None:
        self._invalidator = invalidator
        self._issued = _by_kind(
            metrics, "tiercache_invalidations_issued_total", "Invalidations issued here"
        )
        self._published = _Growth(
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
        for kind, counter in self._issued.items():
            counter.update(stats.issued_by_kind.get(kind, 0))
        for kind, counter in self._dropped.items():
            counter.update(stats.dropped_by_kind.get(kind, 0))


class LeaseMetrics:
    """Cross-replica generation leases of the llm stage: `tiercache.leases.LeaseStats` and the
    waits in `tiercache.llm_stage.LlmStats` (`stage_stats` returns the latter)."""

    def __init__(self, metrics: Metrics, leases: Any, stage_stats: Callable[[], Any]) -> None:
        self._leases = leases
        self._stage_stats = stage_stats
        name = "tiercache_lease_acquisitions_total"
        description = "Lease attempts by result (held_elsewhere: another replica generates)"
        self._acquisitions = {
            result: _Growth(metrics.counter(name, description, result=result))
            for result in ("acquired", "held_elsewhere", "unavailable")
        }
        self._active = metrics.gauge("tiercache_leases_active", "Leases held by this process")
        self._lost = _Growth(
            metrics.counter(
                "tiercache_lease_lost_total", "Leases found expired or taken while generating"
            )
        )
        self._waits = _Growth(
            metrics.counter(
                "tiercache_lease_waits_total", "Misses that waited for another replica's answer"
            )
        )
        self._remote_hits = _Growth(
            metrics.counter(
                "tiercache_lease_remote_hits_total",
                "Waits served by the answer another replica generated",
            )
        )
        name = "tiercache_lease_takeovers_total"
        description = "Waits that generated here: lease freed without an answer, or wait_s passed"
        self._takeovers = {
            reason: _Growth(metrics.counter(name, description, reason=reason))
            for reason in ("lease_free", "wait_timeout")
        }
        metrics.on_flush(self.update)

    def update(self) -> None:
        leases = self._leases.stats()
        self._acquisitions["acquired"].update(leases.acquired)
        self._acquisitions["held_elsewhere"].update(leases.held_elsewhere)
        self._acquisitions["unavailable"].update(leases.unavailable)
        self._active.set(leases.active)
        self._lost.update(leases.lost)
        stage = self._stage_stats()
        self._waits.update(stage.remote_waits)
        self._remote_hits.update(stage.remote_hits)
        self._takeovers["lease_free"].update(stage.lease_takeovers)
        self._takeovers["wait_timeout"].update(stage.lease_wait_timeouts)


def export_redis(metrics: Metrics, cache: Any) -> bool:
    """Redis and invalidation-listener metrics for a `TieredCache` with L3 on Redis; False (and
    nothing exported) without L3."""
    from tiercache.prompt_cache import invalidation_listener, redis_link

    link = redis_link(cache)
    if link is None:
        return False
    RedisMetrics(metrics, link)
    listener = invalidation_listener(cache)
    if listener is not None:
        InvalidationMetrics(metrics, listener)
    return True
