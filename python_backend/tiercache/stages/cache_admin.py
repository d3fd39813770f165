"""The `cache_admin` model: stats, invalidation, flush and warm-up over the deployment's tiers;
adapter warm-ups go to lora_cache's `warm` admin op over BLS. Every call needs the operator's
admin token (tiercache.admin.AdminGate); refused calls are counted."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tiercache.admin import (
    Admin,
    AdminAnswer,
    AdminGate,
    admin_token_path,
    load_or_create_admin_token,
)
from tiercache.config import CacheAdminConfig
from tiercache.engine.model_source import resolve_model
from tiercache.errors import InvalidRequest, Unavailable
from tiercache.stages.common import admin_inputs, export_redis
from tiercache.stages.parts import admin_over, open_adapters, open_exact_cache, open_sealer
from tiercache.stages.seal import Sealer
from tiercache.triton import io
from tiercache.triton import metrics as tm
from tiercache.triton.bls import BlsClient


class LoraAdminBls:
    """lora_cache's admin ops (`list`, `warm`) over BLS, sealed: lora_cache takes them from the
    pipeline only, and the admin token guards them here. lora_cache's NotFound and
    InvalidRequest reach the admin's caller as they are (tiercache.triton.bls)."""

    def __init__(self, model_name: str, sealer: Sealer, timeout_s: float | None = None) -> None:
        self.client = BlsClient(model_name, timeout_s=timeout_s)
        self.sealer = sealer

    def __call__(self, op: dict[str, Any]) -> dict[str, Any]:
        admin = json.dumps(op)
        response = self.client.infer(admin_inputs(self.sealer, admin), ["ADMIN_RESULT"])
        text = io.output_string(response, "ADMIN_RESULT") or ""
        try:
            answer: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise Unavailable(f"{self.client.model_name}: {op['op']} answer is not JSON") from exc
        return answer


class AdminGateMetrics:
    """`tiercache_admin_refused_total{reason=missing|wrong}`: admin calls refused for want of
    the admin token (AdminGate's totals)."""

    def __init__(self, metrics: tm.Metrics, gate: AdminGate) -> None:
        self._gate = gate
        self.refused = tm.delta_counters(
            metrics,
            "tiercache_admin_refused_total",
            "cache_admin calls refused: no admin token (missing) or another one (wrong)",
            "reason",
            ("missing", "wrong"),
        )
        metrics.on_flush(self.update)

    def update(self) -> None:
        stats = self._gate.stats()
        tm.update_all(
            self.refused, {"missing": stats.refused_missing, "wrong": stats.refused_wrong}
        )


class CacheAdminStage:
    def __init__(self, admin: Admin, gate: AdminGate, metrics: tm.Metrics) -> None:
        self.admin = admin
        self.gate = gate
        self.metrics = metrics
        tm.InvalidatorMetrics(metrics, admin.invalidator)
        self.gate_metrics = AdminGateMetrics(metrics, gate)
        self.closing: list[Callable[[], None]] = []  # called by close(), after the cache

    def run(self, text: str | None, token: str | None) -> str:
        """One ADMIN call's JSON result: Forbidden unless `token` is the admin token (checked
        first: nothing else is looked at), else InvalidRequest, NotFound, Unavailable as
        raised."""
        self.gate.check(token)
        return self.run_allowed(text)

    def run_allowed(self, text: str | None) -> str:
        """`run` for a call whose token was checked (`gate.check`) before ADMIN was decoded."""
        if not text:
            raise InvalidRequest("ADMIN is required")
        answer: AdminAnswer = self.admin.run(text)
        return json.dumps(answer.result, sort_keys=True)

    def close(self) -> None:
        self.metrics.close()
        self.admin.cache.close()
        for close in self.closing:
            close()


def open_cache_admin(config: CacheAdminConfig, model_name: str) -> CacheAdminStage:
    """The admin over the deployment's tiers and adapters, behind the admin token (created in
    the state directory at the first start), with its metrics (started)."""
    gate = AdminGate(load_or_create_admin_token(admin_token_path(config.state_path())))
    adapters = open_adapters(config.adapters_path(), config.state_path(), config.adapters_manifest)
    tiers = open_exact_cache(config.cache())
    lora = LoraAdminBls(
        config.lora_model, open_sealer(config.state_path()), config.lora_timeout_s or None
    )
    admin = admin_over(
        config,
        tiers,
        resolve_model(config.model).identity,
        adapters.resolve,
        lora,
    )
    metrics = tm.Metrics(model_name)
    stage = CacheAdminStage(admin, gate, metrics)
    stage.closing.append(lora.client.close)
    export_redis(metrics, tiers)  # with L3: Redis health and invalidations applied
    metrics.start()
    return stage
