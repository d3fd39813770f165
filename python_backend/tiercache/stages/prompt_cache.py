"""The `prompt_cache` stage: canonical request -> scoped digest -> L1 -> L2 -> L3, and the
envelope every later stage reads."""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from tiercache.budgets import BudgetThread, LatencyObjective
from tiercache.config import PromptCacheConfig
from tiercache.errors import Forbidden
from tiercache.exact.codec import token_accounting
from tiercache.exact.memo import MEMO_MAX_CHARS, Memo
from tiercache.exact.prompt_cache import LookupResult, Prepared, PromptCache, small_request
from tiercache.exact.tenant_keys import KeyFile, TenantGrant, key_from_parameter
from tiercache.exact.tiered import Lookup
from tiercache.semantic.embedder import resolve_embedder
from tiercache.stages.common import export_redis, status_counters
from tiercache.stages.contract import (
    PROMPT_CACHE,
    PaddedTenants,
    deployment_terms,
    prompt_cache_terms,
    write_terms,
)
from tiercache.stages.envelope import Envelope, issued_now
from tiercache.stages.memory_budgets import follow_l1
from tiercache.stages.parts import open_lookup, open_sealer
from tiercache.stages.seal import NO_TOKENS, Sealer, Tokens, tokens_array
from tiercache.triton import io
from tiercache.triton import metrics as tm
from tiercache.vocabulary import CacheStatus, Tier, choices


class Outputs(NamedTuple):
    """The stage's output arrays, shaped as its tensors: ENVELOPE and CACHED_TEXT BYTES [1, 1],
    CACHED_TOKENS INT32 [1, 3]."""

    envelope: np.ndarray
    cached_text: np.ndarray
    cached_tokens: np.ndarray


def outputs_of(sealed: bytes, text: str, tokens: Tokens) -> Outputs:
    return Outputs(io.bytes_array(sealed), io.bytes_array(text), tokens_array(tokens).reshape(1, 3))


class PromptCacheStage:
    """Lookups, counted by status and by the tier that answered."""

    def __init__(
        self, cache: PromptCache, metrics: tm.Metrics, sealer: Sealer, keys: KeyFile | None = None
    ) -> None:
        self.cache = cache
        self.sealer = sealer
        self.keys = keys  # None: the tenant input is trusted (no api_keys_file)
        # (raw inputs, grant) -> the request prepared for its lookup (`_prepare`)
        self._prepared: Memo[Prepared] = Memo()
        # (prepared request, answer, key) -> (issue time, an exact hit's outputs: `Outputs`)
        self._sealed: Memo[tuple[int, Outputs]] = Memo()
        self.metrics = m = metrics
        self.requests = status_counters(
            m,
            "tiercache_prompt_cache_requests_total",
            "Requests by cache status",
            "status",
            (*choices(CacheStatus), "error", "forbidden"),
        )
        self._exact = self.requests[CacheStatus.EXACT.value]
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

    def lookup(self, inputs: io.Inputs, authorization: object = None) -> Outputs:
        """The stage's outputs (`Outputs`): the sealed envelope for the later stages (bound to
        the answer), the cached answer ("" unless an exact hit) and its stored token accounting
        (tiercache.stages.seal.Tokens; zeros unless known); InvalidRequest / NotFound for this
        request alone, Forbidden when a key file is configured and `authorization` (the
        forwarded header) carries no key that allows the request."""
        started = time.perf_counter()
        grant = None
        if self.keys is not None:
            grant = self.keys.authorize(key_from_parameter(authorization))
        prepared = self._prepare(inputs, grant)
        found = self.cache.read_exact(prepared)
        key = "" if grant is None else grant.key_hash
        if found is None:
            result = self.cache.result(prepared, None)
            self.requests[result.status.value].increment(1)
            envelope = envelope_of(result, key, serve_ttl_s=self.cache.cache.default_ttl_s)
            outputs = outputs_of(envelope.seal(self.sealer), "", NO_TOKENS)
        else:
            self._exact.increment(1)
            self.hits[found.tier].increment(1)
            outputs = self._sealed_hit(prepared, found, key)
        took_s = time.perf_counter() - started
        self.lookup_s.observe(took_s)
        if self.hit_objective is not None and found is not None:
            self.hit_objective.observe(took_s)
        return outputs

    def _prepare(self, inputs: io.Inputs, grant: TenantGrant | None) -> Prepared:
        """The request prepared for its lookup (PromptCache.prepare), kept by its inputs exactly
        as received and the caller's grant, while it stands (`PromptCache.current`): a repeated
        request reads no input and builds no object before the tiers' read. A padded tenant's
        is never kept (its time here must not tell whether it was asked before)."""
        raw_key = inputs.key(MEMO_MAX_CHARS)
        key = None if raw_key is None else (raw_key, grant)
        prepared = None if key is None else self._prepared.get(key)
        if prepared is not None and self.cache.current(prepared):
            return prepared
        prepared = self.cache.prepare(io.raw_inputs(inputs), grant)
        # not a padded tenant's (`PromptCache.memoizes`); NFKC may have grown the request
        if (
            raw_key is not None
            and small_request(prepared.request)
            and self.cache.memoizes(prepared.tenant)
        ):
            chars = io.key_chars(raw_key) + prepared.request.text_chars()
            self._prepared.put((raw_key, grant), prepared, chars)
        return prepared

    def _sealed_hit(self, prepared: Prepared, found: Lookup, key: str) -> Outputs:
        """An exact hit's outputs, its envelope sealed with its answer and token accounting:
        memoized by the prepared request, the answer and the key that sent it, for the issue
        step it was issued in (a repeated hit skips the envelope's JSON, its HMAC and the
        arrays; tiercache.exact.memo), the memo's arrays read-only. A new step's envelope
        replaces the last one in place: one entry per hot prompt, so the memo never fills up
        with past steps' envelopes (and is never cleared for them)."""
        entry = found.entry
        text, tokens = entry.text, token_accounting(entry)
        issued_s = issued_now()
        # a long answer is never kept: not hashed for a memo key either (a new string each hit)
        short = len(text) <= MEMO_MAX_CHARS
        memo_key = (prepared, text, tokens, key)
        kept = self._sealed.get(memo_key) if short else None
        if kept is not None and kept[0] == issued_s:
            return kept[1]
        result = self.cache.result(prepared, found)
        envelope = envelope_of(result, key, issued_s, self.cache.cache.default_ttl_s)
        outputs = outputs_of(envelope.seal(self.sealer, text, tokens), text, tokens)
        if short and small_request(prepared.request):
            # shared by every response that sends them: read-only, a view copied (its base
            # would stay writable)
            outputs = Outputs(*(io.read_only(array) for array in outputs))
            # the key's answer and request (the prepared one it holds); the arrays' answer
            # and sealed envelope
            held = 2 * len(text) + len(outputs.envelope[0, 0]) + prepared.request.text_chars()
            self._sealed.put(memo_key, (issued_s, outputs), held)
        return outputs

    def count_error(self, exc: BaseException) -> None:
        """A request answered with an error (bad inputs, unknown adapter; refused: forbidden)."""
        self.requests["forbidden" if isinstance(exc, Forbidden) else "error"].increment(1)

    def close(self) -> None:
        if self.budgets is not None:
            self.budgets.close()
        self.metrics.close()
        self.cache.cache.close()


def envelope_of(
    result: LookupResult,
    key: str = "",
    issued_s: int | None = None,
    serve_ttl_s: float = 0.0,
) -> Envelope:
    """The envelope of a lookup, also on an exact hit (llm reads the hit's tenant scope from it
    to decide response-time padding, tiercache.padding), issued at `issued_s` (None: now,
    tiercache.stages.envelope.issued_now), naming the API key that sent it by its hash (`key`;
    "" without a key file), with the oldest answer prompt_cache serves (`serve_ttl_s`, its
    ttl_s), which llm's reads keep to too."""
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
        serve_ttl_s=serve_ttl_s,
        key=key,
        issued_s=issued_now() if issued_s is None else issued_s,
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
