"""The `cache_admin` model: stats, invalidation, flush and warm-up over the deployment's tiers;
adapter warm-ups go to lora_cache's `warm` admin op over BLS."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tiercache.admin import Admin, AdminAnswer
from tiercache.config import CacheAdminConfig
from tiercache.engine.model_source import resolve_model
from tiercache.errors import Unavailable
from tiercache.stages.common import export_redis
from tiercache.stages.parts import admin_over, open_adapters, open_exact_cache
from tiercache.triton import io
from tiercache.triton import metrics as tm
from tiercache.triton.bls import BlsClient


class LoraWarmBls:
    """lora_cache's `{"op": "warm", "names": [...]}` over BLS; lora_cache's NotFound and
    InvalidRequest reach the admin's caller as they are (tiercache.triton.bls)."""

    def __init__(self, model_name: str) -> None:
        self.client = BlsClient(model_name)

    def __call__(self, names: Sequence[str]) -> dict[str, Any]:
        admin = json.dumps({"op": "warm", "names": list(names)})
        response = self.client.infer([io.bytes_tensor("ADMIN", [admin])], ["ADMIN_RESULT"])
        text = io.output_string(response, "ADMIN_RESULT") or ""
        try:
            answer: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise Unavailable(f"{self.client.model_name}: warm answer is not JSON") from exc
        return answer


class CacheAdminStage:
    def __init__(self, admin: Admin, metrics: tm.Metrics) -> None:
        self.admin = admin
        self.metrics = metrics
        tm.InvalidatorMetrics(metrics, admin.invalidator)

    def run(self, text: str) -> str:
        """One ADMIN call's JSON result (InvalidRequest, NotFound, Unavailable as raised)."""
        answer: AdminAnswer = self.admin.run(text)
        return json.dumps(answer.result, sort_keys=True)

    def close(self) -> None:
        self.metrics.close()
        self.admin.cache.close()


def open_cache_admin(config: CacheAdminConfig, model_name: str) -> CacheAdminStage:
    """The admin over the deployment's tiers and adapters, with its metrics (started)."""
    adapters = open_adapters(config.adapters_path(), config.state_path(), config.adapters_manifest)
    tiers = open_exact_cache(config.cache())
    admin = admin_over(
        config,
        tiers,
        resolve_model(config.model).identity,
        adapters.resolve,
        LoraWarmBls(config.lora_model),
    )
    metrics = tm.Metrics(model_name)
    stage = CacheAdminStage(admin, metrics)
    export_redis(metrics, tiers)  # with L3: Redis health and invalidations applied
    metrics.start()
    return stage
