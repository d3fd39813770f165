"""Where each adapter version lives: the engine's slots, host memory, or only on disk.

Three tiers:

- engine: a MIRROR of what the engine holds, keyed as the engines key adapters, by task id and
  digest (`held_key`: two names over identical files, an alias folder, are two adapters, each
  in its own slot). `lora_cache` is its single owner: it decides what the engine loads and
  evicts (each plan says so, by held key) and the engine obeys. Bounded by a number of slots
  and optionally bytes. Pinned names are never evicted from it.
- host: the weights themselves, keyed by version digest (one copy whatever the names), in
  this process's memory, bounded by count and bytes. It also
  keeps older versions of an adapter for requests resolved before the folder changed, so those
  finish on the version they started with. An adapter larger than the whole host budget passes
  through without being kept (never a "cache is full" error).
- disk: the registry (`read`), the last tier.

Store and policy are separate: each tier has its own eviction policy
(`tiercache.eviction`, LRU by default; size: the adapter's bytes), which nominates victims; the
tier evicts them and skips the protected ones (pinned adapters, the one being loaded).

Older versions. `latest(name)` (injected; the registry's current digest) tells a current version
from a stale one: when the current version of a name is planned, the engine drops every other
version of that name in the same plan (an engine that keys adapters by task id alone, like
TensorRT-LLM's, cannot hold two versions of one task id). A stale version that a late request
still asks for is loaded like any other, without evicting the current one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tiercache.adapter_types import AdapterRef, AdapterWeights, held_key, split_held_key
from tiercache.errors import CapacityError, ConfigError
from tiercache.eviction import EvictionPolicy, LruPolicy
from tiercache.lora.types import DISK_TIER, ENGINE_TIER, HOST_TIER
from tiercache.shadow import ShadowQueue, shadow_bytes

V = TypeVar("V")

ReadAdapter = Callable[[AdapterRef], AdapterWeights]
"""Reads a version from disk (the registry's `read`); Unavailable when it is gone."""

LatestDigest = Callable[[str], "str | None"]
"""name -> the digest of its current version, or None when unknown (no older-version eviction)."""


@dataclass(frozen=True, slots=True)
class LoraPlan:
    """What the engine must do before serving `ref`."""

    ref: AdapterRef
    tier: str  # where the version was found: ENGINE_TIER, HOST_TIER or DISK_TIER
    weights: AdapterWeights | None  # None: the engine already holds it; else what to send
    # the adapters (`held_key`s) the engine drops first (room, and older versions)
    evict: tuple[str, ...]
    read_s: float = 0.0  # time spent reading it from disk (0 unless tier is DISK_TIER)


@dataclass(frozen=True, slots=True)
class ResidentAdapter:
    name: str
    task_id: int
    digest: str
    nbytes: int
    pinned: bool
    last_use_s: float  # on the injected clock


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    engine: tuple[ResidentAdapter, ...]  # most recently used first
    host: tuple[ResidentAdapter, ...]


@dataclass(frozen=True, slots=True)
class ResidencyStats:
    """Cumulative counts since construction, keyed by tier name."""

    hits: Mapping[str, int]  # plans by the tier the version was found in
    loads: Mapping[str, int]  # engine: loads ordered (and prefetches); host: disk reads kept
    evictions: Mapping[str, int]  # engine: adapters planned out; host: weights dropped
    resident: Mapping[str, int]  # adapters now in the engine mirror and the host tier
    resident_bytes: Mapping[str, int]
    disk_reads: int
    disk_read_s: float
    # disk reads of versions the host tier evicted lately: their seconds, cumulative, and the
    # bytes those versions span (tiercache.shadow: what one more byte of the host tier saves)
    host_shadow_gained_s: float = 0.0
    host_shadow_bytes: int = 0


# -- store ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Resident(Generic[V]):
    ref: AdapterRef
    nbytes: int
    last_use: int  # a use counter: which version of a pinned name is newest; snapshot order
    last_use_s: float
    value: V


def as_named(weights: AdapterWeights, ref: AdapterRef) -> AdapterWeights:
    """`weights` (kept by digest) as the files of `ref`: the same bytes under another name
    (an alias folder: one digest, its own task id) are that name's files."""
    return weights if weights.ref == ref else dataclasses.replace(weights, ref=ref)


def by_digest(ref: AdapterRef) -> str:
    """The host tier's key: one copy of the files per version, whatever names share it."""
    return ref.digest


class _Tier(Generic[V]):
    """A bounded map key -> resident (`key` of its ref); evicts in the policy's order, skipping
    protected ones. Tells its policy of every add, use and removal. Not thread-safe by itself:
    Residency's lock guards it (and so the policy)."""

    def __init__(
        self,
        name: str,
        max_count: int,
        max_bytes: int,
        policy: EvictionPolicy[str],
        key: Callable[[AdapterRef], str] = by_digest,
    ) -> None:
        self.name = name
        self.max_count = max_count
        self.max_bytes = max_bytes  # 0: no byte bound
        self.key = key
        self._policy = policy
        self.items: dict[str, _Resident[V]] = {}
        self.nbytes = 0

    def get(self, key: str) -> _Resident[V] | None:
        return self.items.get(key)

    def use(self, resident: _Resident[V], uses: int, now: float) -> None:
        resident.last_use, resident.last_use_s = uses, now
        self._policy.access(self.key(resident.ref))

    def can_hold(self, nbytes: int) -> bool:
        return self.max_count >= 1 and (not self.max_bytes or nbytes <= self.max_bytes)

    def withdraw_offers(self) -> None:
        """Forget the last `victims` call's nominees (a plan not taken): a later explicit
        removal of one of them must not count as an eviction."""
        self._policy.nominate(0)

    def victims(
        self,
        nbytes: int,
        protected: Callable[[_Resident[V]], bool],
        forced: Sequence[str] = (),
        preferred: Sequence[str] = (),
    ) -> list[_Resident[V]] | None:
        """Who to evict so one more resident of `nbytes` fits: the `forced` keys first, then
        as many of the `preferred` ones (in order, not protected) as it takes, then the
        policy's nominees, skipping protected residents; None when it cannot fit. Changes
        nothing."""
        chosen = [self.items[k] for k in forced if k in self.items]

        def over() -> tuple[int, int]:
            count = len(self.items) - len(chosen) + 1 - self.max_count
            size = self.nbytes - sum(r.nbytes for r in chosen) + nbytes - self.max_bytes
            return count, (size if self.max_bytes else 0)

        over_count, over_bytes = over()
        for key in preferred:
            if over_count <= 0 and over_bytes <= 0:
                break
            resident = self.items.get(key)
            if resident is not None and resident not in chosen and not protected(resident):
                chosen.append(resident)
                over_count, over_bytes = over()
        if over_count <= 0 and over_bytes <= 0:
            return chosen
        kept = {self.key(r.ref) for r in chosen}

        def skip(key: str) -> bool:
            return key in kept or protected(self.items[key])

        nominees = [self.items[k] for k in self._policy.nominate(over_count, over_bytes, skip)]
        if len(nominees) < over_count or sum(r.nbytes for r in nominees) < over_bytes:
            # no plan: withdraw the offer, or a later explicit removal of a nominee would
            # count as an eviction (gdsf would raise its aging level to that adapter's value)
            self._policy.nominate(0)
            return None
        return chosen + nominees

    def add(self, resident: _Resident[V], cost_s: float = 0.0) -> None:
        """`cost_s`: what fetching the value cost (the disk read), for value-aware policies."""
        key = self.key(resident.ref)
        self.remove(key)
        self.items[key] = resident
        self.nbytes += resident.nbytes
        # a tier bounded by count alone: every adapter takes one slot (a value-aware policy
        # would otherwise evict the largest first where bytes are not what runs out)
        size = resident.nbytes if self.max_bytes else 1
        self._policy.admit(key, size, cost_s=cost_s)

    def nominate_bytes(self, nbytes: int) -> list[str]:
        """The policy's victims for `nbytes` (nothing protected), to shrink to a budget."""
        return self._policy.nominate(0, nbytes, lambda key: False)

    def remove(self, key: str) -> _Resident[V] | None:
        resident = self.items.pop(key, None)
        if resident is not None:
            self.nbytes -= resident.nbytes
            self._policy.remove(key)
        return resident

    def remove_digest(self, digest: str) -> list[_Resident[V]]:
        """Remove every resident of version `digest`, whatever its name: what an engine's
        eviction of that digest drops."""
        keys = [key for key, resident in self.items.items() if resident.ref.digest == digest]
        return [resident for key in keys if (resident := self.remove(key)) is not None]


# -- residency --------------------------------------------------------------------------------


class Residency:
    """The three tiers and the plan that moves a version into the engine. Thread-safe (one lock;
    disk reads happen outside it)."""

    def __init__(
        self,
        engine_slots: int,
        engine_max_bytes: int = 0,
        host_max_adapters: int = 32,
        host_max_bytes: int = 256 << 20,
        pinned: Iterable[str] = (),
        *,
        latest: LatestDigest | None = None,
        clock: Callable[[], float] = time.monotonic,
        engine_policy: EvictionPolicy[str] | None = None,
        host_policy: EvictionPolicy[str] | None = None,
    ) -> None:
        """Pins must leave at least one engine slot free (len(pinned) < engine_slots), so an
        unpinned adapter can always be loaded; ConfigError otherwise. Each tier has its own
        policy (they are stateful): LRU by default."""
        self.pinned = frozenset(pinned)
        problems = []
        if engine_slots < 1:
            problems.append(f"engine_slots must be >= 1, got {engine_slots}")
        elif len(self.pinned) >= engine_slots:
            problems.append(
                f"{len(self.pinned)} pinned adapters ({', '.join(sorted(self.pinned))}) need "
                f"engine_slots >= {len(self.pinned) + 1} (one slot stays free for the others), "
                f"got {engine_slots}"
            )
        for key, value in (
            ("engine_max_bytes", engine_max_bytes),
            ("host_max_adapters", host_max_adapters),
            ("host_max_bytes", host_max_bytes),
        ):
            if value < 0:
                problems.append(f"{key} must be >= 0, got {value}")
        if problems:
            raise ConfigError("; ".join(problems))
        self._engine: _Tier[None] = _Tier(
            ENGINE_TIER,
            engine_slots,
            engine_max_bytes,
            engine_policy if engine_policy is not None else LruPolicy(),
            key=held_key,
        )
        # host_max_bytes 0 means "keep nothing" (not "unbounded"): memory must have a bound.
        self._host: _Tier[AdapterWeights] = _Tier(
            HOST_TIER,
            host_max_adapters if host_max_bytes else 0,
            host_max_bytes,
            host_policy if host_policy is not None else LruPolicy(),
        )
        self._latest = latest or (lambda name: None)
        self._clock = clock
        self._lock = threading.Lock()
        self._uses = 0
        self._hits = dict.fromkeys((ENGINE_TIER, HOST_TIER, DISK_TIER), 0)
        self._loads = dict.fromkeys((ENGINE_TIER, HOST_TIER), 0)
        self._evictions = dict.fromkeys((ENGINE_TIER, HOST_TIER), 0)
        self._disk_reads = 0
        self._disk_read_s = 0.0
        self._host_shadow: ShadowQueue[str] = ShadowQueue(shadow_bytes(host_max_bytes))
        # the host tier's largest budget: an adapter larger passes through at any budget
        self._host_ceiling = host_max_bytes

    # -- the request path ----------------------------------------------------------------------

    def plan(self, ref: AdapterRef, read: ReadAdapter, *, reload: bool = False) -> LoraPlan:
        """Where `ref` is, and what the engine must load and evict to serve it; afterwards the
        mirror holds `ref` as engine-resident. `reload=True` (the engine said it lost `ref`)
        always returns the weights. CapacityError when pinned adapters leave no room for it;
        `read`'s errors (Unavailable: no tier holds this version anymore) pass through."""
        current = self._latest(ref.name) == ref.digest
        key = held_key(ref)  # an alias folder's name is an adapter of its own
        with self._lock:
            if reload:
                self._engine.remove(key)
            if self._engine.get(key) is not None:
                self._hits[ENGINE_TIER] += 1
                return self._admit(ref, None, 0, ENGINE_TIER, 0.0, current)
            held = self._host.get(ref.digest)
            if held is not None:
                self._hits[HOST_TIER] += 1
                weights = as_named(held.value, ref)
                return self._admit(ref, weights, held.nbytes, HOST_TIER, 0.0, current)
        started = self._clock()
        weights = read(ref)
        read_s = self._clock() - started
        if weights.ref.digest != ref.digest:
            raise RuntimeError(f"read({ref.short}) returned {weights.ref.short}")
        with self._lock:
            self._hits[DISK_TIER] += 1
            self._disk_reads += 1
            self._disk_read_s += read_s
            self._host_shadow.credit(ref.digest, read_s)  # a larger host tier: no read
            if self._host.get(ref.digest) is None:
                self._keep(weights, read_s)
            planned = self._engine.get(key)
            if planned is not None and not reload:
                # Another thread planned it while this one read: the engine gets it from there.
                return self._admit(ref, None, weights.nbytes, DISK_TIER, read_s, current)
            return self._admit(ref, weights, weights.nbytes, DISK_TIER, read_s, current)

    def forget(self, ref: AdapterRef) -> bool:
        """The engine said it does not hold `ref`: drop it from the mirror (True if it was
        there). The next plan for it carries its weights."""
        with self._lock:
            return self._engine.remove(held_key(ref)) is not None

    def drop(self, gone: Iterable[str]) -> int:
        """The engine reports these adapters gone (`held_key`s; a bare digest: every name over
        it), e.g. dropped on its own to make room: drop them from the mirror; returns how many
        were there."""
        with self._lock:
            dropped = 0
            for item in gone:
                try:
                    whole = split_held_key(item) is None
                except ValueError:
                    continue  # not a key: nothing of ours
                if whole:
                    dropped += len(self._engine.remove_digest(item))
                else:
                    dropped += self._engine.remove(item) is not None
            return dropped

    def mark_resident(self, weights: AdapterWeights) -> tuple[str, ...]:
        """The engine loaded this version on its own (prefetch at start): record it in the
        mirror, keep its weights in the host tier, and return the adapters (`held_key`s) that
        made room (the engine is expected to have dropped them, or never to have held them)."""
        current = self._latest(weights.ref.name) == weights.ref.digest
        with self._lock:
            if self._host.get(weights.ref.digest) is None:
                self._keep(weights)
            plan = self._admit(weights.ref, None, weights.nbytes, ENGINE_TIER, 0.0, current)
            return plan.evict

    # -- views ---------------------------------------------------------------------------------

    def snapshot(self) -> ResidencySnapshot:
        with self._lock:
            return ResidencySnapshot(self._view(self._engine), self._view(self._host))

    def stats(self) -> ResidencyStats:
        with self._lock:
            return ResidencyStats(
                hits=dict(self._hits),
                loads=dict(self._loads),
                evictions=dict(self._evictions),
                resident={t.name: len(t.items) for t in (self._engine, self._host)},
                resident_bytes={t.name: t.nbytes for t in (self._engine, self._host)},
                disk_reads=self._disk_reads,
                disk_read_s=self._disk_read_s,
                host_shadow_gained_s=self._host_shadow.gained_s,
                host_shadow_bytes=self._host_shadow.bytes,
            )

    def host_shadow_reading(self) -> tuple[float, float]:
        """(disk-read seconds the host tier's shadow hits saved, cumulative; the bytes it
        spans): its budget's `ShadowValue` reads it."""
        with self._lock:
            return self._host_shadow.gained_s, float(self._host_shadow.bytes)

    def host_bytes(self) -> int:
        """What the host tier holds now (its budget's unfilled part frees nothing)."""
        with self._lock:
            return self._host.nbytes

    def resize_host(self, max_bytes: int) -> int:
        """A new byte bound for the host tier (tiercache.budgets): versions are dropped at once,
        in its policy's order, down to it; returns it. The engine's mirror is untouched (a
        version dropped here is read from disk again when the engine needs it back)."""
        if max_bytes < 1:
            raise ConfigError(f"the host tier's budget must be >= 1 byte, got {max_bytes}")
        with self._lock:
            host = self._host
            host.max_bytes = max_bytes
            self._host_shadow.resize(shadow_bytes(max_bytes))
            over = host.nbytes - max_bytes
            if over > 0:
                victims = [host.items[d] for d in host.nominate_bytes(over)]
                self._drop_from_host(victims)
            return max_bytes

    def engine_digests(self) -> frozenset[str]:
        with self._lock:
            return frozenset(resident.ref.digest for resident in self._engine.items.values())

    # -- internals (lock held) -----------------------------------------------------------------

    def _admit(
        self,
        ref: AdapterRef,
        weights: AdapterWeights | None,
        nbytes: int,
        tier: str,
        read_s: float,
        current: bool,
    ) -> LoraPlan:
        """Make `ref` (of `nbytes`; ignored when already resident) engine-resident in the mirror.
        Everything is computed before anything changes, so a CapacityError leaves the mirror as
        the engine has it."""
        engine = self._engine
        held = engine.get(held_key(ref))
        # Older versions of the name leave the engine with the current one's first plan, when
        # the host tier keeps a copy: a request resolved before the change still finishes on
        # its version from there. Without one (an adapter larger than the host tier passes
        # through it; the copy was evicted) the folder no longer has it either, so it stays
        # in the engine until the policy evicts it like any other.
        older = [
            key
            for key, resident in engine.items.items()
            if current and resident.ref.name == ref.name and resident.ref.digest != ref.digest
        ]
        stale = [key for key in older if engine.items[key].ref.digest in self._host.items]
        # Those without a host copy serve late requests nothing else can (the folder holds
        # the new version): the policy's own victims go instead when they make room without
        # them; when its choice takes one of them anyway, they go first and alone (the policy
        # would give the newest up last, as its name's most recently used, after others).
        kept_older = [key for key in older if key not in stale]
        if held is not None:
            victims = [engine.items[key] for key in stale]
        else:
            if not engine.can_hold(nbytes):
                raise CapacityError(
                    f"adapter {ref.short} ({nbytes} bytes) is larger than the engine's adapter "
                    f"budget (engine_max_bytes {engine.max_bytes})"
                )
            protect = self._pinned_check(ref, current)
            found = engine.victims(nbytes, protect, forced=stale)
            if found is None or any(held_key(v.ref) in kept_older for v in found):
                engine.withdraw_offers()  # that plan is not taken
                found = engine.victims(nbytes, protect, forced=stale, preferred=kept_older)
            if found is None:
                raise CapacityError(
                    f"no engine adapter slot can be freed for {ref.short}: the resident "
                    f"adapters are pinned ({', '.join(sorted(self.pinned))})"
                )
            victims = found
        # by name and digest, as the engines hold them: another name over a victim's files
        # (an alias folder) stays
        evict = tuple(held_key(v.ref) for v in victims)
        for key in evict:
            engine.remove(key)
        self._evictions[ENGINE_TIER] += len(victims)
        self._uses += 1
        now = self._clock()
        if held is None:
            engine.add(_Resident(ref, nbytes, self._uses, now, None))
            self._loads[ENGINE_TIER] += 1
        else:
            engine.use(held, self._uses, now)
        kept = self._host.get(ref.digest)
        if kept is not None:  # the host copy stays warm while the engine uses it (for retries)
            self._host.use(kept, self._uses, now)
        return LoraPlan(ref, tier, weights, evict, read_s)

    def _pinned_check(
        self, loading: AdapterRef, current: bool = False
    ) -> Callable[[_Resident[None]], bool]:
        """Protected in the engine: the adapter being loaded, and per pinned name its most
        recently used version (older versions of a pinned name are not pinned). When the
        current version of its name is being loaded, that one is the name's pinned version:
        an old version kept in the engine for late requests must not keep it out (a late
        request for the old version protects the name's newest as before)."""
        newest: dict[str, _Resident[None]] = {}
        for resident in self._engine.items.values():
            name = resident.ref.name
            if current and name == loading.name:
                continue
            if name in self.pinned and (
                name not in newest or resident.last_use > newest[name].last_use
            ):
                newest[name] = resident
        protected = {held_key(r.ref) for r in newest.values()} | {held_key(loading)}
        return lambda resident: held_key(resident.ref) in protected

    def _keep(self, weights: AdapterWeights, read_s: float = 0.0) -> None:
        """Keep `weights` (read from disk in `read_s`) in the host tier if it can hold them at
        all (else they pass through)."""
        host = self._host
        if not host.can_hold(weights.nbytes):
            # passed through: with more bytes it would have stayed (the shadow keeps its latest
            # eviction whatever its size), unless the tier keeps nothing at all
            if host.max_count and 0 < weights.nbytes <= self._host_ceiling:
                self._host_shadow.add(weights.ref.digest, weights.nbytes, read_s)
            return
        # the byte bound, not the count, is what makes room: only then would bytes have helped
        by_bytes = bool(host.max_bytes) and host.nbytes + weights.nbytes > host.max_bytes
        victims = host.victims(weights.nbytes, lambda resident: False)
        if victims is None:  # cannot happen without protected residents; keep it loud
            raise RuntimeError(f"host tier cannot make room for {weights.ref.short}")
        self._drop_from_host(victims, shadow=by_bytes)
        self._uses += 1
        resident = _Resident(weights.ref, weights.nbytes, self._uses, self._clock(), weights)
        host.add(resident, cost_s=read_s)
        self._loads[HOST_TIER] += 1

    def _drop_from_host(
        self, victims: Sequence[_Resident[AdapterWeights]], shadow: bool = True
    ) -> None:
        """Evict from the host tier; each into its shadow (worth a mean disk read) when bytes
        were what ran out."""
        mean_read_s = self._disk_read_s / self._disk_reads if self._disk_reads else 0.0
        for victim in victims:
            self._host.remove(victim.ref.digest)
            if shadow:
                self._host_shadow.add(victim.ref.digest, victim.nbytes, mean_read_s)
        self._evictions[HOST_TIER] += len(victims)

    def _view(self, tier: _Tier[V]) -> tuple[ResidentAdapter, ...]:
        ordered = sorted(tier.items.values(), key=lambda r: r.last_use, reverse=True)
        return tuple(
            ResidentAdapter(
                r.ref.name,
                r.ref.task_id,
                r.ref.digest,
                r.nbytes,
                r.ref.name in self.pinned,
                r.last_use_s,
            )
            for r in ordered
        )
