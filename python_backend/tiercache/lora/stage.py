"""Stage 3, `lora_cache`: the request's adapter version -> its tier, and what the engine must load
and evict before it generates; plus the admin ops `list`, `warm` and `weights`.

Transport-free: model.py injects the engine's admin calls (`EngineAdmin`, BLS to the engine
model). The admin protocol (ADMIN input JSON -> ADMIN_RESULT JSON) is `LoraCache.admin`'s
docstring, summed up in model_repository/lora_cache/config.pbtxt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tiercache.adapter_types import AdapterRef, held_key
from tiercache.admin_ops import parse_admin
from tiercache.errors import InvalidRequest, NotFound, TierCacheError
from tiercache.exact.request import GenerationRequest
from tiercache.lora.registry import AdapterRegistry, check_name, check_ref
from tiercache.lora.residency import LoraPlan, Residency, ResidentAdapter
from tiercache.lora.types import DISK_TIER, ENGINE_TIER, HOST_TIER, TIERS

HIT_STATUSES = frozenset({"exact", "semantic"})  # answered from a cache: no engine, no adapter
LOOKUP_STATUSES = HIT_STATUSES | {"", "miss", "bypass"}
ADMIN_OPS = {"list": {"op"}, "warm": {"op", "names"}, "weights": {"op", "lora"}}
LOADED, ALREADY_LOADED = "loaded", "already loaded"  # warm outcomes (else "error: ...")


class EngineAdmin(Protocol):
    """The engine's adapter admin calls (torch_llm's LORA_OP list and load)."""

    def list_adapters(self) -> Any:
        """The engine's resident adapters, as it reports them (a JSON value)."""
        ...

    def load(self, plan: LoraPlan) -> tuple[float, tuple[str, ...]]:
        """Evict `plan.evict`, load `plan.weights`; returns (load_ms, the adapters no longer
        held, as `held_key`s).
        Raises a TierCacheError when the engine refuses."""
        ...


@dataclass(frozen=True, slots=True)
class AdminAnswer:
    result: dict[str, Any]  # ADMIN_RESULT
    plan: LoraPlan | None = None  # `weights`: what goes out in LORA, LORA_CONFIG, ...


def latest_digest(registry: AdapterRegistry) -> Callable[[str], str | None]:
    """The registry's current digest of a name, or None when it cannot say (unknown, broken)."""

    def latest(name: str) -> str | None:
        try:
            return registry.resolve(name).digest
        except TierCacheError:
            return None

    return latest


class LoraCache:
    def __init__(
        self,
        registry: AdapterRegistry,
        residency: Residency,
        engine: EngineAdmin,
        engine_model: str = "",
        *,
        clock: Callable[[], float] = time.monotonic,
        on_plan: Callable[[LoraPlan], None] = lambda plan: None,
    ) -> None:
        """`clock` must be residency's (idle times in `list`); `on_plan` sees every plan made
        (requests, warm, weights), e.g. to count them by tier."""
        self.registry = registry
        self.residency = residency
        self.engine = engine
        self.engine_model = engine_model
        self._clock = clock
        self._on_plan = on_plan

    # -- the request path ----------------------------------------------------------------------

    def plan_request(
        self, request_of: Callable[[], GenerationRequest | None], lookup_status: str | None
    ) -> LoraPlan | None:
        """The plan for one ensemble request; None when no adapter is involved: a cache hit
        (`lookup_status` exact or semantic, or no request) or a base-model request.
        `request_of` is called only when an adapter may be involved (not on a hit)."""
        status = (lookup_status or "").strip()
        if status not in LOOKUP_STATUSES:
            raise InvalidRequest(
                f"LOOKUP_STATUS must be one of {', '.join(sorted(LOOKUP_STATUSES - {''}))}, "
                f"got {status[:40]!r}"
            )
        if status in HIT_STATUSES:
            return None
        request = request_of()
        if request is None:
            return None
        if not request.lora_digest:
            if request.lora_name:
                # The cache key was computed without the version: serving it could be stale.
                raise InvalidRequest(
                    f"the request names adapter {request.lora_name!r} without its version "
                    "(lora_digest); prompt_cache resolves it"
                )
            return None
        ref = check_ref(AdapterRef(request.lora_name, request.lora_task_id, request.lora_digest))
        return self._plan(ref)

    def _plan(self, ref: AdapterRef, reload: bool = False) -> LoraPlan:
        plan = self.residency.plan(ref, self.registry.read, reload=reload)
        self._on_plan(plan)
        return plan

    # -- admin -----------------------------------------------------------------------------------

    def admin(self, text: str) -> AdminAnswer:
        """One admin call (the ADMIN input). InvalidRequest for a malformed one.

        - `{"op": "list"}` -> `list_report()`.
        - `{"op": "warm", "names": [...]}` loads those adapters into the engine now (before
          their first request); NotFound for an unknown name, before anything is loaded. Returns
          `list_report()` plus `"warmed": {name: "loaded" | "already loaded" | "error: ..."}`.
        - `{"op": "weights", "lora": {"name", "task_id", "digest"}}` (an object or its JSON
          text): the engine said it does not hold that version; the plan carries its weights
          again (llm's retry). Result: `{"op", "lora", "tier", "evict"}` plus the plan.
        """
        data = parse_admin(text, ADMIN_OPS)
        if data["op"] == "list":
            return AdminAnswer(self.list_report())
        if data["op"] == "warm":
            return AdminAnswer(self.warm(_names(data.get("names"))))
        return self.weights(_ref(data.get("lora")))

    def weights(self, ref: AdapterRef) -> AdminAnswer:
        plan = self._plan(check_ref(ref), reload=True)
        result = {
            "op": "weights",
            "lora": json.loads(ref.to_json()),
            "tier": plan.tier,
            "evict": list(plan.evict),
        }
        return AdminAnswer(result, plan)

    def warm(self, names: Sequence[str]) -> dict[str, Any]:
        """Load `names` into the engine; NotFound for an unknown name, before anything is
        loaded. A name whose folder cannot be read now (broken, being rewritten) is that
        name's error, not every name's (one such folder kept the fleet's warm-up from warming
        anything)."""
        refs: list[AdapterRef] = []
        warmed: dict[str, str] = {}
        for name in names:
            try:
                refs.append(self.registry.resolve(name))
            except NotFound:
                raise
            except TierCacheError as exc:
                warmed[name] = f"error: {exc.client_message()}"
        for ref in refs:
            try:
                # reload: always send the weights; loading a held version is a no-op for the
                # engine, and a warm call must not trust a mirror that may have drifted.
                plan = self._plan(ref, reload=True)
                load_ms, evicted = self.engine.load(plan)
            except TierCacheError as exc:
                self.residency.forget(ref)
                warmed[ref.name] = f"error: {exc.client_message()}"
                continue
            self.residency.drop(key for key in evicted if key != held_key(ref))
            warmed[ref.name] = LOADED if load_ms > 0 else ALREADY_LOADED
        return {**self.list_report(), "op": "warm", "warmed": warmed}

    def list_report(self) -> dict[str, Any]:
        """`{"op": "list", "engine_model", "adapters": [...], "engine_reported": [...] | null,
        "stats": {...}}` (+ `"engine_error"` when the engine could not be asked). `adapters` has
        one row per version lora_cache knows, in its highest tier (engine > host > disk):
        `{"name", "task_id", "digest", "tier", "current", "pinned", "bytes", "idle_s"}`
        (`bytes`/`idle_s` null on disk); an adapter whose folder is broken is a row
        `{"name", "tier": "", "problem"}`. `engine_reported` is the engine's own list."""
        snapshot = self.residency.snapshot()
        listing = self.registry.listing()
        current = {item.ref.digest for item in listing if item.ref is not None}
        now = self._clock()
        # by name and version: two names over identical files (an alias folder) are two rows
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        held: dict[str, dict[str, Any]] = {}  # a version's files in memory, under any name
        for tier, residents in ((ENGINE_TIER, snapshot.engine), (HOST_TIER, snapshot.host)):
            for resident in residents:
                row = _row(resident, tier, now, resident.digest in current)
                rows.setdefault((resident.name, resident.digest), row)
                if tier == HOST_TIER:
                    held.setdefault(resident.digest, row)
        problems = []
        for item in listing:
            if item.ref is None:
                problems.append({"name": item.name, "tier": "", "problem": item.problem})
            elif (item.ref.name, item.ref.digest) in rows:
                continue
            elif item.ref.digest in held:  # its files are in memory under another name
                rows[(item.ref.name, item.ref.digest)] = {
                    **held[item.ref.digest],
                    **json.loads(item.ref.to_json()),
                    "pinned": item.ref.name in self.residency.pinned,
                }
            else:
                rows[(item.ref.name, item.ref.digest)] = {
                    **json.loads(item.ref.to_json()),
                    "tier": DISK_TIER,
                    "current": True,
                    "pinned": item.ref.name in self.residency.pinned,
                    "bytes": None,
                    "idle_s": None,
                }
        order = {tier: i for i, tier in enumerate(TIERS)}
        adapters = sorted(rows.values(), key=lambda r: (r["name"], order[r["tier"]], r["digest"]))
        report: dict[str, Any] = {
            "op": "list",
            "engine_model": self.engine_model,
            "adapters": [*adapters, *problems],
            "engine_reported": None,
            "stats": self.stats_report(),
        }
        try:
            report["engine_reported"] = self.engine.list_adapters()
        except TierCacheError as exc:
            report["engine_error"] = exc.client_message()
        return report

    def stats_report(self) -> dict[str, Any]:
        stats = self.residency.stats()
        return {
            "hits": dict(stats.hits),
            "loads": dict(stats.loads),
            "evictions": dict(stats.evictions),
            "resident": dict(stats.resident),
            "resident_bytes": dict(stats.resident_bytes),
            "disk_reads": stats.disk_reads,
            "disk_read_s": round(stats.disk_read_s, 6),
        }


def _row(resident: ResidentAdapter, tier: str, now: float, current: bool) -> dict[str, Any]:
    return {
        "name": resident.name,
        "task_id": resident.task_id,
        "digest": resident.digest,
        "tier": tier,
        "current": current,
        "pinned": resident.pinned,
        "bytes": resident.nbytes,
        "idle_s": round(max(0.0, now - resident.last_use_s), 3),
    }


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(n, str) for n in value):
        raise InvalidRequest('ADMIN op "warm" needs "names": a non-empty list of adapter names')
    return tuple(dict.fromkeys(check_name(n) for n in value))


def _ref(value: Any) -> AdapterRef:
    try:
        data = json.loads(value) if isinstance(value, str) else value
        if not isinstance(data, dict) or set(data) != {"name", "task_id", "digest"}:
            raise ValueError("expected keys name, task_id, digest")
        if not isinstance(data["task_id"], int) or isinstance(data["task_id"], bool):
            raise ValueError("task_id must be an integer")
        ref = AdapterRef(str(data["name"]), data["task_id"], str(data["digest"]))
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f'ADMIN op "weights": "lora" must be an AdapterRef: {exc}') from exc
    return check_ref(ref)
