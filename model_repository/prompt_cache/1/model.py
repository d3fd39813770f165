"""Triton model `prompt_cache`: decode the public inputs, look the request up
(tiercache.stages.prompt_cache), encode the sealed envelope and the cached answer."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from tiercache.config import PromptCacheConfig
from tiercache.exact.tenant_keys import AUTH_PARAMETER
from tiercache.stages.prompt_cache import open_prompt_cache
from tiercache.triton import io


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(PromptCacheConfig, args)
        self.stage = open_prompt_cache(config, args["model_name"])
        io.freeze_startup_objects()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                key = None
                if self.stage.keys is not None:  # the forwarded authorization header
                    key = io.request_parameter(request, AUTH_PARAMETER)
                envelope, cached_text, tokens = self.stage.lookup(io.Inputs(request), key)
            except Exception as exc:  # noqa: BLE001 - mapped to this request's error response
                self.stage.count_error(exc)
                responses.append(io.error_response(exc))
                continue
            tensor = pb_utils.Tensor
            outputs = [
                tensor("ENVELOPE", envelope),
                tensor("CACHED_TEXT", cached_text),
                tensor("CACHED_TOKENS", tokens),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses

    def finalize(self) -> None:
        self.stage.close()
