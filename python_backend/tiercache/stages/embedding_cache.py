"""The `embedding_cache` stage: on an exact miss, embed the prompt (BLS to the `embedder` model),
search the request's semantic scope, and serve a reworded request's answer if the guard passes
it; every other request passes through with the exact lookup's status (an exact hit's with an
empty answer: its text goes from prompt_cache to llm directly, `EmbeddingCacheStage.exact_hit`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.budgets import BudgetThread, cache_budget
from tiercache.config import EmbeddingCacheConfig
from tiercache.errors import Unavailable
from tiercache.exact.confidence import ConfidencePolicy
from tiercache.machine import DiskRoom
from tiercache.semantic.embedder import Screen, resolve_embedder
from tiercache.semantic.entry_trust import ScoreFn, TrustGate, TrustPolicy
from tiercache.semantic.guard import load_guard
from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.stage import ChooseFn, EmbeddingCache, SemanticOutcome
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache
from tiercache.semantic.verifier import VerifiedChoice, open_verified_choice
from tiercache.stages.common import export_late_calls, export_redis, status_counters
from tiercache.stages.envelope import Envelope, Freshness
from tiercache.stages.memory_budgets import follow_l1
from tiercache.stages.parts import ExactTiers, open_exact_cache, open_freshness, open_sealer
from tiercache.stages.seal import (
    ANSWER_LABEL,
    ANSWER_TENSORS,
    EMBED_LABEL,
    NO_TOKENS,
    Sealer,
    Tokens,
    answer_tensors,
    neighbours_text,
    seal_tensors,
    tokens_array,
    trust_array,
)
from tiercache.triton import io
from tiercache.triton import metrics as tm
from tiercache.triton.bls import BlsClient
from tiercache.vocabulary import CacheStatus, Tier


@dataclass(frozen=True, slots=True)
class Answer:
    """What embedding_cache hands llm for one request."""

    text: str  # the answer to serve ("" unless a hit)
    status: str  # semantic on a hit, else the exact lookup's status (exact, miss, bypass)
    similarity: float = 0.0
    vector: np.ndarray | None = None  # the prompt's vector (llm indexes it with a new answer)
    tokens: Tokens = NO_TOKENS  # a hit's stored token accounting (tiercache.stages.seal)
    # A miss's nearest neighbours' answer digests (refused ones too): llm drafts from them. A
    # semantic hit's: the one whose answer it serves (llm names it in the answer id).
    neighbours: tuple[str, ...] = ()
    # A semantic hit's trust decision (semantic_max_error): its calibrated score, and whether
    # the engine must verify it before it is served (tiercache.stages.seal.trust_array)
    score: float = 0.0
    verify: bool = False


# What this stage sends llm for an exact hit, unsealed (`EmbeddingCacheStage.exact_hit`)
EXACT_PASS = Answer("", CacheStatus.EXACT.value)


class EmbeddingCacheStage:
    """Batched semantic lookups with their metrics. Semantic caching is an optimisation: a
    failing lookup sends its requests on as misses (logged), never as errors."""

    def __init__(
        self,
        stage: EmbeddingCache,
        metrics: tm.Metrics,
        sealer: Sealer,
        freshness: Freshness | None = None,
    ) -> None:
        self.core = stage
        self.budgets: BudgetThread | None = None  # L1 following the machine, if asked
        self.closing: list[Callable[[], None]] = []  # called by close(), after the core
        self._unavailable_logged_s = float("-inf")  # a dependency down: logged once a minute
        self.sealer = sealer
        # what an envelope must be past its seal to be looked up (age; key, with a key file)
        self.freshness = freshness if freshness is not None else Freshness()
        self.metrics = m = metrics
        self.outcomes = status_counters(
            m,
            "tiercache_embedding_cache_lookups_total",
            "Semantic lookups by outcome",
            "outcome",
            [*(x.value for x in SemanticOutcome), "skipped", "error"],
        )
        self.trust_decisions = status_counters(
            m,
            "tiercache_embedding_cache_trust_decisions_total",
            "Semantic hits the trust gate (semantic_max_error) served, or sent to the engine to "
            "verify first; the ones it missed are lookups with outcome untrusted",
            "decision",
            ["serve", "verify"],
        )
        self.vector_hits = m.counter(
            "tiercache_embedding_cache_vector_hits_total", "Prompt vectors found in the cache"
        )
        self.lookup_s = m.histogram(
            "tiercache_embedding_cache_lookup_seconds", "Semantic lookup time, embedding included"
        )
        rows = m.gauge("tiercache_embedding_cache_index_rows", "Rows in the semantic index")
        m.on_flush(lambda: rows.set(stage.index.size()))

    def open(self, data: bytes | None, cached_text: str, tokens: Tokens = NO_TOKENS) -> Envelope:
        """prompt_cache's envelope, its seal checked (bound to the exact hit's `cached_text` and
        `tokens`) and its freshness."""
        return Envelope.open(data, self.sealer, self.freshness, cached_text, tokens)

    def seal(self, envelope_seal: str, answer: Answer) -> str:
        """The seal llm checks over this answer, bound to the envelope's (`answer_seal`)."""
        return answer_seal(self.sealer, envelope_seal, answer)

    def exact_hit(self, cached_text: bytes | str | None) -> Answer | None:
        """An exact hit's answer, or None without `cached_text` (then `open` the envelope; the
        text as received: only whether there is one matters here).
        prompt_cache hands an exact hit's text and token counts to llm directly (EXACT_TEXT,
        EXACT_TOKENS), where the envelope's seal is checked over them; what this stage sends for
        it is EXACT_PASS, which carries nothing (no text, no seal: llm reads none of it for an
        exact hit, and refuses it as an answer). So the envelope is neither checked nor decoded
        here: a direct caller that sends a text with any envelope gets nothing but the
        lookup it asked this stage to skip."""
        if not cached_text:
            return None
        self.outcomes["skipped"].increment(1)
        return EXACT_PASS

    def pass_through(
        self, envelope: Envelope, cached_text: str, tokens: Tokens = NO_TOKENS
    ) -> Answer | None:
        """The answer for a request that is not looked up by meaning (an exact hit, or not
        semantic-eligible); None when it must be looked up (then `lookup` it with others).
        `tokens` go on with it: an exact hit whose stored answer is empty comes this way, and
        llm checks the envelope's seal over the hit's text and tokens."""
        if envelope.semantic_lookup:
            return None
        self.outcomes["skipped"].increment(1)
        return Answer(cached_text, envelope.status.value, tokens=tokens)

    def lookup(self, envelopes: Sequence[Envelope]) -> list[Answer]:
        """One batched lookup of requests `pass_through` did not answer."""
        started = time.perf_counter()
        try:
            found = self.core.lookup(
                [e.request.prompt for e in envelopes],
                [e.semantic_scope for e in envelopes],
                [e.request.tenant_scope for e in envelopes],  # a hit must stay in its tenant
                [e.request.greedy for e in envelopes],  # the engine can verify these
                [e.request.lora_digest for e in envelopes],  # ... and to its adapter
            )
        except Exception as exc:  # noqa: BLE001 - semantic caching is an optimisation
            if isinstance(exc, Unavailable):  # a dependency (the embedder): one line a minute
                now = time.monotonic()  # at most, not a traceback per lookup
                if now - self._unavailable_logged_s >= 60.0:
                    self._unavailable_logged_s = now
                    io.log.warning(
                        "semantic lookups fail; their requests go on as misses: %s", exc.message
                    )
            else:
                io.log.exception("semantic lookup failed; the requests go on as misses")
            self.outcomes["error"].increment(len(envelopes))
            return [Answer("", e.status.value) for e in envelopes]
        elapsed = time.perf_counter() - started
        answers = []
        for envelope, result in zip(envelopes, found, strict=True):
            if result.outcome is SemanticOutcome.HIT:
                status = CacheStatus.SEMANTIC.value
                answers.append(
                    Answer(
                        result.text,
                        status,
                        result.similarity,
                        result.vector,
                        result.tokens,
                        neighbours=(result.digest,) if result.digest else (),
                        score=result.score,
                        verify=result.verify,
                    )
                )
                if self.core.trust is not None:
                    self.trust_decisions["verify" if result.verify else "serve"].increment(1)
            else:  # the exact lookup's status (miss, or bypass for semantic-only) goes on
                answers.append(
                    Answer("", envelope.status.value, 0.0, result.vector, neighbours=result.drafts)
                )
            self.outcomes[result.outcome.value].increment(1)
            self.vector_hits.increment(int(result.vector_cached))
            self.lookup_s.observe(elapsed / len(envelopes))
        return answers

    def count_error(self) -> None:
        self.outcomes["error"].increment(1)

    def watch_verifier(self, verified: VerifiedChoice) -> None:
        """Count the pairs the pair verifier reads and time each of its calls."""
        pairs = self.metrics.counter(
            "tiercache_embedding_cache_verifier_pairs_total",
            "(query, candidate) pairs the semantic pair verifier read",
        )
        seconds = self.metrics.histogram(
            "tiercache_embedding_cache_verifier_seconds",
            "The semantic pair verifier's time per call (a lookup's candidates in one batch)",
        )

        def scored(count: int, elapsed: float) -> None:
            pairs.increment(count)
            seconds.observe(elapsed)

        verified.on_scored = scored

    def close(self) -> None:
        if self.budgets is not None:
            self.budgets.close()
        self.metrics.close()
        self.core.close()
        for close in self.closing:
            close()


def answer_seal(sealer: Sealer, envelope_seal: str, answer: Answer) -> str:
    """The seal over what embedding_cache hands llm (`answer_tensors`), bound to the envelope's
    seal; llm checks it over the tensors it received (`LlmStage.received`)."""
    values = answer_tensors(
        answer.text,
        answer.status,
        answer.similarity,
        answer.vector,
        tokens_array(answer.tokens),
        neighbours_text(answer.neighbours),
        trust_array(answer.score, answer.verify),
    )
    return seal_tensors(sealer, ANSWER_LABEL, ANSWER_TENSORS, values, bound=envelope_seal)


class EmbedderBls:
    """The embedder model over BLS: all texts as one [n, 1] batch, [n, d] vectors back, each
    call waited for at most `timeout_s` (0: no deadline; `tiercache.triton.bls.Deadline`)."""

    def __init__(
        self, model_name: str, timeout_s: float = 0.0, sealer: Sealer | None = None
    ) -> None:
        self.client = BlsClient(model_name, label="embedder", timeout_s=timeout_s or None)
        self.sealer = sealer  # each text sealed (EMBED_LABEL): the embedder takes no other

    def close(self) -> None:
        self.client.close()

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        encoded = [t.encode("utf-8") for t in texts]
        batch = np.array([[b] for b in encoded], dtype=np.object_)
        tensors = [pb_utils.Tensor("TEXT", batch)]
        if self.sealer is not None:
            seals = [[self.sealer.seal(EMBED_LABEL, b).encode("ascii")] for b in encoded]
            tensors.append(pb_utils.Tensor("TEXT_SEAL", np.array(seals, dtype=np.object_)))
        response = self.client.infer(tensors, ["EMBEDDING"])
        vectors: np.ndarray = pb_utils.get_output_tensor_by_name(response, "EMBEDDING").as_numpy()
        return vectors


def open_embedding_cache(
    config: EmbeddingCacheConfig, model_name: str, instance_name: str
) -> EmbeddingCacheStage:
    """The stage over the host's vector cache and semantic tables, the exact cache's tiers (a
    hit is served only while its answer is), the guard and its metrics (started)."""
    _, identity = resolve_embedder(config.embedder)
    guard = load_guard(target_precision=config.target_precision or None)
    choose: ChooseFn = guard.choose
    score: ScoreFn = guard.calibrated
    verified: VerifiedChoice | None = None
    if config.verifier != "off":  # loaded before anything is opened: a bad folder leaks nothing
        verified = open_verified_choice(
            guard,
            config.verifier,
            config.verifier_threshold,
            config.verifier_threads,
            config.verifier_dtype,
        )
        choose, score = verified, verified.score
    tiers: ExactTiers = open_exact_cache(config.cache())
    sealer = open_sealer(config.state_path())
    embedder = EmbedderBls(config.embedder_model, config.embedder_timeout_s, sealer)
    trust = None
    if config.semantic_max_error > 0:
        policy = TrustPolicy(
            config.semantic_max_error,
            config.semantic_explore_band,
            config.semantic_audit_rate,
            config.semantic_serve_quantile,
        )
        trust = TrustGate(tiers.cache, policy, score)
    vectors = VectorCache(
        config.vectors_path(),
        identity.dimensions,
        config.vector_l1_max_bytes,
        config.vector_l2_max_bytes,
        disk=DiskRoom(config.state_path(), config.disk_headroom_bytes),
    )
    core = EmbeddingCache(
        vectors,
        SemanticIndex(
            SemanticStore(
                config.semantic_path(),
                config.semantic_max_bytes,
                dimensions=identity.dimensions,
                max_scopes=config.semantic_max_scopes,
                max_scopes_per_tenant=config.semantic_max_scopes_per_tenant,
            ),
            identity.dimensions,
            config.flat_max_rows,
        ),
        tiers.cache,
        embedder,
        choose,
        identity.key,
        top_k=config.top_k,
        min_similarity=config.min_similarity,
        screen=Screen(config.embedder).check,
        draft_neighbours=config.draft_neighbours,
        draft_min_similarity=config.draft_min_similarity,
        confidence=ConfidencePolicy(config.confidence_floor),
        trust=trust,
    )
    if config.semantic_graph_max_bytes > 0:  # bounded before any graph is loaded or built
        core.index.resize_graphs(config.semantic_graph_max_bytes)
    # Open the host's scope tables now (large scopes load or build their HNSW graph here), so
    # the first request does not pay for it; later rows are in the shared tables.
    core.index.refresh()
    if tiers.listener is not None:  # with L3: invalidated answers' rows stop being candidates

        def forget(_inv: object, digests: list[str]) -> None:
            core.index.forget(digests)

        tiers.listener.on_dropped(forget)
    metrics = tm.Metrics(model_name, instance=instance_name)
    freshness = open_freshness(config.envelope_max_age_s, config.api_keys_file)
    stage = EmbeddingCacheStage(core, metrics, sealer, freshness)
    stage.closing.append(embedder.close)
    export_late_calls(
        metrics,
        embedder.client.deadline,
        "tiercache_embedding_cache_embedder_late_total",
        "Embedder calls with no answer within embedder_timeout_s (timed_out), and lookups "
        "not sent while such a call was still out (refused); their requests went on as misses",
    )
    if verified is not None:
        stage.watch_verifier(verified)
    export_redis(metrics, tiers)  # with L3: Redis health and invalidations applied
    skipped = tm.DeltaCounter(
        metrics.counter(
            "tiercache_vector_l2_skipped_total",
            "Prompt vectors kept in L1 only: the state directory's disk short of "
            "disk_headroom_bytes",
        )
    )
    clears = tm.DeltaCounter(
        metrics.counter(
            "tiercache_vector_l2_clears_total",
            "Times the prompt vectors' L2 was full and was emptied (vector_l2_max_bytes too "
            "small for the traffic when it recurs)",
        )
    )

    def flush_vectors() -> None:
        stats = vectors.stats()
        skipped.update(stats.l2_skipped)
        clears.update(stats.l2_clears)

    metrics.on_flush(flush_vectors)
    # its answers' L1 follows the machine, as prompt_cache's does, and so do its vectors' L1
    others = []
    if config.vector_l1_max_bytes > 0:
        others.append(
            cache_budget(
                "vectors",
                config.vector_l1_min_bytes,
                config.vector_l1_max_bytes,
                vectors.resize,
                vectors.shadow_reading,
                used=lambda: vectors.l1_bytes,
            )
        )
    if config.semantic_graph_max_bytes > 0:  # the graphs of large scopes, bounded
        others.append(
            cache_budget(
                "semantic_graphs",
                config.semantic_graph_min_bytes,
                config.semantic_graph_max_bytes,
                core.index.resize_graphs,
                core.index.graphs_value_reading,
                held=core.index.graph_bytes,
            )
        )
    stage.budgets = follow_l1(
        config, tiers.cache.store(Tier.L1), metrics, f"{model_name}.{instance_name}", others
    )
    metrics.start()
    return stage
