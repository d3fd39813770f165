"""Triton model `embedder`: one encode call per batch of requests (dynamic batching)."""

from __future__ import annotations

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import EmbedderConfig
from tiercache.engine.torch_engine import pick_device
from tiercache.errors import InvalidRequest
from tiercache.memory import MemoryTrimmer
from tiercache.semantic.embedder import Embedder
from tiercache.triton import boundary as tb


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = tb.load_config(EmbedderConfig, args)
        self.embedder = Embedder(config.embedder, pick_device(config.device))
        self.trimmer = MemoryTrimmer(config.memory_trim_interval_s)
        self.metrics = m = tb.Metrics(args["model_name"])
        self.texts = m.counter("tiercache_embedder_texts_total", "Texts embedded")
        self.batch_s = m.histogram("tiercache_embedder_batch_seconds", "Time per encode call")
        m.start()

    def execute(self, requests: list) -> list:
        """Every text of every request in one encode call; each request may hold a batch of
        texts ([n, 1], as embedding_cache sends them) and gets [n, 384] back."""
        batches: list[list[str] | None] = []
        responses: list = [None] * len(requests)
        for i, request in enumerate(requests):
            try:
                texts = tb.Inputs(request).batch_strings("TEXT")
                if not texts:
                    raise InvalidRequest("TEXT is required")
                batches.append(texts)
            except Exception as exc:  # noqa: BLE001 - this request's error response
                batches.append(None)
                responses[i] = tb.error_response(exc)
        flat = [t for texts in batches if texts for t in texts]
        if flat:
            started = time.perf_counter()
            vectors = self.embedder.embed(flat)
            self.batch_s.observe(time.perf_counter() - started)
            self.texts.increment(len(flat))
            offset = 0
            for i, texts in enumerate(batches):
                if texts:
                    block = vectors[offset : offset + len(texts)].astype(np.float32)
                    offset += len(texts)
                    responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", block)])
        self.trimmer.maybe_trim()  # freed activations back to the system, at most every interval
        return responses

    def finalize(self) -> None:
        self.metrics.close()
