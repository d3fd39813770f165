"""`llm_plain`: a non-decoupled Python model in front of the real `torch_llm` engine, so that
Triton's own response cache (which refuses decoupled models) can sit in front of the same engine
as tiercache. A miss reaches execute(): the request becomes the engine's canonical request JSON
(greedy, `max_tokens`, the adapter's name and digest, the tenant as the prefix-KV scope), goes to
`torch_llm` over BLS, and the streamed chunks are joined into one `text_output`. An adapter's
files travel with its first request (the engine holds up to `lora_slots` adapters, four by
default, so the committed three stay loaded). A hit never reaches this code: Triton answers it.

Benchmark fixture (tiercache_dev.perf.soak --compare); not served from this folder."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import ADAPTERS_DIR_ENV, default_state_dir
from tiercache.exact.request import GenerationRequest
from tiercache.lora.registry import AdapterRegistry
from tiercache.stages.common import engine_inputs
from tiercache.stages.envelope import Envelope
from tiercache.stages.parts import open_sealer
from tiercache.triton.bls import StreamKeeper

ENGINE = "torch_llm"
DEFAULT_MAX_TOKENS = 16
ENGINE_OUTPUTS = ["TEXT", "FINISH_REASON"]


def _string(request: object, name: str) -> str | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _int(request: object, name: str) -> int | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else int(tensor.as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        state_dir = default_state_dir()
        adapters = Path(os.environ.get(ADAPTERS_DIR_ENV) or state_dir / "adapters")
        self.registry = AdapterRegistry(adapters, state_dir)
        self.sealer = open_sealer(state_dir)
        self.loaded: set[str] = set()  # adapter digests sent to the engine
        self.streams = StreamKeeper()  # as in llm: the stub never drops a stream without the GIL

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                text = self._answer(request)
                out = pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
                responses.append(pb_utils.InferenceResponse([out]))
            except Exception as exc:  # noqa: BLE001 - this request's error; the batch goes on
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"llm_plain: {exc}")  # no traceback
                    )
                )
        return responses

    def _answer(self, request: object) -> str:
        prompt = _string(request, "text_input")
        if not prompt:
            raise ValueError("text_input is required")
        tenant = _string(request, "tenant") or ""
        lora_name = _string(request, "lora_name") or ""
        values: dict[str, str | bytes] = {}
        task_id, digest = 0, ""
        if lora_name:
            ref = self.registry.resolve(lora_name)
            task_id, digest = ref.task_id, ref.digest
            if digest not in self.loaded:
                files = self.registry.read(ref)
                values["LORA_CONFIG"] = files.config_json
                values["LORA_WEIGHTS"] = files.weights
        gen = GenerationRequest(
            prompt=prompt,
            max_tokens=_int(request, "max_tokens") or DEFAULT_MAX_TOKENS,
            lora_name=lora_name,
            lora_task_id=task_id,
            lora_digest=digest,
            tenant_scope=hashlib.sha256(tenant.encode()).hexdigest(),
        )
        values["ENVELOPE"] = Envelope(request=gen).seal(self.sealer)
        infer = pb_utils.InferenceRequest(
            model_name=ENGINE,
            inputs=engine_inputs(self.sealer, values),  # sealed, as llm seals its engine calls
            requested_output_names=ENGINE_OUTPUTS,
        )
        chunks = []
        for response in self.streams.read(infer.exec(decoupled=True)):
            if response.has_error():
                raise RuntimeError(f"engine {ENGINE}: {response.error().message()}")
            tensor = pb_utils.get_output_tensor_by_name(response, "TEXT")
            if tensor is not None:
                value = tensor.as_numpy().reshape(-1)[0]
                chunks.append(value.decode("utf-8") if isinstance(value, bytes) else str(value))
        if digest:
            self.loaded.add(digest)
        return "".join(chunks)
