"""Calls of an internal stage as this server's own pipeline makes them: sealed under the
server's secret (tiercache.stages.seal), which a test reads from the server's state folder. A
client without that file cannot make these calls (tests/security shows them refused)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tiercache.exact.request import GenerationRequest
from tiercache.stages.envelope import ENVELOPE_TENSOR, Envelope
from tiercache.stages.parts import open_sealer
from tiercache.stages.seal import ENGINE_INPUTS, ENGINE_LABEL, seal_tensors


def engine_inputs(state_dir: Path, request: GenerationRequest) -> list[grpcclient.InferInput]:
    """torch_llm's inputs for one generation of `request`, sealed as llm seals them."""
    sealer = open_sealer(state_dir)
    return engine_call(state_dir, {ENVELOPE_TENSOR: Envelope(request=request).seal(sealer)})


def engine_call(state_dir: Path, values: dict[str, str | bytes]) -> list[grpcclient.InferInput]:
    """torch_llm's inputs for one call (`values` by input name: LORA_OP, LORA_EVICT, ...),
    sealed as lora_cache and llm seal their calls."""
    sealer = open_sealer(state_dir)
    seal = seal_tensors(sealer, ENGINE_LABEL, ENGINE_INPUTS, dict(values))
    tensors = []
    for name, value in {**values, "ENGINE_SEAL": seal}.items():
        data = value.encode() if isinstance(value, str) else value
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([data], dtype=np.object_))
        tensors.append(tensor)
    return tensors
