"""Stage 1, the prompt cache: canonical request -> scoped digest -> L1 -> L2."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from tiercache.config import CacheConfig
from tiercache.errors import NotFound
from tiercache.invalidation import HostWatermarks, InvalidationListener
from tiercache.keys import (
    Digest,
    EngineIdentity,
    load_or_create_secret,
    replace_secret,
    request_digest,
    semantic_scope,
    tenant_scope,
)
from tiercache.lora.types import AdapterRef
from tiercache.redis_tier import RedisLink, RedisStore, shared_secret
from tiercache.request import DEFAULT_LIMITS, GenerationRequest, Limits, RawInputs, canonicalize
from tiercache.stores import LmdbStore, MemoryStore
from tiercache.tiered import Tier, TieredCache

log = logging.getLogger(__name__)

ResolveAdapter = Callable[[str], AdapterRef]
"""lora_name -> the adapter's current version (NotFound for an unknown name)."""


class CacheStatus(str, Enum):
    EXACT = "exact"  # served from the exact cache
    MISS = "miss"  # looked up, not found: generated (and stored if allowed)
    BYPASS = "bypass"  # not looked up: `no-cache`, or a sampled request without a seed
    SEMANTIC = "semantic"  # served from the answer of a reworded request in the same scope


@dataclass(frozen=True, slots=True)
class LookupResult:
    request: GenerationRequest
    digest: Digest | None  # None: the request is not cacheable (never coalesced or stored)
    status: CacheStatus
    text: str  # the cached answer on EXACT, else ""
    tier: Tier | None
    write_back: bool  # whether the llm stage may store the answer
    scope: str = ""  # semantic scope ("" when semantic caching does not apply)
    semantic_lookup: bool = False  # whether embedding_cache should look this request up


def open_tiered_cache(
    config: CacheConfig, clock: Callable[[], float] = time.time, with_l1: bool = True
) -> TieredCache:
    """L1 in this process (unless `with_l1` is False), the host's shared L2 and, with
    `redis_url`, L3 on Redis plus the invalidation listener (a thread, joined by `close()`)."""
    l1 = MemoryStore(config.l1_max_bytes) if with_l1 else None
    l2 = LmdbStore(config.l2_path(), config.l2_max_bytes, clock=clock)
    marks = HostWatermarks(config.invalidations_path())
    if not config.redis_url:
        return TieredCache(l1, l2, clock=clock, default_ttl_s=config.ttl_s, host_marks=marks)
    link = RedisLink.from_url(
        config.redis_url, config.redis_prefix, config.redis_timeout_s, config.redis_retry_s
    )
    l3 = RedisStore(link, max_ttl_s=config.redis_max_ttl_s, clock=clock)
    cache = TieredCache(l1, l2, l3, clock=clock, default_ttl_s=config.ttl_s, host_marks=marks)
    listener = InvalidationListener(link, cache, retry_s=config.redis_retry_s).start()
    cache.background.append(listener)
    # Serve nothing before the recorded watermarks are noted: this replica's L2 may hold entries
    # invalidated while it was down. Redis down: the local tiers serve at once (docs/replicas.md).
    if not listener.wait_first_attempt(2 * config.redis_timeout_s + 1.0):
        log.warning(
            "Redis %s did not answer at start: entries invalidated while this replica was down "
            "can be served from its own tiers until Redis is back",
            link.url or "(injected client)",
        )
    return cache


def redis_link(cache: TieredCache) -> RedisLink | None:
    """The cache's Redis link (for leases and invalidations), None without L3."""
    return cache.l3.link if isinstance(cache.l3, RedisStore) else None


def invalidation_listener(cache: TieredCache) -> InvalidationListener | None:
    found = [b for b in cache.background if isinstance(b, InvalidationListener)]
    return found[0] if found else None


def load_secret(config: CacheConfig, cache: TieredCache) -> bytes:
    """The server secret: the host's (`<state>/secret`) or, with L3, the one every replica shares
    (kept in Redis; the host's file is replaced by it, so a later start without Redis agrees)."""
    path = config.secret_path()
    local = load_or_create_secret(path)
    link = redis_link(cache)
    if link is None:
        return local
    shared = shared_secret(link, local)
    if shared != local:
        replace_secret(path, shared)
    return shared


class PromptCache:
    def __init__(
        self,
        cache: TieredCache,
        secret: bytes,
        engine: EngineIdentity,
        limits: Limits = DEFAULT_LIMITS,
        embedder_key: str = "",
        resolve_adapter: ResolveAdapter | None = None,
    ) -> None:
        """`embedder_key` names the embedding cache's embedder; empty turns semantic scopes off.
        `resolve_adapter` maps a lora_name to its current version; None serves the base only."""
        self.cache = cache
        self._secret = secret
        self.engine = engine
        self.limits = limits
        self.embedder_key = embedder_key
        self.resolve_adapter = resolve_adapter

    def _with_adapter(self, request: GenerationRequest) -> GenerationRequest:
        """Pin the request to the adapter version its name resolves to now: the version's digest
        goes into every key, so a changed adapter folder never hits the old version's entries."""
        if not request.lora_name:
            return request
        if self.resolve_adapter is None:
            raise NotFound(f"unknown adapter {request.lora_name!r}: no adapters are configured")
        ref = self.resolve_adapter(request.lora_name)
        return dataclasses.replace(request, lora_task_id=ref.task_id, lora_digest=ref.digest)

    def lookup(self, raw: RawInputs, read: bool = True) -> LookupResult:
        """Validate and canonicalize `raw` (InvalidRequest on bad input; NotFound for an unknown
        adapter), then look it up. `read` False computes everything but reads no tier: a
        cacheable request is then a MISS (cache_admin's warm, which stores an answer under the
        digest whether or not one is there)."""
        canonical = canonicalize(raw, self.limits)
        tenant = tenant_scope(self._secret, canonical.tenant)
        # The engine keys its prefix KV blocks by the tenant scope (never in key_fields()).
        control = canonical.cache_control
        request = dataclasses.replace(
            self._with_adapter(canonical.request),
            kv_scope=tenant,
            cache_tags=control.tags,
            max_age_s=control.max_age_s,
        )
        if not canonical.cacheable:
            return LookupResult(request, None, CacheStatus.BYPASS, "", None, False)
        adapter = request.lora_digest
        digest = request_digest(tenant, self.engine, request, adapter)
        write_back = not control.no_store
        scope = ""
        if self.embedder_key and canonical.semantic_eligible:
            scope = semantic_scope(tenant, self.engine, request, self.embedder_key, adapter)
        # A semantic hit's age is not checked, so a request with max-age is not looked up by
        # meaning; embedding_cache then embeds nothing, so its answer is not indexed either.
        semantic = bool(scope) and control.max_age_s is None
        if control.no_cache:
            return LookupResult(request, digest, CacheStatus.BYPASS, "", None, write_back, scope)
        if control.semantic_only:  # no exact lookup: `bypass` unless the semantic one hits
            return LookupResult(
                request, digest, CacheStatus.BYPASS, "", None, write_back, scope, semantic
            )
        found = self.cache.get(digest, control.max_age_s) if read else None
        if found is None:
            return LookupResult(
                request, digest, CacheStatus.MISS, "", None, write_back, scope, semantic
            )
        return LookupResult(request, digest, CacheStatus.EXACT, found.entry.text, found.tier, False)
