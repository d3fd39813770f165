"""The `lora_cache` stage: the request's adapter version -> its tier, and what the engine must
load and evict before it generates; the admin ops `list`, `warm` and `weights`; with Redis, the
fleet's adapter metadata and usage."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tiercache.budgets import Budget, BudgetThread, cache_budget
from tiercache.config import LoraCacheConfig
from tiercache.errors import Unavailable
from tiercache.lora.fleet import FleetSync, local_versions
from tiercache.lora.residency import LoraPlan, Residency
from tiercache.lora.stage import LoraCache
from tiercache.lora.trtllm import TrtllmLoraConverter
from tiercache.lora.types import DISK_TIER, ENGINE_TIER, HOST_TIER, TIERS
from tiercache.stages.common import engine_inputs, export_late_calls
from tiercache.stages.envelope import Freshness, ReceivedEnvelope
from tiercache.stages.memory_budgets import start_budgets
from tiercache.stages.parts import (
    open_adapter_cipher,
    open_fleet,
    open_freshness,
    open_lora_core,
    open_sealer,
)
from tiercache.stages.seal import ADMIN_LABEL, LORA_LABEL, Part, Sealer, lora_inputs, seal_tensors
from tiercache.stages.transport import AdapterCipher, seal_views
from tiercache.triton import io
from tiercache.triton import metrics as tm
from tiercache.triton.bls import BlsClient
from tiercache.vocabulary import EngineKind

# The outputs of every lora_cache response, in order; TensorRT-LLM's tensors come on top.
OUTPUTS = ("LORA", "LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT", "LORA_TIER", "ADMIN_RESULT")
# TensorRT-LLM's adapter arrays, encrypted for llm like the PEFT files (tiercache.stages.transport).
CLOSED_ARRAYS = ("LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG")
TRTLLM_OUTPUTS = {
    "lora_task_id": "LORA_TASK_ID",
    "lora_weights": "LORA_TRT_WEIGHTS",
    "lora_config": "LORA_TRT_CONFIG",
}
ENGINE_OUTPUTS = ["TEXT", "FINISH_REASON"]


class EngineBls:
    """`EngineAdmin` over BLS: torch_llm's LORA_OP "list" and "load" (its inputs have no batch
    dimension: max_batch_size 0)."""

    def __init__(self, model_name: str, sealer: Sealer, timeout_s: float | None = None) -> None:
        self.model_name = model_name
        self.sealer = sealer
        self.client = BlsClient(model_name, label=f"engine {model_name}", stream_idle_s=timeout_s)

    def list_adapters(self) -> Any:
        text = self._call("listed", engine_inputs(self.sealer, {"LORA_OP": "list"}))
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise Unavailable(f"engine {self.model_name}: list answer is not JSON") from exc

    def load(self, plan: LoraPlan) -> tuple[float, tuple[str, ...]]:
        if plan.weights is None:
            raise ValueError("a load needs the plan's weights (plan with reload=True)")
        values: dict[str, str | bytes] = {
            "LORA_OP": "load",
            "LORA": plan.ref.to_json(),
            "LORA_CONFIG": plan.weights.config_json,
            "LORA_WEIGHTS": plan.weights.weights,
        }
        if plan.evict:
            values["LORA_EVICT"] = json.dumps(plan.evict)
        text = self._call("loaded", engine_inputs(self.sealer, values))
        try:
            answer = json.loads(text)
            return float(answer.get("load_ms", 0.0)), tuple(answer.get("evicted", ()))
        except (ValueError, TypeError, AttributeError) as exc:
            raise Unavailable(f"engine {self.model_name}: unexpected load answer") from exc

    def _call(self, expected_finish: str, inputs: list) -> str:
        """The engine's TEXT, once its answer finished with `expected_finish`."""
        finish, text = "", ""
        for response in self.client.stream(inputs, ENGINE_OUTPUTS):
            reason = io.output_string(response, "FINISH_REASON")
            if reason is not None:  # the final, flags-only response carries no outputs
                finish, text = reason, io.output_string(response, "TEXT") or ""
        if finish != expected_finish:
            raise Unavailable(
                f"engine {self.model_name}: answered {finish or 'nothing'!r}, "
                f"expected {expected_finish!r}"
            )
        return text


class PlanCounter:
    """Plans by the tier their adapter was found in (requests, warm, weights), and disk reads."""

    def __init__(self, metrics: tm.Metrics) -> None:
        self.requests = {
            tier: metrics.counter(
                "tiercache_lora_requests_total",
                "Adapter requests by the tier the version was found in (none: no adapter)",
                tier=tier,
            )
            for tier in (*TIERS, "none", "error")
        }
        self.disk_read_s = metrics.histogram(
            "tiercache_lora_disk_read_seconds", "Time to read and verify an adapter from disk"
        )

    def __call__(self, plan: LoraPlan) -> None:
        self.requests[plan.tier].increment(1)
        if plan.tier == DISK_TIER:
            self.disk_read_s.observe(plan.read_s)


class LoraCacheStage:
    """Plans and admin calls, counted by tier; the fleet's usage counted with Redis."""

    def __init__(
        self,
        core: LoraCache,
        metrics: tm.Metrics,
        plans: PlanCounter,
        sealer: Sealer,
        cipher: AdapterCipher,
        trtllm: TrtllmLoraConverter | None = None,
        fleet: FleetSync | None = None,
        freshness: Freshness | None = None,
    ) -> None:
        """`plans` must be the `on_plan` hook `core` was built with."""
        self.budgets: BudgetThread | None = None  # the host tier following the machine
        # tiercache_lora_engine_late_total by event (with engine_timeout_s; open_stage)
        self.engine_late: dict[str, Any] = {}
        self.core = core
        self.sealer = sealer
        # what an envelope must be past its seal to plan for (age; key, with a key file)
        self.freshness = freshness if freshness is not None else Freshness()
        self.cipher = cipher
        self.trtllm = trtllm
        self.fleet = fleet
        self.metrics = m = metrics
        self.requests = plans.requests
        self.disk_read_s = plans.disk_read_s
        self.resident = {
            tier: m.gauge("tiercache_lora_resident", "Adapters resident per tier", tier=tier)
            for tier in TIERS
        }
        self.loads = tm.delta_counters(
            m,
            "tiercache_lora_loads_total",
            "Adapters loaded into a tier",
            "tier",
            (ENGINE_TIER, HOST_TIER),
        )
        self.evictions = tm.delta_counters(
            m,
            "tiercache_lora_evictions_total",
            "Adapters evicted from a tier",
            "tier",
            (ENGINE_TIER, HOST_TIER),
        )
        self.transport_bytes = m.gauge(
            "tiercache_lora_transport_cache_bytes",
            "Bytes of the encrypted adapter files kept to be sent again (transport_cache_bytes)",
        )
        m.on_flush(self._refresh)

    def count_error(self) -> None:
        self.requests["error"].increment(1)

    def _refresh(self) -> None:
        """On the metrics flusher: gauges, and the counters the residency keeps."""
        stats = self.core.residency.stats()
        for tier in (ENGINE_TIER, HOST_TIER):
            self.resident[tier].set(stats.resident[tier])
        self.resident[DISK_TIER].set(len(self.core.registry.names()))
        tm.update_all(self.loads, stats.loads)
        tm.update_all(self.evictions, stats.evictions)
        self.transport_bytes.set(self.cipher.body_bytes)

    def received(self, data: bytes | None) -> ReceivedEnvelope:
        """prompt_cache's envelope, checked when it is first read. Its seal is checked as that of
        a request without an exact hit (no cached text): lora_cache plans misses only."""
        return ReceivedEnvelope(data, self.sealer, self.freshness)

    def plan(self, envelope: ReceivedEnvelope, lookup_status: str | None) -> LoraPlan | None:
        """The plan for one ensemble request (None: no adapter involved); the envelope is
        checked and decoded only when an adapter may be involved."""
        plan = self.core.plan_request(
            lambda: envelope.get().request if envelope.data else None, lookup_status
        )
        if plan is None:
            self.requests["none"].increment(1)
        elif self.fleet is not None:
            self.fleet.fleet.count_use(plan.ref.name)
        return plan

    def count_hit(self) -> None:
        """A request answered from a cache (an exact or semantic hit): no adapter, no plan."""
        self.requests["none"].increment(1)

    def admin(self, text: str, seal: str | None) -> tuple[LoraPlan | None, str]:
        """One admin call (internal: from llm and cache_admin, sealed): the plan it made
        (`weights`) and its JSON result, with the fleet's view on `list` and `warm` when Redis
        is configured. Forbidden when `seal` does not verify."""
        self.sealer.check(seal, ADMIN_LABEL, text.encode("utf-8"), what="ADMIN")
        answer = self.core.admin(text)
        result = answer.result
        if self.fleet is not None and "adapters" in result:  # list and warm
            local = local_versions(self.core.registry)
            result = {**result, "fleet": self.fleet.fleet.report(local)}
        return answer.plan, json.dumps(result, sort_keys=True)

    def outputs(self, plan: LoraPlan | None, bound: str, admin_result: str = "") -> dict[str, Part]:
        """A response's tensors by name (OUTPUTS, then TensorRT-LLM's for a plan when the
        engine is TensorRT-LLM), the adapter files closed for the answer `bound` (the envelope's
        seal, or the admin call's): only a stage with the secret opens them."""
        if plan is None:
            return dict(zip(OUTPUTS, ("", b"", b"", "", "", admin_result), strict=True))
        weights, close, version = plan.weights, self.cipher.close, plan.ref.digest
        values: dict[str, Part] = {
            "LORA": plan.ref.to_json(),
            "LORA_CONFIG": close(
                "LORA_CONFIG",
                weights.config_json.encode("utf-8") if weights else b"",
                bound,
                version,
            ),
            "LORA_WEIGHTS": close(
                "LORA_WEIGHTS", weights.weights if weights else b"", bound, version
            ),
            "LORA_EVICT": json.dumps(list(plan.evict)),
            "LORA_TIER": plan.tier,
            "ADMIN_RESULT": admin_result,
        }
        if self.trtllm is not None:
            trt = self.trtllm.request_lora(plan.ref, plan.weights).tensors()
            for key, name in TRTLLM_OUTPUTS.items():
                array = trt.get(key)  # the weights and their config only when the engine lacks them
                if name in CLOSED_ARRAYS:
                    values[name] = self.cipher.close_array(name, array, bound, version)
                elif array is not None:
                    values[name] = np.ascontiguousarray(array)
        return values

    def seal(self, envelope: ReceivedEnvelope, values: dict[str, Part]) -> str:
        """LORA_SEAL over the adapter tensors of a plan's response (as sent: the files closed),
        bound to the envelope's."""
        names = lora_inputs(self.trtllm is not None)
        return seal_tensors(self.sealer, LORA_LABEL, names, seal_views(values), bound=envelope.seal)

    def close(self) -> None:
        if self.budgets is not None:
            self.budgets.close()
        if self.fleet is not None:
            self.fleet.close()
        self.metrics.close()


def open_lora_cache_stage(config: LoraCacheConfig, model_name: str) -> LoraCacheStage:
    """The stage with its registry, residency, engine admin calls over BLS, the fleet sync with
    `redis_url`, and its metrics (started)."""
    trtllm = (
        TrtllmLoraConverter(dtype=config.trtllm_dtype)
        if config.engine_kind == EngineKind.TENSORRT_LLM
        else None
    )
    metrics = tm.Metrics(model_name)
    plans = PlanCounter(metrics)
    sealer = open_sealer(config.state_path())
    engine = EngineBls(config.engine_model, sealer, config.engine_timeout_s or None)
    engine_late = export_late_calls(  # by event; none without engine_timeout_s
        metrics,
        engine.client.stream_deadline,
        "tiercache_lora_engine_late_total",
        "Adapter loads and listings with no response from the engine within engine_timeout_s "
        "(timed_out), and those not sent while too many such streams were still out (refused)",
    )
    core = open_lora_core(config, engine, on_plan=plans)
    cipher = open_adapter_cipher(config.state_path(), config.transport_cache_bytes)
    # With redis_url: this replica's adapter versions and usage shared with the fleet, and the
    # fleet's most-used adapters warmed at start (tiercache.lora.fleet).
    freshness = open_freshness(config.envelope_max_age_s, config.api_keys_file)
    fleet = open_fleet(config, core)
    stage = LoraCacheStage(core, metrics, plans, sealer, cipher, trtllm, fleet, freshness)
    stage.engine_late = engine_late
    budgets: list[Budget] = []  # a bound of 0 keeps nothing: no budget to follow
    if config.host_max_bytes > 0:
        budgets.append(
            adapter_host_budget(core.residency, config.host_min_bytes, config.host_max_bytes)
        )
    if config.transport_cache_bytes > 0:
        budgets.append(
            transport_budget(cipher, config.transport_cache_min_bytes, config.transport_cache_bytes)
        )
    if budgets:
        stage.budgets = start_budgets(
            config.memory_headroom_bytes,
            config.budget_interval_s,
            budgets,
            metrics,
            config.state_path(),
            model_name,
            total_bytes=config.cache_memory_bytes,
        )
    metrics.start()
    return stage


def transport_budget(cipher: AdapterCipher, floor_bytes: int, ceiling_bytes: int) -> Budget:
    """The transport cache's budget: between its floor and its fixed size, valued by the
    encryptions of adapter bodies it dropped lately and had to make again."""
    return cache_budget(
        "adapters_transport", floor_bytes, ceiling_bytes, cipher.resize, cipher.shadow_reading,
        used=lambda: cipher.body_bytes,
    )  # fmt: skip


def adapter_host_budget(residency: Residency, floor_bytes: int, ceiling_bytes: int) -> Budget:
    """The host tier's budget: between its floor and its fixed size, valued by what one more
    byte would save (disk reads of adapter versions it dropped lately, asked for again)."""
    return cache_budget(
        "adapters_host", floor_bytes, ceiling_bytes, residency.resize_host,
        residency.host_shadow_reading, used=residency.host_bytes,
    )  # fmt: skip
