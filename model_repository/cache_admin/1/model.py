"""Triton model `cache_admin`: decode ADMIN and ADMIN_TOKEN, run the call behind the admin token
(tiercache.stages.cache_admin), encode ADMIN_RESULT."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from tiercache.admin import MAX_ADMIN_BYTES
from tiercache.config import CacheAdminConfig
from tiercache.stages.cache_admin import open_cache_admin
from tiercache.triton import io


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(CacheAdminConfig, args)
        self.stage = open_cache_admin(config, args["model_name"])
        io.freeze_startup_objects()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                inputs = io.Inputs(request)
                self.stage.gate.check(inputs.string("ADMIN_TOKEN"))  # before ADMIN is decoded
                result = self.stage.run_allowed(inputs.string("ADMIN", MAX_ADMIN_BYTES))
            except Exception as exc:  # noqa: BLE001 - mapped to this request's error response
                responses.append(io.error_response(exc))
                continue
            responses.append(
                pb_utils.InferenceResponse([io.bytes_tensor("ADMIN_RESULT", [result])])
            )
        return responses

    def finalize(self) -> None:
        self.stage.close()
