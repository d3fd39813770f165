"""Triton model `torch_llm` (decoupled): the CPU engine with its LoRA adapters. One worker thread
handles one request at a time, in arrival order (adapter evictions, a load, then the op; see
config.pbtxt), streaming each chunk of an answer as a response; execute() only enqueues."""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import EngineConfig, name_list
from tiercache.engine.adapters import EVICT, GENERATE, LIST, LOAD, AdapterOrder, AdapterStats
from tiercache.engine.kv_cache import KvStats
from tiercache.engine.model_source import resolve_model
from tiercache.engine.policy import RefusalPolicy
from tiercache.engine.torch_engine import TorchEngine
from tiercache.errors import ConfigError, TierCacheError
from tiercache.lora.registry import AdapterRegistry
from tiercache.memory import MemoryTrimmer
from tiercache.request import GenerationRequest
from tiercache.triton import boundary as tb

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_STOP = object()
# What the final response of each admin op says in FINISH_REASON.
OP_FINISH = {LOAD: "loaded", LIST: "listed", EVICT: "evicted"}


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = tb.load_config(EngineConfig, args)
        self.refusal = RefusalPolicy.parse(config.refuse_prompt_pattern, config.refusal_text)
        self.engine = TorchEngine(
            resolve_model(config.model),
            config.models_path(),
            config.device,
            config.lora_slots,
            kv_reuse=config.kv_reuse,
            tokens_per_block=config.tokens_per_block,
            kv_pool_max_bytes=config.kv_pool_max_bytes,
        )
        self._prefetch(config)
        self.trimmer = MemoryTrimmer(config.memory_trim_interval_s)
        self.metrics = m = tb.Metrics(args["model_name"])
        self.tokens = m.counter("tiercache_engine_generated_tokens_total", "Tokens generated")
        self.prompt_tokens = m.counter("tiercache_engine_prompt_tokens_total", "Prompt tokens run")
        self.finished = {
            r: m.counter(
                "tiercache_engine_finished_total", "Generations by finish reason", reason=r
            )
            for r in ("stop", "length", "cancelled", "content_filter", "error")
        }
        self.queue_depth = m.gauge(
            "tiercache_engine_queue_depth", "Requests waiting for the engine"
        )
        self.adapter_loads = m.counter(
            "tiercache_engine_adapter_loads_total", "LoRA adapters loaded into the engine"
        )
        self.adapter_evictions = m.counter(
            "tiercache_engine_adapter_evictions_total",
            "LoRA adapters dropped from the engine (asked for, or to make room)",
        )
        self.adapter_load_s = m.histogram(
            "tiercache_engine_adapter_load_seconds", "Time to load one adapter into the engine"
        )
        self.adapter_swap_s = m.histogram(
            "tiercache_engine_adapter_swap_seconds",
            "Time to switch the active adapter (when a request needs another one)",
        )
        self.adapters_resident = m.gauge(
            "tiercache_engine_adapters_resident", "LoRA adapters loaded in the engine"
        )
        self.kv_reused = m.counter(
            "tiercache_engine_kv_reused_tokens_total", "Prompt tokens served from the KV pool"
        )
        self.kv_computed = m.counter(
            "tiercache_engine_kv_computed_tokens_total", "Prompt tokens the engine computed"
        )
        self.kv_pool_bytes = m.gauge(
            "tiercache_engine_kv_pool_bytes", "Bytes of KV blocks held in the prefix pool"
        )
        self.kv_evictions = m.counter(
            "tiercache_engine_kv_evictions_total", "KV blocks evicted from the prefix pool"
        )
        self.kv_lookups = {
            r: m.counter(
                "tiercache_engine_kv_lookups_total",
                "Prefix KV lookups (hit: at least one prompt token reused)",
                result=r,
            )
            for r in ("hit", "miss")
        }
        self.memory_trims = m.counter(
            "tiercache_engine_memory_trims_total", "Returns of freed heap memory to the system"
        )
        self.memory_trim_s = m.counter(
            "tiercache_engine_memory_trim_seconds_total", "Time spent returning freed memory"
        )
        self.kv_pool_bytes.set(self.engine.kv_stats().bytes)
        m.start()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="torch_llm", daemon=True)
        self._worker.start()

    def _prefetch(self, config: EngineConfig) -> None:
        """Load the `lora_prefetch` adapters before the first request (lora_cache's `prefetch`
        names the same list, so its mirror starts in step with the engine)."""
        names = name_list(config.lora_prefetch)
        if not names:
            return
        manifest = Path(config.adapters_manifest) if config.adapters_manifest else None
        registry = AdapterRegistry(config.adapters_path(), config.state_path(), manifest)
        for name in names:
            try:
                seconds = self.engine.adapters.load(registry.read(registry.resolve(name)))
            except TierCacheError as exc:
                raise ConfigError(f"lora_prefetch adapter {name!r}: {exc.message}") from exc
            tb.log.info("prefetched adapter %s in %.0f ms", name, seconds * 1000.0)

    def execute(self, requests: list) -> None:
        for request in requests:
            self._queue.put(request)
        self.queue_depth.set(self._queue.qsize())
        return None

    def _run(self) -> None:
        while (request := self._queue.get()) is not _STOP:
            self.queue_depth.set(self._queue.qsize())
            sender = request.get_response_sender()
            before = self.engine.adapters.stats()
            kv_before = self.engine.kv_stats()
            try:
                self._serve(request, sender)
            except Exception as exc:  # noqa: BLE001 - this request's error; the worker goes on
                self.finished["error"].increment(1)
                try:
                    sender.send(tb.error_response(exc), flags=FINAL)
                except Exception:  # noqa: BLE001 - e.g. the client is gone; keep serving others
                    tb.log.exception("could not send an error response")
            finally:
                self._record_adapters(before, self.engine.adapters.stats())
                self._record_kv(kv_before, self.engine.kv_stats())
                self._trim_memory()

    def _serve(self, request: object, sender: object) -> None:
        inputs = tb.Inputs(request)
        text = inputs.string("REQUEST")
        gen_request = None if text is None else GenerationRequest.from_json(text)
        order = AdapterOrder.parse(
            op=inputs.string("LORA_OP"),
            lora=inputs.string("LORA"),
            config_json=inputs.string("LORA_CONFIG"),
            weights=inputs.blob("LORA_WEIGHTS"),
            evict=inputs.string("LORA_EVICT"),
            request=gen_request,
        )
        done = self.engine.adapters.prepare(order)
        if order.op == GENERATE and gen_request is not None:
            self._generate(gen_request, sender)
            return
        if order.op == LOAD:
            answer = json.dumps({"load_ms": done.load_s * 1e3, "evicted": list(done.evicted)})
        elif order.op == LIST:
            answer = json.dumps(self.engine.adapters.resident())
        else:
            answer = json.dumps({"evicted": list(done.evicted)})
        sender.send(self._final(answer, OP_FINISH[order.op], 0, 0, 0, 0), flags=FINAL)

    def _generate(self, gen_request: GenerationRequest, sender: object) -> None:
        events = self.refusal.generate(
            gen_request, lambda: self.engine.generate(gen_request, sender.is_cancelled)
        )
        for event in events:
            if event.finish_reason is None:
                text = tb.bytes_tensor("TEXT", [event.text], batched=False)
                sender.send(pb_utils.InferenceResponse([text]))
                continue
            response = self._final(
                event.text,
                event.finish_reason,
                event.generated_tokens,
                event.prompt_tokens,
                event.reused_tokens,
                event.computed_tokens,
            )
            sender.send(response, flags=FINAL)
            self.tokens.increment(event.generated_tokens)
            self.prompt_tokens.increment(event.prompt_tokens)
            self.kv_reused.increment(event.reused_tokens)
            self.kv_computed.increment(event.computed_tokens)
            self.finished[event.finish_reason].increment(1)

    @staticmethod
    def _final(
        text: str, finish_reason: str, generated: int, prompt: int, reused: int, computed: int
    ) -> object:
        return pb_utils.InferenceResponse(
            [
                tb.bytes_tensor("TEXT", [text], batched=False),
                tb.bytes_tensor("FINISH_REASON", [finish_reason], batched=False),
                tb.scalar_tensor("GENERATED_TOKENS", generated, np.int32, False),
                tb.scalar_tensor("PROMPT_TOKENS", prompt, np.int32, False),
                tb.scalar_tensor("REUSED_TOKENS", reused, np.int32, False),
                tb.scalar_tensor("COMPUTED_TOKENS", computed, np.int32, False),
            ]
        )

    def _trim_memory(self) -> None:
        """Freed activations back to the system, at most every memory_trim_interval_s."""
        before = self.trimmer.stats()
        if self.trimmer.maybe_trim():
            self.memory_trims.increment(1)
            self.memory_trim_s.increment(self.trimmer.stats().seconds - before.seconds)

    def _record_adapters(self, before: AdapterStats, after: AdapterStats) -> None:
        """Metrics from the adapter stats, on the worker thread (the only one that changes them).
        Each request loads and switches at most once, so the last timing is this request's."""
        if after.loads > before.loads:
            self.adapter_loads.increment(after.loads - before.loads)
            self.adapter_load_s.observe(after.last_load_s)
        if after.evictions > before.evictions:
            self.adapter_evictions.increment(after.evictions - before.evictions)
        if after.switches > before.switches:
            self.adapter_swap_s.observe(after.last_switch_s)
        self.adapters_resident.set(after.resident)

    def _record_kv(self, before: KvStats, after: KvStats) -> None:
        """Prefix-pool metrics from its stats, on the worker thread (the only one using it)."""
        hits = after.hit_lookups - before.hit_lookups
        if hits:
            self.kv_lookups["hit"].increment(hits)
        misses = (after.lookups - before.lookups) - hits
        if misses:
            self.kv_lookups["miss"].increment(misses)
        if after.evictions > before.evictions:
            self.kv_evictions.increment(after.evictions - before.evictions)
        self.kv_pool_bytes.set(after.bytes)

    def finalize(self) -> None:
        self._queue.put(_STOP)
        self._worker.join(timeout=30)
        self.metrics.close()
