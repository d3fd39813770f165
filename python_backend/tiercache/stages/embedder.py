"""The `embedder` model: one encode call per batch of requests (dynamic batching)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tiercache.config import EmbedderConfig
from tiercache.engine.threads import ThreadRole, set_torch_threads
from tiercache.engine.torch_engine import pick_device
from tiercache.memory import MemoryTrimmer
from tiercache.semantic.embedder import Embedder
from tiercache.triton import metrics as tm


class EmbedderStage:
    def __init__(self, embedder: Embedder, trimmer: MemoryTrimmer, metrics: tm.Metrics) -> None:
        self.embedder = embedder
        self.trimmer = trimmer
        self.metrics = metrics
        self.texts = metrics.counter("tiercache_embedder_texts_total", "Texts embedded")
        self.batch_s = metrics.histogram("tiercache_embedder_batch_seconds", "Time per encode call")

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Every text's vector ([n, d] float32), in one encode call."""
        started = time.perf_counter()
        vectors = self.embedder.embed(list(texts)).astype(np.float32)
        self.batch_s.observe(time.perf_counter() - started)
        self.texts.increment(len(texts))
        return vectors

    def after_batch(self) -> None:
        """Freed activations back to the system, at most every interval."""
        self.trimmer.maybe_trim()

    def close(self) -> None:
        self.metrics.close()


def open_embedder(config: EmbedderConfig, model_name: str) -> EmbedderStage:
    """torch's threads set (`torch_threads`), then the embedder loaded and its metrics
    started."""
    set_torch_threads(config.torch_threads, ThreadRole.EMBEDDER)
    metrics = tm.Metrics(model_name)
    stage = EmbedderStage(
        Embedder(
            config.embedder,
            pick_device(config.device),
            packed_linears=config.packed_linears,
        ),
        MemoryTrimmer(config.memory_trim_interval_s),
        metrics,
    )
    metrics.start()
    return stage
