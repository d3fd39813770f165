"""Triton model `embedding_cache`: open the sealed envelope, look requests up by meaning in one
batch (tiercache.stages.embedding_cache), encode each request's answer, sealed, for llm (an
exact hit's answer goes from prompt_cache to llm directly: its pass-through here is empty)."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import EmbeddingCacheConfig
from tiercache.stages.embedding_cache import EXACT_PASS, Answer, open_embedding_cache
from tiercache.stages.envelope import Envelope, seal_of
from tiercache.stages.seal import neighbours_text, tokens_array, tokens_of, trust_array
from tiercache.triton import io

NO_VECTOR = np.zeros((1, 0), dtype=np.float32)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(EmbeddingCacheConfig, args)
        self.stage = open_embedding_cache(config, args["model_name"], args["model_instance_name"])
        io.freeze_startup_objects()

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        seals = [""] * len(requests)  # each request's envelope seal, which its answer's binds
        todo: list[tuple[int, Envelope]] = []  # looked up together, in one embedding call
        for i, request in enumerate(requests):
            try:
                inputs = io.Inputs(request)
                # an exact hit goes from prompt_cache to llm directly: nothing to check here,
                # nor its text to decode
                if self.stage.exact_hit(inputs.blob("CACHED_TEXT")) is not None:  # EXACT_PASS
                    responses[i] = pb_utils.InferenceResponse(
                        [pb_utils.Tensor(n, a) for n, a in EXACT_PASS_ARRAYS]
                    )
                    continue
                cached_text = inputs.string("CACHED_TEXT") or ""
                data = inputs.blob("ENVELOPE")
                tokens = tokens_of(inputs.vector("CACHED_TOKENS"))
                seals[i] = seal_of(data)
                envelope = self.stage.open(data, cached_text, tokens)
                answer = self.stage.pass_through(envelope, cached_text, tokens)
            except Exception as exc:  # noqa: BLE001 - this request's error response
                self.stage.count_error()
                responses[i] = io.error_response(exc)
                continue
            if answer is None:
                todo.append((i, envelope))
            else:
                responses[i] = encode(answer, self.stage.seal(seals[i], answer))
        if todo:
            answers = self.stage.lookup([envelope for _, envelope in todo])
            for (i, _), answer in zip(todo, answers, strict=True):
                responses[i] = encode(answer, self.stage.seal(seals[i], answer))
        return responses

    def finalize(self) -> None:
        self.stage.close()


def arrays(answer: Answer, seal: str) -> list[tuple[str, np.ndarray]]:
    """A response's output arrays by name: `answer` and its seal (bound to the envelope's)."""
    vector = answer.vector
    embedding = NO_VECTOR if vector is None else vector.reshape(1, -1).astype(np.float32)
    return [
        ("ANSWER_TEXT", io.bytes_array(answer.text)),
        ("ANSWER_STATUS", io.bytes_array(answer.status)),
        ("SIMILARITY", np.array([[answer.similarity]], dtype=np.float32)),
        ("EMBEDDING", embedding),
        ("ANSWER_SEAL", io.bytes_array(seal)),
        ("ANSWER_TOKENS", tokens_array(answer.tokens).reshape(1, 3)),
        ("NEIGHBOURS", io.bytes_array(neighbours_text(answer.neighbours))),
        ("HIT_TRUST", trust_array(answer.score, answer.verify).reshape(1, -1)),
    ]


def encode(answer: Answer, seal: str) -> object:
    return pb_utils.InferenceResponse([pb_utils.Tensor(n, a) for n, a in arrays(answer, seal)])


# An exact hit's pass-through (EXACT_PASS, unsealed) is the same every time: its arrays are
# built once and shared by every such response, read-only (the backend serializes or copies
# each into the response's own buffer when it is sent).
EXACT_PASS_ARRAYS = tuple((name, io.read_only(array)) for name, array in arrays(EXACT_PASS, ""))
