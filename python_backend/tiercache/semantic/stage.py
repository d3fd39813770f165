"""Stage 2, `embedding_cache`: on an exact miss, find a reworded request's answer in the scope.

Transport-free: the Triton model.py injects the embedding call (BLS to the `embedder` model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from tiercache.exact.codec import token_accounting
from tiercache.exact.confidence import ConfidencePolicy
from tiercache.exact.tiered import TieredCache
from tiercache.log_throttle import LogThrottle
from tiercache.semantic.entry_trust import Decision, TrustGate, length_class
from tiercache.semantic.features import memo_scope
from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.penalties import read_floor_checked
from tiercache.semantic.row_log import InvalidVector, check_vector
from tiercache.semantic.vectors import VectorCache, vector_key

log = logging.getLogger(__name__)
# records a damaged or planted state directory serves on every request: once a minute
_DAMAGE_LOG = LogThrottle()

EmbedFn = Callable[[Sequence[str]], np.ndarray]
NO_VECTOR = np.zeros(0, dtype=np.float32)
# (query, [(candidate prompt, cosine), ...] nearest first) -> index of the accepted one, or None
ChooseFn = Callable[[str, Sequence[tuple[str, float]]], "int | None"]


class SemanticOutcome(str, Enum):
    HIT = "semantic"  # a candidate passed the guard and its answer is still cached
    MISS = "miss"  # no candidate passed (or the scope is empty)
    REJECTED = "rejected"  # candidates above the similarity floor, all refused by the guard
    STALE = "stale"  # a candidate passed but its answer is gone (evicted or expired)
    UNSURE = "unsure"  # a candidate passed but its answer's confidence is under the floor
    PENALISED = "penalised"  # a candidate passed but under its answer's floor (bad feedback)
    UNTRUSTED = "untrusted"  # a candidate passed but its entry's record misses max_error
    TOO_LONG = "too_long"  # over the embedder's window: neither looked up nor indexed
    UNSUPPORTED = "unsupported"  # [UNK] tokens or a non-Latin script: the same


# a candidate's answer exists but may not be served: this outcome wins over a later stale one
_REFUSED = (SemanticOutcome.UNSURE, SemanticOutcome.PENALISED, SemanticOutcome.UNTRUSTED)


@dataclass(frozen=True, slots=True)
class SemanticLookup:
    outcome: SemanticOutcome
    vector: np.ndarray  # the query's vector (written to the index with a new answer)
    text: str = ""
    similarity: float = 0.0
    vector_cached: bool = False
    # A hit's stored answer's token accounting (tiercache.exact.codec.token_accounting): that of
    # the generation that produced it, for the reworded prompt it answered.
    tokens: tuple[int, int, int] = (0, 0, 0)
    # Not a hit: the answer digests of the nearest neighbours at or above the draft floor
    # (refused ones included), nearest first; llm drafts a speculative decoding from them.
    drafts: tuple[str, ...] = ()
    digest: str = ""  # a hit's answer digest (the neighbour's entry it served)
    # With a trust gate: a hit's calibrated score, and whether the engine must verify it first
    # (the entry is close to the deployment's max_error but not there: tiercache.semantic.
    # entry_trust); llm records the verification's outcome against the entry at this score.
    score: float = 0.0
    verify: bool = False


class EmbeddingCache:
    def __init__(
        self,
        vectors: VectorCache,
        index: SemanticIndex,
        answers: TieredCache,
        embed: EmbedFn,
        choose: ChooseFn,
        embedder_key: str,
        top_k: int = 5,
        min_similarity: float = 0.6,
        screen: Callable[[str], str | None] = lambda text: None,
        draft_neighbours: int = 0,
        draft_min_similarity: float = 0.5,
        confidence: ConfidencePolicy | None = None,
        trust: TrustGate | None = None,
    ) -> None:
        """`screen` says why a prompt is kept out of the semantic cache ("too_long",
        "unsupported"; `tiercache.semantic.embedder.Screen.check`), or None to take it.
        A lookup that does not hit names up to `draft_neighbours` neighbours at or above
        `draft_min_similarity` as drafts (`SemanticLookup.drafts`). An answer `confidence`
        calls unsure is never served to a rewording (tiercache.exact.confidence). With
        `trust`, a chosen candidate is served, verified or missed by its entry's record
        (tiercache.semantic.entry_trust)."""
        self.confidence = confidence or ConfidencePolicy()
        self.trust = trust
        self.vectors = vectors
        self.index = index
        self.answers = answers
        self._embed = embed
        self._choose = choose
        self.embedder_key = embedder_key
        self.top_k = top_k
        self.min_similarity = min_similarity
        self._screen = screen
        self.draft_neighbours = draft_neighbours
        self.draft_min_similarity = draft_min_similarity
        self.scope_mismatches = 0  # candidates refused: their answer is another tenant's
        self.unread_records = 0  # candidates whose floor could not be read (failing closed)
        self.search_failures = 0  # lookups answered as misses because their scope's search failed
        self.bad_vectors = 0  # prompts' vectors the index refuses (`_sound_vector`): misses
        self._failed_scopes: set[str] = set()  # logged once each

    def vectors_for(
        self, prompts: Sequence[str], tenant_scopes: Sequence[str] | None = None
    ) -> list[tuple[np.ndarray, bool]]:
        """Each prompt's vector and whether it came from the vector cache (kept per tenant
        scope: another tenant's vector is never reused, whose fast lookup would tell that the
        text was sent before); the ones not cached are embedded in one call and stored. One
        the index would refuse (`_sound_vector`) is neither stored nor returned: its prompt
        gets an empty vector (NO_VECTOR)."""
        tenants = [""] * len(prompts) if tenant_scopes is None else tenant_scopes
        keys = [vector_key(self.embedder_key, p, t) for p, t in zip(prompts, tenants, strict=True)]
        found = [self.vectors.get(k) for k in keys]
        missing = [i for i, v in enumerate(found) if v is None]
        if missing:
            started = time.perf_counter()
            fresh = self._embed([prompts[i] for i in missing])
            each_s = (time.perf_counter() - started) / len(missing)
            for i, vector in zip(missing, fresh, strict=True):
                if self._sound_vector(vector):
                    self.vectors.put(keys[i], vector, each_s)
                    found[i] = vector
                else:
                    found[i] = NO_VECTOR
        return [(v, i not in missing) for i, v in enumerate(found) if v is not None]

    def _sound_vector(self, vector: np.ndarray) -> bool:
        """Whether a prompt's vector is one the index takes (`check_vector`: its width, finite
        values, unit norm): an embedder that misbehaves (a config of another width, a vector
        not normalized, which would score past every true neighbour) makes a miss, never a
        search; counted in `bad_vectors` and logged."""
        try:
            check_vector(vector, self.index.dimensions)
        except InvalidVector as exc:
            self.bad_vectors += 1
            if _DAMAGE_LOG.ready():
                log.error(
                    "the embedder gave a vector the index refuses (%s); its prompt is a miss "
                    "(%d such lines not logged)",
                    exc,
                    _DAMAGE_LOG.suppressed,
                )
            return False
        return True

    def search(
        self,
        prompt: str,
        scope: str,
        vector: np.ndarray,
        cached: bool,
        tenant_scope: str | None = None,
        can_verify: bool = False,
        adapter: str | None = None,
    ) -> SemanticLookup:
        """The candidate of `scope` the guard likes best, if its answer still exists.

        The index returns only rows of `scope` (it re-reads each row's scope from the log);
        with `tenant_scope`, the answer a row points to must also belong to that tenant
        (its cache entry's `tenant_scope`) before it is served: a row written with another
        tenant's answer digest (a forged shared row, a damaged log) is refused, counted in
        `scope_mismatches` and logged, and treated as a stale candidate; with `adapter` (the
        request's adapter digest, "" for the base model), so must its adapter. `can_verify`: the
        request may be verified by the engine (greedy), so a trust gate may ask for it. The
        guard's text profiles are memoized within `scope` only (`features.memo_scope`)."""
        with memo_scope(scope):
            return self._search(prompt, scope, vector, cached, tenant_scope, can_verify, adapter)

    def _search(
        self,
        prompt: str,
        scope: str,
        vector: np.ndarray,
        cached: bool,
        tenant_scope: str | None,
        can_verify: bool,
        adapter: str | None,
    ) -> SemanticLookup:
        found_rows = self.index.search(scope, vector, self.top_k)
        drafts = tuple(n.digest for n in found_rows if n.similarity >= self.draft_min_similarity)[
            : self.draft_neighbours
        ]
        neighbours = [n for n in found_rows if n.similarity >= self.min_similarity]
        outcome = SemanticOutcome.MISS
        forget = getattr(self._choose, "forget", None)
        if forget is not None:  # a chooser's memo serves one search's retries, no other caller
            forget()
        while neighbours:
            chosen = self._choose(prompt, [(n.prompt, n.similarity) for n in neighbours])
            if chosen is None:
                return SemanticLookup(
                    SemanticOutcome.REJECTED, vector, vector_cached=cached, drafts=drafts
                )
            neighbour = neighbours.pop(chosen)
            found = self.answers.get(neighbour.digest)
            if found is not None and not self._same_tenant(found.entry.tenant_scope, tenant_scope):
                found = None
            if found is not None and adapter is not None and found.entry.adapter != adapter:
                self.scope_mismatches += 1  # a row pointing at another adapter's answer
                if _DAMAGE_LOG.ready():
                    log.warning(
                        "a semantic candidate's answer is another adapter's; not served (%d "
                        "such lines not logged)",
                        _DAMAGE_LOG.suppressed,
                    )
                found = None
            if found is not None:
                entry = found.entry
                if self.confidence.unsure(entry.mean_logprob):
                    outcome = SemanticOutcome.UNSURE  # the engine was unsure of it: not reworded
                    continue
                floor, floor_known = read_floor_checked(
                    self.answers, neighbour.digest, tenant_scope
                )
                if floor is not None and neighbour.similarity < floor:
                    outcome = SemanticOutcome.PENALISED  # judged wrong this close before
                    continue
                score, verify = 0.0, False
                if self.trust is not None:
                    score = self.trust.score(prompt, neighbour.prompt, neighbour.similarity)
                    decision = self.trust.decide(
                        neighbour.digest, score, tenant_scope, can_verify, entry.adapter,
                        length_class(entry.text),
                    )  # fmt: skip
                    if decision is Decision.MISS:
                        outcome = SemanticOutcome.UNTRUSTED
                        continue
                    verify = decision is Decision.VERIFY
                if not floor_known:
                    # A shared tier could not be read (Redis down): a floor a `bad` verdict
                    # left there is unknown. Failing closed: verified by the engine, or a miss.
                    self.unread_records += 1
                    if not can_verify:
                        outcome = SemanticOutcome.UNTRUSTED
                        continue
                    verify = True
                return SemanticLookup(
                    SemanticOutcome.HIT,
                    vector,
                    entry.text,
                    neighbour.similarity,
                    cached,
                    token_accounting(entry),
                    digest=neighbour.digest,
                    score=score,
                    verify=verify,
                )
            if outcome not in _REFUSED:
                outcome = SemanticOutcome.STALE
        return SemanticLookup(outcome, vector, vector_cached=cached, drafts=drafts)

    def _same_tenant(self, answer_scope: str, tenant_scope: str | None) -> bool:
        if tenant_scope is None or answer_scope == tenant_scope:
            return True
        self.scope_mismatches += 1
        if _DAMAGE_LOG.ready():
            log.warning(
                "a semantic candidate's answer belongs to another tenant scope (%s..., not "
                "%s...); not served (%d such lines not logged)",
                answer_scope[:8],
                tenant_scope[:8],
                _DAMAGE_LOG.suppressed,
            )
        return False

    def lookup(
        self,
        prompts: Sequence[str],
        scopes: Sequence[str],
        tenant_scopes: Sequence[str] | None = None,
        can_verify: Sequence[bool] | None = None,
        adapters: Sequence[str] | None = None,
    ) -> list[SemanticLookup]:
        """One result per prompt, in order; prompts the screen refuses are not embedded (their
        result has an empty vector, so the llm stage does not index them either). With
        `tenant_scopes` (one per prompt), a hit's answer must belong to that tenant (`search`);
        `can_verify` (one per prompt, default none) says which the engine may verify."""
        refused = {i: why for i, p in enumerate(prompts) if (why := self._screen(p)) is not None}
        taken = [i for i in range(len(prompts)) if i not in refused]
        tenants: Sequence[str | None] = (
            [None] * len(prompts) if tenant_scopes is None else tenant_scopes
        )
        found = self.vectors_for([prompts[i] for i in taken], [tenants[i] or "" for i in taken])
        vectors = dict(zip(taken, found, strict=True))
        verifiable = [False] * len(prompts) if can_verify is None else can_verify
        results = []
        for i, (prompt, scope, tenant) in enumerate(zip(prompts, scopes, tenants, strict=True)):
            if i in refused:
                results.append(SemanticLookup(SemanticOutcome(refused[i]), NO_VECTOR))
                continue
            vector, cached = vectors[i]
            if not vector.size:  # refused by `vectors_for`: a miss, neither searched nor indexed
                results.append(SemanticLookup(SemanticOutcome.MISS, NO_VECTOR))
                continue
            try:
                result = self.search(
                    prompt,
                    scope,
                    vector,
                    cached,
                    tenant,
                    verifiable[i],
                    None if adapters is None else adapters[i],
                )
            except Exception:  # noqa: BLE001 - one broken scope: a miss for its request alone
                self.search_failures += 1
                if scope not in self._failed_scopes:
                    self._failed_scopes.add(scope)
                    log.exception("searching scope %s... failed; its lookups are misses", scope[:8])
                result = SemanticLookup(SemanticOutcome.MISS, vector, vector_cached=cached)
            results.append(result)
        return results

    def close(self) -> None:
        self.vectors.close()
        self.index.close()
        self.answers.close()
