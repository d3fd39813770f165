"""Triton model `cache_admin`: decode ADMIN, call tiercache.admin, encode ADMIN_RESULT; adapter
warm-ups go to lora_cache's `warm` admin op over BLS."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from tiercache.admin import open_admin
from tiercache.config import CacheAdminConfig
from tiercache.engine.model_source import resolve_model
from tiercache.errors import InvalidRequest, NotFound, Unavailable
from tiercache.lora.registry import AdapterRegistry
from tiercache.triton import boundary as tb


class LoraWarmBls:
    """lora_cache's `{"op": "warm", "names": [...]}` over BLS (it batches: max_batch_size 8)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def __call__(self, names: Sequence[str]) -> dict[str, Any]:
        admin = json.dumps({"op": "warm", "names": list(names)})
        request = pb_utils.InferenceRequest(
            model_name=self.model_name,
            inputs=[tb.bytes_tensor("ADMIN", [admin])],
            requested_output_names=["ADMIN_RESULT"],
        )
        response = request.exec()
        if response.has_error():
            message = str(response.error().message())
            for error in (NotFound, InvalidRequest):  # lora_cache's own kind prefixes
                prefix = f"{error.kind}: "
                if message.startswith(prefix):
                    raise error(message[len(prefix) :])
            raise Unavailable(f"{self.model_name}: {message}")
        text = tb.output_string(response, "ADMIN_RESULT") or ""
        try:
            answer: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise Unavailable(f"{self.model_name}: warm answer is not JSON") from exc
        return answer


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = tb.load_config(CacheAdminConfig, args)
        manifest = Path(config.adapters_manifest) if config.adapters_manifest else None
        adapters = AdapterRegistry(config.adapters_path(), config.state_path(), manifest)
        self.admin = open_admin(
            config,
            resolve_model(config.model).identity,
            adapters.resolve,
            LoraWarmBls(config.lora_model),
        )
        self.metrics = m = tb.Metrics(args["model_name"])
        tb.InvalidatorMetrics(m, self.admin.invalidator)
        tb.export_redis(m, self.admin.cache)  # with L3: Redis health and invalidations applied
        m.start()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                text = tb.Inputs(request).string("ADMIN")
                if not text:
                    raise InvalidRequest("ADMIN is required")
                answer = self.admin.run(text)
            except Exception as exc:  # noqa: BLE001 - mapped to this request's error response
                responses.append(tb.error_response(exc))
                continue
            result = json.dumps(answer.result, sort_keys=True)
            responses.append(
                pb_utils.InferenceResponse([tb.bytes_tensor("ADMIN_RESULT", [result])])
            )
        return responses

    def finalize(self) -> None:
        self.metrics.close()
        self.admin.cache.close()
