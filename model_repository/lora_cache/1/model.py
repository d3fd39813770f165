"""Triton model `lora_cache`: take the sealed envelope (or a sealed ADMIN call), plan the adapter
(tiercache.stages.lora_cache), encode what the engine must load and evict, sealed for llm."""

from __future__ import annotations

import json
from typing import Any

import triton_python_backend_utils as pb_utils

from tiercache.config import LoraCacheConfig
from tiercache.lora.residency import LoraPlan
from tiercache.stages.envelope import ReceivedEnvelope
from tiercache.stages.lora_cache import OUTPUTS, open_lora_cache_stage
from tiercache.stages.seal import Part
from tiercache.triton import io
from tiercache.vocabulary import is_hit


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(LoraCacheConfig, args)
        self.stage = open_lora_cache_stage(config, args["model_name"])

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
            plan, result = self.stage.admin(admin, inputs.string("ADMIN_SEAL"))
            return self._respond(None, plan, result)
        envelope = self.stage.received(inputs.blob("ENVELOPE"))
        status = inputs.string("LOOKUP_STATUS")
        plan = self.stage.plan(envelope, status)
        # llm checks LORA_SEAL on misses only: a hit's response goes unsealed (a forged status
        # here gains nothing: llm checks embedding_cache's seal over the status it acts on).
        return self._respond(None if is_hit(status or "") else envelope, plan)

    def _respond(
        self, envelope: ReceivedEnvelope | None, plan: LoraPlan | None, admin_result: str = ""
    ) -> Any:
        """The response; with `envelope` (an ensemble request that is not a hit) LORA_SEAL over
        what llm reads, else an empty LORA_SEAL (an admin call's answer goes back to its
        internal caller over BLS)."""
        values: tuple[str | bytes, ...]
        if plan is None:
            values = ("", "", b"", "", "", admin_result)
        else:
            weights = plan.weights
            values = (
                plan.ref.to_json(),
                weights.config_json if weights else "",
                weights.weights if weights else b"",
                json.dumps(list(plan.evict)),
                plan.tier,
                admin_result,
            )
        outputs: dict[str, Part] = dict(zip(OUTPUTS, values, strict=True))
        if plan is not None:
            outputs.update(self.stage.trtllm_tensors(plan))
        seal = "" if envelope is None else self.stage.seal(envelope, outputs)
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
