"""The `torch_llm` engine model (decoupled): the PyTorch engine with its LoRA adapters and paged
prefix KV pool. One worker thread runs one request at a time, in arrival order (adapter
evictions, a load, then the op); `submit` only enqueues."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from tiercache.budgets import Budget, BudgetThread, LatencyObjective
from tiercache.config import EngineConfig, name_list
from tiercache.engine.adapter_call import is_not_in_engine
from tiercache.engine.adapters import (
    EVICT,
    GENERATE,
    LIST,
    LOAD,
    AdapterOrder,
    AdapterStats,
    adapter_slots_budget,
)
from tiercache.engine.events import StreamEvent
from tiercache.engine.kv_cache import KvStats, kv_pool_budget
from tiercache.engine.model_source import resolve_model
from tiercache.engine.policy import RefusalPolicy
from tiercache.engine.threads import ThreadRole, pass_thread_count, set_torch_threads, usable_cpus
from tiercache.engine.torch_engine import TorchEngine
from tiercache.errors import ConfigError, InvalidRequest, TierCacheError, Unavailable
from tiercache.exact.request import GenerationRequest
from tiercache.log_throttle import LogThrottle
from tiercache.machine import GpuMemoryProbe, GpuReading, nvml_card
from tiercache.memory import MemoryTrimmer
from tiercache.stages.common import DraftMetrics
from tiercache.stages.envelope import Envelope, Freshness
from tiercache.stages.memory_budgets import start_budgets
from tiercache.stages.parts import open_adapters, open_freshness, open_sealer
from tiercache.stages.seal import ENGINE_INPUTS, ENGINE_LABEL, Sealer, check_tensors
from tiercache.threads import NamedThread
from tiercache.triton import io
from tiercache.triton import metrics as tm

log = logging.getLogger(__name__)
STALL_CAUSES = ("adapter_load", "adapter_switch", "kv_evict")

# What the final response of each admin op says in FINISH_REASON.
OP_FINISH = {LOAD: "loaded", LIST: "listed", EVICT: "evicted"}
# adapter_missing: refused before any output because the engine does not hold the request's
# adapter; the caller sends the weights and asks again (tiercache.engine.adapter_call), so it is
# the adapter protocol's expected turn, not an error.
FINISH_REASONS = ("stop", "length", "cancelled", "content_filter", "error", "adapter_missing")
_STOP = object()
# Requests waiting for the one worker at most: each holds its inputs (an adapter's files among
# them) until it runs, and llm sends one per generation it runs (a few at a time).
MAX_QUEUED = 256


class EngineSink(Protocol):
    """One request's response channel (model.py encodes the tensors)."""

    def is_cancelled(self) -> bool: ...

    def send_chunk(self, text: str) -> None: ...

    def send_final(
        self,
        text: str,
        finish_reason: str,
        generated: int,
        prompt: int,
        reused: int,
        computed: int,
        speculated: int = 0,
        mean_logprob: float | None = None,
        engine_s: float | None = None,
    ) -> None: ...

    def send_error(self, exc: BaseException) -> None: ...


EngineCall = tuple[AdapterOrder, GenerationRequest | None]
"""One request's adapter order and generation, decoded (its seals checked) in execute."""


class TorchLlmStage:
    def __init__(
        self,
        engine: TorchEngine,
        refusal: RefusalPolicy,
        trimmer: MemoryTrimmer,
        metrics: tm.Metrics,
        sealer: Sealer,
        freshness: Freshness | None = None,
    ) -> None:
        self.engine = engine
        self.sealer = sealer
        # the engine calls' envelopes are llm's, made as each call goes out: their age alone
        self.freshness = freshness if freshness is not None else Freshness()
        self.refusal = refusal
        self.trimmer = trimmer
        self.budgets: BudgetThread | None = None  # the KV pool following the host's memory
        # the KV pool's budget and the slots dropped for theirs, as the last request left them
        self._kv_budget_seen = engine.kv_pool.max_bytes
        self._slot_drops_seen = 0
        self.objective: LatencyObjective | None = None  # ttft_objective_s, if set
        self._refusals_log = LogThrottle()  # refused requests a caller can repeat at will
        self._failures_log = LogThrottle()
        self.metrics = m = metrics
        self.tokens = m.counter("tiercache_engine_generated_tokens_total", "Tokens generated")
        self.prompt_tokens = m.counter("tiercache_engine_prompt_tokens_total", "Prompt tokens run")
        self.finished = {
            r: m.counter(
                "tiercache_engine_finished_total", "Generations by finish reason", reason=r
            )
            for r in FINISH_REASONS
        }
        self.queue_depth = m.gauge(
            "tiercache_engine_queue_depth", "Requests waiting for the engine"
        )
        self.adapter_loads = tm.DeltaCounter(
            m.counter(
                "tiercache_engine_adapter_loads_total", "LoRA adapters loaded into the engine"
            )
        )
        self.adapter_evictions = tm.DeltaCounter(
            m.counter(
                "tiercache_engine_adapter_evictions_total",
                "LoRA adapters dropped from the engine (asked for, or to make room)",
            )
        )
        self.adapter_load_s = m.histogram(
            "tiercache_engine_adapter_load_seconds", "Time to load one adapter into the engine"
        )
        self.adapter_swap_s = m.histogram(
            "tiercache_engine_adapter_swap_seconds",
            "Time to switch the active adapter (when a request needs another one)",
        )
        self.stall_s = m.histogram(
            "tiercache_gen_stall_seconds",
            "Time a request waited for memory before its engine work: an adapter load or "
            "switch, and evicting KV blocks to make room for it (the seeds' gen-stall-duration)",
        )
        self.stall_causes = {
            cause: m.counter(
                "tiercache_gen_stall_cause_seconds_total",
                "gen-stall-duration by cause",
                cause=cause,
            )
            for cause in STALL_CAUSES
        }
        self.adapters_resident = m.gauge(
            "tiercache_engine_adapters_resident", "LoRA adapters loaded in the engine"
        )
        self.adapter_slot_bytes = m.gauge(
            "tiercache_engine_adapter_slot_bytes",
            "Bytes of the adapter slots injected in the model, held or free (lora_max_bytes)",
        )
        self.kv_reused = m.counter(
            "tiercache_engine_kv_reused_tokens_total", "Prompt tokens served from the KV pool"
        )
        self.kv_computed = m.counter(
            "tiercache_engine_kv_computed_tokens_total", "Prompt tokens the engine computed"
        )
        self.drafts = DraftMetrics(m)
        self.kv_pool_bytes = m.gauge(
            "tiercache_engine_kv_pool_bytes", "Bytes of KV blocks held in the prefix pool"
        )
        self.kv_evictions = tm.DeltaCounter(
            m.counter(
                "tiercache_engine_kv_evictions_total", "KV blocks evicted from the prefix pool"
            )
        )
        self.kv_evicted_reuses = tm.DeltaCounter(
            m.counter(
                "tiercache_engine_kv_evicted_reuses_total",
                "Reuses the evicted KV blocks had had while held (the value eviction gave up; "
                "over evictions: the mean)",
            )
        )
        self.kv_rejected = tm.DeltaCounter(
            m.counter(
                "tiercache_engine_kv_rejected_blocks_total",
                "KV blocks not kept: no room even after evicting every unpinned block",
            )
        )
        self.kv_hit_skew = m.gauge(
            "tiercache_engine_kv_hit_skew_ratio",
            "Share of the held KV blocks' reuses taken by their hottest 1 % (cache-skew-ratio)",
        )
        self.kv_lookups = tm.delta_counters(
            m,
            "tiercache_engine_kv_lookups_total",
            "Prefix KV lookups (hit: at least one prompt token reused)",
            "result",
            ("hit", "miss"),
        )
        self.memory_trims = tm.DeltaCounter(
            m.counter(
                "tiercache_engine_memory_trims_total", "Returns of freed heap memory to the system"
            )
        )
        self.memory_trim_s = tm.DeltaCounter(
            m.counter(
                "tiercache_engine_memory_trim_seconds_total", "Time spent returning freed memory"
            )
        )
        self._seed_counters()
        self._queue: queue.Queue = queue.Queue()
        # adapter files held by waiting requests (queue_max_adapter_bytes); the worker frees
        # a request's share as it takes it
        self.max_queued_adapter_bytes = 0
        self._queued_adapter_bytes = 0
        self._queued_lock = threading.Lock()
        self._worker = NamedThread(target=self._run, name="torch_llm", daemon=True)
        self._worker.start()

    def _seed_counters(self) -> None:
        """Totals from before the first request (prefetched adapters) are not counted again."""
        adapters, kv = self.engine.adapters.stats(), self.engine.kv_stats()
        self._evict_seen_s = kv.evict_s
        self.adapter_loads.seen = adapters.loads
        self.adapter_evictions.seen = adapters.evictions
        self.kv_evictions.seen = kv.evictions
        self.kv_evicted_reuses.seen = kv.evicted_reuses
        self.kv_rejected.seen = kv.rejected_blocks
        self.kv_lookups["hit"].seen = kv.hit_lookups
        self.kv_lookups["miss"].seen = kv.lookups - kv.hit_lookups
        self.kv_pool_bytes.set(kv.bytes)

    def submit(self, call: EngineCall, sink: EngineSink) -> None:
        """Queue one request for the worker; past MAX_QUEUED waiting, or with adapter files
        that would take the waiting ones past `max_queued_adapter_bytes` (while any wait),
        refused at once (Unavailable: the caller, llm, answers it as any engine failure)."""
        if self._queue.qsize() >= MAX_QUEUED:
            self.refuse(
                Unavailable(f"the engine has {MAX_QUEUED} requests waiting; try again"), sink
            )
            return
        size = _adapter_bytes(call)
        if size:
            with self._queued_lock:
                held, bound = self._queued_adapter_bytes, self.max_queued_adapter_bytes
                if bound and held and held + size > bound:
                    refused: Unavailable | None = Unavailable(
                        f"the requests waiting for the engine hold {held} bytes of adapter "
                        f"files; {size} more would pass queue_max_adapter_bytes ({bound}); "
                        "try again"
                    )
                else:
                    refused, self._queued_adapter_bytes = None, held + size
            if refused is not None:
                self.refuse(refused, sink)
                return
        self._queue.put((call, sink))
        self.queue_depth.set(self._queue.qsize())

    def _taken(self, call: EngineCall) -> None:
        """The worker took `call` off the queue: its adapter files no longer count as waiting."""
        if size := _adapter_bytes(call):
            with self._queued_lock:
                self._queued_adapter_bytes -= size

    def refuse(self, exc: BaseException, sink: EngineSink) -> None:
        """Answer a request with `exc`, counted by its finish reason and logged: one that
        failed on the worker, or one it will not run (inputs refused in execute, queue full)."""
        reason = "adapter_missing" if is_not_in_engine(exc) else "error"
        self.finished[reason].increment(1)
        if reason == "adapter_missing":  # the protocol's turn: the caller sends weights
            io.log.info("engine request refused: %s", exc)
        elif isinstance(exc, TierCacheError):  # a refused request: its message is enough
            if self._refusals_log.ready():  # a caller can repeat one at will: once a minute
                io.log.warning(
                    "engine request refused: %s (%d refusals not logged)",
                    str(exc)[:500],
                    self._refusals_log.suppressed,
                )
        elif self._failures_log.ready():
            io.log.error(
                "engine request failed (%d failures not logged)",
                self._failures_log.suppressed,
                exc_info=exc,
            )
        try:
            sink.send_error(exc)
        except Exception:  # noqa: BLE001 - e.g. the client is gone; keep serving others
            io.log.exception("could not send an error response")

    def _run(self) -> None:
        while (job := self._queue.get()) is not _STOP:
            self.queue_depth.set(self._queue.qsize())
            call, sink = job
            self._taken(call)
            order, request = call
            # the objective's clock starts here, not at submit: the queue holds earlier
            # requests' whole generations, which no cache memory shortens
            started = time.monotonic()
            before = self.engine.adapters.stats()
            try:
                self._serve(order, request, sink, started)
            except Exception as exc:  # noqa: BLE001 - this request's error; the worker goes on
                self.refuse(exc, sink)
            finally:
                try:
                    adapters, kv = self.engine.adapters.stats(), self.engine.kv_stats()
                    self._record_adapters(before, adapters)
                    self._record_kv(kv)
                    self._record_stall(before, adapters, kv)
                    self._trim_memory()
                    self._release_gpu_memory(adapters, kv)
                except Exception:  # noqa: BLE001 - the only worker: it must go on serving
                    io.log.exception("the engine's bookkeeping after a request failed")

    def _cancelled(self, sink: EngineSink) -> bool:
        """Whether the caller gave up on a request while it waited in the queue (llm's
        deadline, a flight nobody waits for any more); if so it is answered as cancelled."""
        try:
            if not sink.is_cancelled():
                return False
            self.finished["cancelled"].increment(1)
            sink.send_final("", "cancelled", 0, 0, 0, 0)
        except Exception:  # noqa: BLE001 - e.g. the client is gone; keep serving others
            io.log.exception("could not answer a cancelled request")
        return True

    def _serve(
        self,
        order: AdapterOrder,
        request: GenerationRequest | None,
        sink: EngineSink,
        started: float,
    ) -> None:
        # the adapter work it carries first, whatever became of its caller: lora_cache's mirror
        # counts the weights it sent, and the evictions it planned, as done
        done = self.engine.adapters.prepare(order)
        if order.op == GENERATE and request is not None:
            if self._cancelled(sink):
                return  # gone while it waited: no prompt run for nobody
            self._generate(request, sink, started)
            return
        if order.op == LOAD:
            answer = json.dumps({"load_ms": done.load_s * 1e3, "evicted": list(done.evicted)})
        elif order.op == LIST:
            answer = json.dumps(self.engine.adapters.resident())
        else:
            answer = json.dumps({"evicted": list(done.evicted)})
        sink.send_final(answer, OP_FINISH[order.op], 0, 0, 0, 0)

    def _generate(self, request: GenerationRequest, sink: EngineSink, started: float) -> None:
        events = self.refusal.generate(
            request, lambda: self.engine.generate(request, sink.is_cancelled)
        )
        with contextlib.closing(events):  # a send that fails mid-stream releases the KV lease now
            self._stream(events, sink, started)

    def _stream(self, events: Iterator[StreamEvent], sink: EngineSink, started: float) -> None:
        first = True
        for event in events:
            # to the first event: the adapter switch, the KV lookup and the prefill; a refusal
            # (no prompt run through the model) is no TTFT of the engine's
            if first and self.objective is not None and event.prompt_tokens > 0:
                self.objective.observe(time.monotonic() - started)
            first = False
            if event.finish_reason is None:
                sink.send_chunk(event.text)
                continue
            sink.send_final(
                event.text,
                event.finish_reason,
                event.generated_tokens,
                event.prompt_tokens,
                event.reused_tokens,
                event.computed_tokens,
                event.accepted_tokens,
                event.mean_logprob,
                time.monotonic() - started,  # the engine's own seconds: not its queue's
            )
            self.tokens.increment(event.generated_tokens)
            self.prompt_tokens.increment(event.prompt_tokens)
            self.kv_reused.increment(event.reused_tokens)
            self.kv_computed.increment(event.computed_tokens)
            self.drafts.record(event.draft_steps)
            self.finished[event.finish_reason].increment(1)

    def _release_gpu_memory(self, adapters: AdapterStats, kv: KvStats) -> None:
        """On a GPU whose budgets follow the card, after a request that applied a smaller
        budget (the KV pool's, evicting down to it) or dropped adapter slots for one: the
        card gets the freed memory back, where NVML (what the budgets read) sees it. Not after
        the pool's ordinary evictions (a full pool making room): torch would allocate again
        at once."""
        if self.budgets is None or not self.engine.on_gpu:
            return
        shrunk = kv.max_bytes < self._kv_budget_seen
        dropped = adapters.budget_evictions > self._slot_drops_seen
        self._kv_budget_seen, self._slot_drops_seen = kv.max_bytes, adapters.budget_evictions
        if shrunk or dropped:
            try:
                self.engine.release_cached_memory()
            except Exception:  # noqa: BLE001 - the worker must go on serving
                io.log.exception("handing cached GPU memory back failed")

    def _trim_memory(self) -> None:
        """Freed activations back to the system, at most every memory_trim_interval_s."""
        if self.trimmer.maybe_trim():
            stats = self.trimmer.stats()
            self.memory_trims.update(stats.trims)
            self.memory_trim_s.update(stats.seconds)

    def _record_adapters(self, before: AdapterStats, after: AdapterStats) -> None:
        """Metrics from the adapter stats, on the worker thread (the only one that changes them).
        Each request loads and switches at most once, so the last timing is this request's."""
        if after.loads > before.loads:
            self.adapter_load_s.observe(after.last_load_s)
        if after.switches > before.switches:
            self.adapter_swap_s.observe(after.last_switch_s)
        self.adapter_loads.update(after.loads)
        self.adapter_evictions.update(after.evictions)
        self.adapters_resident.set(after.resident)
        self.adapter_slot_bytes.set(after.slot_bytes)

    def _record_stall(self, before: AdapterStats, after: AdapterStats, kv: KvStats) -> None:
        """This request's gen-stall-duration: its adapter load and switch (each at most once
        a request: the last timing is its) and its KV evictions (the pool's eviction time
        since the last request: only this worker thread evicts)."""
        causes = {
            "adapter_load": after.last_load_s if after.loads > before.loads else 0.0,
            "adapter_switch": after.last_switch_s if after.switches > before.switches else 0.0,
            "kv_evict": max(kv.evict_s - self._evict_seen_s, 0.0),
        }
        self._evict_seen_s = kv.evict_s
        for cause, seconds in causes.items():
            if seconds > 0:
                self.stall_causes[cause].increment(seconds)
        self.stall_s.observe(sum(causes.values()))

    def _record_kv(self, after: KvStats) -> None:
        """Prefix-pool metrics from its stats, on the worker thread (the only one using it)."""
        self.kv_lookups["hit"].update(after.hit_lookups)
        self.kv_lookups["miss"].update(after.lookups - after.hit_lookups)
        self.kv_evictions.update(after.evictions)
        self.kv_evicted_reuses.update(after.evicted_reuses)
        self.kv_rejected.update(after.rejected_blocks)
        self.kv_hit_skew.set(self.engine.kv_pool.hit_skew())
        self.kv_pool_bytes.set(after.bytes)

    def close(self) -> None:
        if self.budgets is not None:
            self.budgets.close()
        self._queue.put(_STOP)
        self._worker.join(timeout=30)
        self.metrics.close()


def _adapter_bytes(call: EngineCall) -> int:
    """The adapter files a call carries (0: none)."""
    weights = call[0].weights
    return weights.nbytes if weights is not None else 0


def open_torch_llm(config: EngineConfig, model_name: str) -> TorchLlmStage:
    """torch's threads set (`torch_threads`), then the engine (weights converted once under the
    state folder), its refusal policy, the `lora_prefetch` adapters loaded, its metrics
    (started) and its worker (started)."""
    threads = set_torch_threads(config.torch_threads, ThreadRole.ENGINE)
    pass_threads = pass_thread_count(config.pass_threads, usable_cpus())
    refusal = RefusalPolicy.parse(config.refuse_prompt_pattern, config.refusal_text)
    engine = TorchEngine(
        resolve_model(config.model),
        config.models_path(),
        config.device,
        config.lora_slots,
        kv_reuse=config.kv_reuse,
        tokens_per_block=config.tokens_per_block,
        kv_pool_max_bytes=config.kv_pool_max_bytes,
        lora_max_bytes=config.lora_max_bytes,
        kv_eviction=config.kv_eviction,
        speculate=config.speculate,
        speculate_sampled=config.speculate_sampled,
        draft_index_tokens=config.draft_index_tokens,
        pass_threads=pass_threads,
        packed_linears=config.packed_linears,
    )
    if pass_threads and pass_threads != threads and not engine.on_gpu:
        log.info("torch threads for passes over several tokens: %d (pass_threads)", pass_threads)
    prefetch(engine, config)
    metrics = tm.Metrics(model_name)
    trimmer = MemoryTrimmer(config.memory_trim_interval_s)
    sealer = open_sealer(config.state_path())
    freshness = open_freshness(config.envelope_max_age_s)  # no key: llm's calls carry none
    stage = TorchLlmStage(engine, refusal, trimmer, metrics, sealer, freshness)
    stage.max_queued_adapter_bytes = config.queue_max_adapter_bytes
    if engine.on_gpu:  # "auto" may have picked a GPU
        if config.memory_headroom_bytes or config.cache_memory_bytes:
            log.warning(
                "memory_headroom_bytes, cache_memory_bytes: the KV pool and the adapter slots "
                "are on %s, not host memory; gpu_memory_headroom_bytes is what they follow",
                engine.device,
            )
        if config.gpu_memory_headroom_bytes > 0:
            stage.budgets = follow_gpu(engine, config, metrics, model_name)
    else:
        if config.ttft_objective_s > 0:
            stage.objective = LatencyObjective(config.ttft_objective_s)
        stage.budgets = start_budgets(
            config.memory_headroom_bytes,
            config.budget_interval_s,
            engine_budgets(engine, config),
            metrics,
            config.state_path(),
            model_name,
            trim=config.memory_trim_interval_s > 0,
            total_bytes=config.cache_memory_bytes,
            objective=stage.objective.state if stage.objective is not None else None,
        )
    metrics.start()
    return stage


def follow_gpu(
    engine: TorchEngine,
    config: EngineConfig,
    metrics: tm.Metrics,
    model_name: str,
    probe: GpuMemoryProbe | None = None,
) -> BudgetThread | None:
    """The engine's budgets following its card's free memory through NVML
    (`gpu_memory_headroom_bytes`), shared with the other processes on that card through a
    ledger of its own; None, with a warning, where NVML cannot tell which card it is."""
    probe = probe if probe is not None else GpuMemoryProbe()
    index, uuid = engine.card()
    readings: list[GpuReading] = []
    for _attempt in range(3):  # a reading that fails once (NVML busy) is not "no card"
        readings = probe.read()
        if readings or probe.why_none:
            break
        time.sleep(0.5)
    card = nvml_card(
        index,
        readings,
        uuid,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        pci_order=os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID",
    )
    if card is None:
        why = probe.why_none or (
            "NVML read no card" if not readings else "no NVML card is known to be it"
        )
        log.warning(
            "gpu_memory_headroom_bytes: NVML cannot tell the free memory of %s (%s); its "
            "budgets stay fixed",
            engine.device,
            why,
        )
        probe.close()
        return None
    found = card

    def available() -> int:
        for reading in probe.read():
            if reading.index == found.index:
                return reading.free_bytes
        raise RuntimeError(f"NVML did not read card {found.index} this time")  # the tick holds

    label = card.uuid.lower().removeprefix("gpu-") if card.uuid else f"index-{card.index}"
    return start_budgets(
        config.gpu_memory_headroom_bytes,
        config.budget_interval_s,
        engine_budgets(engine, config),
        metrics,
        config.state_path(),
        model_name,
        available=available,
        memory=f"gpu-{label}",
        on_close=probe.close,
    )


def engine_budgets(engine: TorchEngine, config: EngineConfig) -> list[Budget]:
    """The KV pool's budget, and the adapter slots' when they have a byte bound."""
    budgets = [kv_pool_budget(engine.kv_pool, config.kv_pool_min_bytes, config.kv_pool_max_bytes)]
    if config.lora_max_bytes > 0 and config.lora_slots > 0:
        budgets.append(
            adapter_slots_budget(engine.adapters, config.lora_min_bytes, config.lora_max_bytes)
        )
    return budgets


def decode_call(
    sealer: Sealer, freshness: Freshness, blobs: dict[str, bytes | None]
) -> tuple[AdapterOrder, GenerationRequest | None]:
    """One engine call from its BYTES inputs (by name; None: omitted), its ENGINE_SEAL checked
    over all of them before anything is parsed, then the envelope's own seal and `freshness`:
    the engine is internal (llm and lora_cache call it). Forbidden when unsealed, altered or
    too old."""
    check_tensors(
        sealer,
        (blobs.get("ENGINE_SEAL") or b"").decode("ascii", "replace"),
        ENGINE_LABEL,
        ENGINE_INPUTS,
        dict(blobs),
        what="the engine call",
    )
    data = blobs.get("ENVELOPE")
    request = Envelope.open(data, sealer, freshness).request if data else None
    order = AdapterOrder.parse(
        op=_text(blobs.get("LORA_OP")),
        lora=_text(blobs.get("LORA")),
        config_json=_text(blobs.get("LORA_CONFIG")),
        weights=blobs.get("LORA_WEIGHTS"),
        evict=_text(blobs.get("LORA_EVICT")),
        request=request,
    )
    return order, request


def _text(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("an engine input is not UTF-8") from None


def prefetch(engine: TorchEngine, config: EngineConfig) -> None:
    """Load the `lora_prefetch` adapters before the first request (lora_cache's `prefetch`
    names the same list, so its mirror starts in step with the engine)."""
    names = name_list(config.lora_prefetch)
    if not names:
        return
    registry = open_adapters(config.adapters_path(), config.state_path(), config.adapters_manifest)
    for name in names:
        try:
            seconds = engine.adapters.load(registry.read(registry.resolve(name)))
        except TierCacheError as exc:
            raise ConfigError(f"lora_prefetch adapter {name!r}: {exc.message}") from exc
        io.log.info("prefetched adapter %s in %.0f ms", name, seconds * 1000.0)
