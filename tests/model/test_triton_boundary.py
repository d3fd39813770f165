"""The Triton boundary (tiercache.triton): I/O and error mapping, BLS, metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tiercache.config import PromptCacheConfig
from tiercache.errors import (
    CapacityError,
    ConfigError,
    Forbidden,
    InvalidRequest,
    NotFound,
    TierCacheError,
    Unavailable,
)
from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.vocabulary import Tier


@pytest.fixture
def tb(pb_utils: ModuleType) -> ModuleType:
    """The three boundary modules' names in one namespace (each name is defined once)."""
    from tiercache.triton import bls, io, metrics

    merged = ModuleType("triton_boundary")
    for module in (io, bls, metrics):
        for name in dir(module):
            if not name.startswith("__"):
                setattr(merged, name, getattr(module, name))
    return merged


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidRequest("bad"), "INVALID_ARG"),
        (Forbidden("not sealed"), "INVALID_ARG"),  # Triton has no permission code
        (NotFound("no adapter"), "NOT_FOUND"),
        (Unavailable("engine down"), "UNAVAILABLE"),
        (CapacityError("full"), "UNAVAILABLE"),
        (ConfigError("bad param"), "INTERNAL"),
        (TierCacheError("oops"), "INTERNAL"),
    ],
)
def test_core_errors_map_to_codes(
    tb: ModuleType, pb_utils: ModuleType, exc: TierCacheError, code: str
) -> None:
    error = tb.to_triton_error(exc)
    assert error.code() == getattr(pb_utils.TritonError, code)
    assert error.message() == exc.client_message() == f"{exc.kind}: {exc.message}"


def test_unexpected_error_is_one_line_internal(tb: ModuleType, pb_utils: ModuleType) -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        error = tb.to_triton_error(exc)
    assert error.code() == pb_utils.TritonError.INTERNAL
    assert error.message() == "internal: RuntimeError (details in the server's log)"
    assert "boom" not in error.message()  # the text stays in the log
    assert "Traceback" not in error.message() and "\n" not in error.message()


def test_error_response(tb: ModuleType, pb_utils: ModuleType) -> None:
    response = tb.error_response(NotFound("x"))
    assert response.has_error() and response.output_tensors() == []
    assert response.error().code() == pb_utils.TritonError.NOT_FOUND


def request_with(pb_utils: ModuleType, **arrays: np.ndarray) -> Any:
    return pb_utils.InferenceRequest([pb_utils.Tensor(k, v) for k, v in arrays.items()])


def test_read_raw_inputs(tb: ModuleType, pb_utils: ModuleType) -> None:
    raw = tb.read_raw_inputs(
        request_with(
            pb_utils,
            text_input=np.array([["héllo".encode()]], dtype=np.object_),
            max_tokens=np.array([[7]], dtype=np.int32),
            stream=np.array([[True]]),
            temperature=np.array([[0.5]], dtype=np.float32),
            seed=np.array([[2**64 - 1]], dtype=np.uint64),
            stop_words=np.array([[b"a", b"b"]], dtype=np.object_),
        )
    )
    assert raw.text_input == "héllo".encode()  # raw: canonicalize bounds, then decodes it
    assert (raw.max_tokens, raw.stream, raw.temperature, raw.seed) == (7, True, 0.5, 2**64 - 1)
    assert raw.stop_words == [b"a", b"b"]
    assert (raw.top_p, raw.top_k, raw.tenant, raw.cache_control, raw.lora_name) == (None,) * 5


@pytest.mark.parametrize(
    ("reader", "array", "fragment"),
    [
        ("integer", np.array([[1.5]], dtype=np.float32), "integer"),
        ("number", np.array([[1]], dtype=np.int32), "float"),
        ("boolean", np.array([[1]], dtype=np.int8), "BOOL"),
        ("string", np.array([[1]], dtype=np.int32), "BYTES"),
        ("string", np.array([[b"a", b"b"]], dtype=np.object_), "exactly one"),
        ("string", np.array([[b"\xff"]], dtype=np.object_), "UTF-8"),
        ("integer", np.array([[1], [2]], dtype=np.int32), "batch size"),
    ],
)
def test_readers_reject_bad_tensors(
    tb: ModuleType, pb_utils: ModuleType, reader: str, array: np.ndarray, fragment: str
) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        getattr(tb.Inputs(request_with(pb_utils, x=array)), reader)("x")


def test_missing_input_reads_as_none(tb: ModuleType, pb_utils: ModuleType) -> None:
    request = request_with(pb_utils)
    for reader in ("integer", "number", "boolean", "string", "strings"):
        assert getattr(tb.Inputs(request), reader)("absent") is None


def test_raw_key_is_equal_only_for_inputs_equal_byte_for_byte(
    tb: ModuleType, pb_utils: ModuleType
) -> None:
    """`Inputs.raw_key`: the same tensors give the same key; another value, dtype, shape, an
    omitted input or inputs not named each give another; too many bytes, or a BYTES tensor
    holding more than one value or anything but bytes or text, give none."""
    text = np.array([[b"an answer"]], dtype=np.object_)
    score = np.array([[0.5]], dtype=np.float32)

    def key(max_bytes: int = 100, **inputs: np.ndarray) -> object:
        return tb.Inputs(request_with(pb_utils, **inputs)).raw_key(("t", "s"), max_bytes)

    base = key(t=text, s=score)
    assert base is not None and hash(base) == hash(key(t=text.copy(), s=score.copy()))
    assert base == key(t=text.copy(), s=score.copy(), other=score)  # only the names asked
    variants = [
        key(t=np.array([[b"another"]], dtype=np.object_), s=score),
        key(t=np.array([["an answer"]], dtype=np.object_), s=score),  # text, not bytes
        key(t=text.reshape(1), s=score),
        key(t=text, s=score.astype(np.float64)),
        key(t=text, s=np.array([[0.25]], dtype=np.float32)),
        key(t=text),
    ]
    assert all(v is not None and v != base for v in variants)
    assert len(set(variants)) == len(variants)
    assert key(max_bytes=12, t=text, s=score) is None  # 9 + 4 bytes
    assert key(max_bytes=13, t=text, s=score) is not None
    assert key(t=np.array([[1]], dtype=np.object_), s=score) is None
    assert key(t=np.array([[b"an", b"answer"]], dtype=np.object_), s=score) is None
    assert key(t=text, s=np.zeros((1, 64), dtype=np.float32)) is None  # 9 + 256 bytes


def test_key_holds_every_input_as_received(tb: ModuleType, pb_utils: ModuleType) -> None:
    """`Inputs.key`: every input the request carries, named; equal only for the same tensors
    byte for byte in the same order; none past `max_bytes` or for a BYTES tensor of several
    values or of anything but bytes or text. `key_chars` counts the values' bytes."""
    text = np.array([[b"an answer"]], dtype=np.object_)
    score = np.array([[0.5]], dtype=np.float32)

    def key(max_bytes: int = 100, **inputs: np.ndarray) -> Any:
        return tb.Inputs(request_with(pb_utils, **inputs)).key(max_bytes)

    base = key(t=text, s=score)
    assert base is not None and base == key(t=text.copy(), s=score.copy())
    assert tb.key_chars(base) == 9 + 4
    variants = [
        key(t=np.array([[b"another"]], dtype=np.object_), s=score),
        key(t=np.array([["an answer"]], dtype=np.object_), s=score),  # text, not bytes
        key(t=text.reshape(1), s=score),
        key(t=text, s=score.astype(np.float64)),
        key(t=text, s=score.view(np.int32)),  # the same bytes, another dtype
        key(t=text, s=np.array([[0.25]], dtype=np.float32)),
        key(t=text),
        key(t=text, s=score, other=score),  # one input more
        key(u=text, s=score),  # another name
        key(s=score, t=text),  # another order
    ]
    assert all(v is not None and v != base for v in variants)
    assert len(set(variants)) == len(variants)
    assert key(max_bytes=12, t=text, s=score) is None
    assert key(max_bytes=13, t=text, s=score) is not None
    assert key(t=np.array([[1]], dtype=np.object_), s=score) is None
    assert key(t=np.array([[b"an", b"answer"]], dtype=np.object_), s=score) is None
    assert key(t=text, s=np.zeros((1, 64), dtype=np.float32)) is None


def test_output_tensors_round_trip(tb: ModuleType, pb_utils: ModuleType) -> None:
    response = pb_utils.InferenceResponse(
        [tb.bytes_tensor("S", ["☃"]), tb.scalar_tensor("N", 5, np.int32, batched=False)]
    )
    assert tb.output_string(response, "S") == "☃"
    assert tb.output_int(response, "N") == 5
    assert tb.output_string(response, "absent") is None
    assert tb.output_int(response, "absent") is None


def test_a_hits_answer_and_small_counts_are_built_once_and_shared_read_only(
    tb: ModuleType,
) -> None:
    """A hit's answer (sent again on every repeat) and small token counts get one array each,
    shared and read-only; a long answer (past MEMO_MAX_CHARS) and a large count get their own."""
    from tiercache.exact.memo import MEMO_MAX_CHARS

    answer = "The answer, longer than the statuses' 32 characters: ünïcode too."
    first = tb.shared_bytes_array(answer)
    assert first.shape == (1, 1) and first[0, 0] == answer.encode("utf-8")
    assert tb.shared_bytes_array(answer) is first and not first.flags.writeable
    long_answer = "x" * (MEMO_MAX_CHARS + 1)
    own = tb.shared_bytes_array(long_answer)
    assert own[0, 0] == long_answer.encode() and own.flags.writeable
    assert tb.shared_bytes_array(long_answer) is not own
    count = tb.int32_array(31)
    assert count.dtype == np.int32 and count.tolist() == [[31]]
    assert tb.int32_array(31) is count and not count.flags.writeable
    large = tb.int32_array(1 << 20)
    assert large.tolist() == [[1 << 20]] and tb.int32_array(1 << 20) is not large
    assert tb.int32_array(-1).tolist() == [[-1]]


def test_load_config(tb: ModuleType) -> None:
    model_config = {"parameters": {"ttl_s": {"string_value": "30"}}, "name": "prompt_cache"}
    config, raw = tb.load_config(PromptCacheConfig, {"model_config": json.dumps(model_config)})
    assert config == PromptCacheConfig(ttl_s=30.0)
    assert raw == model_config


def test_metrics_families_and_labels(tb: ModuleType, pb_utils: ModuleType) -> None:
    metrics = tb.Metrics("m")
    a = metrics.counter("c_total", "c", status="a").metric
    b = metrics.counter("c_total", "c", status="b").metric
    assert a.family is b.family and a.family.kind == pb_utils.MetricFamily.COUNTER
    assert (a.labels, b.labels) == ({"model": "m", "status": "a"}, {"model": "m", "status": "b"})
    assert metrics.gauge("g", "g").metric.family.kind == pb_utils.MetricFamily.GAUGE


def test_a_gauge_is_sent_only_when_its_value_changed(tb: ModuleType) -> None:
    """Flush hooks set gauges on every flush; each send is a round trip to the server, so a
    flush sends a gauge only when its value differs from the one last sent."""
    metrics = tb.Metrics("m")
    gauge = metrics.gauge("tiercache_test_gauge", "a gauge")
    sent: list[float] = []
    real = gauge.metric.set
    gauge.metric.set = lambda value: sent.append(value) or real(value)
    for value in (3.0, 3.0, 4.0, 4.0, 3.0):
        gauge.set(value)
        metrics.flush()
    metrics.flush()
    assert sent == [3.0, 4.0, 3.0]
    assert gauge.metric.value() == 3.0


def test_histogram_is_aggregated_and_flushed_as_bucket_counters(
    tb: ModuleType, pb_utils: ModuleType
) -> None:
    metrics = tb.Metrics("m")
    h = metrics.histogram("h_seconds", "h", buckets=[0.001, 0.01, 0.1], status="a")
    for value in (0.0005, 0.001, 0.005, 0.5, float("nan")):  # 0.001 is in le="0.001"
        h.observe(value)
    families = {f.name: f for f in {m.family for m in (h.metric, *h._bucket_metrics)}}
    buckets = families["h_seconds_bucket"]
    assert buckets.kind == pb_utils.MetricFamily.COUNTER
    by_le = {m.labels["le"]: m for m in buckets.metrics}
    assert list(by_le) == ["0.001", "0.01", "0.1", "+Inf"]
    assert all(m.labels["model"] == "m" and m.labels["status"] == "a" for m in by_le.values())
    assert h.metric.value() == 0  # nothing leaves the process before a flush
    metrics.flush()
    assert {le: m.value() for le, m in by_le.items()} == {
        "0.001": 2, "0.01": 3, "0.1": 3, "+Inf": 4,
    }  # fmt: skip
    assert h.metric.value() == 4  # the NaN was dropped
    sum_metric = next(m for m in metrics._families["h_seconds_sum"].metrics)
    assert sum_metric.value() == pytest.approx(0.5065)
    h.observe(0.05)
    metrics.flush()
    metrics.flush()  # nothing new: nothing sent twice
    assert {le: m.value() for le, m in by_le.items()} == {
        "0.001": 2, "0.01": 3, "0.1": 4, "+Inf": 5,
    }  # fmt: skip
    assert h.metric.value() == 5
    with pytest.raises(ValueError, match="ascending"):
        metrics.histogram("bad_seconds", "b", buckets=[0.1, 0.01])


def test_updates_from_many_threads_are_each_counted_once_and_kept_bounded(
    tb: ModuleType,
) -> None:
    """Increments and observations are appended without a lock and summed by the flush:
    four threads' updates, flushed while they run, all arrive, none twice; with no flush the
    appended updates are summed on the request's thread past _FOLD_AT, so they stay bounded."""
    metrics = tb.Metrics("m")
    counter = metrics.counter("c_total", "c")
    histogram = metrics.histogram("h_seconds", "h", buckets=[0.5])
    done = threading.Event()

    def flushing() -> None:
        while not done.is_set():
            metrics.flush()

    def updating() -> None:
        for i in range(20_000):
            counter.increment(1)
            histogram.observe(0.25 if i % 2 else 0.75)

    flusher = threading.Thread(target=flushing)
    flusher.start()
    workers = [threading.Thread(target=updating) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done.set()
    flusher.join()
    metrics.flush()
    assert counter.metric.value() == 80_000 and histogram.metric.value() == 80_000
    bucket = next(
        m for m in metrics._families["h_seconds_bucket"].metrics if m.labels["le"] == "0.5"
    )
    assert bucket.value() == 40_000
    for _ in range(3 * tb._FOLD_AT):
        counter.increment(2)
    assert len(counter._increments) <= tb._FOLD_AT
    metrics.flush()
    assert counter.metric.value() == 80_000 + 6 * tb._FOLD_AT


def test_a_failing_flush_hook_freezes_no_metric(tb: ModuleType) -> None:
    """A hook that raised stopped the whole flush: every metric of the stage froze."""
    metrics = tb.Metrics("m")
    counter = metrics.counter("c_total", "c")
    seen: list[int] = []

    def broken() -> None:
        raise RuntimeError("a reading failed")

    metrics.on_flush(broken)
    metrics.on_flush(lambda: seen.append(1))
    counter.increment(3)
    metrics.flush()
    metrics.flush()
    assert counter.metric.value() == 3 and seen == [1, 1]


def test_store_metrics_count_eviction_deltas(tb: ModuleType) -> None:
    store = MemoryStore(3 * CacheEntry("x", 0.0).size_bytes)
    metrics = tb.Metrics("m")
    store_metrics = tb.StoreMetrics(metrics, TieredCache([(Tier.L1, store)]))
    entries, nbytes, evictions = store_metrics._gauges[next(iter(store_metrics._gauges))]
    for i in range(5):
        store.put(f"k{i}", CacheEntry("x", 0.0))
    metrics.flush()  # runs StoreMetrics.update as a flush hook, then applies the updates
    metrics.flush()  # a second refresh must not count the same evictions again
    values = (entries.metric.value(), nbytes.metric.value(), evictions.counter.metric.value())
    assert values == (3, store.stats().bytes, 2)
    assert nbytes.metric.value() == store.stats().max_bytes


def test_store_metrics_count_l2s_evictions_ahead_of_the_writes(
    tb: ModuleType, tmp_path: Path
) -> None:
    """L2 with evict_early: its evictions on its own thread are counted, once each."""
    import time

    store = LmdbStore(tmp_path / "l2", 4 << 20, evict_early=True)
    metrics = tb.Metrics("m")
    store_metrics = tb.StoreMetrics(metrics, TieredCache([(Tier.L2, store)]))
    (early,) = store_metrics._early.values()
    i = 0
    deadline = time.monotonic() + 30.0
    while store.stats().early_evictions < 2 and time.monotonic() < deadline:
        i += 1
        store.put(f"k{i:06d}", CacheEntry("x" * 400, float(i)))
        if store.stats().bytes > (4 << 20) * 0.75 * 0.96:  # in the band: let it run
            time.sleep(0.01)
    metrics.flush()
    metrics.flush()  # not counted twice
    seen = store.stats().early_evictions
    store.close()
    assert seen >= 2 and early.counter.metric.value() == seen


class _Stream:
    """A response iterator that records when it is dropped."""

    def __init__(self, name: str, dropped: list[str]) -> None:
        self.name = name
        self.dropped = dropped

    def __del__(self) -> None:
        self.dropped.append(self.name)


def test_stream_keeper_holds_streams_for_hold_s_then_drops_them(tb: ModuleType) -> None:
    now = [0.0]
    dropped: list[str] = []
    keeper = tb.StreamKeeper(30.0, clock=lambda: now[0])
    keeper.keep(_Stream("a", dropped))
    now[0] = 10.0
    keeper.keep(_Stream("b", dropped))
    now[0] = 29.9
    keeper.keep(_Stream("c", dropped))
    assert dropped == [] and len(keeper) == 3  # the caller's reference is never the last one
    now[0] = 30.0
    keeper.keep(_Stream("d", dropped))  # a's 30 s are over: dropped by this call
    assert dropped == ["a"] and len(keeper) == 3
    now[0] = 60.0
    keeper.keep(_Stream("e", dropped))
    assert sorted(dropped) == ["a", "b", "c", "d"] and len(keeper) == 1
    keeper.clear()
    assert sorted(dropped) == ["a", "b", "c", "d", "e"] and len(keeper) == 0


def test_stream_keeper_refuses_a_hold_of_zero(tb: ModuleType) -> None:
    with pytest.raises(ValueError, match="hold_s must be > 0"):
        tb.StreamKeeper(0.0)


def test_stream_keeper_read_keeps_the_stream_when_read_to_the_end_or_abandoned(
    tb: ModuleType,
) -> None:
    keeper = tb.StreamKeeper(30.0)
    whole, partial, failing = ["a", "b"], ["c", "d"], ["e"]
    assert list(keeper.read(whole)) == ["a", "b"]
    reader = keeper.read(partial)
    assert next(reader) == "c"
    reader.close()  # the consumer stopped early (an error, a cancelled request)
    with pytest.raises(RuntimeError, match="engine down"):
        for _ in keeper.read(failing):
            raise RuntimeError("engine down")
    held = [stream for _, stream in keeper._held]
    assert [id(s) for s in held] == [id(whole), id(partial), id(failing)]


# ---- a typed error crosses a BLS call as the same typed error -----------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        InvalidRequest("bad input"),
        Forbidden("the engine call is not sealed"),
        NotFound("unknown adapter 'x'"),
        Unavailable("engine down"),
        CapacityError("pool full"),
        ConfigError("bad parameter"),
        TierCacheError("broken state"),
    ],
)
def test_error_round_trip(tb: ModuleType, exc: TierCacheError) -> None:
    """Encoding then decoding gives back the same class and message, by message alone (the
    gRPC stream loses the code) and with the code."""
    error = tb.to_triton_error(exc)
    for code in (None, error.code()):
        back = tb.from_triton_error(error.message(), code)
        assert type(back) is type(exc) and back.message == exc.message


@pytest.mark.parametrize(
    ("code", "expected"),
    [("INVALID_ARG", InvalidRequest), ("NOT_FOUND", NotFound), ("INTERNAL", Unavailable)],
)
def test_foreign_errors_are_typed_by_code(
    tb: ModuleType, pb_utils: ModuleType, code: str, expected: type
) -> None:
    """Another backend's message (no kind prefix) is typed by its code; anything but the
    caller's fault is the dependency being unavailable."""
    back = tb.from_triton_error("[TensorRT-LLM][ERROR] boom", getattr(pb_utils.TritonError, code))
    assert type(back) is expected and back.message == "[TensorRT-LLM][ERROR] boom"


def _callee(exc: BaseException, pb_utils: ModuleType, tb: ModuleType) -> Any:
    """A BLS model that answers every request with `exc` as its error response."""
    return lambda request: [tb.error_response(exc)]


@pytest.mark.parametrize(
    ("raised", "expected_message"),
    [
        (InvalidRequest("prompt too long"), "prompt too long"),  # the caller's fault: verbatim
        (Forbidden("ENVELOPE is not sealed"), "ENVELOPE is not sealed"),
        (NotFound("unknown adapter 'x'"), "unknown adapter 'x'"),
        (Unavailable("out of memory"), "engine e: out of memory"),  # a dependency: labelled
        (CapacityError("slots full"), "engine e: slots full"),
        (RuntimeError("bug"), "engine e: RuntimeError (details in the server's log)"),  # internal
    ],
)
def test_bls_client_raises_the_callees_typed_error(
    tb: ModuleType,
    pb_utils: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    raised: BaseException,
    expected_message: str,
) -> None:
    monkeypatch.setitem(pb_utils.BLS_MODELS, "e", _callee(raised, pb_utils, tb))
    client = tb.BlsClient("e", label="engine e")
    expected = type(raised) if isinstance(raised, TierCacheError) else TierCacheError
    for call in (
        lambda: client.infer([], ["OUT"]),
        lambda: list(client.stream([], ["OUT"])),
    ):
        with pytest.raises(TierCacheError) as info:
            call()
        assert type(info.value) is expected
        assert info.value.message == expected_message
    # and back out to this stage's own caller: the same kind and Triton code again
    error = tb.to_triton_error(info.value)
    assert error.message() == f"{expected.kind}: {expected_message}"


def test_bls_stream_is_kept_when_read_abandoned_or_failed(
    tb: ModuleType, pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = pb_utils.InferenceResponse([tb.bytes_tensor("OUT", ["x"])])
    monkeypatch.setitem(pb_utils.BLS_MODELS, "ok", lambda request: [ok, ok])
    keeper = tb.StreamKeeper(30.0)
    client = tb.BlsClient("ok", keeper=keeper)
    assert len(list(client.stream([], ["OUT"]))) == 2
    reader = client.stream([], ["OUT"])
    next(reader)
    reader.close()  # abandoned after one response
    assert len(keeper) == 2


def test_bls_deadline_answers_unavailable_once_then_refuses_until_the_late_call_ends(
    tb: ModuleType, pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A callee that stops answering costs one call its deadline; later calls are refused at
    once (no second thread, no second wait) until the late one returns; then calls go through."""
    release = threading.Event()
    calls: list[str] = []
    ok = pb_utils.InferenceResponse([tb.bytes_tensor("OUT", ["x"])])

    def callee(request: Any) -> list[Any]:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            release.wait(30)
        return [ok]

    monkeypatch.setitem(pb_utils.BLS_MODELS, "slow", callee)
    client = tb.BlsClient("slow", label="embedder", timeout_s=0.2)
    try:
        with pytest.raises(Unavailable, match=r"embedder: no answer within 0\.2 s"):
            client.infer([], ["OUT"])
        with pytest.raises(Unavailable, match="an earlier call has had no answer"):
            client.infer([], ["OUT"])
        assert len(calls) == 1  # the refused call never reached the callee
        assert (client.deadline.timed_out, client.deadline.refused) == (1, 1)
        release.set()
        for _ in range(100):  # the late call ends on the worker
            if client.deadline._late is not None and client.deadline._late.done():
                break
            time.sleep(0.01)
        assert client.infer([], ["OUT"]) is ok
        assert len(calls) == 2 and calls[0] == calls[1] != threading.current_thread().name
    finally:
        release.set()
        client.close()


def test_bls_deadline_passes_the_callees_errors_and_needs_a_bounded_timeout(
    tb: ModuleType, pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(pb_utils.BLS_MODELS, "bad", _callee(NotFound("no such row"), pb_utils, tb))
    client = tb.BlsClient("bad", timeout_s=5.0)
    try:
        with pytest.raises(NotFound, match="no such row"):
            client.infer([], ["OUT"])
        assert client.deadline.timed_out == 0
    finally:
        client.close()
    deadline = tb.Deadline(5.0, "x")
    try:

        def own_timeout() -> None:
            raise TimeoutError("the callee's own socket timed out")

        with pytest.raises(TimeoutError, match="the callee's own"):  # not taken for a deadline
            deadline.run(own_timeout)
        assert (deadline.timed_out, deadline._late) == (0, None)
    finally:
        deadline.close()
    with pytest.raises(Unavailable, match="x: closed"):
        deadline.run(lambda: 1)
    for bad in (0.0, -1.0, 1e10, float("inf")):
        with pytest.raises(ValueError, match="timeout_s must be > 0"):
            tb.Deadline(bad, "x")


def test_bls_deadline_withdraws_a_call_queued_past_its_deadline(tb: ModuleType) -> None:
    """Two threads call at once while the callee hangs: the one that started is the late call,
    the one queued behind it is withdrawn (it never runs); later calls are refused until the
    late one ends, then run."""
    release = threading.Event()
    ran: list[str] = []

    def hang(name: str) -> str:
        ran.append(name)
        release.wait(30)
        return name

    deadline = tb.Deadline(0.3, "embedder")
    outcomes: dict[str, object] = {}

    def caller(name: str) -> None:
        try:
            outcomes[name] = deadline.run(lambda: hang(name))
        except Unavailable as exc:
            outcomes[name] = exc

    try:
        threads = [threading.Thread(target=caller, args=(n,)) for n in ("first", "second")]
        threads[0].start()
        time.sleep(0.05)  # "first" is on the worker
        threads[1].start()
        for thread in threads:
            thread.join(10)
        assert all(isinstance(o, Unavailable) for o in outcomes.values())
        assert ran == ["first"] and deadline.timed_out == 2
        with pytest.raises(Unavailable, match="an earlier call"):
            deadline.run(lambda: "third")
        release.set()
        for _ in range(200):
            if deadline._late.done():
                break
            time.sleep(0.01)
        assert deadline.run(lambda: "fourth") == "fourth"
        assert ran == ["first"]  # the withdrawn call never ran
    finally:
        release.set()
        deadline.close()


def test_a_hung_deadline_call_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    """The worker is a daemon: a process whose callee never returns still exits."""
    script = tmp_path / "hung.py"
    script.write_text(
        "import sys, threading\n"
        "from tiercache_dev import pb_utils_stub\n"
        "sys.modules['triton_python_backend_utils'] = pb_utils_stub\n"
        "from tiercache.triton.bls import Deadline\n"
        "d = Deadline(0.1, 'x')\n"
        "try:\n"
        "    d.run(threading.Event().wait)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.strip() == "Unavailable"


class _HeldStream:
    """A decoupled stream's responses: `first` of them at once, the rest once `release` is set
    (the stand-in's `exec` iterates whatever the handler returns)."""

    def __init__(self, responses: list[Any], first: int) -> None:
        self.responses = responses
        self.first = first
        self.release = threading.Event()
        self.read = 0

    def __iter__(self) -> Any:
        for i, response in enumerate(self.responses):
            if i == self.first:
                assert self.release.wait(30), "never released"
            self.read += 1
            yield response


def test_bls_stream_deadline_fails_a_stalled_stream_and_refuses_while_too_many_are_out(
    tb: ModuleType, pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream whose next response does not come within stream_idle_s fails as unavailable
    (after the responses that came, in order); while max_stalled such streams are still being
    read, new calls are refused before reaching the callee; once one ends, calls go through,
    and every stream reaches the keeper when its reader is done with it."""
    ok = [pb_utils.InferenceResponse([tb.bytes_tensor("OUT", [str(i)])]) for i in range(3)]
    streams: list[_HeldStream] = []

    def callee(request: Any) -> Any:
        streams.append(_HeldStream(ok, first=1))
        return streams[-1]

    monkeypatch.setitem(pb_utils.BLS_MODELS, "engine", callee)
    keeper = tb.StreamKeeper(30.0)
    client = tb.BlsClient("engine", label="engine e", keeper=keeper, stream_idle_s=0.2)
    watch = client.stream_deadline
    watch.max_stalled = 2
    try:
        for n in range(2):
            got = []
            started = time.monotonic()
            with pytest.raises(Unavailable, match=r"engine e: no response within 0\.2 s"):
                for response in client.stream([], ["OUT"]):
                    got.append(tb.output_string(response, "OUT"))
            assert got == ["0"]  # the one that came, then the failure
            assert 0.15 < time.monotonic() - started < 5
            assert watch.stalled() == n + 1
        with pytest.raises(Unavailable, match="2 earlier calls have had no response"):
            list(client.stream([], ["OUT"]))
        assert len(streams) == 2 and (watch.timed_out, watch.refused) == (2, 1)
        assert len(keeper) == 0  # still being read
        streams[0].release.set()  # the first stalled stream ends; its reader drops the rest
        for _ in range(200):
            if watch.stalled() == 1:
                break
            time.sleep(0.01)
        assert watch.stalled() == 1 and len(keeper) == 1
        assert streams[0].read == 3  # read to its end once released, the rest dropped
        streams.clear()
        monkeypatch.setitem(pb_utils.BLS_MODELS, "engine", lambda request: ok)
        out = [tb.output_string(r, "OUT") for r in client.stream([], ["OUT"])]
        assert out == ["0", "1", "2"] and len(keeper) == 2
    finally:
        for stream in streams:
            stream.release.set()


def test_bls_stream_deadline_bounds_a_call_whose_first_response_never_comes(
    tb: ModuleType, pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """python_backend's `exec(decoupled=True)` returns only with the callee's first response
    (the stand-in does too): an engine that never sends one fails the call after idle_s, and
    the stream's reader, which opened it, keeps it once the callee answers."""
    ok = [pb_utils.InferenceResponse([tb.bytes_tensor("OUT", ["x"])])]
    held = _HeldStream(ok, first=0)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "engine", lambda request: held)
    keeper = tb.StreamKeeper(30.0)
    client = tb.BlsClient("engine", label="engine e", keeper=keeper, stream_idle_s=0.2)
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable, match=r"engine e: no response within 0\.2 s"):
            next(client.stream([], ["OUT"]))
        assert 0.15 < time.monotonic() - started < 5
        assert client.stream_deadline.stalled() == 1 and len(keeper) == 0
        held.release.set()
        for _ in range(200):
            if client.stream_deadline.stalled() == 0:
                break
            time.sleep(0.01)
        assert client.stream_deadline.stalled() == 0 and len(keeper) == 1
    finally:
        held.release.set()


class _CancellableStream(_HeldStream):
    """A held stream with python_backend's cancel() (the stand-in's exec hides a handler's)."""

    def __init__(self, responses: list[Any], first: int) -> None:
        super().__init__(responses, first)
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


@pytest.mark.parametrize("opened", [True, False], ids=["stream-open", "first-response-late"])
def test_a_stream_past_its_deadline_is_cancelled_once_and_read_to_its_end(
    tb: ModuleType,
    pb_utils: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    opened: bool,
) -> None:
    """With cancel_on_close, a stream the deadline gives up on is cancelled once: at once when
    it is open, else as it opens (python_backend's exec returns with the first response); its
    reader then reads it to its end (python_backend lets go of a stream only then), drops what
    it reads, and keeps it."""
    ok = [pb_utils.InferenceResponse([tb.bytes_tensor("OUT", [str(i)])]) for i in range(3)]
    held = _CancellableStream(ok, first=1)
    open_now = threading.Event()
    if opened:
        open_now.set()

    def exec_(self: Any, decoupled: bool = False) -> Any:
        assert open_now.wait(30), "never opened"
        return held

    monkeypatch.setattr(pb_utils.InferenceRequest, "exec", exec_)
    keeper = tb.StreamKeeper(30.0)
    client = tb.BlsClient("engine", label="engine e", keeper=keeper, stream_idle_s=0.2)
    try:
        got = []
        with pytest.raises(Unavailable, match="no response within"):
            for response in client.stream([], ["OUT"], cancel_on_close=True):
                got.append(tb.output_string(response, "OUT"))
        assert got == (["0"] if opened else [])
        assert held.cancelled == (1 if opened else 0)
        open_now.set()
        held.release.set()
        for _ in range(200):
            if len(keeper) == 1:
                break
            time.sleep(0.01)
        assert held.cancelled == 1 and held.read == 3 and len(keeper) == 1
        assert client.stream_deadline.stalled() == 0
    finally:
        open_now.set()
        held.release.set()


def test_bls_stream_deadline_passes_errors_and_an_abandoned_stream_is_kept(
    tb: ModuleType, pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a stream deadline the callee's error response is raised typed, an exception of
    the stream itself reaches the caller, and a stream the caller stops reading is dropped by
    its reader and kept."""
    monkeypatch.setitem(
        pb_utils.BLS_MODELS, "bad", _callee(NotFound("no such adapter"), pb_utils, tb)
    )
    keeper = tb.StreamKeeper(30.0)
    client = tb.BlsClient("bad", keeper=keeper, stream_idle_s=5.0)
    with pytest.raises(NotFound, match="no such adapter"):
        list(client.stream([], ["OUT"]))

    def broken(request: Any) -> Any:
        yield pb_utils.InferenceResponse([tb.bytes_tensor("OUT", ["x"])])
        raise RuntimeError("the stub lost the stream")

    monkeypatch.setitem(pb_utils.BLS_MODELS, "bad", broken)
    with pytest.raises(RuntimeError, match="lost the stream"):
        list(client.stream([], ["OUT"]))
    ok = pb_utils.InferenceResponse([tb.bytes_tensor("OUT", ["x"])])
    held = _HeldStream([ok] * 5, first=1)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "bad", lambda request: held)
    reader = client.stream([], ["OUT"])
    next(reader)
    reader.close()  # left after one response; the rest comes after
    held.release.set()
    for _ in range(200):
        if len(keeper) == 3:
            break
        time.sleep(0.01)
    assert len(keeper) == 3 and client.stream_deadline.stalled() == 0
    assert held.read == 5  # read to its end, dropped
    for bad in (0.0, -1.0, 1e10, float("inf")):
        with pytest.raises(ValueError, match="idle_s must be > 0"):
            tb.StreamDeadline(bad, "x")


def test_delta_counter_counts_growth_once(tb: ModuleType) -> None:
    metrics = tb.Metrics("m")
    counter = tb.DeltaCounter(metrics.counter("c_total", "c"))
    for total in (0, 3, 3, 2, 7):  # a total that shrank (a restart of its source) adds nothing
        counter.update(total)
    metrics.flush()
    assert counter.counter.metric.value() == 3 + 4


def test_unexpected_errors_are_logged_once_a_minute(
    tb: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug a caller can reach was one traceback per request."""
    with caplog.at_level("ERROR", logger="tiercache"):
        for _ in range(50):
            try:
                raise RuntimeError("boom")
            except RuntimeError as exc:
                tb.to_triton_error(exc)
    assert len([r for r in caplog.records if "unexpected error" in r.getMessage()]) <= 1
