"""The `prompt_cache` stage: canonical request -> scoped digest -> L1 -> L2 -> L3, and the
envelope every later stage reads."""

from __future__ import annotations

import time

from tiercache.budgets import BudgetThread, LatencyObjective
from tiercache.config import PromptCacheConfig
from tiercache.errors import Forbidden
from tiercache.exact.memo import MEMO_MAX_CHARS, Memo
from tiercache.exact.prompt_cache import LookupResult, PromptCache, small_request
from tiercache.exact.request import RawInputs
from tiercache.exact.tenant_keys import KeyFile, key_from_parameter
from tiercache.semantic.embedder import resolve_embedder
from tiercache.stages.common import export_redis, status_counters
from tiercache.stages.contract import (
    PROMPT_CACHE,
    PaddedTenants,
    deployment_terms,
    prompt_cache_terms,
    write_terms,
)
from tiercache.stages.envelope import Envelope
from tiercache.stages.memory_budgets import follow_l1
from tiercache.stages.parts import open_lookup, open_sealer
from tiercache.stages.seal import Sealer
from tiercache.triton import metrics as tm
from tiercache.vocabulary import CacheStatus, Tier, choices


class PromptCacheStage:
    """Lookups, counted by status and by the tier that answered."""

    def __init__(
        self, cache: PromptCache, metrics: tm.Metrics, sealer: Sealer, keys: KeyFile | None = None
    ) -> None:
        self.cache = cache
        self.sealer = sealer
        self.keys = keys  # None: the tenant input is trusted (no api_keys_file)
        # (envelope, answer) -> the sealed envelope of an exact hit: a repeated hit skips the
        # envelope's JSON and its HMAC (tiercache.exact.memo)
        self._sealed: Memo[bytes] = Memo()
        self.metrics = m = metrics
        self.requests = status_counters(
            m,
            "tiercache_prompt_cache_requests_total",
            "Requests by cache status",
            "status",
            (*choices(CacheStatus), "error", "forbidden"),
        )
        self.hits = {
            tier: m.counter(
                "tiercache_prompt_cache_hits_total", "Exact hits by tier", tier=tier.value
            )
            for tier, _ in cache.cache.stores()
        }
        self.lookup_s = m.histogram(
            "tiercache_prompt_cache_lookup_seconds", "Stage time per request"
        )
        tm.StoreMetrics(m, cache.cache)
        self.budgets: BudgetThread | None = None  # L1 following the host's memory, if asked
        self.hit_objective: LatencyObjective | None = None  # hit_objective_s, if set

    def lookup(
        self, raw: RawInputs, authorization: object = None
    ) -> tuple[bytes, str, tuple[int, int, int]]:
        """The sealed envelope for the later stages (bound to the answer), the cached answer
        ("" unless an exact hit) and its stored token accounting (tiercache.stages.seal.Tokens;
        zeros unless known); InvalidRequest / NotFound for this request alone, Forbidden
        when a key file is configured and `authorization` (the forwarded header) carries no
        key that allows the request."""
        started = time.perf_counter()
        grant = None
        if self.keys is not None:
            grant = self.keys.authorize(key_from_parameter(authorization))
        result = self.cache.lookup(raw, grant=grant)
        self.requests[result.status.value].increment(1)
        if result.tier is not None:
            self.hits[result.tier].increment(1)
        key = "" if grant is None else grant.key_hash
        sealed = self._seal(envelope_of(result, key), result.text, result.tokens)
        took_s = time.perf_counter() - started
        self.lookup_s.observe(took_s)
        if self.hit_objective is not None and result.status is CacheStatus.EXACT:
            self.hit_objective.observe(took_s)
        return sealed, result.text, result.tokens

    def _seal(self, envelope: Envelope, text: str, tokens: tuple[int, int, int]) -> bytes:
        """The envelope's wire form, sealed with the exact hit's `text` and `tokens`; memoized
        for exact hits (a miss's envelope is sealed once and its answer generated anyway)."""
        too_long = len(text) > MEMO_MAX_CHARS or not small_request(envelope.request)
        if envelope.status is not CacheStatus.EXACT or too_long:
            return envelope.seal(self.sealer, text, tokens)
        key = (envelope, text, tokens)
        sealed = self._sealed.get(key)
        if sealed is None:
            sealed = envelope.seal(self.sealer, text, tokens)
            # the key's answer and envelope (its request); the sealed bytes (the envelope's JSON)
            held = len(text) + len(sealed) + envelope.request.text_chars()
            self._sealed.put(key, sealed, held)
        return sealed

    def count_error(self, exc: BaseException) -> None:
        """A request answered with an error (bad inputs, unknown adapter; refused: forbidden)."""
        self.requests["forbidden" if isinstance(exc, Forbidden) else "error"].increment(1)

    def close(self) -> None:
        if self.budgets is not None:
            self.budgets.close()
        self.metrics.close()
        self.cache.cache.close()


def envelope_of(result: LookupResult, key: str = "") -> Envelope:
    """The envelope of a lookup, also on an exact hit (llm reads the hit's tenant scope from it
    to decide response-time padding, tiercache.padding), issued now, naming the API key that
    sent it by its hash (`key`; "" without a key file)."""
    return Envelope(
        request=result.request,
        status=result.status,
        digest=result.digest,
        write_back=result.write_back,
        semantic_scope=result.semantic_scope,
        semantic_lookup=result.semantic_lookup,
        cache_tags=result.cache_tags,
        max_age_s=result.max_age_s,
        draft_digest=result.draft_digest,
        verify_semantic=result.verify_semantic,
        key=key,
    )


def open_prompt_cache(config: PromptCacheConfig, model_name: str) -> PromptCacheStage:
    """The stage with its L1, the host's L2, L3 with `redis_url`, the deployment's secret,
    the adapter registry and its metrics (started)."""
    embedder_key = resolve_embedder(config.embedder)[1].key if config.embedder else ""
    cache, tiers, secret = open_lookup(config, embedder_key)
    cache.deferred = PaddedTenants(config.state_path()).pads  # llm looks those up, padded
    metrics = tm.Metrics(model_name)
    keys_path = config.api_keys_path()
    keys = KeyFile(keys_path) if keys_path is not None else None
    stage = PromptCacheStage(cache, metrics, open_sealer(config.state_path()), keys)
    terms = prompt_cache_terms(
        keys_path, secret, cache.engine, cache.limits, deployment_terms(config)
    )
    write_terms(config.state_path(), PROMPT_CACHE, terms)  # what the gateway's edge must match
    export_redis(metrics, tiers)  # with L3: Redis health and invalidations applied
    if config.hit_objective_s > 0:
        stage.hit_objective = LatencyObjective(config.hit_objective_s)
    stage.budgets = follow_l1(
        config,
        cache.cache.store(Tier.L1),
        metrics,
        model_name,
        objective=stage.hit_objective.state if stage.hit_objective is not None else None,
    )
    metrics.start()
    return stage
