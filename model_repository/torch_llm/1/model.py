"""Triton model `torch_llm` (decoupled): the PyTorch engine (tiercache.stages.torch_llm).
execute() checks each request's seal and decodes its inputs (a forged or malformed call is
answered there, never queued), then queues it; the stage's worker runs it and streams each
chunk of an answer as a response through the sink below."""

from __future__ import annotations

import os

# Defaults (the environment wins), set before any import loads torch: libgomp reads its
# variables once, when torch loads it.
# Spinning OpenMP workers of two torch processes would steal the cores from each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# HF tokenizers' rayon pool would add a thread per core; this process's calls are small.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import EngineConfig
from tiercache.engine.adapters import AdapterOrder
from tiercache.exact.request import GenerationRequest
from tiercache.stages.envelope import Freshness, check_envelope_size
from tiercache.stages.seal import ENGINE_INPUTS, Sealer
from tiercache.stages.torch_llm import decode_call, open_torch_llm
from tiercache.triton import io

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def decode(
    request: object, sealer: Sealer, freshness: Freshness
) -> tuple[AdapterOrder, GenerationRequest | None]:
    inputs = io.Inputs(request)
    blobs = {name: inputs.blob(name) for name in (*ENGINE_INPUTS, "ENGINE_SEAL")}
    check_envelope_size(blobs.get("ENVELOPE"))
    return decode_call(sealer, freshness, blobs)


class Sink:
    """One request's responses (the engine's inputs and outputs have no batch dimension)."""

    def __init__(self, sender: object) -> None:
        self.sender = sender

    def is_cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())

    def send_chunk(self, text: str) -> None:
        chunk = io.bytes_tensor("TEXT", [text], batched=False)
        self.sender.send(pb_utils.InferenceResponse([chunk]))

    def send_final(
        self,
        text: str,
        finish_reason: str,
        generated: int,
        prompt: int,
        reused: int,
        computed: int,
        speculated: int = 0,
        mean_logprob: float | None = None,
        engine_s: float | None = None,
    ) -> None:
        logprob = float("nan") if mean_logprob is None else mean_logprob
        spent = float("nan") if engine_s is None else engine_s
        response = pb_utils.InferenceResponse(
            [
                io.bytes_tensor("TEXT", [text], batched=False),
                io.bytes_tensor("FINISH_REASON", [finish_reason], batched=False),
                io.scalar_tensor("GENERATED_TOKENS", generated, np.int32, False),
                io.scalar_tensor("PROMPT_TOKENS", prompt, np.int32, False),
                io.scalar_tensor("REUSED_TOKENS", reused, np.int32, False),
                io.scalar_tensor("COMPUTED_TOKENS", computed, np.int32, False),
                io.scalar_tensor("SPECULATED_TOKENS", speculated, np.int32, False),
                io.scalar_tensor("MEAN_LOGPROB", logprob, np.float32, False),
                io.scalar_tensor("ENGINE_S", spent, np.float32, False),
            ]
        )
        self.sender.send(response, flags=FINAL)

    def send_error(self, exc: BaseException) -> None:
        self.sender.send(io.error_response(exc), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(EngineConfig, args)
        self.stage = open_torch_llm(config, args["model_name"])
        io.freeze_startup_objects()

    def execute(self, requests: list) -> None:
        for request in requests:
            sink = Sink(request.get_response_sender())
            try:  # here, not on the worker: a forged call never waits in line nor costs it
                decoded = decode(request, self.stage.sealer, self.stage.freshness)
            except Exception as exc:  # noqa: BLE001 - this request's error
                self.stage.refuse(exc, sink)
                continue
            self.stage.submit(decoded, sink)
        return None

    def finalize(self) -> None:
        self.stage.close()
