"""Feedback on served answers (issue 19): the `feedback` model's core.

A caller sends back the `answer_id` of a response (tiercache.exact.answer_ids) with a verdict:

- `bad`: the answer's cache entry is invalidated by key (tiercache.exact.invalidation's
  `Invalidator`): with Redis on every replica (L1, L2, L3, and the semantic rows that point to
  it), within the invalidation latency docs/replicas.md measures; without Redis on this host
  (its L2, and its processes' L1 through the host's invalidation log). The entry is generated
  again by the next request that asks for it. When the answer was a semantic hit, its entry's
  similarity floor is raised above the similarity it was served at
  (tiercache.semantic.penalties), so once regenerated it is not served to that rewording
  again. A `bad` on an answer that a watermark issued after it was served already covers (a
  key invalidation of its entry, bad feedback included, or one of its tenant; read from the
  fleet's invalidation table, which every replica shares through Redis and replays after a
  restart) invalidates nothing more: replaying one id cannot grow the fleet's invalidation log.
- `good`: counted, and while the answer is cached its entry's count of endorsements rises (at
  most `MAX_ENDORSEMENTS`), written back to the shared tiers (L2, L3): every process that admits
  the entry into its L1 from then on (on every replica, through L3) ranks it as asked for that
  many more times, and a copy already in a process's L1 takes the new verdicts up on a hit
  (compared with the shared tiers at most every 30 s per key: `TieredCache`; docs/feedback.md).

On a semantic hit that a trust gate decided (its id carries the gate's score), either verdict is
also an outcome of the entry served (tiercache.semantic.entry_trust: good right, bad wrong),
counted once per answer id (the id's issue time stamps it), what the gate decides by next.

The id opens only under the tenant scope it was issued to, so feedback is taken only from the
tenant that was served the answer (the caller of the stage resolves the tenant as prompt_cache
does, from the API key when a key file is configured); an id whose entry is still cached must
also name an entry of that tenant (a second check, should a forged id ever open).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact.answer_ids import AnswerIds, ServedAs
from tiercache.exact.codec import MAX_ENDORSEMENTS, CacheEntry
from tiercache.exact.invalidation import Invalidator
from tiercache.exact.request import echo
from tiercache.exact.tiered import TieredCache
from tiercache.semantic.entry_trust import feedback_stamp, length_class, record_outcome
from tiercache.semantic.penalties import raise_floor
from tiercache.vocabulary import InvalidationKind

log = logging.getLogger(__name__)


class Verdict(str, Enum):
    GOOD = "good"
    BAD = "bad"


def parse_verdict(text: str | None) -> Verdict:
    """The verdict named by `text` (case and surrounding blanks ignored); InvalidRequest else."""
    try:
        return Verdict((text or "").strip().lower())
    except ValueError:
        raise InvalidRequest(
            f"verdict must be one of {[v.value for v in Verdict]}, got {echo(text or '')}"
        ) from None


@dataclass(frozen=True, slots=True)
class FeedbackReport:
    verdict: Verdict
    served: ServedAs
    invalidated: bool  # bad: an invalidation was issued now (False: one already covered it)
    published: bool  # that invalidation was recorded in Redis and sent to every replica
    endorsed: bool = False  # good: the entry's endorsements rose in the shared tiers

    def to_json(self, masked: bool = False) -> dict[str, object]:
        """The caller's answer; `masked` (a deployment that pads some tenant's responses): the
        verdict only, since how the answer was served and whether someone else flagged it
        first are what padding hides (docs/security.md)."""
        if masked:
            return {"verdict": self.verdict.value, "accepted": True}
        reaches = (
            "every replica (L1, L2, L3, semantic rows)"
            if self.published
            else "this host only (no Redis)"
            if self.invalidated
            else "nothing more: an invalidation issued after this answer was served covers it"
            if self.verdict is Verdict.BAD
            else "counted; the cached answer ranks higher where it is cached next"
            if self.endorsed
            else "counted"
        )
        return {
            "verdict": self.verdict.value,
            "accepted": True,
            "served": self.served.kind,
            "invalidated": self.invalidated,
            "published": self.published,
            "endorsed": self.endorsed,
            "reaches": reaches,
        }


class Feedback:
    """Opens answer ids and acts on verdicts. Thread-safe (its parts are)."""

    def __init__(self, ids: AnswerIds, invalidator: Invalidator) -> None:
        self.ids = ids
        self.invalidator = invalidator

    def give(
        self,
        answer_id: str,
        verdict: Verdict,
        tenant_scope: str,
        adapters: frozenset[str] | None = None,
    ) -> FeedbackReport:
        """Act on `verdict` for the answer `answer_id` names, given by `tenant_scope` with a
        key that may use `adapters` (None: any). InvalidRequest for something that is not an
        answer id, Forbidden for an id not issued to this tenant by this deployment or for an
        answer of an adapter the key may not use; Unavailable when Redis cannot be reached (a
        bad answer is then invalidated on this host only: send the feedback again)."""
        ref = self.ids.open(answer_id, tenant_scope)
        if not ref.adapter_allowed(adapters):
            raise Forbidden(
                "this API key may not use the adapter of the answer answer_id names"
                + (
                    " (the id is of a format that does not say which)"
                    if ref.adapter is None
                    else ""
                )
            )
        # a bad verdict sent again after Redis refused the first: its invalidation was applied
        # here, so the watermark below covers the answer, and is published now
        retry = self.invalidator.unpublished(InvalidationKind.KEY, ref.digest)
        cache = self.invalidator.cache
        found = cache.peek(ref.digest)  # not a request; also notes the watermarks issued since
        if found is not None and found.tenant_scope not in ("", tenant_scope):
            raise Forbidden("answer_id names an answer of another tenant")
        table = cache.invalidations
        # An answer invalidated after this id was issued (clearly after: the id is stamped by
        # the serving host's clock) and generated again is not the one this verdict is about.
        served = CacheEntry("", ref.issued_s + 2 * table.skew_s, tenant_scope=tenant_scope)
        replaced = table.covers(ref.digest, served)
        # An answer served from the cache (an exact or semantic hit), or generated (its id is
        # issued with the final response), was made before its id: one held now that was made
        # clearly after the id is another answer (the served one was invalidated by a tag or
        # an adapter, which the id does not carry, or expired or was evicted, which leaves no
        # watermark), and the verdict is not about it. An OWN id (a generation's, issued before
        # 2026-12-07 ahead of its answer) is not decidable that way.
        cached = ref.served in (ServedAs.CACHED, ServedAs.SEMANTIC)
        if cached and found is not None and found.created_s > served.created_s:
            replaced = True
        if ref.served is ServedAs.SEMANTIC and ref.score > 0.0 and not retry:
            try:  # what the trust gate learns from: the verdict on the hit it let through
                right = verdict is Verdict.GOOD
                # the entry's adapter and answer length; unknown once it is gone or replaced:
                # no tenant calibration learns, and its own record counts the id once
                adapter, answer_class, stamp = None, 0, ref.issued_s
                if found is not None and not replaced:
                    adapter, answer_class = found.adapter, length_class(found.text)
                    # one of each verdict per answer: a semantic hit's id is issued afresh at
                    # each serve, and asking again to say `good` again added one each time
                    stamp = feedback_stamp(ref.digest, found.created_s, right)
                record_outcome(
                    cache, ref.digest, ref.score, right, tenant_scope, stamp, adapter,
                    answer_class,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - the verdict is acted on; the outcome is extra
                log.exception("recording a verdict against %s... failed", ref.digest[:12])
        if verdict is Verdict.GOOD:
            endorsed = False
            if found is not None and not replaced:
                try:
                    endorsed = endorse(cache, ref.digest, found.created_s)
                except Exception:  # noqa: BLE001 - the verdict is counted; the rank is extra
                    log.exception("endorsing %s... failed", ref.digest[:12])
            return FeedbackReport(verdict, ref.served, False, False, endorsed)
        # Covered only by a watermark clearly after the answer was served (the skew allowance
        # past `issued_s`, which is another host's clock): a doubtful case invalidates again.
        # first: stops serving
        report = None if replaced and not retry else self.invalidator.key(ref.digest)
        if report is not None and report.published:  # Redis answers: what it missed goes too
            self.invalidator.publish_pending()
        if ref.served is ServedAs.SEMANTIC:
            # The floor is about the neighbour and the similarity it was served at, not one
            # version of its answer: raised even when the answer was replaced since (a second
            # `bad`, at a higher similarity, after the first one's invalidation), so the
            # regenerated answer is not served to that rewording again.
            try:  # the floor outlives the answer (another key): its regeneration needs it
                raise_floor(cache, ref.digest, ref.similarity, tenant_scope)
            except Exception:  # noqa: BLE001 - the invalidation stands; the floor is extra
                log.exception("raising the similarity floor of %s... failed", ref.digest[:12])
        if report is None:
            return FeedbackReport(verdict, ref.served, False, False)
        return FeedbackReport(verdict, ref.served, True, report.published)


def endorse(cache: TieredCache, digest: str, created_s: float) -> bool:
    """Count one more `good` verdict on `digest`'s entry made at `created_s` (the one that was
    served): the highest count any shared tier holds for it (L2 and L3: never a process's L1,
    whose copy may predate other verdicts; another replica may have counted one in L3 that this
    host's L2 has not seen), plus one, written to every tier holding that answer
    (`TieredCache.endorse_entry`: never over a newer one, nor into a tier that lost it). False
    when no shared tier holds that entry (expired, invalidated, evicted, generated again) or
    its count is already
    at MAX_ENDORSEMENTS. Two verdicts at the same instant may count as one: a rank, not a
    tally (tiercache_feedback_total counts every verdict)."""
    now = cache.now()
    held = [
        entry
        for entry in cache.shared_copies(digest)
        if entry.created_s == created_s and not entry.expired(now)
    ]
    if not held:
        return False
    entry = max(held, key=lambda e: e.endorsements)
    if entry.endorsements >= MAX_ENDORSEMENTS:
        return False
    # only the tiers that hold this answer: one holding a newer answer is not reverted to it
    return cache.endorse_entry(digest, created_s, entry.endorsements + 1) > 0
