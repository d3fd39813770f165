"""Triton model `lora_cache`: decode inputs, call tiercache.lora.stage, encode outputs; the
engine's adapter admin calls (list, load) go to the engine model over BLS."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import LoraCacheConfig
from tiercache.errors import ConfigError, Unavailable
from tiercache.lora.fleet import local_versions, open_fleet
from tiercache.lora.residency import LoraPlan
from tiercache.lora.stage import open_lora_cache
from tiercache.lora.trtllm import TrtllmLoraConverter
from tiercache.lora.types import DISK_TIER, ENGINE_TIER, HOST_TIER, TIERS
from tiercache.triton import boundary as tb

OUTPUTS = ("LORA", "LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT", "LORA_TIER", "ADMIN_RESULT")
ENGINE_KINDS = ("torch_llm", "tensorrt_llm")
# TensorRT-LLM's request tensors (tiercache.lora.trtllm), sent only with engine_kind tensorrt_llm.
TRTLLM_OUTPUTS = {
    "lora_task_id": "LORA_TASK_ID",
    "lora_weights": "LORA_TRT_WEIGHTS",
    "lora_config": "LORA_TRT_CONFIG",
}
ENGINE_OUTPUTS = ["TEXT", "FINISH_REASON"]


class EngineBls:
    """`EngineAdmin` over BLS: torch_llm's LORA_OP "list" and "load" (its inputs have no batch
    dimension: max_batch_size 0)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.streams = tb.StreamKeeper()  # finished engine streams, released with the GIL

    def list_adapters(self) -> Any:
        text = self._call("listed", [tb.bytes_tensor("LORA_OP", ["list"], batched=False)])
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise Unavailable(f"engine {self.model_name}: list answer is not JSON") from exc

    def load(self, plan: LoraPlan) -> tuple[float, tuple[str, ...]]:
        if plan.weights is None:
            raise ValueError("a load needs the plan's weights (plan with reload=True)")
        inputs = [
            tb.bytes_tensor("LORA_OP", ["load"], batched=False),
            tb.bytes_tensor("LORA", [plan.ref.to_json()], batched=False),
            tb.bytes_tensor("LORA_CONFIG", [plan.weights.config_json], batched=False),
            tb.bytes_tensor("LORA_WEIGHTS", [plan.weights.weights], batched=False),
        ]
        if plan.evict:
            inputs.append(tb.bytes_tensor("LORA_EVICT", [json.dumps(plan.evict)], batched=False))
        text = self._call("loaded", inputs)
        try:
            answer = json.loads(text)
            return float(answer.get("load_ms", 0.0)), tuple(answer.get("evicted", ()))
        except (ValueError, TypeError, AttributeError) as exc:
            raise Unavailable(f"engine {self.model_name}: unexpected load answer") from exc

    def _call(self, expected_finish: str, inputs: list) -> str:
        """The engine's TEXT, once its answer finished with `expected_finish`."""
        request = pb_utils.InferenceRequest(
            model_name=self.model_name, inputs=inputs, requested_output_names=ENGINE_OUTPUTS
        )
        finish, text = "", ""
        for response in self.streams.read(request.exec(decoupled=True)):
            if response.has_error():
                raise Unavailable(f"engine {self.model_name}: {response.error().message()}")
            reason = tb.output_string(response, "FINISH_REASON")
            if reason is not None:  # the final, flags-only response carries no outputs
                finish, text = reason, tb.output_string(response, "TEXT") or ""
        if finish != expected_finish:
            raise Unavailable(
                f"engine {self.model_name}: answered {finish or 'nothing'!r}, "
                f"expected {expected_finish!r}"
            )
        return text


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.config = config = tb.load_config(LoraCacheConfig, args)[0]
        if config.engine_kind not in ENGINE_KINDS:
            raise ConfigError(
                f"engine_kind must be one of {', '.join(ENGINE_KINDS)}, got {config.engine_kind!r}"
            )
        self.trtllm = (
            TrtllmLoraConverter(dtype=config.trtllm_dtype)
            if config.engine_kind == "tensorrt_llm"
            else None
        )
        self.metrics = m = tb.Metrics(args["model_name"])
        self.requests = {
            tier: m.counter(
                "tiercache_lora_requests_total",
                "Adapter requests by the tier the version was found in (none: no adapter)",
                tier=tier,
            )
            for tier in (*TIERS, "none", "error")
        }
        self.resident = {
            tier: m.gauge("tiercache_lora_resident", "Adapters resident per tier", tier=tier)
            for tier in TIERS
        }
        self.loads = {
            tier: m.counter("tiercache_lora_loads_total", "Adapters loaded into a tier", tier=tier)
            for tier in (ENGINE_TIER, HOST_TIER)
        }
        self.evictions = {
            tier: m.counter(
                "tiercache_lora_evictions_total", "Adapters evicted from a tier", tier=tier
            )
            for tier in (ENGINE_TIER, HOST_TIER)
        }
        self.disk_read_s = m.histogram(
            "tiercache_lora_disk_read_seconds", "Time to read and verify an adapter from disk"
        )
        self.stage = open_lora_cache(config, EngineBls(config.engine_model), on_plan=self._count)
        # With redis_url: this replica's adapter versions and usage shared with the fleet, and
        # the fleet's most-used adapters warmed at start (tiercache.lora.fleet).
        self.fleet = open_fleet(config, self.stage)
        self._counted: dict[tuple[str, str], int] = {}  # (kind, tier) -> total already counted
        m.on_flush(self._refresh)
        m.start()

    def _count(self, plan: LoraPlan) -> None:
        self.requests[plan.tier].increment(1)
        if plan.tier == DISK_TIER:
            self.disk_read_s.observe(plan.read_s)

    def _refresh(self) -> None:
        """On the metrics flusher: gauges, and the counters the residency keeps, as deltas."""
        stats = self.stage.residency.stats()
        for tier in (ENGINE_TIER, HOST_TIER):
            self.resident[tier].set(stats.resident[tier])
        self.resident[DISK_TIER].set(len(self.stage.registry.names()))
        for kind, counters, totals in (
            ("loads", self.loads, stats.loads),
            ("evictions", self.evictions, stats.evictions),
        ):
            for tier, counter in counters.items():
                delta = totals[tier] - self._counted.get((kind, tier), 0)
                if delta:
                    counter.increment(delta)
                    self._counted[kind, tier] = totals[tier]

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(self._serve(tb.Inputs(request)))
            except Exception as exc:  # noqa: BLE001 - this request's error response
                self.requests["error"].increment(1)
                responses.append(tb.error_response(exc))
        return responses

    def _serve(self, inputs: tb.Inputs) -> Any:
        admin = inputs.string("ADMIN")
        if admin:
            answer = self.stage.admin(admin)
            result = answer.result
            if self.fleet is not None and "adapters" in result:  # list and warm
                local = local_versions(self.stage.registry)
                result = {**result, "fleet": self.fleet.fleet.report(local)}
            return self._respond(answer.plan, json.dumps(result, sort_keys=True))
        plan = self.stage.plan_request(inputs.string("REQUEST"), inputs.string("LOOKUP_STATUS"))
        if plan is None:
            self.requests["none"].increment(1)
        elif self.fleet is not None:
            self.fleet.fleet.count_use(plan.ref.name)
        return self._respond(plan)

    def _respond(self, plan: LoraPlan | None, admin_result: str = "") -> Any:
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
        tensors = [
            tb.bytes_tensor(name, [value]) for name, value in zip(OUTPUTS, values, strict=True)
        ]
        if self.trtllm is not None and plan is not None:
            # The task id always; the weights only when the engine lacks this version.
            trt = self.trtllm.request_lora(plan.ref, plan.weights).tensors()
            tensors += [
                pb_utils.Tensor(TRTLLM_OUTPUTS[k], np.ascontiguousarray(v)) for k, v in trt.items()
            ]
        return pb_utils.InferenceResponse(tensors)

    def finalize(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        self.metrics.close()
