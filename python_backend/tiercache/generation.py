"""The core of stage 4, `llm`: serve hits, run one generation per digest on a miss, write back
clean results.

Transport-free: the stage (tiercache.stages.llm) supplies a `Responder` per request and an engine
call (`GenerateFn`, a BLS stream in production, a fake in unit tests).

One generation per digest in this process (`tiercache.exact.flights`) and, with a
`LeaseCoordinator`, across every replica sharing a Redis (`tiercache.exact.leases`): a flight's
leader whose digest another replica is generating waits for that replica's answer instead of
generating it again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from tiercache.engine.events import CONTENT_FILTER, StreamEvent
from tiercache.errors import CapacityError, TierCacheError, Unavailable
from tiercache.exact.codec import CacheEntry
from tiercache.exact.confidence import ConfidencePolicy
from tiercache.exact.flights import EngineUsage, Flight, FlightTable, abandoned_error
from tiercache.exact.keys import Digest
from tiercache.exact.leases import Lease, LeaseCoordinator, LeaseState
from tiercache.exact.request import GenerationRequest
from tiercache.exact.tiered import Lookup, TieredCache, made_for
from tiercache.log_throttle import LogThrottle
from tiercache.threads import name_this_thread
from tiercache.vocabulary import CacheStatus, DraftSource

log = logging.getLogger(__name__)
# records a damaged or planted state directory serves on every request: once a minute
_DAMAGE_LOG = LogThrottle()

GenerateFn = Callable[[GenerationRequest], Iterator[StreamEvent]]
CLEAN_FINISHES = frozenset({"stop", "length"})
# Misses one llm instance holds, queued or being answered, before it refuses more at once: a
# client that gave up does not cancel its queued miss (Triton 2.51 does not pass an ensemble's
# cancellation on), so without a bound a burst queues engine work no one waits for.
MAX_PENDING_MISSES = 1024
# Served to every requester as the answer, never stored or indexed: the engine flagged it (a
# refusal; tiercache.engine.policy).
SERVED_UNCACHED_FINISHES = frozenset({CONTENT_FILTER})


def flight_key(digest: Digest, status: str, max_age_s: float | None, write_back: bool) -> str:
    """The key under which identical in-flight misses share one generation. A looked-up miss
    (`status` "miss") without `max-age` may be answered by an entry stored since its lookup, so
    its leader checks the cache again, and it stores its answer. A `bypass` request (no-cache,
    semantic-only) must get a fresh generation, a `max-age` request nothing older than its own
    bound, and a `no-store` leader would leave its followers' answer unstored: each such kind
    shares flights only with requests that want the same thing."""
    if status == "miss" and max_age_s is None and write_back:
        return digest
    age = "" if max_age_s is None else repr(max_age_s)
    return f"{digest}|{status}|{age}|{'store' if write_back else 'no-store'}"


class Responder(Protocol):
    """What the stage needs from one request's response channel."""

    def is_cancelled(self) -> bool: ...

    def send_chunk(self, text: str) -> None: ...

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        usage: EngineUsage | None = None,
        finish_reason: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        """The last response: `text` (None in stream mode, where chunks carried it), status, the
        similarity of a semantic hit, and for a generated answer the (reused, computed) prompt
        tokens the engine reported (prefix KV reuse; every subscriber of a flight gets them) and
        its finish reason (`content_filter`: a refusal, not cached; a hit's is its stored
        generation's, `stop` or `length`). `tokens` is the answer's
        (prompt, completion) token counts: a generation's own, or for a hit those of the
        generation that produced the stored answer ((0, 0) when unknown, as for a warmed one)."""
        ...

    def send_cancelled(self) -> None:
        """Only the final flag: the client went away."""
        ...

    def identify(self, answer_id: str) -> None:
        """The answer's id (tiercache.exact.answer_ids), sent with the final response."""
        ...

    def send_error(self, exc: BaseException) -> None: ...


@dataclass(frozen=True, slots=True)
class _Directives:
    """A miss's cache_control directives that are not part of its key."""

    tags: tuple[str, ...] = ()
    max_age_s: float | None = None
    draft_digest: str = ""  # where this prompt's greedy answers are kept as drafts
    neighbours: tuple[str, ...] = ()  # its semantic neighbours' answer digests (more drafts)
    # a semantic hit's answer the engine verifies first (`verify-semantic`); None for none (an
    # empty answer is one to verify)
    verify: str | None = None
    # prompt_cache's ttl_s (0: none): the oldest stored answer it would serve
    serve_ttl_s: float = 0.0

    @property
    def read_age_s(self) -> float | None:
        """The oldest stored answer this miss takes instead of a generation: its max-age and
        prompt_cache's ttl_s, whichever is less (None: any, under this stage's own ttl_s)."""
        if self.serve_ttl_s <= 0:
            return self.max_age_s
        if self.max_age_s is None:
            return self.serve_ttl_s
        return min(self.max_age_s, self.serve_ttl_s)


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """One engine call that ran to its end (clean or not), for metrics."""

    ttft_s: float | None
    duration_s: float
    generated_tokens: int
    finish_reason: str
    stored: bool
    mean_logprob: float | None = None  # the engine's (tiercache.exact.confidence)
    engine_s: float | None = None  # the engine's own seconds (StreamEvent.engine_s)

    @property
    def cost_s(self) -> float:
        """What the answer cost to make, for the caches' eviction: the engine's own seconds
        when it reports them (never more than the call took), else the call's duration, which
        counts the wait behind other requests too (a caller flooding the engine with distinct
        prompts would make its answers look that much dearer)."""
        spent = self.engine_s
        if spent is None or not math.isfinite(spent) or spent < 0:
            return self.duration_s
        return min(spent, self.duration_s)


@dataclass(frozen=True, slots=True)
class GenerationStats:
    generations: int
    coalesced: int
    write_backs: int
    write_failures: int
    in_flight: int
    remote_waits: int = 0  # flights that waited for another replica's generation
    remote_hits: int = 0  # of those, served by the other replica's answer
    lease_takeovers: int = 0  # waits that ended in taking the lease: freed without an answer
    lease_wait_timeouts: int = 0  # waits that gave up after `wait_s` and generated here too


LEASE_READ_EVERY = 20  # lease polls per read of the tiers while another replica generates


class _PendingSlot:
    """One of `Generations.max_pending`'s slots, released once: by the request that took it,
    or, when it leads a flight, by the flight's producer (`handed`)."""

    __slots__ = ("_owner", "_released", "handed")

    def __init__(self, owner: Generations) -> None:
        self._owner = owner
        self._released = False
        self.handed = False

    def release(self) -> None:
        owner = self._owner
        with owner._lock:
            if not self._released:
                self._released = True
                owner._pending -= 1


class Generations:
    """Hits served whole; misses coalesced into one generation per digest (and across replicas
    with leases), streamed to every subscriber and written back when clean."""

    def __init__(
        self,
        cache: TieredCache,
        generate: GenerateFn,
        max_workers: int = 64,
        on_generation: Callable[[GenerationRecord], None] | None = None,
        on_follow: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        leases: LeaseCoordinator | None = None,
        confidence: ConfidencePolicy | None = None,
        max_pending: int = MAX_PENDING_MISSES,
    ) -> None:
        """`leases` coalesces misses across replicas (None: this process only); `confidence`
        decides how long an unsure answer is kept (tiercache.exact.confidence; None: like any).
        `max_pending`: misses submitted and not yet answered (a flight's generation holds its
        leader's place until it ends, requesters or not), past which a new one is refused at
        once (CapacityError) rather than queued behind them."""
        self.cache = cache
        self.confidence = confidence or ConfidencePolicy()
        self._leases = leases
        self._generate = generate
        self._on_generation = on_generation
        self._on_follow = on_follow
        self._clock = clock
        self.flights = FlightTable()
        # Two pools: readers block on their flight, so producers must never queue behind them
        # (one shared pool deadlocks once every worker is a waiting reader).
        self._pool = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="llm-serve", initializer=name_this_thread
        )
        self._producers = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="llm-gen", initializer=name_this_thread
        )
        self._lock = threading.Lock()
        self.max_pending = max_pending
        self._pending = 0  # misses submitted and not yet answered
        self._refused = 0  # misses refused because max_pending were pending
        self._generations = self._write_backs = self._write_failures = 0
        self._remote_waits = self._remote_hits = 0
        # digest -> this process's flight holding its cross-replica lease (`_take_turn`)
        self._leased: dict[str, Flight] = {}
        self._lease_takeovers = self._lease_wait_timeouts = 0

    # -- entry points (called from execute) ------------------------------------------------

    @staticmethod
    def serve_hit(
        text: str,
        status: str,
        responder: Responder,
        similarity: float | None = None,
        tokens: tuple[int, int, int] | None = None,
    ) -> None:
        """A cache hit: the whole answer in one final response, so the first chunk is at once;
        `tokens` is the stored answer's accounting (prompt and completion tokens, 1 if its
        generation stopped at max_tokens: the hit's finish reason is then `length`)."""
        if tokens is None:
            responder.send_final(text, status, similarity)
        else:
            prompt, completion, truncated = tokens
            responder.send_final(
                text,
                status,
                similarity,
                finish_reason="length" if truncated else "stop",
                tokens=(prompt, completion),
            )

    def submit_miss(
        self,
        request: GenerationRequest,
        digest: Digest | None,
        status: str,
        write_back: bool,
        responder: Responder,
        after_store: Callable[[], None] | None = None,
        generate: GenerateFn | None = None,
        *,
        tags: tuple[str, ...] = (),
        max_age_s: float | None = None,
        draft_digest: str = "",
        neighbours: tuple[str, ...] = (),
        verify: str | None = None,
        on_verified: Callable[[bool | None], None] | None = None,
        serve_ttl_s: float = 0.0,
    ) -> None:
        """Serve a miss on a worker thread; returns at once (the model is decoupled).
        `tags` go with the stored answer; `max_age_s` bounds the age of a cached answer this
        request accepts instead of a generation (its cache_control directives), and so does
        `serve_ttl_s` (prompt_cache's ttl_s, 0: none), whichever is less.
        `draft_digest` (tiercache.exact.keys.draft_digest): the answer kept there goes to the
        engine as a draft for speculative decoding, and a greedy request's answer is kept there
        once stored. The answers under `neighbours` (its nearest semantic neighbours') go
        to the engine as drafts too. `verify` (a semantic hit's answer, `verify-semantic`) goes
        first, verified whole in the prompt's prefill pass: when the answer the engine
        generated is exactly it, the response's status is `verified` instead of `status`;
        `on_verified` gets, once per request, True (verified), False (refuted) or None
        (unchecked: the answer came from elsewhere, or the request failed or was cancelled).
        `after_store` runs once the answer is stored (the semantic index write), if it is.
        `generate` replaces the stage's engine call for this request if it leads its flight (it
        carries per-request engine inputs, such as the adapter weights lora_cache sent)."""
        directives = _Directives(tags, max_age_s, draft_digest, neighbours, verify, serve_ttl_s)
        with self._lock:
            full = self._pending >= self.max_pending
            if full:
                self._refused += 1
            else:
                self._pending += 1
        if full:
            if verify is not None and on_verified is not None:
                on_verified(None)
            responder.send_error(
                CapacityError(
                    f"{self.max_pending} requests are already waiting for the engine here: "
                    "retry later"
                )
            )
            return
        try:
            self._pool.submit(
                self._serve_counted,
                request,
                digest,
                status,
                write_back,
                responder,
                after_store,
                generate,
                directives,
                on_verified,
            )
        except RuntimeError as exc:  # the stage is closing: its pool takes no more
            with self._lock:
                self._pending -= 1
            responder.send_error(Unavailable(f"the llm stage is closing: {exc}"))

    # -- internals -----------------------------------------------------------------------------

    def _serve_counted(self, *args: Any) -> None:
        """`_serve_miss`, counted among the pending misses until it returns, or, when it leads a
        flight, until that flight's generation ends: the slot goes to the producer, so work a
        cancelled requester left behind (a queued producer, its flight, a lease) stays within
        max_pending."""
        slot = _PendingSlot(self)
        try:
            self._serve_miss(*args, slot=slot)
        finally:
            if not slot.handed:
                slot.release()

    @property
    def pending(self) -> tuple[int, int]:
        """(misses submitted and not yet answered or whose generation still runs, misses
        refused for max_pending so far)."""
        with self._lock:
            return self._pending, self._refused

    def _serve_miss(
        self,
        request: GenerationRequest,
        digest: Digest | None,
        status: str,
        write_back: bool,
        responder: Responder,
        after_store: Callable[[], None] | None,
        generate: GenerateFn | None = None,
        directives: _Directives | None = None,
        on_verified: Callable[[bool | None], None] | None = None,
        *,
        slot: _PendingSlot | None = None,
    ) -> None:
        directives = directives or _Directives()
        if responder.is_cancelled():  # cancelled while queued: no flight, no generation
            responder.send_cancelled()
            if directives.verify is not None and on_verified is not None:
                on_verified(None)
            return
        if digest is None:
            flight, leader = Flight(key="", subscribers=1), True
        else:
            key = flight_key(digest, status, directives.max_age_s, write_back)

            def stale(running: Flight) -> bool:
                """An invalidation since `running` started covers what it generates."""
                made = CacheEntry(
                    "",
                    created_s=running.started_s,
                    tags=running.tags,  # its leader's, which its answer is stored with
                    tenant_scope=request.tenant_scope,
                    adapter=request.lora_digest,
                )
                return self.cache.invalidates(digest, made)

            flight, leader = self.flights.join(key, self.cache.now(), stale, directives.tags)
            if after_store is not None and flight.after_store is None:
                flight.after_store = after_store  # the leader's, or a follower's if it had none
            if not leader and self._on_follow is not None:
                try:
                    self._on_follow()
                except Exception:  # noqa: BLE001 - a count must not leave the follower unserved
                    log.exception("on_follow callback failed")
        if leader:
            # Only a looked-up miss may be answered by an entry stored since its lookup; `bypass`
            # (no-cache, semantic-only) asked not to be served from the exact cache.
            recheck = status == "miss"
            try:
                if slot is not None:
                    slot.handed = True  # the producer releases it when the generation ends
                self._producers.submit(
                    self._produce,
                    flight,
                    request,
                    digest,
                    write_back,
                    recheck,
                    generate,
                    directives,
                    slot=slot,
                )
            except Exception as exc:  # noqa: BLE001 - no producer: end the flight, never leave it
                if slot is not None:
                    slot.handed = False
                log.exception("starting a generation failed")
                failed = Unavailable(f"the generation could not start: {type(exc).__name__}")
                if digest is None:
                    flight.finish(failed)
                else:
                    self.flights.complete(flight, failed)
        verified: bool | None = None  # the verify outcome; None: the engine's run did not say
        try:
            parts: list[str] = []
            for chunk in flight.read(responder.is_cancelled):
                parts.append(chunk)
                if request.stream and chunk:
                    responder.send_chunk(chunk)
            if responder.is_cancelled():
                responder.send_cancelled()
            else:
                answer = "".join(parts)
                text = None if request.stream else answer
                usage = flight.usage
                finish_reason = flight.finish_reason
                tokens = None if usage is None else (usage.prompt_tokens, flight.generated_tokens)
                if flight.stored is not None:  # an answer stored meanwhile: as a hit reports it
                    prompt_tokens, completion_tokens, finish_reason = flight.stored
                    tokens = (prompt_tokens, completion_tokens)
                # only an answer the engine generated to its end says whether the candidate
                # was its own (an answer stored meanwhile or another replica's does not)
                if (
                    directives.verify is not None
                    and flight.stored is None
                    and flight.finish_reason in ("stop", "length")
                ):
                    verified = answer == directives.verify
                    status = CacheStatus.VERIFIED.value if verified else status
                responder.send_final(
                    text, status, usage=usage, finish_reason=finish_reason, tokens=tokens
                )
        except TierCacheError as exc:
            responder.send_error(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged with traceback
            log.exception("serving a miss failed")
            responder.send_error(exc)
        finally:
            self.flights.leave(flight)
            if directives.verify is not None and on_verified is not None:
                on_verified(verified)  # once per request, whatever became of it

    def _produce(
        self,
        flight: Flight,
        request: GenerationRequest,
        digest: Digest | None,
        write_back: bool,
        recheck: bool = True,
        generate: GenerateFn | None = None,
        directives: _Directives | None = None,
        *,
        slot: _PendingSlot | None = None,
    ) -> None:
        """Run one generation into `flight`; store it only if clean, complete and wanted (then
        run the flight's `after_store`). `slot`: its leader's pending slot, released as the
        flight ends."""
        error: TierCacheError | None = None
        lease: Lease | None = None
        directives = directives or _Directives()
        try:
            # every requester left while this waited for a producer: no lookup, no lease, no
            # engine run for nobody, and no request joins it from here on
            if self.flights.retire_if_abandoned(flight):
                raise abandoned_error()
            max_age_s = directives.read_age_s
            if digest is not None and recheck:
                # A flight for this digest may have finished between the lookup and now.
                found = self._stored(digest, max_age_s, request)
                if found is not None:
                    flight.serve_stored(found.entry)
                    return
                if write_back and self._leases is not None:
                    lease, remote = self._take_turn(flight, request, digest, max_age_s)
                    if lease is not None:
                        with self._lock:
                            self._leased[digest] = flight
                    if remote is not None:
                        flight.serve_stored(remote)
                        return
            # every requester left while this waited for a producer (or a lease): no engine run
            # for nobody, and no request joins it from here on
            if self.flights.retire_if_abandoned(flight):
                raise abandoned_error()
            started_s = self.cache.now()
            # drafts only from the cache, read here; an answer not stored is not kept as one
            own = dataclasses.replace(request, drafts=(), index_answer=write_back)
            drafted = self._with_drafts(own, directives)
            record = self._run_engine(flight, drafted, generate or self._generate)
            stored = False
            # abandoned only if nobody joined meanwhile: it then leaves the table at once, so a
            # request arriving from here on starts afresh rather than join a dropped answer
            if record.finish_reason == "cancelled" or self.flights.retire_if_abandoned(flight):
                error = abandoned_error()
            elif record.finish_reason in SERVED_UNCACHED_FINISHES:
                log.info(
                    "engine finished %s with %r: served, not cached", digest, record.finish_reason
                )
            elif record.finish_reason not in CLEAN_FINISHES:
                error = Unavailable(f"engine finished with {record.finish_reason!r}")
            elif write_back and digest is not None:
                prompt_tokens = 0 if flight.usage is None else flight.usage.prompt_tokens
                stored = self._store(
                    digest,
                    flight.text(),
                    record,
                    request,
                    started_s,
                    directives.tags,
                    prompt_tokens,
                )
                if stored and directives.draft_digest and request.greedy:
                    self._keep_draft(directives.draft_digest, flight.text(), request, started_s)
                if stored and flight.after_store is not None:
                    self._run_after_store(flight.after_store)
            if self._on_generation is not None:
                try:
                    self._on_generation(dataclasses.replace(record, stored=stored))
                except Exception:  # noqa: BLE001 - a report must not fail a served answer
                    log.exception("on_generation callback failed for %s", digest)
        except TierCacheError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - every subscriber gets the error; traceback logged
            log.exception("generation failed")
            # its type only: the text (paths, CUDA's messages) stays in the log above
            error = Unavailable(f"generation failed: {type(exc).__name__}")
        except BaseException as exc:  # the thread is being stopped: never a partial answer served
            error = Unavailable(f"generation stopped: {type(exc).__name__}")
            raise
        finally:
            if lease is not None and self._leases is not None:
                try:  # after the store: waiting replicas find the answer
                    self._leases.release(lease)
                except Exception:  # noqa: BLE001 - the flight must end whatever the lease did
                    log.exception("releasing the lease on %s failed", digest)
                with self._lock:
                    if digest is not None and self._leased.get(digest) is flight:
                        del self._leased[digest]
            if slot is not None:  # before the subscribers wake: one may send the next miss
                slot.release()
            if digest is None:
                flight.finish(error)
            else:
                self.flights.complete(flight, error)

    def _with_drafts(
        self, request: GenerationRequest, directives: _Directives
    ) -> GenerationRequest:
        """`request` with its drafts: the answer kept under its draft digest, then its semantic
        neighbours' answers, each only if it belongs to the request's tenant scope and adapter
        (a forged or damaged index row never carries another scope's text into the engine)
        and is not a copy of an earlier one. Unchanged when none can be read: drafts only
        speed decoding up."""
        if not request.speculate:
            return request
        drafts: list[tuple[str, str]] = []
        if directives.verify:  # embedding_cache's hit in the request's scope (empty: no draft)
            drafts.append((DraftSource.VERIFY.value, directives.verify))
        wanted = [(DraftSource.ANSWER.value, d) for d in (directives.draft_digest,) if d]
        wanted += [(DraftSource.NEIGHBOUR.value, d) for d in directives.neighbours]
        for source, digest in wanted:
            try:
                found = self.cache.get(Digest(digest), request=False)
            except Exception:  # noqa: BLE001 - a draft is an optimisation
                log.exception("reading the draft %s failed", digest)
                continue
            if found is None or not found.entry.text:
                continue
            entry = found.entry
            if entry.tenant_scope != request.tenant_scope or entry.adapter != request.lora_digest:
                if _DAMAGE_LOG.ready():
                    log.warning(
                        "draft %s... is another scope's answer: not used (%d such lines not "
                        "logged)",
                        digest[:8],
                        _DAMAGE_LOG.suppressed,
                    )
                continue
            if all(entry.text != text for _, text in drafts):
                drafts.append((source, entry.text))
        return dataclasses.replace(request, drafts=tuple(drafts)) if drafts else request

    def _keep_draft(
        self, draft_digest: str, text: str, request: GenerationRequest, started_s: float
    ) -> None:
        """Keep a stored greedy answer as the draft of its prompt's other requests, with the
        answer's own metadata (so a tenant or adapter invalidation drops it as well)."""
        try:
            self.cache.put(
                draft_digest,
                text,
                tenant_scope=request.tenant_scope,
                adapter=request.lora_digest,
                created_s=started_s,
            )
        except Exception:  # noqa: BLE001 - a draft is an optimisation
            log.exception("keeping %s as a draft failed", draft_digest)

    def _stored(
        self,
        digest: Digest,
        max_age_s: float | None,
        request: GenerationRequest,
        counted: bool = True,
    ) -> Lookup | None:
        """The tiers' answer under `digest` made for `request` (`made_for`: a value made for
        another tenant or adapter is a miss here too, as in prompt_cache, and the answer
        generated now is written over it; a padded tenant's request is looked up here alone)."""
        found = self.cache.get(digest, max_age_s, request=counted)
        return made_for(found, request.tenant_scope, request.lora_digest)

    def _take_turn(
        self,
        flight: Flight,
        request: GenerationRequest,
        digest: Digest,
        max_age_s: float | None,
    ) -> tuple[Lease | None, CacheEntry | None]:
        """Across replicas: (our lease, None) to generate; (None, entry) when another replica's
        answer arrived; (None, None) to generate without a lease (Redis unavailable, or the
        other replica took longer than `wait_s`). Raises if every local requester left."""
        leases = self._leases
        if leases is None:
            return None, None
        deadline = self._clock() + leases.wait_s
        waited = False
        while True:
            state, lease = leases.acquire(digest)
            if state is LeaseState.ACQUIRED and lease is not None:
                if waited:  # the holder may have stored its answer just before letting go
                    try:
                        found = self._stored(digest, max_age_s, request)
                    except BaseException:
                        leases.release(lease)  # not yet _produce's to release: never leak it
                        raise
                    if found is not None:
                        leases.release(lease)
                        self._count_remote(hit=True)
                        return None, found.entry
                    self._count_remote(takeover=True)
                return lease, None
            if state is LeaseState.UNAVAILABLE or self._held_by_superseded(digest):
                return None, None
            if not waited:
                waited = True
                self._count_remote(wait=True)
            polls = 0
            while True:
                # a poll every 50 ms; the tiers read at its first and every LEASE_READ_EVERY-th
                # (the holder stores its answer before it lets go, which the read after the
                # next acquire finds: a value planted under the key, up to 4 MiB read and
                # checked, is not read 20 times a second), not a request: nothing counted
                if polls % LEASE_READ_EVERY == 0:
                    found = self._stored(digest, max_age_s, request, counted=False)
                    if found is not None:
                        self._count_remote(hit=True)
                        return None, found.entry
                polls += 1
                # retired, not only read: a request joining between this check and the
                # flight's end would be given the abandoned error it did not earn
                if self.flights.retire_if_abandoned(flight):
                    raise abandoned_error()
                if self._held_by_superseded(digest):
                    return None, None
                if self._clock() >= deadline:
                    self._count_remote(wait_timeout=True)
                    log.warning(
                        "another replica held %s for over %.0f s; generating here too",
                        digest,
                        leases.wait_s,
                    )
                    return None, None
                held = leases.held(digest)
                if held is None:
                    return None, None
                if not held:
                    break  # released without an answer, or expired: take it
                leases.pause()

    def _held_by_superseded(self, digest: Digest) -> bool:
        """Whether this process's own flight holds `digest`'s lease and an invalidation has
        superseded it: its answer will not be stored, so a newer flight generates at once
        (without a lease) rather than wait for it to end."""
        with self._lock:
            holder = self._leased.get(digest)
        return holder is not None and holder.superseded

    @property
    def leases(self) -> LeaseCoordinator | None:
        """The cross-replica lease coordinator (None: this process only), for its metrics."""
        return self._leases

    def _count_remote(
        self,
        wait: bool = False,
        hit: bool = False,
        takeover: bool = False,
        wait_timeout: bool = False,
    ) -> None:
        with self._lock:
            self._remote_waits += wait
            self._remote_hits += hit
            self._lease_takeovers += takeover
            self._lease_wait_timeouts += wait_timeout

    def _run_engine(
        self, flight: Flight, request: GenerationRequest, generate: GenerateFn
    ) -> GenerationRecord:
        with self._lock:
            self._generations += 1
        started = self._clock()
        ttft: float | None = None
        finish: str | None = None
        tokens = 0
        mean_logprob: float | None = None
        engine_s: float | None = None
        events = generate(request)
        try:
            for event in events:
                if event.text:
                    if ttft is None:
                        ttft = self._clock() - started
                    flight.append(event.text)
                if event.finish_reason is not None:
                    finish, tokens = event.finish_reason, event.generated_tokens
                    mean_logprob = event.mean_logprob
                    engine_s = event.engine_s
                    flight.finish_reason = finish
                    flight.generated_tokens = tokens
                    flight.usage = EngineUsage(
                        event.reused_tokens, event.computed_tokens, event.accepted_tokens
                    )
                elif flight.abandoned and self.flights.retire_if_abandoned(flight):
                    # every requester left: the stream is closed (the engine's call cancelled)
                    # rather than run to max_tokens for nobody; never stored
                    finish = "cancelled"
                    break
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # a generator's: its stream closed, the engine's call cancelled
        if finish is None:
            raise Unavailable("engine stream ended without a finish reason")
        duration = self._clock() - started
        return GenerationRecord(ttft, duration, tokens, finish, False, mean_logprob, engine_s)

    def _store(
        self,
        digest: Digest,
        text: str,
        record: GenerationRecord,
        request: GenerationRequest,
        started_s: float,
        tags: tuple[str, ...] = (),
        prompt_tokens: int = 0,
    ) -> bool:
        try:
            stored = self.cache.put(
                digest,
                text,
                ttl_s=self.confidence.ttl_s(record.mean_logprob, self.cache.default_ttl_s),
                finish_reason=record.finish_reason,
                generated_tokens=record.generated_tokens,
                tags=tags,
                tenant_scope=request.tenant_scope,
                adapter=request.lora_digest,
                created_s=started_s,  # an invalidation issued while it generated covers it
                prompt_tokens=prompt_tokens,
                mean_logprob=record.mean_logprob,
                generation_s=record.cost_s,
                temperature=request.temperature,
            )
        except Exception:  # noqa: BLE001 - a failed write-back must not fail the answer
            log.exception("write-back of %s failed", digest)
            with self._lock:
                self._write_failures += 1
            return False
        if stored is None:  # invalidated while it was generated: served, not stored
            return False
        with self._lock:
            self._write_backs += 1
        return True

    def _run_after_store(self, after_store: Callable[[], None]) -> None:
        try:
            after_store()
        except Exception:  # noqa: BLE001 - the answer is stored; an index write may fail alone
            log.exception("after-store hook failed")
            with self._lock:
                self._write_failures += 1

    def stats(self) -> GenerationStats:
        with self._lock:
            return GenerationStats(
                generations=self._generations,
                coalesced=self.flights.coalesced_total,
                write_backs=self._write_backs,
                write_failures=self._write_failures,
                in_flight=self.flights.in_flight(),
                remote_waits=self._remote_waits,
                remote_hits=self._remote_hits,
                lease_takeovers=self._lease_takeovers,
                lease_wait_timeouts=self._lease_wait_timeouts,
            )

    def drain(self) -> None:
        """Finish every miss in flight (their answers stored, their after-store hooks run);
        the cache stays open."""
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._producers.shutdown(wait=True, cancel_futures=False)

    def close(self) -> None:
        self.drain()
        if self._leases is not None:
            self._leases.close()
        self.cache.close()
