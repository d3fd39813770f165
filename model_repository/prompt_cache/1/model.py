"""Triton model `prompt_cache`: decode inputs, call tiercache.prompt_cache, encode outputs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import PromptCacheConfig
from tiercache.engine.model_source import resolve_model
from tiercache.lora.registry import AdapterRegistry
from tiercache.prompt_cache import (
    CacheStatus,
    LookupResult,
    PromptCache,
    load_secret,
    open_tiered_cache,
)
from tiercache.semantic.embedder import resolve_embedder
from tiercache.triton import boundary as tb


def request_json(result: LookupResult) -> str:
    """The canonical request, also on an exact hit: llm reads the hit's tenant scope (kv_scope)
    from it to decide response-time padding (tiercache.padding)."""
    return result.request.to_json()


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = tb.load_config(PromptCacheConfig, args)
        manifest = Path(config.adapters_manifest) if config.adapters_manifest else None
        self.adapters = AdapterRegistry(config.adapters_path(), config.state_path(), manifest)
        cache = open_tiered_cache(config)
        self.cache = PromptCache(
            cache,
            load_secret(config, cache),
            resolve_model(config.model).identity,
            config.limits(),
            resolve_embedder(config.embedder)[1].key if config.embedder else "",
            self.adapters.resolve,
        )
        self.metrics = m = tb.Metrics(args["model_name"])
        self.requests = {
            s: m.counter(
                "tiercache_prompt_cache_requests_total", "Requests by cache status", status=s
            )
            for s in [*(c.value for c in CacheStatus), "error"]
        }
        self.hits = {
            t: m.counter("tiercache_prompt_cache_hits_total", "Exact hits by tier", tier=t.value)
            for t, _ in self.cache.cache.stores()
        }
        self.lookup_s = m.histogram(
            "tiercache_prompt_cache_lookup_seconds", "Stage time per request"
        )
        tb.StoreMetrics(m, self.cache.cache)
        tb.export_redis(m, self.cache.cache)  # with L3: Redis health and invalidations applied
        m.start()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            started = time.perf_counter()
            try:
                result = self.cache.lookup(tb.read_raw_inputs(request))
            except Exception as exc:  # noqa: BLE001 - mapped to this request's error response
                self.requests["error"].increment(1)
                responses.append(tb.error_response(exc))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        tb.bytes_tensor("REQUEST", [request_json(result)]),
                        tb.bytes_tensor("DIGEST", [result.digest or ""]),
                        tb.bytes_tensor("CACHED_TEXT", [result.text]),
                        tb.bytes_tensor("LOOKUP_STATUS", [result.status.value]),
                        tb.scalar_tensor("WRITE_BACK", result.write_back, np.bool_),
                        tb.bytes_tensor("SCOPE", [result.scope]),
                        tb.scalar_tensor("SEMANTIC_LOOKUP", result.semantic_lookup, np.bool_),
                    ]
                )
            )
            self.requests[result.status.value].increment(1)
            if result.tier is not None:
                self.hits[result.tier].increment(1)
            self.lookup_s.observe(time.perf_counter() - started)
        return responses

    def finalize(self) -> None:
        self.metrics.close()
        self.cache.cache.close()
