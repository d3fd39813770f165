"""Triton model `embedding_cache`: decode inputs, call tiercache.semantic.stage, encode outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import EmbeddingCacheConfig
from tiercache.errors import InvalidRequest, Unavailable
from tiercache.prompt_cache import CacheStatus, invalidation_listener, open_tiered_cache
from tiercache.request import GenerationRequest
from tiercache.semantic.embedder import Screen, resolve_embedder
from tiercache.semantic.guard import load_guard
from tiercache.semantic.index import SemanticIndex, SemanticStore
from tiercache.semantic.stage import EmbeddingCache, SemanticOutcome
from tiercache.semantic.vectors import VectorCache
from tiercache.triton import boundary as tb

NO_VECTOR = np.zeros((1, 0), dtype=np.float32)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.config = config = tb.load_config(EmbeddingCacheConfig, args)[0]
        _, identity = resolve_embedder(config.embedder)
        guard = load_guard(target_precision=config.target_precision or None)
        self.stage = EmbeddingCache(
            VectorCache(
                config.vectors_path(),
                identity.dimensions,
                config.vector_l1_max_bytes,
                config.vector_l2_max_bytes,
            ),
            SemanticIndex(
                SemanticStore(config.semantic_path(), config.semantic_max_bytes),
                identity.dimensions,
                config.flat_max_rows,
            ),
            open_tiered_cache(config),
            self._embed,
            guard.choose,
            identity.key,
            top_k=config.top_k,
            min_similarity=config.min_similarity,
            screen=Screen(config.embedder).check,
        )
        # Open the host's scope tables now (large scopes load or build their HNSW graph here),
        # so the first request does not pay for it; later rows are in the shared tables.
        self.stage.index.refresh()
        listener = invalidation_listener(self.stage.answers)
        if listener is not None:  # with L3: invalidated answers' rows stop being candidates
            listener.on_dropped(lambda _inv, digests: self.stage.index.forget(digests))
        self.metrics = m = tb.Metrics(args["model_name"], instance=args["model_instance_name"])
        self.outcomes = {
            o: m.counter(
                "tiercache_embedding_cache_lookups_total", "Semantic lookups by outcome", outcome=o
            )
            for o in [*(x.value for x in SemanticOutcome), "skipped", "error"]
        }
        self.vector_hits = m.counter(
            "tiercache_embedding_cache_vector_hits_total", "Prompt vectors found in the cache"
        )
        self.lookup_s = m.histogram(
            "tiercache_embedding_cache_lookup_seconds", "Semantic lookup time, embedding included"
        )
        self.rows = m.gauge("tiercache_embedding_cache_index_rows", "Rows in the semantic index")
        m.on_flush(lambda: self.rows.set(self.stage.index.size()))
        tb.export_redis(m, self.stage.answers)  # with L3: Redis health and invalidations applied
        m.start()

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        """One BLS call to the embedder for all texts, as one [n, 1] batch."""
        batch = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
        request = pb_utils.InferenceRequest(
            model_name=self.config.embedder_model,
            inputs=[pb_utils.Tensor("TEXT", batch)],
            requested_output_names=["EMBEDDING"],
        )
        response = request.exec()
        if response.has_error():
            raise Unavailable(f"embedder: {response.error().message()}")
        return pb_utils.get_output_tensor_by_name(response, "EMBEDDING").as_numpy()

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        todo: list[tuple[int, str, str, str]] = []  # (index, prompt, scope, status) to look up
        for i, request in enumerate(requests):
            try:
                inputs = tb.Inputs(request)
                status = inputs.string("LOOKUP_STATUS") or ""
                if not inputs.boolean("SEMANTIC_LOOKUP"):
                    responses[i] = self._respond(inputs.string("CACHED_TEXT") or "", status)
                    self.outcomes["skipped"].increment(1)
                    continue
                request_json, scope = inputs.string("REQUEST"), inputs.string("SCOPE")
                if not request_json or not scope:
                    raise InvalidRequest("a semantic lookup needs REQUEST and SCOPE")
                prompt = GenerationRequest.from_json(request_json).prompt
                todo.append((i, prompt, scope, status))
            except Exception as exc:  # noqa: BLE001 - this request's error response
                self.outcomes["error"].increment(1)
                responses[i] = tb.error_response(exc)
        if todo:
            self._lookup(todo, responses)
        return responses

    def _lookup(self, todo: list[tuple[int, str, str, str]], responses: list) -> None:
        started = time.perf_counter()
        try:
            found = self.stage.lookup([t[1] for t in todo], [t[2] for t in todo])
        except Exception:  # noqa: BLE001 - semantic caching is an optimisation: fall through
            tb.log.exception("semantic lookup failed; the requests go on as misses")
            for i, _, _, status in todo:
                self.outcomes["error"].increment(1)
                responses[i] = self._respond("", status)
            return
        elapsed = time.perf_counter() - started
        for (i, _, _, status), result in zip(todo, found, strict=True):
            if result.outcome is SemanticOutcome.HIT:
                responses[i] = self._respond(
                    result.text, CacheStatus.SEMANTIC.value, result.similarity, result.vector
                )
            else:  # the exact lookup's status (miss, or bypass for semantic-only) goes on
                responses[i] = self._respond("", status, 0.0, result.vector)
            self.outcomes[result.outcome.value].increment(1)
            self.vector_hits.increment(int(result.vector_cached))
            self.lookup_s.observe(elapsed / len(todo))

    @staticmethod
    def _respond(
        text: str, status: str, similarity: float = 0.0, vector: np.ndarray | None = None
    ) -> object:
        embedding = NO_VECTOR if vector is None else vector.reshape(1, -1).astype(np.float32)
        return pb_utils.InferenceResponse(
            [
                tb.bytes_tensor("ANSWER_TEXT", [text]),
                tb.bytes_tensor("ANSWER_STATUS", [status]),
                tb.scalar_tensor("SIMILARITY", similarity, np.float32),
                pb_utils.Tensor("EMBEDDING", embedding),
            ]
        )

    def finalize(self) -> None:
        self.metrics.close()
        self.stage.close()
