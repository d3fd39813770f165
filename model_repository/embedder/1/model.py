"""Triton model `embedder`: decode every request's texts, embed them in one call
(tiercache.stages.embedder), encode each request's vectors."""

from __future__ import annotations

import os

# Defaults (the environment wins), set before any import loads torch: libgomp reads its
# variables once, when torch loads it.
# Spinning OpenMP workers of two torch processes would steal the cores from each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# HF tokenizers' rayon pool would add a thread per core; this process's calls are small.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import triton_python_backend_utils as pb_utils

from tiercache.config import EmbedderConfig
from tiercache.errors import InvalidRequest
from tiercache.exact.request import DEFAULT_LIMITS
from tiercache.stages.embedder import open_embedder
from tiercache.stages.seal import SEAL_CHARS
from tiercache.triton import io

# A text to embed: embedding_cache sends prompts prompt_cache accepted and its screen let
# through (a few hundred tokens); anyone calling this model directly gets no more. The
# tokenizer reads a text whole before it truncates it (seconds and gigabytes for megabytes).
MAX_TEXT_BYTES = DEFAULT_LIMITS.max_prompt_bytes


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(EmbedderConfig, args)
        self.stage = open_embedder(config, args["model_name"])
        io.freeze_startup_objects()

    def execute(self, requests: list) -> list:
        """Each request may hold a batch of texts ([n, 1], as embedding_cache sends them), each
        with its seal (TEXT_SEAL, [n, 1]: an internal stage), and gets [n, d] back."""
        batches: list[list[str] | None] = []
        responses: list = [None] * len(requests)
        for i, request in enumerate(requests):
            try:
                inputs = io.Inputs(request)
                texts = inputs.batch_strings("TEXT", MAX_TEXT_BYTES)  # bounded, then decoded
                if not texts:
                    raise InvalidRequest("TEXT is required")
                # sealed over their UTF-8 bytes as embedding_cache sent them; before the tokenizer
                raw = [t.encode("utf-8") for t in texts]
                self.stage.check(raw, inputs.batch_strings("TEXT_SEAL", SEAL_CHARS))
                batches.append(texts)
            except Exception as exc:  # noqa: BLE001 - this request's error response
                batches.append(None)
                responses[i] = io.error_response(exc)
        flat = [t for texts in batches if texts for t in texts]
        if flat:
            try:
                vectors = self.stage.embed(flat)
            except Exception as exc:  # noqa: BLE001 - the batch's requests get its error
                for i, texts in enumerate(batches):
                    if texts:
                        responses[i] = io.error_response(exc)
                self.stage.after_batch()
                return responses
            offset = 0
            for i, texts in enumerate(batches):
                if texts:
                    block = vectors[offset : offset + len(texts)]
                    offset += len(texts)
                    responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", block)])
        self.stage.after_batch()
        return responses

    def finalize(self) -> None:
        self.stage.close()
