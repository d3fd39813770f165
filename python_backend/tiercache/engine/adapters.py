"""LoRA adapters held by the engine's transformers model, through peft, in recycled slots.

Several adapters are injected into the model at once (peft keeps one `lora_A`/`lora_B` pair per
adapter in each target layer); one is active per forward, or none (the base model). What the engine
holds is keyed by (task_id, digest): a changed adapter folder is a new digest and so a different
adapter, and the old version stays until it is evicted, so requests resolved to it still run.

Slots, as vLLM's fixed LoRA slots: at most `max_slots` peft adapters are ever injected, named
`slot0`, `slot1`, ... whatever they hold, with a map from (task_id, digest) to slot. Evicting an
adapter only marks its slot free (switching to the base model if it was active); the peft adapter
stays in the model. A load then takes, in this order:

- recycle: a free slot with the same signature (every config field that changes the forward:
  r, rank_pattern, targets, use_rslora, fan_in_fan_out, bias, lora_bias, use_dora, ...; and the
  state dict's keys, shapes and dtypes) gets the new weights copied into its parameters in place,
  through a file-key -> Parameter map built once per slot, and its scaling set from lora_alpha.
  No module walk: ~1.3 ms instead of ~65 ms for an injection (~89 ms with the model's linear
  layers packed, docs/engine.md), loading the committed rank-8 adapters from host bytes
  (`python -m tiercache_dev.bench.lora engine`: the recycled and injected rows);
- inject: with fewer than `max_slots` slots, a new one, as peft's functional API does it
  (`inject_adapter_in_model` with `low_cpu_mem_usage`, then `set_peft_model_state_dict`; config from
  the adapter_config.json text, weights from the safetensors bytes, nothing read from disk or the
  Hub). transformers' `load_adapter` does the same through its checkpoint loader, about as fast,
  but logs every other adapter's keys as missing on each load;
- replace: otherwise one free slot is deleted from the model (`delete_adapter` on every layer, a
  module walk) and a new one injected.

The signature is compared before anything is copied, so only the copy itself can fail a
recycled load; the slot then stays free, its half-copied weights are never served (a slot is
active only once its load finished) and the next load into it overwrites every tensor.
lora_dropout is left out of the signature: the engine runs the model in eval mode, where dropout is
the identity (injected dropout modules are put in the model's mode: peft creates them training).
A slot whose file-key map or scaling cannot be reproduced (a peft or transformers key conversion
this module does not know, an alpha_pattern), or that holds a LoRA variant with state of its own
(DoRA), is never recycled, only replaced.

Switching calls `set_adapter` on the LoRA layers directly (a cached list): walking every module,
as `model.set_adapter` does, costs about twice as much (python -m tiercache_dev.bench.lora engine).

Bytes, as the KV pool's (issue 20): with `max_bytes` (torch_llm's `lora_max_bytes`; 0: slots
only) the injected slots' parameters, held or free, stay within a byte budget that
`tiercache.budgets` may move between its floor and that ceiling (`resize`, from the budget
thread: recorded, and applied by the engine thread at its next request, `prepare`). Room is made
by deleting free slots first (nothing served is lost), then dropping the policy's victims and
deleting their slots; the adapter a request runs with is never dropped, and one adapter is always
loaded even when it alone is over the budget (a request is never refused for room). What the
engine dropped for bytes is remembered in a shadow queue (`tiercache.shadow`): loading it again
credits the load's seconds, what one more byte of slots would have saved. lora_cache learns of
the drop as of any: the engine says it does not hold the version, and llm sends its weights.

The base model is "no active adapter": each LoRA layer then computes exactly its base layer's
output, so base-model answers are unchanged by what is loaded or left in free slots.

Not thread-safe: the engine's single worker thread calls every method except `stats()`, which
only reads counters and may be called from a metrics thread.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import regex
import torch
from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from tiercache.adapter_types import (
    AdapterRef,
    AdapterWeights,
    held_key_of,
    not_in_engine_message,
    split_held_key,
)
from tiercache.budgets import Budget, cache_budget
from tiercache.engine.adapter_call import adapter_ref
from tiercache.errors import CapacityError, ConfigError, Forbidden, InvalidRequest, NotFound
from tiercache.eviction import EvictionPolicy, LruPolicy
from tiercache.exact.request import GenerationRequest
from tiercache.shadow import ShadowQueue, shadow_bytes

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
# The most one module name, and all of them, may take an adapter's target_modules regex to
# match (a pattern with catastrophic backtracking is refused; peft's own `re` has no timeout)
REGEX_TIMEOUT_S = 0.05
REGEX_TOTAL_S = 1.0
PEFT_PREFIX = "base_model.model."  # what an adapter file's keys start with (peft)

AdapterKey = tuple[int, str]  # (task_id, digest)

GENERATE, LOAD, LIST, EVICT = "generate", "load", "list", "evict"
OPS = (GENERATE, LOAD, LIST, EVICT)


@dataclass(frozen=True, slots=True)
class AdapterOrder:
    """What one engine request asks of the adapters, decoded from the torch_llm inputs.

    Done in this order: `evict` (never `needs` itself), then `weights` loaded, then the op
    itself. `evict` names held adapters (`held_key`: task id and digest), or bare digests (every
    name over those files).
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
            raise InvalidRequest("ENVELOPE is required to generate")
        needs = adapter_ref(request) if request is not None and op == GENERATE else None
        ref = adapter_ref(request) if request is not None else None
        if lora:
            try:
                ref = AdapterRef.from_json(lora)
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
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
            if not loaded.matches():  # never load files under an identity they do not have
                raise Forbidden(
                    f"adapter {ref.short}: its files do not match its digest; not loaded"
                )
        elif op == LOAD:
            raise InvalidRequest("LORA_OP load needs LORA_CONFIG and LORA_WEIGHTS")
        evicted: tuple[str, ...] = ()
        if evict:
            try:
                parsed = json.loads(evict)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequest(f"LORA_EVICT is not valid JSON: {exc}") from exc
            if not isinstance(parsed, list) or not all(isinstance(d, str) for d in parsed):
                raise InvalidRequest(
                    "LORA_EVICT must be a JSON list of held adapters (<task id>:<digest>) or "
                    "digests (strings)"
                )
            for item in parsed:
                try:
                    split_held_key(item)
                except ValueError as exc:
                    raise InvalidRequest(f"LORA_EVICT: {exc}") from None
            evicted = tuple(parsed)
        return cls(op, ref, loaded, evicted, needs)


@dataclass(frozen=True, slots=True)
class OrderResult:
    load_s: float  # 0.0 when nothing was loaded (or it was already held)
    # the adapters no longer held (`held_key`s): asked for, or dropped to make room
    evicted: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AdapterStats:
    """A snapshot of the engine's adapter slots; counters only grow."""

    resident: int
    resident_bytes: int
    max_slots: int
    injected_slots: int  # peft adapters in the model: the held ones and the free slots
    loads: int
    recycled_loads: int  # of those, copied into a free slot's parameters (no injection)
    load_failures: int  # rejected adapters (no slot serves any of their weights)
    evictions: int  # every adapter dropped, asked for or to make room
    lru_evictions: int  # of those, dropped to make room for a load into a full set
    activations: int  # generations started (activate() calls that succeeded)
    switches: int  # activations that changed the active adapter (base counts as one)
    last_load_s: float
    last_switch_s: float
    active: AdapterRef | None
    slot_bytes: int = 0  # parameters of every injected slot, held or free
    max_bytes: int = 0  # the byte budget in force (0: slots only)
    budget_evictions: int = 0  # of `evictions`, dropped for the byte budget


@dataclass(slots=True)
class _Slot:
    """One peft adapter injected in the model, holding one adapter version or free."""

    name: str  # the peft adapter name: slot<i>, whatever the slot holds
    signature: str | None  # what a recycled load must match; None: never recycled
    params: dict[str, torch.nn.Parameter]  # state-dict key (as in the file) -> parameter
    layers: tuple[BaseTunerLayer, ...]  # the LoRA layers holding this slot
    nbytes: int = 0  # its parameters' bytes, held or free
    holder: _Resident | None = None


@dataclass(slots=True)
class _Resident:
    ref: AdapterRef
    slot: _Slot
    nbytes: int
    uses: int = 0
    load_s: float = 0.0  # what loading it took: what keeping it saves


def _copy_weights(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """Copy each tensor into its parameter in place (same shape and dtype: checked before)."""
    with torch.no_grad():
        for param, tensor in pairs:
            param.copy_(tensor)


def _scaling(lora_alpha: float, rank: int, use_rslora: bool) -> float:
    """peft's LoRA scaling (LoraLayer.update_layer), recomputed when a slot is recycled."""
    return lora_alpha / math.sqrt(rank) if use_rslora else lora_alpha / rank


def _key(ref: AdapterRef) -> AdapterKey:
    return (ref.task_id, ref.digest)


def _jsonable(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


class EngineAdapters:
    """The LoRA adapters loaded into `model`, at most `max_slots` at a time, in as many slots.

    `load` adds one (all or nothing), `activate` picks the one the next forward uses, `evict`
    drops one and frees its slot for the next load. A load into a full set first evicts the
    policy's victim (default LRU; loads and activations count as uses, size is one slot, cost is
    the load's seconds); normally lora_cache sends evictions ahead of loads, so this bound is a
    safety net.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_slots: int = 4,
        clock: Callable[[], float] = time.perf_counter,
        policy: EvictionPolicy[AdapterKey] | None = None,
        max_bytes: int = 0,
    ) -> None:
        """`max_bytes`: the slots' byte budget (0: `max_slots` alone bounds them)."""
        if max_slots < 0:
            raise ConfigError(f"lora_slots must be >= 0, got {max_slots}")
        if max_bytes < 0:
            raise ConfigError(f"lora_max_bytes must be >= 0, got {max_bytes}")
        self.model = model
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self._budget_lock = threading.Lock()  # the target and the shadow: read by the budget
        self._target: int | None = None  # a `resize` recorded for the next request
        self._shadow: ShadowQueue[AdapterKey] = ShadowQueue(shadow_bytes(max_bytes))
        self._slot_bytes = 0
        self._budget_evictions = 0
        self._clock = clock
        self._module_names = tuple(name for name, _ in model.named_modules() if name)
        self._held: dict[AdapterKey, _Resident] = {}
        self._policy: EvictionPolicy[AdapterKey] = policy if policy is not None else LruPolicy()
        self._slots: dict[str, _Slot] = {}  # every peft adapter in the model, by name
        self._layers: list[tuple[str, BaseTunerLayer]] = []  # (module name, layer)
        self._active: _Resident | None = None
        self._bytes = 0
        self._loads = 0
        self._recycled_loads = 0
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
        """The adapters held, in eviction order: the policy's next victim first (the least
        recently used, by default), then any it does not rank. JSON-ready: the engine's `list`
        op."""
        order = [key for key in self._policy.nominate(len(self._held)) if key in self._held]
        # A listing, not a plan: nominating nothing withdraws the offer (gdsf would count a
        # later removal of any listed adapter, a new version's, as an eviction and age by it).
        self._policy.nominate(0)
        ranked = set(order)
        order += [key for key in self._held if key not in ranked]
        return [
            {
                "name": r.ref.name,
                "task_id": r.ref.task_id,
                "digest": r.ref.digest,
                "bytes": r.nbytes,
                "uses": r.uses,
            }
            for r in (self._held[key] for key in order)
        ]

    def stats(self) -> AdapterStats:
        active = self._active
        return AdapterStats(
            resident=len(self._held),
            resident_bytes=self._bytes,
            max_slots=self.max_slots,
            injected_slots=len(self._slots),
            loads=self._loads,
            recycled_loads=self._recycled_loads,
            load_failures=self._load_failures,
            evictions=self._evictions,
            lru_evictions=self._lru_evictions,
            activations=self._activations,
            switches=self._switches,
            last_load_s=self._last_load_s,
            last_switch_s=self._last_switch_s,
            active=None if active is None else active.ref,
            slot_bytes=self._slot_bytes,
            max_bytes=self.max_bytes,
            budget_evictions=self._budget_evictions,
        )

    def slot_bytes(self) -> int:
        """What the slots hold now, held or free."""
        return self._slot_bytes

    def held_bytes(self) -> int:
        """The budget's `held`: the budget in force plus what the next request will free of
        what the slots hold over it. One adapter may stay over the budget alone (the one a
        request runs with), so the largest held slot is never counted as coming back. Read
        from the budget thread: the slots are copied in one step (the engine thread changes
        them)."""
        with self._budget_lock:
            budget = self.max_bytes if self._target is None else self._target
        if not budget:
            return self._slot_bytes
        slots = tuple(self._slots.values())
        stays = max((slot.nbytes for slot in slots if slot.holder is not None), default=0)
        return budget + max(self._slot_bytes - max(budget, stays), 0)

    def shadow_reading(self) -> tuple[float, float]:
        """(load seconds the shadow's hits saved, cumulative; the bytes it spans): the
        budget's `ShadowValue` reads it from the budget thread."""
        with self._budget_lock:
            return self._shadow.gained_s, float(self._shadow.bytes)

    # ---- changes --------------------------------------------------------------------------

    def load(self, weights: AdapterWeights) -> float:
        """Load one adapter version; returns the seconds it took (0.0 if it was already held,
        which only marks it recently used). Also what start-up prefetch calls.

        Raises InvalidRequest for an adapter that does not fit this model (bad config or
        weights); no slot then serves any of its weights and the held adapters compute what
        they did before. Into a full set the least recently used adapter is evicted first, so
        that at most `max_slots` adapters are ever injected: a load that fails after that
        (peft refusing the weights on injection) has still evicted it.
        """
        key = (weights.ref.task_id, weights.ref.digest)
        if key in self._held:
            self._policy.access(key)
            return 0.0
        if self.max_slots == 0:
            raise CapacityError("this engine holds no adapters (lora_slots is 0)")
        with self._budget_lock:  # dropped for bytes lately: a larger budget would have kept it
            shadowed = self._shadow.credit(key, 0.0)  # what it saves: this load, once measured
        started = self._clock()
        try:
            config = self._parse_config(weights)
            # keys as peft reads them, copies of the model's own tensors left out: what the
            # slot holds, so its bytes and its signature (a recycled slot) are its own
            state_dict = self._without_copies(self._parse_weights(weights))
        except InvalidRequest:
            self._load_failures += 1
            raise
        signature = self._signature(config, state_dict)
        while len(self._held) >= self.max_slots:
            victims = self._policy.nominate(1)
            if not victims or victims[0] not in self._held:
                raise RuntimeError(f"the adapter policy nominated {victims}: none is held")
            self._drop(victims[0])
            self._lru_evictions += 1
        slot = next(
            (s for s in self._slots.values() if s.holder is None and s.signature == signature),
            None,
        )
        nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        if slot is None and self.max_bytes:  # a new slot: room for about its weights' bytes
            self._make_room(nbytes, keep=key)
        try:
            if slot is not None:
                self._recycle(slot, config, state_dict)
                self._recycled_loads += 1
            else:
                slot = self._inject_slot(config, state_dict, signature, weights.ref)
        except BaseException:
            self._load_failures += 1
            raise
        load_s = self._clock() - started
        slot.holder = self._held[key] = _Resident(weights.ref, slot, nbytes, load_s=load_s)
        self._bytes += nbytes
        self._loads += 1
        self._last_load_s = load_s
        self._policy.admit(key, 1, cost_s=load_s)
        if shadowed:
            with self._budget_lock:
                self._shadow.gained_s += load_s
        return load_s

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
            self._policy.access(key)
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
        """Drop every held adapter with this digest (its slot is kept, free, for the next
        load); False if none was held."""
        keys = [key for key in self._held if key[1] == digest]
        for key in keys:
            self._drop(key)
        with self._budget_lock:  # asked for, not a lost hit: a larger budget would not keep it
            for key in [k for k in self._shadow.keys() if k[1] == digest]:
                self._shadow.discard(key)
        return bool(keys)

    def evict_key(self, key: AdapterKey) -> bool:
        """Drop one held adapter (task id, digest), leaving other names over the same files;
        False if it was not held."""
        held = key in self._held
        if held:
            self._drop(key)
        with self._budget_lock:
            self._shadow.discard(key)
        return held

    def remove_free_slots(self) -> int:
        """Delete the free slots from the model (a module walk each) and return how many; the
        next loads inject afresh. For a lowered `max_slots`, and tests."""
        free = [s for s in self._slots.values() if s.holder is None]
        for slot in free:
            self._delete_slot(slot)
        return len(free)

    def resize(self, max_bytes: int) -> int:
        """A new byte budget for the slots (tiercache.budgets, from its own thread); returns
        it. Recorded here, applied by the engine thread when the next request starts
        (`prepare`): slots are the model's parameters, which a forward may be reading."""
        if max_bytes < 1:
            raise ConfigError(f"the adapter slots' budget must be >= 1 byte, got {max_bytes}")
        with self._budget_lock:
            self._target = max_bytes
        return max_bytes

    def prepare(self, order: AdapterOrder) -> OrderResult:
        """Evict, then load, as `order` asks; the op itself is the caller's. A new byte budget
        (`resize`) takes effect first."""
        before = set(self._held)
        # the adapter this order generates with, or loads (a load of one held is a no-op)
        kept = order.needs or (order.weights.ref if order.weights is not None else None)
        self._follow_budget(None if kept is None else _key(kept))
        needs = None if order.needs is None else _key(order.needs)
        for item in order.evict:
            key = split_held_key(item)
            if key is None:  # a bare digest: every name over those files
                if needs is None or item != needs[1]:
                    self.evict(item)
            elif key != needs:
                self.evict_key(key)
        load_s = 0.0 if order.weights is None else self.load(order.weights)
        gone = before - set(self._held)
        return OrderResult(load_s, tuple(sorted(held_key_of(*key) for key in gone)))

    # ---- internals ------------------------------------------------------------------------

    def _follow_budget(self, keep: AdapterKey | None) -> None:
        """Apply a recorded `resize`, then shrink to the budget (never dropping `keep`)."""
        with self._budget_lock:
            target, self._target = self._target, None
            if target is not None:
                self.max_bytes = target
                self._shadow.resize(shadow_bytes(target))
        if self.max_bytes:
            self._make_room(0, keep)

    def _make_room(self, nbytes: int, keep: AdapterKey | None) -> None:
        """Until the slots and `nbytes` more fit the budget: delete a free slot, else drop the
        policy's victim (never `keep`) and delete its slot, remembering it in the shadow. Stops
        when nothing is left to give: one adapter may stay over the budget alone."""
        while self._slot_bytes + nbytes > self.max_bytes:
            free = next((s for s in self._slots.values() if s.holder is None), None)
            if free is not None:
                self._delete_slot(free)
                continue
            victims = self._policy.nominate(1, 0, lambda k: k == keep)
            if not victims or victims[0] not in self._held:
                return
            resident = self._held[victims[0]]
            self._drop(victims[0])
            self._delete_slot(resident.slot)
            self._budget_evictions += 1
            with self._budget_lock:
                self._shadow.add(victims[0], resident.slot.nbytes, resident.load_s)

    def _drop(self, key: AdapterKey) -> None:
        resident = self._held.pop(key)
        self._policy.remove(key)
        if resident is self._active:
            self._apply(None)
            self._active = None
        resident.slot.holder = None
        self._bytes -= resident.nbytes
        self._evictions += 1

    def _parse_config(self, weights: AdapterWeights) -> PeftConfig:
        where = f"adapter {weights.ref.short}"
        try:
            data = json.loads(weights.config_json)
        except (ValueError, RecursionError) as exc:  # RecursionError: deep nesting
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
        targets = self._check_targets(where, data.get("target_modules"))
        if targets is not None:  # a regex, resolved here: peft gets the names it matched
            data["target_modules"] = targets
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

    def _check_targets(self, where: str, targets: object) -> list[str] | None:
        """Each listed target names a module of this model (peft's rule: the full name or a
        dotted suffix); a regex string must match at least one full name, and is returned
        resolved: the full names it matches, for peft to take instead of matching it itself.
        A regex is the adapter file's, run on this engine's one worker: matched under
        REGEX_TIMEOUT_S per name and REGEX_TOTAL_S in all (the `regex` module's timeout;
        `(.|.)*!` against a module name ran for hours in `re`), else refused."""
        if isinstance(targets, str):
            if targets == "all-linear":
                return None
            try:
                re.compile(targets)  # peft's own rule for what a valid pattern is
                pattern = regex.compile(targets)
                deadline = time.monotonic() + REGEX_TOTAL_S
                matched = []
                for name in self._module_names:
                    if pattern.fullmatch(name, timeout=REGEX_TIMEOUT_S):
                        matched.append(name)
                    if time.monotonic() > deadline:
                        raise TimeoutError
            except (re.error, regex.error) as exc:
                raise InvalidRequest(
                    f"{where}: target_modules is not a valid regex: {exc}"
                ) from exc
            except TimeoutError as exc:
                raise InvalidRequest(
                    f"{where}: target_modules {targets[:80]!r} takes too long to match (over "
                    f"{REGEX_TIMEOUT_S:g} s on a module name, or {REGEX_TOTAL_S:g} s on all): "
                    "list the modules instead"
                ) from exc
            if not matched:
                raise InvalidRequest(f"{where}: target_modules {targets!r} matches no module")
            return matched
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
        return None

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

    @staticmethod
    def _signature(config: PeftConfig, state_dict: dict[str, torch.Tensor]) -> str:
        """SHA-256 over what a slot's layers and parameters are made of: the config, less the
        fields that do not change the eval-mode forward once the weights are given (names,
        versions, task type, lora_dropout; lora_alpha too when no alpha_pattern, since a
        recycled slot's scaling is recomputed from it), and each tensor's key, shape and dtype."""
        fields = config.to_dict()
        for name in (
            "base_model_name_or_path",
            "revision",
            "peft_version",
            "inference_mode",
            "task_type",
            "auto_mapping",
            "lora_dropout",
        ):
            fields.pop(name, None)
        if not fields.get("alpha_pattern"):
            fields.pop("lora_alpha", None)
        tensors = sorted((k, tuple(t.shape), str(t.dtype)) for k, t in state_dict.items())
        text = json.dumps([fields, tensors], sort_keys=True, default=_jsonable)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def _recycle(
        self, slot: _Slot, config: PeftConfig, state_dict: dict[str, torch.Tensor]
    ) -> None:
        """Copy the weights into the free `slot` (same signature: same keys, shapes, dtypes)
        and set its scaling; no module walk. Raises with the slot still free."""
        try:
            pairs = [(slot.params[key], tensor) for key, tensor in state_dict.items()]
        except KeyError as exc:  # the signature matched: the slot's map is broken
            raise RuntimeError(f"{slot.name} has no parameter for {exc}") from exc
        _copy_weights(pairs)
        lora: Any = config  # a LoraConfig: PeftConfig's type lacks its fields
        for layer in slot.layers:
            held: Any = layer
            held.lora_alpha[slot.name] = lora.lora_alpha
            held.scaling[slot.name] = _scaling(lora.lora_alpha, held.r[slot.name], lora.use_rslora)
        peft_config = getattr(self.model, "peft_config", None)
        if isinstance(peft_config, dict):
            peft_config[slot.name] = config

    def _inject_slot(
        self,
        config: PeftConfig,
        state_dict: dict[str, torch.Tensor],
        signature: str,
        ref: AdapterRef,
    ) -> _Slot:
        """A new slot holding these weights; into a full model, a free slot is deleted first."""
        while len(self._slots) >= self.max_slots:
            free = next((s for s in self._slots.values() if s.holder is None), None)
            if free is None:  # load() evicts down to max_slots - 1 held first
                raise RuntimeError("no free slot to replace: every slot is held")
            self._delete_slot(free)
        name = next(
            f"slot{i}" for i in range(len(self._slots) + 1) if f"slot{i}" not in self._slots
        )
        try:
            self._inject(name, config, state_dict, ref)
            self._refresh_layers()  # the injection may have wrapped more layers
            slot = self._new_slot(name, config, state_dict, signature)
        except BaseException:
            self._remove_from_model(name)
            raise
        finally:
            self._refresh_layers()
            self._apply(self._active)  # injecting activates the new adapter; restore
        self._slots[name] = slot
        self._slot_bytes += slot.nbytes
        return slot

    def _new_slot(
        self,
        name: str,
        config: PeftConfig,
        state_dict: dict[str, torch.Tensor],
        signature: str,
    ) -> _Slot:
        """The slot's file-key -> Parameter map (peft's rule: the model key less the adapter
        name, under `base_model.model.`), checked against the weights peft just loaded; and its
        scaling checked against `_scaling`. Either check failing: never recycled."""
        lora: Any = config  # a LoraConfig: PeftConfig's type lacks its fields
        params: dict[str, torch.nn.Parameter] = {}
        layers: list[BaseTunerLayer] = []
        recyclable = not lora.alpha_pattern
        for module_name, layer in self._layers:
            held: Any = layer
            mine = [(n, p) for n, p in held.named_parameters() if name in n.split(".")]
            if not mine:
                continue
            layers.append(layer)
            if name in getattr(held, "lora_dropout", {}):  # peft builds it training
                held.lora_dropout[name].train(self.model.training)
            for param_name, param in mine:
                parts = [part for part in param_name.split(".") if part != name]
                params[".".join(["base_model.model", module_name, *parts])] = param
            recyclable = (
                recyclable
                and name not in getattr(held, "lora_variant", {})  # DoRA and kin keep state
                and held.scaling[name] == _scaling(lora.lora_alpha, held.r[name], lora.use_rslora)
            )
        recyclable = (
            recyclable
            and params.keys() == state_dict.keys()
            and all(
                params[k].shape == t.shape
                and torch.equal(params[k], t.to(device=params[k].device, dtype=params[k].dtype))
                for k, t in state_dict.items()
            )
        )
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        return _Slot(name, signature if recyclable else None, params, tuple(layers), nbytes)

    def _delete_slot(self, slot: _Slot) -> None:
        if slot.holder is not None:
            raise RuntimeError(f"{slot.name} is held by {slot.holder.ref.short}: not deleted")
        self._remove_from_model(slot.name)
        del self._slots[slot.name]
        self._slot_bytes -= slot.nbytes

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
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise InvalidRequest(f"{where} does not fit the model: {exc}") from exc
        # peft loads a key that is not one of the new adapter's own tensors as it is (loading
        # is not strict): a file holding a base-model key, or another slot's, rewrote that
        # parameter for every request. Only this slot's own tensors are taken (copies of the
        # model's own were left out by `load`); anything else refuses the adapter.
        own = self._file_keys(name)
        stray = [key for key in state_dict if key not in own]
        if stray:
            raise InvalidRequest(
                f"{where}: {len(stray)} tensors are neither LoRA weights of the adapter's "
                f"modules nor the model's own, e.g. {stray[0][:120]!r}; not loaded"
            )
        try:
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

    def _without_copies(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state_dict` with its keys as peft reads them (the `base_model.model.` prefix added
        where it is left out, a DoRA magnitude's `.weight` added), less the tensors equal to
        a parameter the model holds (an embedding peft saved with the adapter,
        `save_embedding_layers`, and its tied head): nothing to load. Compared in slices of
        rows, on the parameter's device."""
        params: dict[str, torch.nn.Parameter] | None = None
        kept: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            file_key = key if key.startswith(PEFT_PREFIX) else PEFT_PREFIX + key
            if file_key.endswith(".lora_magnitude_vector"):
                file_key += ".weight"
            if "lora_" not in file_key:  # only a base parameter's key can be a copy
                if params is None:
                    params = dict(self.model.named_parameters(remove_duplicate=False))
                    model: Any = self.model  # a transformers model: its embeddings
                    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", 0)
                    embeddings = model.get_input_embeddings() if tied else None
                    if embeddings is not None and "lm_head.weight" not in params:
                        # a tied head packed for oneDNN holds no parameter of its own
                        params["lm_head.weight"] = embeddings.weight
                if _is_copy(tensor, _model_parameter(params, file_key[len(PEFT_PREFIX) :])):
                    continue
            kept[file_key] = tensor
        return kept

    def _file_keys(self, name: str) -> set[str]:
        """The file keys of slot `name`'s tensors, by `_new_slot`'s rule (peft's: the LoRA
        layer's parameter name less the adapter name, under `base_model.model.`)."""
        keys = set()
        for module_name, module in self.model.named_modules():
            if not isinstance(module, BaseTunerLayer):
                continue
            for param_name, _ in module.named_parameters():  # type: ignore[attr-defined]
                parts = param_name.split(".")
                if name in parts:
                    kept = [part for part in parts if part != name]
                    keys.add(PEFT_PREFIX + ".".join([module_name, *kept]))
        return keys

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
        self._layers = [
            (n, m) for n, m in self.model.named_modules() if isinstance(m, BaseTunerLayer)
        ]

    def _apply(self, target: _Resident | None) -> None:
        names = [] if target is None else [target.slot.name]
        for _, layer in self._layers:
            layer.set_adapter(names, inference_mode=True)


def adapter_slots_budget(adapters: EngineAdapters, floor_bytes: int, ceiling_bytes: int) -> Budget:
    """The adapter slots' budget: between its floor and `lora_max_bytes`, valued by what one
    more byte would save (loads of adapters the engine dropped for bytes lately, asked for
    again); applied by the engine thread at the next request, so what the slots will free then
    counts as `held` (never the one adapter that may stay over the budget alone)."""
    return cache_budget(
        "adapter_slots", floor_bytes, ceiling_bytes, adapters.resize, adapters.shadow_reading,
        adapters.held_bytes,
    )  # fmt: skip


def _model_parameter(params: dict[str, torch.nn.Parameter], name: str) -> torch.nn.Parameter | None:
    """The model's parameter an adapter file's base key names: as it is, or with peft's
    `base_layer` (the module wrapped by an earlier adapter's layer, or not yet)."""
    found = params.get(name)
    if found is not None:
        return found
    if ".base_layer." in name:
        return params.get(name.replace(".base_layer.", ".", 1))
    head, _, last = name.rpartition(".")
    return params.get(f"{head}.base_layer.{last}") if head else None


def _is_copy(tensor: torch.Tensor, held: torch.nn.Parameter | None, rows: int = 4096) -> bool:
    """Whether `tensor` holds exactly `held`'s values, compared a slice of rows at a time on
    `held`'s device (an embedding is not copied there whole); never for a parameter on the
    meta device (not loaded yet)."""
    if held is None or held.device.type == "meta" or held.shape != tensor.shape:
        return False
    if tensor.dim() == 0:
        return bool(torch.equal(held.detach(), tensor.to(device=held.device, dtype=held.dtype)))
    return all(
        torch.equal(mine, theirs.to(device=held.device, dtype=held.dtype))
        for mine, theirs in zip(held.detach().split(rows), tensor.split(rows), strict=True)
    )
