"""The `embedder` model: one encode call per batch of requests (dynamic batching)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tiercache.config import EmbedderConfig
from tiercache.engine.threads import ThreadRole, set_torch_threads
from tiercache.engine.torch_engine import pick_device
from tiercache.errors import Forbidden
from tiercache.memory import MemoryTrimmer
from tiercache.semantic.embedder import Embedder
from tiercache.stages.parts import open_sealer
from tiercache.stages.seal import EMBED_LABEL, Sealer
from tiercache.triton import metrics as tm


class EmbedderStage:
    def __init__(
        self,
        embedder: Embedder,
        trimmer: MemoryTrimmer,
        metrics: tm.Metrics,
        sealer: Sealer,
    ) -> None:
        self.embedder = embedder
        self.sealer = sealer
        self.trimmer = trimmer
        self.metrics = metrics
        self.texts = metrics.counter("tiercache_embedder_texts_total", "Texts embedded")
        self.batch_s = metrics.histogram("tiercache_embedder_batch_seconds", "Time per encode call")

    def check(self, texts: Sequence[bytes], seals: Sequence[str] | None) -> None:
        """Forbidden unless every text carries its seal (`EMBED_LABEL`): the embedder is an
        internal stage (a direct caller's large batches would hold the one instance every
        lookup waits on). Checked over the texts' UTF-8 bytes, before the tokenizer."""
        if seals is None or len(seals) != len(texts):
            raise Forbidden(
                "TEXT is not sealed: this stage is internal and takes requests from this "
                "server's pipeline only (call the ensemble)"
            )
        for text, seal in zip(texts, seals, strict=True):
            self.sealer.check(seal, EMBED_LABEL, text, what="TEXT")

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
        open_sealer(config.state_path()),
    )
    metrics.start()
    return stage
