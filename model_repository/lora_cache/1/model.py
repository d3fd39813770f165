"""Triton model `lora_cache`: take the sealed envelope (or a sealed ADMIN call), plan the adapter
(tiercache.stages.lora_cache), encode what the engine must load and evict (the adapter files
encrypted, tiercache.stages.transport), sealed for llm."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import LoraCacheConfig
from tiercache.lora.stage import HIT_STATUSES
from tiercache.stages.lora_cache import OUTPUTS, open_lora_cache_stage
from tiercache.stages.seal import Part
from tiercache.triton import io
from tiercache.vocabulary import is_hit

# A hit's response (what `_respond` sends for no plan, unsealed): every output empty. The
# arrays are shared by every hit's response, read-only (the backend serializes each into the
# response's own buffer when it is sent).
HIT_OUTPUTS = tuple(
    (name, io.read_only(np.array([[b""]], dtype=np.object_))) for name in (*OUTPUTS, "LORA_SEAL")
)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(LoraCacheConfig, args)
        self.stage = open_lora_cache_stage(config, args["model_name"])
        io.freeze_startup_objects()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(self._serve(io.Inputs(request)))
            except Exception as exc:  # noqa: BLE001 - this request's error response
                self.stage.count_error()
                responses.append(io.error_response(exc))
        return responses

    def _serve(self, inputs: io.Inputs) -> Any:
        admin = inputs.string("ADMIN")
        if admin:
            seal = inputs.string("ADMIN_SEAL")
            plan, result = self.stage.admin(admin, seal)  # Forbidden unless sealed
            return self._respond(self.stage.outputs(plan, seal or "", result), "")
        status = inputs.string("LOOKUP_STATUS")
        if status in HIT_STATUSES:  # answered from a cache: no adapter, the envelope unused
            inputs.blob("ENVELOPE")  # but a malformed one is still this request's error
            self.stage.count_hit()
            return pb_utils.InferenceResponse([pb_utils.Tensor(n, a) for n, a in HIT_OUTPUTS])
        envelope = self.stage.received(inputs.blob("ENVELOPE"))
        plan = self.stage.plan(envelope, status)
        outputs = self.stage.outputs(plan, envelope.seal)
        # llm checks LORA_SEAL on misses only: a hit's response goes unsealed (a forged status
        # here gains nothing: llm checks embedding_cache's seal over the status it acts on).
        seal = "" if is_hit(status or "") else self.stage.seal(envelope, outputs)
        return self._respond(outputs, seal)

    def _respond(self, outputs: dict[str, Part], seal: str) -> Any:
        """The response: `outputs` and LORA_SEAL (empty for a hit, and for an admin call's
        answer, which goes back to its internal caller over BLS)."""
        tensors = [
            io.bytes_tensor(name, [value])
            if isinstance(value, str | bytes)
            else pb_utils.Tensor(name, value)
            for name, value in outputs.items()
        ]
        tensors.append(io.bytes_tensor("LORA_SEAL", [seal]))
        return pb_utils.InferenceResponse(tensors)

    def finalize(self) -> None:
        self.stage.close()
