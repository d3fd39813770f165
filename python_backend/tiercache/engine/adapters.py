"""LoRA adapters held by the engine's transformers model, through peft.

Several adapters are injected into the model at once (peft keeps one `lora_A`/`lora_B` pair per
adapter in each target layer); one is active per forward, or none (the base model). What the engine
holds is keyed by (task_id, digest): a changed adapter folder is a new digest and so a different
adapter, and the old version stays until it is evicted, so requests resolved to it still run.

Loading uses peft's functional API (`inject_adapter_in_model` with `low_cpu_mem_usage`, then
`set_peft_model_state_dict`): the config comes from the adapter_config.json text and the weights
from the safetensors bytes, so nothing is read from disk or the Hub. transformers' `load_adapter`
does the same through its checkpoint loader, about as fast, but logs every other adapter's keys
as missing on each load. Switching calls `set_adapter` on the LoRA layers directly (a cached list):
walking every module, as `model.set_adapter` does, costs about twice as much
(scripts/bench_lora.py engine).

The base model is "no active adapter": each LoRA layer then computes exactly its base layer's
output, so base-model answers are unchanged by what is loaded.

Not thread-safe: the engine's single worker thread calls every method except `stats()`, which
only reads counters and may be called from a metrics thread.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from tiercache.errors import CapacityError, ConfigError, InvalidRequest, NotFound
from tiercache.lora.engine_call import adapter_ref
from tiercache.lora.types import AdapterRef, AdapterWeights, not_in_engine_message
from tiercache.request import GenerationRequest

# Config keys whose features need more than LoRA layers switched by name (extra trainable modules,
# extra forward arguments or a changed model structure); this engine refuses them.
UNSUPPORTED_KEYS = (
    "modules_to_save",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "layer_replication",
    "target_parameters",
)
_PEFT_CONFIG_WARNING = "Already found a `peft_config` attribute"

AdapterKey = tuple[int, str]  # (task_id, digest)

GENERATE, LOAD, LIST, EVICT = "generate", "load", "list", "evict"
OPS = (GENERATE, LOAD, LIST, EVICT)


@dataclass(frozen=True, slots=True)
class AdapterOrder:
    """What one engine request asks of the adapters, decoded from the torch_llm inputs.

    Done in this order: `evict` (never the digest of `needs`), then `weights` loaded, then the
    op itself.
    """

    op: str = GENERATE
    ref: AdapterRef | None = None  # what `weights` are stored under: LORA, else the request's
    weights: AdapterWeights | None = None
    evict: tuple[str, ...] = ()
    needs: AdapterRef | None = None  # the adapter the generation runs with (op generate)

    @classmethod
    def parse(
        cls,
        op: str | None = None,
        lora: str | None = None,
        config_json: str | None = None,
        weights: bytes | None = None,
        evict: str | None = None,
        request: GenerationRequest | None = None,
    ) -> AdapterOrder:
        """Validate the raw inputs (None: omitted); raises InvalidRequest naming the input."""
        op = (op or "").strip() or GENERATE
        if op not in OPS:
            raise InvalidRequest(f"LORA_OP must be one of {', '.join(OPS)} (or empty), got {op!r}")
        if op == GENERATE and request is None:
            raise InvalidRequest("REQUEST is required to generate")
        needs = adapter_ref(request) if request is not None and op == GENERATE else None
        ref = adapter_ref(request) if request is not None else None
        if lora:
            try:
                ref = AdapterRef.from_json(lora)
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidRequest(
                    f"LORA must be JSON {{name, task_id, digest}}: {exc!r}"
                ) from exc
        if (config_json is None) != (weights is None):
            raise InvalidRequest("LORA_CONFIG and LORA_WEIGHTS must be sent together")
        loaded: AdapterWeights | None = None
        if config_json is not None and weights is not None:
            if ref is None:
                raise InvalidRequest(
                    "LORA_WEIGHTS need an adapter version: LORA, or REQUEST with a lora_digest"
                )
            loaded = AdapterWeights(ref, config_json, weights)
        elif op == LOAD:
            raise InvalidRequest("LORA_OP load needs LORA_CONFIG and LORA_WEIGHTS")
        digests: tuple[str, ...] = ()
        if evict:
            try:
                parsed = json.loads(evict)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"LORA_EVICT is not valid JSON: {exc}") from exc
            if not isinstance(parsed, list) or not all(isinstance(d, str) for d in parsed):
                raise InvalidRequest("LORA_EVICT must be a JSON list of digests (strings)")
            digests = tuple(parsed)
        return cls(op, ref, loaded, digests, needs)


@dataclass(frozen=True, slots=True)
class OrderResult:
    load_s: float  # 0.0 when nothing was loaded (or it was already held)
    evicted: tuple[str, ...]  # digests no longer held: asked for, or dropped to make room


@dataclass(frozen=True, slots=True)
class AdapterStats:
    """A snapshot of the engine's adapter slots; counters only grow."""

    resident: int
    resident_bytes: int
    max_slots: int
    loads: int
    load_failures: int  # rejected adapters (the model was left as it was)
    evictions: int  # every adapter dropped, asked for or to make room
    lru_evictions: int  # of those, dropped to make room for a load into a full set
    activations: int  # generations started (activate() calls that succeeded)
    switches: int  # activations that changed the active adapter (base counts as one)
    last_load_s: float
    last_switch_s: float
    active: AdapterRef | None


@dataclass(slots=True)
class _Resident:
    ref: AdapterRef
    peft_name: str
    nbytes: int
    uses: int = 0


def peft_adapter_name(ref: AdapterRef) -> str:
    """The adapter's name inside the model: peft names become module keys, which may not hold
    '.', so the digest (any string) is hashed; task id and digest together name one version."""
    tag = hashlib.sha256(ref.digest.encode("utf-8")).hexdigest()[:16]
    return f"t{ref.task_id}_{tag}"


class EngineAdapters:
    """The LoRA adapters loaded into `model`, at most `max_slots` at a time.

    `load` adds one (all or nothing), `activate` picks the one the next forward uses, `evict`
    drops one. A load into a full set then evicts the least recently used adapter (loads and
    activations count as uses); normally lora_cache sends evictions ahead of loads, so this
    bound is a safety net.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_slots: int = 4,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_slots < 0:
            raise ConfigError(f"lora_slots must be >= 0, got {max_slots}")
        self.model = model
        self.max_slots = max_slots
        self._clock = clock
        self._module_names = tuple(name for name, _ in model.named_modules() if name)
        self._held: OrderedDict[AdapterKey, _Resident] = OrderedDict()  # least recent first
        self._layers: list[BaseTunerLayer] = []
        self._active: _Resident | None = None
        self._bytes = 0
        self._loads = 0
        self._load_failures = 0
        self._evictions = 0
        self._lru_evictions = 0
        self._activations = 0
        self._switches = 0
        self._last_load_s = 0.0
        self._last_switch_s = 0.0

    # ---- queries --------------------------------------------------------------------------

    def holds(self, ref: AdapterRef) -> bool:
        return (ref.task_id, ref.digest) in self._held

    def resident(self) -> list[dict[str, Any]]:
        """The adapters held, least recently used first (JSON-ready: the engine's `list` op)."""
        return [
            {
                "name": r.ref.name,
                "task_id": r.ref.task_id,
                "digest": r.ref.digest,
                "bytes": r.nbytes,
                "uses": r.uses,
            }
            for r in self._held.values()
        ]

    def stats(self) -> AdapterStats:
        active = self._active
        return AdapterStats(
            resident=len(self._held),
            resident_bytes=self._bytes,
            max_slots=self.max_slots,
            loads=self._loads,
            load_failures=self._load_failures,
            evictions=self._evictions,
            lru_evictions=self._lru_evictions,
            activations=self._activations,
            switches=self._switches,
            last_load_s=self._last_load_s,
            last_switch_s=self._last_switch_s,
            active=None if active is None else active.ref,
        )

    # ---- changes --------------------------------------------------------------------------

    def load(self, weights: AdapterWeights) -> float:
        """Load one adapter version; returns the seconds it took (0.0 if it was already held,
        which only marks it recently used). Also what start-up prefetch calls.

        Raises InvalidRequest for an adapter that does not fit this model (bad config or
        weights); the model then computes exactly what it did before and nothing is evicted.
        Into a full set, the new adapter goes in first and then the least recently used one
        out, so for a moment one more adapter than `max_slots` is held.
        """
        key = (weights.ref.task_id, weights.ref.digest)
        if key in self._held:
            self._held.move_to_end(key)
            return 0.0
        if self.max_slots == 0:
            raise CapacityError("this engine holds no adapters (lora_slots is 0)")
        started = self._clock()
        try:
            config = self._parse_config(weights)
            state_dict = self._parse_weights(weights)
        except InvalidRequest:
            self._load_failures += 1
            raise
        name = peft_adapter_name(weights.ref)
        try:
            self._inject(name, config, state_dict, weights.ref)
        except BaseException:
            self._load_failures += 1
            self._remove_from_model(name)
            raise
        finally:
            self._refresh_layers()
            self._apply(self._active)  # injecting activates the new adapter; restore
        nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        self._held[key] = _Resident(weights.ref, name, nbytes)
        self._bytes += nbytes
        while len(self._held) > self.max_slots:  # after the load, so a failed one drops nothing
            self._drop(next(iter(self._held)))
            self._lru_evictions += 1
        self._loads += 1
        self._last_load_s = self._clock() - started
        return self._last_load_s

    def activate(self, ref: AdapterRef | None) -> float:
        """Make `ref` the adapter the next forwards use (None: the base model, exactly).
        Returns the seconds spent switching, 0.0 when it was already active.

        Raises NotFound with `not_in_engine_message` if the adapter is not held: the caller
        sends the weights and asks again (TensorRT-LLM's protocol)."""
        target: _Resident | None = None
        if ref is not None:
            key = (ref.task_id, ref.digest)
            target = self._held.get(key)
            if target is None:
                raise NotFound(not_in_engine_message(ref))
            self._held.move_to_end(key)
            target.uses += 1
        self._activations += 1
        if target is self._active:
            return 0.0
        started = self._clock()
        self._apply(target)
        self._active = target
        self._switches += 1
        self._last_switch_s = self._clock() - started
        return self._last_switch_s

    def evict(self, digest: str) -> bool:
        """Drop every held adapter with this digest; False if none was held."""
        keys = [key for key in self._held if key[1] == digest]
        for key in keys:
            self._drop(key)
        return bool(keys)

    def prepare(self, order: AdapterOrder) -> OrderResult:
        """Evict, then load, as `order` asks; the op itself is the caller's."""
        before = {digest for _, digest in self._held}
        keep = None if order.needs is None else order.needs.digest
        for digest in order.evict:
            if digest != keep:
                self.evict(digest)
        load_s = 0.0 if order.weights is None else self.load(order.weights)
        after = {digest for _, digest in self._held}
        return OrderResult(load_s, tuple(sorted(before - after)))

    # ---- internals ------------------------------------------------------------------------

    def _drop(self, key: AdapterKey) -> None:
        resident = self._held.pop(key)
        if resident is self._active:
            self._apply(None)
            self._active = None
        self._remove_from_model(resident.peft_name)
        self._bytes -= resident.nbytes
        self._evictions += 1

    def _parse_config(self, weights: AdapterWeights) -> PeftConfig:
        where = f"adapter {weights.ref.short}"
        try:
            data = json.loads(weights.config_json)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{where}: adapter_config.json is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidRequest(f"{where}: adapter_config.json must be a JSON object")
        if data.get("peft_type") != "LORA":
            raise InvalidRequest(f"{where}: peft_type must be LORA, got {data.get('peft_type')!r}")
        rank = data.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise InvalidRequest(f"{where}: rank r must be a positive integer, got {rank!r}")
        for key in UNSUPPORTED_KEYS:
            if data.get(key):
                raise InvalidRequest(f"{where}: {key} is not supported by this engine")
        self._check_targets(where, data.get("target_modules"))
        data.pop("runtime_config", None)  # peft's own loader drops it too
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # keys of newer peft versions are dropped
                config = PeftConfig.from_peft_type(**data)
        except (TypeError, ValueError, KeyError) as exc:
            raise InvalidRequest(
                f"{where}: adapter_config.json is not a valid LoRA config: {exc}"
            ) from exc
        config.inference_mode = True
        return config

    def _check_targets(self, where: str, targets: object) -> None:
        """Each listed target names a module of this model (peft's rule: the full name or a
        dotted suffix); a regex string must match at least one full name."""
        if isinstance(targets, str):
            if targets == "all-linear":
                return
            try:
                pattern = re.compile(targets)
            except re.error as exc:
                raise InvalidRequest(
                    f"{where}: target_modules is not a valid regex: {exc}"
                ) from exc
            if not any(pattern.fullmatch(name) for name in self._module_names):
                raise InvalidRequest(f"{where}: target_modules {targets!r} matches no module")
            return
        if not isinstance(targets, list) or not targets:
            raise InvalidRequest(f"{where}: target_modules must be a non-empty list or a regex")
        missing = [
            t
            for t in targets
            if not isinstance(t, str)
            or not any(n == t or n.endswith(f".{t}") for n in self._module_names)
        ]
        if missing:
            raise InvalidRequest(f"{where}: target_modules {missing} are not modules of the model")

    @staticmethod
    def _parse_weights(weights: AdapterWeights) -> dict[str, torch.Tensor]:
        where = f"adapter {weights.ref.short}"
        try:
            state_dict = load_safetensors(weights.weights)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise InvalidRequest(f"{where}: weights are not valid safetensors: {exc}") from exc
        if not state_dict:
            raise InvalidRequest(f"{where}: the weights file holds no tensors")
        return state_dict

    def _inject(
        self,
        name: str,
        config: PeftConfig,
        state_dict: dict[str, torch.Tensor],
        ref: AdapterRef,
    ) -> None:
        """Add the LoRA layers (empty, on the meta device) and assign the weights to them."""
        where = f"adapter {ref.short}"
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_PEFT_CONFIG_WARNING)
                inject_adapter_in_model(config, self.model, name, low_cpu_mem_usage=True)
            result: Any = set_peft_model_state_dict(  # typed as a bare namedtuple
                self.model, state_dict, adapter_name=name, low_cpu_mem_usage=True
            )
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise InvalidRequest(f"{where} does not fit the model: {exc}") from exc
        if result.unexpected_keys:
            raise InvalidRequest(
                f"{where}: weights for modules the model lacks, e.g. {result.unexpected_keys[0]}"
            )
        marker = f".{name}."
        missing = [k for k in result.missing_keys if marker in k]
        if missing:
            raise InvalidRequest(
                f"{where}: weights missing for {len(missing)} tensors, e.g. "
                f"{missing[0].replace(marker, '.')}"
            )

    def _remove_from_model(self, name: str) -> None:
        """Delete adapter `name` from every LoRA layer and the model's peft config. The layers
        stay wrapped; with no adapter they compute the base layer's output."""
        for module in self.model.modules():
            if isinstance(module, BaseTunerLayer):
                if name in module.active_adapters:
                    module.set_adapter([], inference_mode=True)
                module.delete_adapter(name)
        peft_config = getattr(self.model, "peft_config", None)
        if isinstance(peft_config, dict):
            peft_config.pop(name, None)

    def _refresh_layers(self) -> None:
        self._layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]

    def _apply(self, target: _Resident | None) -> None:
        names = [] if target is None else [target.peft_name]
        for layer in self._layers:
            layer.set_adapter(names, inference_mode=True)
