"""Triton model `embedder`: one encode call per batch of requests (dynamic batching)."""

from __future__ import annotations

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import EmbedderConfig
from tiercache.engine.torch_engine import pick_device
from tiercache.semantic.embedder import Embedder
from tiercache.triton import boundary as tb


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = tb.load_config(EmbedderConfig, args)
        self.embedder = Embedder(config.embedder, pick_device(config.device))
        self.metrics = m = tb.Metrics(args["model_name"])
        self.texts = m.counter("tiercache_embedder_texts_total", "Texts embedded")
        self.batch_s = m.histogram("tiercache_embedder_batch_seconds", "Time per encode call")
        m.start()

    def execute(self, requests: list) -> list:
        texts: list[str | None] = []
        errors: list[Exception | None] = []
        for request in requests:
            try:
                text = tb.Inputs(request).string("TEXT")
                if text is None:
                    raise ValueError("TEXT is required")
                texts.append(text)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - this request's error response
                texts.append(None)
                errors.append(exc)
        valid = [t for t in texts if t is not None]
        started = time.perf_counter()
        vectors = iter(self.embedder.embed(valid)) if valid else iter(())
        self.batch_s.observe(time.perf_counter() - started)
        self.texts.increment(len(valid))
        responses = []
        for text, error in zip(texts, errors, strict=True):
            if error is not None or text is None:
                responses.append(tb.error_response(error or ValueError("no text")))
                continue
            vector = next(vectors).reshape(1, -1).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", vector)]))
        return responses

    def finalize(self) -> None:
        self.metrics.close()
