"""Stage 1, the prompt cache: canonical request -> scoped digest -> L1 -> L2 -> L3."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tiercache.adapter_types import AdapterRef
from tiercache.errors import NotFound
from tiercache.exact.codec import token_accounting
from tiercache.exact.keys import (
    Digest,
    EngineIdentity,
    TenantScope,
    draft_digest,
    request_digest,
    semantic_scope,
    tenant_scope,
)
from tiercache.exact.memo import MEMO_MAX_CHARS, Memo
from tiercache.exact.request import (
    DEFAULT_LIMITS,
    Canonical,
    GenerationRequest,
    Limits,
    RawInputs,
    canonicalize,
)
from tiercache.exact.tenant_keys import TenantGrant
from tiercache.exact.tiered import Lookup, TieredCache, made_for
from tiercache.vocabulary import CacheStatus, Tier

log = logging.getLogger(__name__)

TENANT_SCOPE_MEMO = 4096  # tenant names whose scope is kept (a generation: tiercache.exact.memo)

ResolveAdapter = Callable[[str], AdapterRef]
"""lora_name -> the adapter's current version (NotFound for an unknown name)."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    request: GenerationRequest
    digest: Digest | None  # None: the request is not cacheable (never coalesced or stored)
    status: CacheStatus
    text: str  # the cached answer on EXACT, else ""
    tier: Tier | None
    write_back: bool  # whether the llm stage may store the answer
    semantic_scope: str = ""  # "" when semantic caching does not apply
    semantic_lookup: bool = False  # whether embedding_cache should look this request up
    cache_tags: tuple[str, ...] = ()  # cache_control tags the stored answer carries
    max_age_s: float | None = None  # the oldest cached answer this request accepts
    # On EXACT: the stored answer's token accounting (tiercache.stages.seal.Tokens: prompt and
    # completion tokens, 1 if it stopped at max_tokens; (0, 0, 0) when unknown).
    tokens: tuple[int, int, int] = (0, 0, 0)
    # On a miss: where drafts for its speculative decoding are kept (keys.draft_digest).
    draft_digest: str = ""
    # cache_control `verify-semantic`: a semantic hit is served only once the engine verified it
    verify_semantic: bool = False


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
        # tenant name -> scope: one HMAC per tenant instead of one per request (a deployment has
        # few tenants; bounded, so a caller naming endless tenants costs memory only up to this).
        self._scopes: Memo[TenantScope] = Memo(TENANT_SCOPE_MEMO)
        # A repeated request (an exact hit's usual case) skips canonicalizing and digesting:
        # (raw inputs, the API key's tenant) -> canonical form; (raw inputs, scope, adapter
        # version) -> request, digest. Both are kept per tenant (the raw inputs name the tenant
        # without an API key), and never for a padded tenant (`memoizes`): a memo's hit is a few
        # microseconds faster, which would tell a caller that the same request was made lately.
        self._canonical: Memo[Canonical] = Memo()
        self._requests: Memo[tuple[GenerationRequest, Digest | None]] = Memo()
        # Tenant scopes whose requests are not looked up here (llm pads their responses, and
        # looks the answer up behind the padding): None, every tenant's are
        self.deferred: Callable[[str], bool] | None = None

    def scope(self, tenant: str) -> TenantScope:
        """The scope of the tenant named `tenant` (memoized)."""
        return self._scope(tenant)

    def _scope(self, tenant: str) -> TenantScope:
        scope = self._scopes.get(tenant)
        if scope is None:
            scope = self._scopes.put(tenant, tenant_scope(self._secret, tenant))
        return scope

    def _adapter(self, name: str) -> AdapterRef | None:
        """The version the adapter `name` resolves to now (None for the base model): its digest
        goes into every key, so a changed adapter folder never hits the old version's entries."""
        if not name:
            return None
        if self.resolve_adapter is None:
            raise NotFound(f"unknown adapter {name!r}: no adapters are configured")
        return self.resolve_adapter(name)

    def memoizes(self, tenant: TenantScope) -> bool:
        """Whether requests of the tenant with scope `tenant` may be kept in memos (here and in
        the stage): not a padded tenant's (`deferred`), whose time in this stage must not
        depend on what was asked before. Asked only when a memo is about to keep something,
        never on a memo's hit."""
        return self.deferred is None or not self.deferred(tenant)

    def _canonicalize(
        self, raw: RawInputs, grant: TenantGrant | None
    ) -> tuple[Canonical, tuple[object, ...] | None, bool]:
        """`canonicalize(raw)`, memoized (InvalidRequest is never) by the raw inputs and the
        grant's tenant; the raw inputs' memo key (None when its prompt is too long to
        memoize), and whether the canonical form was computed now (not yet kept: `prepare`
        keeps it once it knows the tenant)."""
        key = _raw_key(raw)
        if key is None:
            return canonicalize(raw, self.limits), None, True
        canonical = self._canonical.get((key, None if grant is None else grant.tenant))
        if canonical is not None:
            return canonical, key, False
        canonical = canonicalize(raw, self.limits)
        if not small_request(canonical.request):  # NFKC grew it (up to 18x)
            return canonical, None, True
        return canonical, key, True

    def _request(
        self,
        canonical: Canonical,
        raw_key: tuple[object, ...] | None,
        tenant: TenantScope,
        ref: AdapterRef | None,
    ) -> tuple[GenerationRequest, Digest | None]:
        """The request pinned to its tenant scope and adapter version `ref`, and its digest
        (None when it is not cacheable); memoized by the raw inputs they follow from (not a
        padded tenant's: `memoizes`)."""
        key = None if raw_key is None else (raw_key, tenant, ref)
        made = None if key is None else self._requests.get(key)
        if made is not None:
            return made
        request = canonical.request
        if ref is None:
            request = request.pinned(tenant, request.lora_task_id, request.lora_digest)
        else:
            request = request.pinned(tenant, ref.task_id, ref.digest)
        digest = None
        if canonical.cacheable:
            digest = request_digest(tenant, self.engine, request, request.lora_digest)
        made = (request, digest)
        if raw_key is None or not self.memoizes(tenant):
            return made
        return self._requests.put(key, made, key_chars(raw_key) + request.text_chars())

    def lookup(
        self, raw: RawInputs, read: bool = True, grant: TenantGrant | None = None
    ) -> LookupResult:
        """Validate and canonicalize `raw` (InvalidRequest on bad input; NotFound for an unknown
        adapter), then look it up. `read` False computes everything but reads no tier: a
        cacheable request is then a MISS (cache_admin's warm, which stores an answer under the
        digest whether or not one is there). With a `grant` (the caller's API key,
        tiercache.exact.tenant_keys) the tenant is the grant's, and a request naming another
        tenant, or an adapter or cache_control word the grant does not allow, is Forbidden."""
        prepared = self.prepare(raw, grant)
        return self.result(prepared, self.read_exact(prepared) if read else None)

    def prepare(self, raw: RawInputs, grant: TenantGrant | None = None) -> Prepared:
        """`raw` validated, canonicalized and pinned to its tenant scope (the `grant`'s, with
        one) and adapter version, with its digest: all of `lookup` but the tiers' read.
        InvalidRequest, NotFound and Forbidden as `lookup` raises them."""
        canonical, raw_key, computed = self._canonicalize(raw, grant)
        tenant_name = canonical.tenant
        if grant is not None:
            named = canonical.tenant if raw.tenant is not None else None
            grant.check(named, canonical.request.lora_name, canonical.cache_control)
            tenant_name = grant.tenant
        tenant = self._scope(tenant_name)
        if computed and raw_key is not None and self.memoizes(tenant):
            chars = key_chars(raw_key) + canonical.request.text_chars()
            self._canonical.put(
                (raw_key, None if grant is None else grant.tenant), canonical, chars
            )
        # The engine keys its prefix KV blocks by the tenant scope (never in key_fields()).
        ref = self._adapter(canonical.request.lora_name)
        request, digest = self._request(canonical, raw_key, tenant, ref)
        return Prepared(canonical, tenant, request, digest, ref)

    def current(self, prepared: Prepared) -> bool:
        """Whether a kept `prepare` result still stands: its adapter (if any) resolves to the
        version it was pinned to (NotFound once the adapter is gone). Everything else in it
        follows from the raw inputs and the grant alone."""
        name = prepared.request.lora_name
        return not name or self._adapter(name) == prepared.ref

    def read_exact(self, prepared: Prepared) -> Lookup | None:
        """The exact tiers' answer to a prepared request; None on a miss, or where it is not
        looked up there: not cacheable, `no-cache` or `semantic-only`, or a padded tenant's
        (llm looks those up behind the padding: a caller may call this stage directly, and
        what it found would reach them unpadded and unmasked)."""
        control = prepared.canonical.cache_control
        if prepared.digest is None or control.no_cache or control.semantic_only:
            return None
        if self.deferred is not None and self.deferred(prepared.tenant):
            return None
        return self.cache.get(prepared.digest, control.max_age_s)

    def result(self, prepared: Prepared, found: Lookup | None) -> LookupResult:
        """The lookup's outcome for a prepared request given the exact tiers' answer `found`
        (`read_exact`'s; None: a miss, or not read)."""
        request, digest = prepared.request, prepared.digest
        tenant, canonical = prepared.tenant, prepared.canonical
        control = canonical.cache_control

        def result(
            digest: Digest | None,
            status: CacheStatus,
            write_back: bool,
            semantic_scope: str = "",
            semantic_lookup: bool = False,
            text: str = "",
            tier: Tier | None = None,
            tokens: tuple[int, int, int] = (0, 0, 0),
            draft: str = "",
        ) -> LookupResult:
            return LookupResult(
                request,
                digest,
                status,
                text,
                tier,
                write_back,
                semantic_scope,
                semantic_lookup,
                control.tags,
                control.max_age_s,
                tokens,
                draft,
                control.verify_semantic,
            )

        if digest is None:
            return result(None, CacheStatus.BYPASS, False)
        found = made_for(found, request.tenant_scope, request.lora_digest)  # else a miss
        if found is not None:  # an exact hit needs no semantic scope: not computed
            entry = found.entry
            return result(
                digest,
                CacheStatus.EXACT,
                False,
                text=entry.text,
                tier=found.tier,
                tokens=token_accounting(entry),
            )
        adapter = request.lora_digest
        write_back = not control.no_store
        # A padded tenant's request goes on as a miss (`read_exact`), and llm serves the stored
        # answer (its re-check before generating) behind the padding; no semantic lookup
        # (embedding_cache answers a direct caller too).
        deferred = self.deferred is not None and self.deferred(tenant)
        scope = ""
        if self.embedder_key and canonical.semantic_eligible:
            scope = semantic_scope(tenant, self.engine, request, self.embedder_key, adapter)
        # A semantic hit's age is not checked, so a request with max-age is not looked up by
        # meaning; embedding_cache then embeds nothing, so its answer is not indexed either.
        semantic = bool(scope) and control.max_age_s is None and not deferred
        # Greedy answers to this prompt under other max_tokens or stop words: drafts for its
        # speculative decoding, sampled or greedy (a miss only: a hit is not decoded); llm keeps
        # only a greedy answer there.
        draft = draft_digest(tenant, self.engine, request, adapter)
        if control.no_cache:
            return result(digest, CacheStatus.BYPASS, write_back, scope, draft=draft)
        if control.semantic_only:  # no exact lookup: `bypass` unless the semantic one hits
            return result(digest, CacheStatus.BYPASS, write_back, scope, semantic, draft=draft)
        return result(digest, CacheStatus.MISS, write_back, scope, semantic, draft=draft)


@dataclass(eq=False, slots=True)
class Prepared:
    """A request as `PromptCache.prepare` made it: canonical, pinned to its tenant scope and
    adapter version `ref`, with its digest (None: not cacheable). Hashed by identity
    (`eq=False`): PromptCacheStage keeps it by the raw inputs it came from and keys its sealed
    envelopes by it."""

    canonical: Canonical
    tenant: TenantScope
    request: GenerationRequest
    digest: Digest | None
    ref: AdapterRef | None


def small_request(request: GenerationRequest) -> bool:
    """Whether a canonical request is small enough to memoize: its prompt and history within
    MEMO_MAX_CHARS after normalization, as the raw key's bound is before it."""
    history = sum(len(content) for _, content in request.history)
    return max(len(request.prompt), history) <= MEMO_MAX_CHARS


def key_chars(raw_key: tuple[object, ...]) -> int:
    """The characters of text a raw memo key (`_raw_key`) holds: the inputs as received, which
    normalization may shrink (padding counts here, not in the canonical request)."""
    chars = 0
    for field in raw_key:
        if isinstance(field, (str, bytes)):
            chars += len(field)
        elif isinstance(field, tuple):  # the stop words
            chars += sum(len(word) for word in field if isinstance(word, (str, bytes)))
    return chars


def _raw_key(raw: RawInputs) -> tuple[object, ...] | None:
    """`raw` as a memo key (its fields, stop words as a tuple); None when the prompt or the
    history is longer than MEMO_MAX_CHARS (not worth the memory) or a field cannot be hashed."""
    text = raw.text_input
    if text is None or len(text) > MEMO_MAX_CHARS:
        return None
    if raw.history is not None and len(raw.history) > MEMO_MAX_CHARS:
        return None
    stops = None if raw.stop_words is None else tuple(raw.stop_words)
    key = (
        text,
        raw.max_tokens,
        raw.stream,
        raw.temperature,
        raw.top_p,
        raw.top_k,
        raw.seed,
        stops,
        raw.tenant,
        raw.cache_control,
        raw.lora_name,
        raw.history,
        raw.raw_prompt,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key
