"""Triton model `llm` (decoupled): hits stream at once; misses go to tiercache.llm_stage, which
calls the engine model through BLS: `torch_llm` (engine_kind torch_llm, the default) or Triton's
TensorRT-LLM backend model (engine_kind tensorrt_llm, tiercache.engine.trtllm_client)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import LlmConfig
from tiercache.engine.events import StreamEvent
from tiercache.engine.trtllm_client import (
    REQUESTED_OUTPUTS,
    EngineLimits,
    KvCacheReuse,
    TrtllmClient,
    load_tokenizer,
    request_lora_from_arrays,
)
from tiercache.errors import ConfigError, Unavailable
from tiercache.keys import Digest
from tiercache.leases import LeaseCoordinator
from tiercache.llm_stage import GenerationRecord, LlmStage, Responder
from tiercache.lora.engine_call import NO_LORA, EngineLora, generate_with_adapter
from tiercache.lora.types import AdapterRef
from tiercache.padding import PaddedResponder, ResponseTimer, padding_policy, uniform_source
from tiercache.prompt_cache import CacheStatus, load_secret, open_tiered_cache, redis_link
from tiercache.redis_tier import RedisLink
from tiercache.request import GenerationRequest
from tiercache.semantic.embedder import resolve_embedder
from tiercache.semantic.index import SemanticStore
from tiercache.semantic.redis_rows import RowSharing
from tiercache.tiered import TieredCache
from tiercache.triton import boundary as tb

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENGINE_OUTPUTS = [
    "TEXT",
    "FINISH_REASON",
    "GENERATED_TOKENS",
    "PROMPT_TOKENS",
    "REUSED_TOKENS",
    "COMPUTED_TOKENS",
]
ENGINE_KINDS = ("torch_llm", "tensorrt_llm")
# lora_cache's TensorRT-LLM tensors (engine_kind tensorrt_llm): on the ensemble path and on the
# `weights` admin call of the retry.
TRT_LORA = ("LORA_TASK_ID", "LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG")


def lora_from_response(response: object) -> EngineLora:
    return EngineLora(
        config_json=tb.output_string(response, "LORA_CONFIG") or "",
        weights=tb.output_blob(response, "LORA_WEIGHTS") or b"",
        evict=tuple(json.loads(tb.output_string(response, "LORA_EVICT") or "[]")),
    )


class _Responder:
    """One request's response sender, in the shape tiercache.llm_stage.Responder asks for."""

    def __init__(self, sender: object) -> None:
        self.sender = sender

    def is_cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())

    def send_chunk(self, text: str) -> None:
        self.sender.send(pb_utils.InferenceResponse([tb.bytes_tensor("TEXT_OUTPUT", [text])]))

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        prompt_usage: tuple[int, int] | None = None,
        finish_reason: str | None = None,
    ) -> None:
        outputs = [tb.bytes_tensor("CACHE_STATUS", [status])]
        if finish_reason is not None:
            outputs.append(tb.bytes_tensor("FINISH_REASON", [finish_reason]))
        if similarity is not None:
            outputs.append(tb.scalar_tensor("CACHE_SIMILARITY", similarity, np.float32))
        if prompt_usage is not None:
            reused, computed = prompt_usage
            outputs.append(tb.scalar_tensor("KV_REUSED_TOKENS", reused, np.int32))
            outputs.append(tb.scalar_tensor("KV_COMPUTED_TOKENS", computed, np.int32))
        if text is not None:
            outputs.insert(0, tb.bytes_tensor("TEXT_OUTPUT", [text]))
        self.sender.send(pb_utils.InferenceResponse(outputs), flags=FINAL)

    def send_cancelled(self) -> None:
        self.sender.send(flags=FINAL)

    def send_error(self, exc: BaseException) -> None:
        self.sender.send(tb.error_response(exc), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.config, _ = tb.load_config(LlmConfig, args)
        if self.config.engine_kind not in ENGINE_KINDS:
            raise ConfigError(
                f"engine_kind must be one of {', '.join(ENGINE_KINDS)}, "
                f"got {self.config.engine_kind!r}"
            )
        self.trtllm: TrtllmClient | None = None
        if self.config.engine_kind == "tensorrt_llm":
            if not self.config.tokenizer_dir:
                raise ConfigError("engine_kind tensorrt_llm needs tokenizer_dir (the engine's)")
            self.trtllm = TrtllmClient(
                load_tokenizer(self.config.tokenizer_dir),
                limits=EngineLimits(
                    self.config.trtllm_max_input_len, self.config.trtllm_max_seq_len
                ),
            )
        self.engine = self._generate_trtllm if self.trtllm is not None else self._generate
        if self.config.engine_streams < 0:
            raise ConfigError(f"engine_streams must be >= 0, got {self.config.engine_streams}")
        self.engine_streams = threading.BoundedSemaphore(
            self.config.engine_streams or self.config.max_concurrency
        )
        self.streams = tb.StreamKeeper()  # finished engine streams, released with the GIL
        self.metrics = m = tb.Metrics(args["model_name"])
        self.requests = {
            s: m.counter("tiercache_llm_requests_total", "Responses by cache status", status=s)
            for s in [*(c.value for c in CacheStatus), "error"]
        }
        self.generations = m.counter("tiercache_llm_generations_total", "Engine generations")
        self.coalesced = m.counter(
            "tiercache_llm_coalesced_total", "Misses served by joining an identical in-flight one"
        )
        self.write_backs = m.counter("tiercache_llm_write_backs_total", "Answers stored in L2")
        self.write_failures = m.counter(
            "tiercache_llm_write_failures_total", "Failed writes of an answer or its index row"
        )
        self._write_failures_seen = 0
        self._seen_lock = threading.Lock()
        self.tokens = m.counter("tiercache_llm_generated_tokens_total", "Tokens generated")
        self.ttft_s = m.histogram(
            "tiercache_llm_time_to_first_token_seconds",
            "Engine TTFT on a miss",
            buckets=tb.GENERATION_BUCKETS_S,
        )
        self.duration_s = m.histogram(
            "tiercache_llm_generation_seconds",
            "Engine time per miss",
            buckets=tb.GENERATION_BUCKETS_S,
        )
        if self.trtllm is not None:
            self.kv_reused_blocks = m.counter(
                "tiercache_trtllm_kv_cache_reused_blocks_total",
                "KV-cache blocks TensorRT-LLM reused from earlier requests (prefix reuse)",
            )
            self.kv_total_blocks = m.counter(
                "tiercache_trtllm_kv_cache_blocks_total",
                "KV-cache blocks TensorRT-LLM's requests used in all, reused or new",
            )
        self.semantic = SemanticStore(self.config.semantic_path(), self.config.semantic_max_bytes)
        cache = open_tiered_cache(self.config, with_l1=False)
        link = redis_link(cache)
        # Response-time padding for untrusted tenants (tiercache.padding); off at floor 0.
        self.padding = padding_policy(
            self.config, load_secret(self.config, cache) if self.config.hit_padding_ms > 0 else b""
        )
        self.padding_timer = ResponseTimer() if self.padding.enabled else None
        self.padding_jitter = uniform_source()
        self.stage = LlmStage(
            cache,
            self.engine,
            max_workers=self.config.max_concurrency,
            on_generation=self._record,
            on_follow=lambda: self.coalesced.increment(1),
            leases=(
                LeaseCoordinator(link, self.config.lease_ttl_s, self.config.lease_wait_s)
                if link is not None
                else None
            ),
        )
        tb.export_redis(m, cache)  # with L3: Redis health and invalidations applied
        self.sharing = self._share_rows(cache, link, m)
        if self.stage.leases is not None:
            tb.LeaseMetrics(m, self.stage.leases, self.stage.stats)
        m.start()

    def _share_rows(
        self, cache: TieredCache, link: RedisLink | None, m: tb.Metrics
    ) -> RowSharing | None:
        """With L3: share index rows through Redis (tiercache.semantic.redis_rows), catch up with
        the fleet's rows (waiting up to redis_semantic_warm_s) and follow them."""
        if link is None or self.config.redis_semantic_max_rows <= 0 or not self.config.embedder:
            return None
        _, embedder = resolve_embedder(self.config.embedder)
        sharing = RowSharing(
            cache,
            self.semantic,
            link,
            max_rows=self.config.redis_semantic_max_rows,
            embedder=embedder.key,
            dimensions=embedder.dimensions,
            retry_s=self.config.redis_retry_s,
        ).start()
        events = ("published", "publish_failed", "added", "duplicate", "own", "dead", "foreign")
        counters = {
            e: m.counter(
                "tiercache_semantic_redis_rows_total",
                "Semantic index rows shared through Redis: published here, or read from the "
                "stream and added, already held, own, dead (invalidated/expired), foreign",
                event=e,
            )
            for e in (*events, "malformed")
        }
        counted = dict.fromkeys(counters, 0)

        def refresh() -> None:
            f = sharing.follower.stats()
            p = sharing.publisher
            totals = {
                "published": p.published,
                "publish_failed": p.failed,
                "added": f.added,
                "duplicate": f.duplicate,
                "own": f.own,
                "dead": f.dead,
                "foreign": f.foreign,
                "malformed": f.malformed,
            }
            for event, total in totals.items():
                if total > counted[event]:
                    counters[event].increment(total - counted[event])
                    counted[event] = total

        m.on_flush(refresh)
        caught_up = sharing.follower.wait_caught_up(self.config.redis_semantic_warm_s)
        tb.log.info(
            "semantic rows from Redis: %s",
            "caught up" if caught_up else "catching up in the background",
        )
        return sharing

    def _generate(
        self, request: GenerationRequest, lora: EngineLora = NO_LORA
    ) -> Iterator[StreamEvent]:
        """One engine call over BLS, as a stream of events. BLS requests cannot be cancelled in
        this Triton version, so an abandoned generation runs to max_tokens and is discarded."""
        inputs = [tb.bytes_tensor("REQUEST", [request.to_json()], batched=False)]
        if lora.loads:
            inputs.append(tb.bytes_tensor("LORA_CONFIG", [lora.config_json], batched=False))
            inputs.append(tb.bytes_tensor("LORA_WEIGHTS", [lora.weights], batched=False))
        if lora.evict:
            evict = json.dumps(list(lora.evict))
            inputs.append(tb.bytes_tensor("LORA_EVICT", [evict], batched=False))
        infer = pb_utils.InferenceRequest(
            model_name=self.config.engine_model,
            inputs=inputs,
            requested_output_names=ENGINE_OUTPUTS,
        )
        with self.engine_streams:  # held until the stream ends (engine_streams)
            # The keeper, not the stub's cleanup thread, drops the stream (tb.StreamKeeper).
            for response in self.streams.read(infer.exec(decoupled=True)):
                if response.has_error():
                    raise Unavailable(
                        f"engine {self.config.engine_model}: {response.error().message()}"
                    )
                finish = tb.output_string(response, "FINISH_REASON")
                yield StreamEvent(
                    text=tb.output_string(response, "TEXT") or "",
                    finish_reason=finish or None,
                    generated_tokens=tb.output_int(response, "GENERATED_TOKENS") or 0,
                    prompt_tokens=tb.output_int(response, "PROMPT_TOKENS") or 0,
                    reused_tokens=tb.output_int(response, "REUSED_TOKENS") or 0,
                    computed_tokens=tb.output_int(response, "COMPUTED_TOKENS") or 0,
                )

    def _generate_trtllm(
        self, request: GenerationRequest, lora: EngineLora = NO_LORA
    ) -> Iterator[StreamEvent]:
        """One generation on Triton's TensorRT-LLM backend model, over BLS. An answer that ends
        early (a stop word) cancels the rest of the engine's stream."""
        trtllm = self.trtllm
        if trtllm is None:
            raise RuntimeError("_generate_trtllm without a TensorRT-LLM client")
        call = trtllm.request(request, lora.trtllm)
        infer = pb_utils.InferenceRequest(
            model_name=self.config.engine_model,
            inputs=[pb_utils.Tensor(name, array) for name, array in call.tensors.items()],
            requested_output_names=list(REQUESTED_OUTPUTS),
        )
        responses = infer.exec(decoupled=True)
        try:
            yield from trtllm.events(request, call, self._outputs(responses), self._record_kv)
        finally:
            cancel = getattr(responses, "cancel", None)  # python_backend >= 25.05
            if cancel is not None:
                cancel()  # a no-op once the stream has ended
            self.streams.keep(responses)  # never the stub's last reference (StreamKeeper)

    def _outputs(self, responses: Iterator[Any]) -> Iterator[dict[str, np.ndarray]]:
        for response in responses:
            if response.has_error():
                raise Unavailable(
                    f"engine {self.config.engine_model}: {response.error().message()}"
                )
            yield {t.name(): t.as_numpy() for t in response.output_tensors()}

    def _record_kv(self, reuse: KvCacheReuse) -> None:
        self.kv_reused_blocks.increment(reuse.reused_blocks)
        self.kv_total_blocks.increment(reuse.total_blocks)

    def _fetch_weights(self, ref: AdapterRef) -> EngineLora:
        """Ask lora_cache again for an adapter the engine says it lost (see engine_call)."""
        admin = json.dumps({"op": "weights", "lora": json.loads(ref.to_json())})
        wanted = list(TRT_LORA) if self.trtllm else ["LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT"]
        infer = pb_utils.InferenceRequest(
            model_name=self.config.lora_model,
            inputs=[tb.bytes_tensor("ADMIN", [admin])],
            requested_output_names=wanted,
        )
        response = infer.exec()
        if response.has_error():
            raise Unavailable(f"{self.config.lora_model}: {response.error().message()}")
        if self.trtllm is None:
            return lora_from_response(response)
        trt = request_lora_from_arrays(*(_output_array(response, name) for name in TRT_LORA))
        if trt is None or trt.lora is None:
            raise Unavailable(
                f"{self.config.lora_model} sent no TensorRT-LLM weights for {ref.short} "
                "(is its engine_kind tensorrt_llm?)"
            )
        return EngineLora(trtllm=trt)

    def _engine_call(
        self, inputs: tb.Inputs
    ) -> Callable[[GenerationRequest], Iterator[StreamEvent]]:
        """This request's engine call: with what lora_cache sent, retried once on a lost adapter."""
        if self.trtllm is not None:
            trt = request_lora_from_arrays(*(inputs.vector(name) for name in TRT_LORA))
            lora = EngineLora(trtllm=trt)
        else:
            lora = EngineLora(
                config_json=inputs.string("LORA_CONFIG") or "",
                weights=inputs.blob("LORA_WEIGHTS") or b"",
                evict=tuple(json.loads(inputs.string("LORA_EVICT") or "[]")),
            )
        return lambda request: generate_with_adapter(
            self.engine, self._fetch_weights, request, lora
        )

    def _index_writer(
        self, inputs: tb.Inputs, request: GenerationRequest, digest: str | None
    ) -> Callable[[], None] | None:
        """What to run once the answer is stored: add the prompt's vector to its scope's rows."""
        scope = inputs.string("SCOPE") or ""
        tensor = inputs.vector("EMBEDDING")
        if not scope or not digest or tensor is None or tensor.size == 0:
            return None
        vector = tensor.reshape(-1).astype(np.float32)
        cache = self.stage.cache
        sharing = self.sharing

        def write() -> None:
            self.semantic.append_or_compact(scope, digest, request.prompt, vector, cache.exists)
            if sharing is not None:  # then to the other replicas, through Redis
                sharing.publish(scope, digest, request.prompt, vector)

        return write

    def _record(self, record: GenerationRecord) -> None:
        self.generations.increment(1)
        with self._seen_lock:  # producers finish on several threads
            failures = self.stage.stats().write_failures
            if failures > self._write_failures_seen:
                self.write_failures.increment(failures - self._write_failures_seen)
                self._write_failures_seen = failures
        self.tokens.increment(record.generated_tokens)
        if record.ttft_s is not None:
            self.ttft_s.observe(record.ttft_s)
        self.duration_s.observe(record.duration_s)
        if record.stored:
            self.write_backs.increment(1)

    def _padded(
        self, responder: Responder, request_json: str | None, arrival_s: float
    ) -> Responder:
        """`responder`, held until the padding floor if this request's tenant is padded. The
        tenant is known by its scope (kv_scope of REQUEST; prompt_cache sends it on hits too); a
        request without one is padded."""
        timer = self.padding_timer
        if timer is None:
            return responder
        scope = str(json.loads(request_json).get("kv_scope", "")) if request_json else ""
        if not self.padding.pads(scope):
            return responder
        release_s = self.padding.release_at(arrival_s, self.padding_jitter)
        return PaddedResponder(responder, release_s, timer)

    def execute(self, requests: list) -> None:
        for request in requests:
            arrival_s = time.monotonic()  # padding counts from here (ResponseTimer's clock)
            responder: Responder = _Responder(request.get_response_sender())
            try:
                inputs = tb.Inputs(request)
                lookup = inputs.string("LOOKUP_STATUS")
                responder = self._padded(responder, inputs.string("REQUEST"), arrival_s)
                if lookup in (CacheStatus.EXACT, CacheStatus.SEMANTIC):
                    semantic = lookup == CacheStatus.SEMANTIC
                    similarity = inputs.number("SIMILARITY") if semantic else None
                    text = inputs.string("CACHED_TEXT") or ""
                    self.stage.serve_hit(text, str(lookup), responder, similarity)
                    self.requests[str(lookup)].increment(1)
                    continue
                request_json = inputs.string("REQUEST")
                if request_json is None or lookup not in (CacheStatus.MISS, CacheStatus.BYPASS):
                    raise Unavailable(f"llm got an incomplete lookup (status {lookup!r})")
                digest = inputs.string("DIGEST") or None
                request_obj = GenerationRequest.from_json(request_json)
                self.stage.submit_miss(
                    request_obj,
                    Digest(digest) if digest else None,
                    lookup,
                    bool(inputs.boolean("WRITE_BACK")),
                    responder,
                    self._index_writer(inputs, request_obj, digest),
                    self._engine_call(inputs),
                )
                self.requests[lookup].increment(1)
            except Exception as exc:  # noqa: BLE001 - mapped to this request's error response
                self.requests["error"].increment(1)
                responder.send_error(exc)
        return None

    def finalize(self) -> None:
        if self.sharing is not None:
            self.sharing.close()  # joins the follower before the stage closes the Redis link
        # Misses in flight first (their rows go to the semantic store), then the semantic
        # store (a compaction it runs checks answers in the cache, which must still be open),
        # then the cache.
        self.stage.drain()
        self.semantic.close()
        self.stage.close()
        if self.padding_timer is not None:
            self.padding_timer.close()  # after the stage: its last misses may still be held
        self.streams.clear()
        self.metrics.close()


def _output_array(response: object, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return None if tensor is None else tensor.as_numpy()
