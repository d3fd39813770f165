"""The stages' parts, built from their typed configs; no Triton here, so unit tests build them too.

Shared by several stages: the exact cache's tiers with their Redis link and invalidation listener,
the server secret, the adapter registry. One stage's each: the admin (cache_admin), the adapter
residency and fleet sync (lora_cache), the response padding policy (llm). The Triton-facing stage
objects that hold them, with their metrics and BLS clients, are the other modules of this
package."""

from __future__ import annotations

import logging
import os
import time
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tiercache.adapter_types import AdapterRef
from tiercache.admin import Admin, LoraAdmin
from tiercache.config import (
    CacheAdminConfig,
    CacheConfig,
    LlmConfig,
    LoraCacheConfig,
    PromptCacheConfig,
    api_keys_path,
    name_list,
)
from tiercache.engine.model_source import resolve_model
from tiercache.errors import ConfigError, TierCacheError
from tiercache.eviction import named_policy
from tiercache.exact.invalidation import InvalidationListener, RestartSweeper
from tiercache.exact.keys import EngineIdentity, load_or_create_secret, read_secret, tenant_scope
from tiercache.exact.l2_values import L2Values, l2_values_map_bytes
from tiercache.exact.prompt_cache import PromptCache, ResolveAdapter
from tiercache.exact.redis_tier import (
    RedisLink,
    RedisStore,
    check_eviction_policy,
    check_fleet_secret,
)
from tiercache.exact.request import canonical_tenant
from tiercache.exact.stores import LmdbStore, MemoryStore, Store, make_private_dir
from tiercache.exact.tenant_keys import KeyFile
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import DEFAULT_MAX_EVENTS, HostWatermarks, InvalidationTable
from tiercache.lora.fleet import AdapterFleet, FleetSync, local_versions, replica_id
from tiercache.lora.registry import AdapterRegistry
from tiercache.lora.residency import LoraPlan, Residency
from tiercache.lora.stage import EngineAdmin, LoraCache, latest_digest
from tiercache.machine import DiskRoom
from tiercache.padding import PaddingPolicy
from tiercache.stages.envelope import Freshness
from tiercache.stages.seal import Sealer
from tiercache.stages.transport import AdapterCipher
from tiercache.vocabulary import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExactTiers:
    """An opened exact cache and what runs beside it. `cache.close()` closes all of it (the
    listener and the sweeper are among its `background`, closed first)."""

    cache: TieredCache
    link: RedisLink | None = None  # with redis_url: the link of L3, leases and shared rows
    listener: InvalidationListener | None = None  # with redis_url
    sweeper: RestartSweeper | None = None  # with redis_url: the L2 sweep at start


def open_l2_values(config: CacheConfig, clock: Callable[[], float]) -> L2Values | None:
    """L2's shared values (`l2_eviction` gdsf), or None: set to `oldest`, or when they cannot
    be opened (advice: logged, and L2 evicts oldest first rather than the stage failing)."""
    if config.l2_eviction != "gdsf":
        return None
    try:
        return L2Values(config.l2_values_path(), l2_values_map_bytes(config.l2_max_bytes), clock)
    except Exception:  # noqa: BLE001 - advice only
        log.exception(
            "L2 values at %s did not open; L2 evicts oldest first", config.l2_values_path()
        )
        return None


def open_exact_cache(
    config: CacheConfig,
    clock: Callable[[], float] = time.time,
    *,
    max_events: int = DEFAULT_MAX_EVENTS,
    environ: Mapping[str, str] | None = None,
) -> ExactTiers:
    """L1 in this process (if `l1_max_bytes` > 0), the host's shared L2 and, with `redis_url`,
    L3 on Redis plus the invalidation listener (a thread, joined by the cache's `close()`).

    `ttl_s` is the entry lifetime horizon: the invalidation table, the host's log and the Redis
    log forget a watermark only once it is older than that (plus the skew allowance), past
    `max_events` (tiercache.exact.watermarks); with `ttl_s` 0 they forget none.

    With `redis_url` the link carries the host's secret (`host_secret`), which signs and checks
    every L3 value, invalidation and shared row; it is checked against the fleet's fingerprint
    first, so a replica with another secret fails here (ConfigError) before opening anything,
    and so does a Redis that may evict the control keys (`check_eviction_policy`, which reads
    its override from `environ`; None: the process's environment). Once the listener has
    caught up, a `RestartSweeper` sweeps L2 in the background for the watermarks issued since
    the host's last such sweep."""
    link: RedisLink | None = None
    if config.redis_url:
        secret = host_secret(config.state_path())
        link = RedisLink.from_url(
            config.redis_url,
            config.redis_prefix,
            config.redis_timeout_s,
            config.redis_retry_s,
            secret=secret,
        )
        try:
            check_fleet_secret(link, secret, secret_source(config.state_path()))
            entries_expire = config.redis_max_ttl_s > 0 or config.ttl_s > 0
            check_eviction_policy(link, entries_expire, environ)
        except BaseException:
            link.close()
            raise
    horizon_s = config.ttl_s or None  # 0: answers never expire, no watermark is forgotten
    table = InvalidationTable(max_events=max_events, horizon_s=horizon_s, clock=clock)
    tiers: list[tuple[Tier, Store]] = []
    if config.l1_max_bytes > 0:
        tiers.append((Tier.L1, MemoryStore(config.l1_max_bytes, named_policy(config.l1_eviction))))
    values = open_l2_values(config, clock)
    try:
        disk = DiskRoom(config.state_path(), config.disk_headroom_bytes)
        l2 = LmdbStore(
            config.l2_path(), config.l2_max_bytes, clock=clock, values=values, disk=disk,
            evict_early=True,  # a miss's write-back never waits for a scan of L2
        )  # fmt: skip
    except BaseException:
        if values is not None:
            values.close()
        raise
    tiers.append((Tier.L2, l2))
    marks = HostWatermarks(
        config.invalidations_path(), max_events, horizon_s=horizon_s, clock=clock
    )
    if link is not None:
        tiers.append((Tier.L3, RedisStore(link, max_ttl_s=config.redis_max_ttl_s, clock=clock)))
    cache = TieredCache(
        tiers, clock=clock, default_ttl_s=config.ttl_s, invalidations=table, host_marks=marks
    )
    if link is None:
        return ExactTiers(cache)
    listener = InvalidationListener(link, cache, retry_s=config.redis_retry_s).start()
    cache.background.append(listener)
    # L3 is read only while the listener has every recorded watermark: a value replayed into
    # Redis after an invalidation this process has not noted (its record unreadable, cut off)
    # is never served; the local tiers are (Redis down at start: docs/replicas.md)
    l3 = cache.store(Tier.L3)
    if isinstance(l3, RedisStore):
        l3.ready = listener.caught_up
    # Serve nothing before the recorded watermarks are noted: this replica's L2 may hold entries
    # invalidated while it was down. Redis down: the local tiers serve at once (docs/replicas.md).
    if not listener.wait_first_attempt(2 * config.redis_timeout_s + 1.0):
        log.warning(
            "Redis %s %s at start: entries invalidated while this replica was down can be "
            "served from its own tiers until it is",
            link.url or "(injected client)",
            "answered but its invalidation record could not be read whole"
            if listener.subscribed
            else "did not answer",
        )
    # Then give back the space of what was invalidated while it was down, for good: once the
    # listener has caught up (now, or when Redis is back), off the request path.
    sweeper = RestartSweeper(cache, marks, ready=listener.wait_connected).start()
    cache.background.append(sweeper)
    return ExactTiers(cache, link, listener, sweeper)


def open_lookup(
    config: PromptCacheConfig, embedder_key: str
) -> tuple[PromptCache, ExactTiers, bytes]:
    """prompt_cache's lookup over the tiers its config names (its own L1, the host's L2, L3 with
    `redis_url`), under the deployment's secret, engine identity, limits and adapter registry:
    what the stage serves from, and what the gateway's edge layer builds from the same
    parameters so that it computes the same digests (tiercache.gateway.edge). `embedder_key`
    "" computes no semantic scopes. Also returns the tiers and the secret it keys by."""
    tiers = open_exact_cache(config.cache())
    adapters = open_adapters(config.adapters_path(), config.state_path(), config.adapters_manifest)
    secret = load_secret(config.cache(), tiers.link)
    lookup = PromptCache(
        tiers.cache,
        secret,
        resolve_model(config.model).identity,
        config.limits(),
        embedder_key,
        adapters.resolve,
    )
    return lookup, tiers, secret


def load_secret(config: CacheConfig, link: RedisLink | None) -> bytes:
    """The server secret: this host's (`host_secret`: `$TIERCACHE_SECRET_FILE`, else
    `<state>/secret`), never Redis's. With `link`, checked against the fingerprint of the
    fleet's secret in Redis (`check_fleet_secret`): ConfigError when it is another secret."""
    secret = host_secret(config.state_path())
    if link is not None:
        check_fleet_secret(link, secret, secret_source(config.state_path()))
    return secret


def secret_source(state_path: Path) -> str:
    """Where `host_secret(state_path)` reads this host's secret, for messages."""
    named = os.environ.get("TIERCACHE_SECRET_FILE")
    return f"$TIERCACHE_SECRET_FILE={named}" if named else str(state_path / "secret")


def host_secret(state_path: Path) -> bytes:
    """This host's server secret: the file `$TIERCACHE_SECRET_FILE` names (the replicas of one
    fleet are given one file), else `<state>/secret`, created (0600) on first use."""
    path = secret_path(state_path)
    if path == state_path / "secret":
        make_private_dir(state_path)  # 0700: it holds the secret and every tenant's answers
    return load_or_create_secret(path)


def secret_path(state_path: Path) -> Path:
    """This host's secret file: `$TIERCACHE_SECRET_FILE`, else `<state>/secret`."""
    named = os.environ.get("TIERCACHE_SECRET_FILE")
    return Path(named) if named else state_path / "secret"


def read_host_secret(state_path: Path) -> bytes:
    """`host_secret` for an admin tool: read, never created (ConfigError when missing)."""
    return read_secret(secret_path(state_path))


def open_sealer(state_path: Path) -> Sealer:
    """The stages' sealer (tiercache.stages.seal) under this host's secret: every stage of one
    server reads the same secret file, never Redis."""
    return Sealer.from_secret(host_secret(state_path))


def open_freshness(max_age_s: float, api_keys_file: str | None = None) -> Freshness:
    """What a stage checks of an envelope past its seal (tiercache.stages.envelope.Freshness):
    its age, and with the deployment's key file (the parameter, else $TIERCACHE_API_KEYS_FILE;
    None: the stage checks no key, as torch_llm, whose envelopes come from llm alone) that the
    key that sent it still allows it."""
    keys_path = None if api_keys_file is None else api_keys_path(api_keys_file)
    return Freshness(max_age_s, KeyFile(keys_path) if keys_path is not None else None)


def open_adapter_cipher(state_path: Path, max_body_bytes: int = 0) -> AdapterCipher:
    """What closes and opens the adapter files lora_cache sends llm (tiercache.stages.transport),
    under this host's secret like the seals; lora_cache keeps up to `max_body_bytes` of the
    encrypted files it sends."""
    return AdapterCipher.from_secret(host_secret(state_path), max_body_bytes)


def open_adapters(adapters_dir: Path, state_dir: Path, manifest: str) -> AdapterRegistry:
    """The adapter registry over `adapters_dir` (and the optional JSON `manifest`)."""
    return AdapterRegistry(adapters_dir, state_dir, Path(manifest) if manifest else None)


def open_admin(
    config: CacheAdminConfig,
    engine: EngineIdentity,
    resolve_adapter: ResolveAdapter | None = None,
    lora_admin: LoraAdmin | None = None,
    clock: Callable[[], float] = time.time,
) -> Admin:
    """The deployment's L2 (and L3 with its listener) without an L1, its secret, and a
    `PromptCache` over them for digests. `close()` the admin's `cache` when done."""
    tiers = open_exact_cache(config.cache(), clock=clock)
    return admin_over(config, tiers, engine, resolve_adapter, lora_admin)


def admin_over(
    config: CacheAdminConfig,
    tiers: ExactTiers,
    engine: EngineIdentity,
    resolve_adapter: ResolveAdapter | None = None,
    lora_admin: LoraAdmin | None = None,
) -> Admin:
    secret = load_secret(config.cache(), tiers.link)
    prompts = PromptCache(tiers.cache, secret, engine, config.limits(), "", resolve_adapter)
    return Admin(prompts, secret, lora_admin, tiers.link)


def open_lora_core(
    config: LoraCacheConfig,
    engine: EngineAdmin,
    *,
    on_plan: Callable[[LoraPlan], None] = lambda plan: None,
    clock: Callable[[], float] = time.monotonic,
) -> LoraCache:
    """The stage from its config: the registry, the residency with pins (the `pin` parameter
    plus the manifest's), and the `prefetch` adapters recorded as engine-resident (the engine
    loads the same list at its start; if they diverge, the engine's "not found in cache" answer
    and llm's retry correct it). ConfigError for a pin or prefetch name that does not resolve."""
    manifest = Path(config.adapters_manifest) if config.adapters_manifest else None
    registry = AdapterRegistry(config.adapters_path(), config.state_path(), manifest, clock=clock)
    pinned = tuple(dict.fromkeys([*name_list(config.pin), *registry.pinned()]))
    prefetch = tuple(dict.fromkeys(name_list(config.prefetch)))  # LoraCacheConfig checks its size
    refs: dict[str, AdapterRef] = {}
    for name in (*pinned, *prefetch):
        try:
            refs[name] = registry.resolve(name)
        except TierCacheError as exc:
            raise ConfigError(f"pin/prefetch adapter {name!r}: {exc.message}") from exc
    residency = Residency(
        config.engine_slots,
        config.engine_max_bytes,
        config.host_max_adapters,
        config.host_max_bytes,
        pinned,
        latest=latest_digest(registry),
        clock=clock,
        engine_policy=named_policy(config.adapter_eviction, config.engine_slots),
        host_policy=named_policy(config.adapter_eviction, config.host_max_adapters),
    )
    for name in prefetch:
        residency.mark_resident(registry.read(refs[name]))
    return LoraCache(registry, residency, engine, config.engine_model, clock=clock, on_plan=on_plan)


def open_fleet(config: LoraCacheConfig, stage: LoraCache) -> FleetSync | None:
    """The `lora_cache` stage's fleet sync (started), or None without `redis_url`. With
    `prefetch_fleet_top` N > 0 it warms, at start, those of the fleet's N most-used adapters
    that this replica's folder has and that are not already pinned or prefetched, as many as
    the engine slots left by those allow."""
    if not config.redis_url:
        return None
    link = RedisLink.from_url(
        config.redis_url, config.redis_prefix, config.redis_timeout_s, config.redis_retry_s
    )
    fleet = AdapterFleet(link, replica_id(config.state_path()))
    registry = stage.registry
    configured = {*name_list(config.pin), *name_list(config.prefetch), *registry.pinned()}
    room = max(0, config.engine_slots - len(configured))

    def choose(names: list[str]) -> list[str]:
        known = set(registry.names())
        return [n for n in names if n in known and n not in configured][:room]

    return FleetSync(
        fleet,
        lambda: local_versions(registry),
        sync_s=config.fleet_sync_s,
        warm=lambda names: dict(stage.warm(names)["warmed"]),
        choose_warm=choose,
        warm_top=config.prefetch_fleet_top,
    ).start()


def kv_reuse_scope(config: LlmConfig, secret: bytes) -> str | None:
    """The one tenant scope llm lets reach an engine with prefix KV reuse on
    (`trtllm_kv_reuse_tenant`, named as prompt_cache names a tenant); None: every tenant."""
    if not config.trtllm_kv_reuse_tenant:
        return None
    return tenant_scope(secret, canonical_tenant(config.trtllm_kv_reuse_tenant))


def padding_policy(config: LlmConfig, secret: bytes) -> PaddingPolicy:
    """The stage's policy from its parameters; `trusted_tenants` names are normalized as
    prompt_cache normalizes `tenant` (NFKC, stripped) and turned into scopes under `secret`."""
    names = (unicodedata.normalize("NFKC", n).strip() for n in name_list(config.trusted_tenants))
    return PaddingPolicy(
        floor_s=config.hit_padding_ms / 1000.0,
        jitter_s=config.hit_padding_jitter_ms / 1000.0,
        trusted=frozenset(tenant_scope(secret, n) for n in names),
    )
