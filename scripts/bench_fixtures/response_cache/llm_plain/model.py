"""`llm_plain`: a non-decoupled Python model in front of the real `torch_llm` engine, so that
Triton's own response cache (which refuses decoupled models) can sit in front of the same engine
as tiercache. A miss reaches execute(): the inputs are read and canonicalized by the package's own
code (`tiercache.triton.io.read_raw_inputs`, `tiercache.exact.request.canonicalize`), exactly as
tiercache's prompt_cache does, so the engine gets the request tiercache's llm stage sends it: the
same normalized prompt text (NFKC, whitespace runs collapsed to one space), the same max_tokens
default and sampling fields, the adapter's name and digest, and the tenant's scope
(`tiercache.exact.keys.tenant_scope` under this server's secret) as the prefix-KV scope. It goes to
`torch_llm` over BLS, sealed as llm seals its engine calls, and the streamed chunks are joined
into one `text_output`. An adapter's files travel with an instance's first request for it (the
engine holds up to `lora_slots` adapters, four by default, so the committed three stay loaded; a
second load of a held adapter is a no-op). A hit never reaches this code: Triton answers it.

Benchmark fixture (tiercache_dev.perf.soak --compare); not served from this folder."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import ADAPTERS_DIR_ENV, default_state_dir
from tiercache.exact.keys import tenant_scope
from tiercache.exact.request import GenerationRequest, canonicalize
from tiercache.lora.registry import AdapterRegistry
from tiercache.stages.common import engine_inputs
from tiercache.stages.envelope import Envelope
from tiercache.stages.parts import host_secret, open_sealer
from tiercache.triton import io
from tiercache.triton.bls import StreamKeeper

ENGINE = "torch_llm"
ENGINE_OUTPUTS = ["TEXT", "FINISH_REASON"]


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        state_dir = default_state_dir()
        adapters = Path(os.environ.get(ADAPTERS_DIR_ENV) or state_dir / "adapters")
        self.registry = AdapterRegistry(adapters, state_dir)
        self.sealer = open_sealer(state_dir)
        # The tenant scope prompt_cache computes (HMAC under the server secret), so the engine's
        # prefix-KV blocks are keyed exactly as they are behind tiercache.
        self.secret = host_secret(state_dir)
        self.loaded: set[str] = set()  # adapter digests this instance sent to the engine
        self.streams = StreamKeeper()  # as in llm: the stub never drops a stream without the GIL

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                text = self._answer(request)
                out = pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
                responses.append(pb_utils.InferenceResponse([out]))
            except Exception as exc:  # noqa: BLE001 - this request's error; the batch goes on
                responses.append(io.error_response(exc))  # one line; a traceback goes to the log
        return responses

    def request_of(self, request: object) -> tuple[GenerationRequest, dict[str, str | bytes]]:
        """The engine's request, as prompt_cache would build it, and the adapter files to send
        with it (none once this instance has sent them)."""
        # Fairness (issue 15): the package's canonicalization, not a copy of it, so the engine
        # sees the same prompt text, max_tokens default and sampling fields as behind tiercache.
        canonical = canonicalize(io.read_raw_inputs(request))
        gen = dataclasses.replace(
            canonical.request, tenant_scope=tenant_scope(self.secret, canonical.tenant)
        )
        files: dict[str, str | bytes] = {}
        if gen.lora_name:
            ref = self.registry.resolve(gen.lora_name)
            gen = dataclasses.replace(gen, lora_task_id=ref.task_id, lora_digest=ref.digest)
            if ref.digest not in self.loaded:
                adapter = self.registry.read(ref)
                files = {"LORA_CONFIG": adapter.config_json, "LORA_WEIGHTS": adapter.weights}
        return gen, files

    def _answer(self, request: object) -> str:
        gen, values = self.request_of(request)
        values["ENVELOPE"] = Envelope(request=gen).seal(self.sealer)
        infer = pb_utils.InferenceRequest(
            model_name=ENGINE,
            inputs=engine_inputs(self.sealer, values),  # sealed, as llm seals its engine calls
            requested_output_names=ENGINE_OUTPUTS,
        )
        chunks = []
        for response in self.streams.read(infer.exec(decoupled=True)):
            if response.has_error():
                raise io.from_triton_error(response.error().message())
            text = io.output_string(response, "TEXT")
            if text:
                chunks.append(text)
        if gen.lora_digest:
            self.loaded.add(gen.lora_digest)
        return "".join(chunks)

    def finalize(self) -> None:
        self.streams.clear()
