"""Triton model `feedback`: decode ANSWER_ID, VERDICT and tenant (and the forwarded API key),
act on the verdict (tiercache.stages.feedback), encode FEEDBACK_RESULT."""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from tiercache.config import FeedbackConfig
from tiercache.exact.request import DEFAULT_LIMITS
from tiercache.exact.tenant_keys import AUTH_PARAMETER
from tiercache.stages.feedback import MAX_ANSWER_ID_CHARS, MAX_VERDICT_BYTES, open_feedback
from tiercache.triton import io


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(FeedbackConfig, args)
        self.stage = open_feedback(config, args["model_name"])
        io.freeze_startup_objects()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                inputs = io.Inputs(request)
                key = None
                if self.stage.keys is not None:  # the forwarded authorization header
                    key = io.request_parameter(request, AUTH_PARAMETER)
                answer = self.stage.give(  # each bounded before it is decoded
                    inputs.string("ANSWER_ID", MAX_ANSWER_ID_CHARS),
                    inputs.string("VERDICT", MAX_VERDICT_BYTES),
                    inputs.string("tenant", DEFAULT_LIMITS.max_tenant_bytes),
                    key,
                )
            except Exception as exc:  # noqa: BLE001 - mapped to this request's error response
                responses.append(io.error_response(exc))
                continue
            result = json.dumps(answer, sort_keys=True)
            responses.append(
                pb_utils.InferenceResponse([io.bytes_tensor("FEEDBACK_RESULT", [result])])
            )
        return responses

    def finalize(self) -> None:
        self.stage.close()
