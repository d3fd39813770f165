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
- `good`: counted. (Raising the entry's value in the tiers' eviction policies is not built yet:
  docs/feedback.md, "Not built yet".)

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
from tiercache.exact.codec import CacheEntry
from tiercache.exact.invalidation import Invalidator
from tiercache.semantic.penalties import raise_floor

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
            f"verdict must be one of {[v.value for v in Verdict]}, got {text!r}"
        ) from None


@dataclass(frozen=True, slots=True)
class FeedbackReport:
    verdict: Verdict
    served: ServedAs
    invalidated: bool  # bad: an invalidation was issued now (False: one already covered it)
    published: bool  # that invalidation was recorded in Redis and sent to every replica

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
            else "counted"
        )
        return {
            "verdict": self.verdict.value,
            "accepted": True,
            "served": self.served.name.lower(),
            "invalidated": self.invalidated,
            "published": self.published,
            "reaches": reaches,
        }


class Feedback:
    """Opens answer ids and acts on verdicts. Thread-safe (its parts are)."""

    def __init__(self, ids: AnswerIds, invalidator: Invalidator) -> None:
        self.ids = ids
        self.invalidator = invalidator

    def give(self, answer_id: str, verdict: Verdict, tenant_scope: str) -> FeedbackReport:
        """Act on `verdict` for the answer `answer_id` names, given by `tenant_scope`.
        InvalidRequest for something that is not an answer id, Forbidden for an id not issued
        to this tenant by this deployment; Unavailable when Redis cannot be reached (a bad
        answer is then invalidated on this host only: send the feedback again)."""
        ref = self.ids.open(answer_id, tenant_scope)
        cache = self.invalidator.cache
        found = cache.get(ref.digest)  # also notes the watermarks issued meanwhile
        if found is not None and found.entry.tenant_scope not in ("", tenant_scope):
            raise Forbidden("answer_id names an answer of another tenant")
        if verdict is Verdict.GOOD:
            return FeedbackReport(verdict, ref.served, False, False)
        # Covered only by a watermark clearly after the answer was served (the skew allowance
        # past `issued_s`, which is another host's clock): a doubtful case invalidates again.
        table = cache.invalidations
        served = CacheEntry("", ref.issued_s + 2 * table.skew_s, tenant_scope=tenant_scope)
        if table.covers(ref.digest, served):
            return FeedbackReport(verdict, ref.served, False, False)
        report = self.invalidator.key(ref.digest)  # first: it stops the answer being served
        if ref.served is ServedAs.SEMANTIC:
            try:  # the floor outlives the answer (another key): its regeneration needs it
                raise_floor(cache, ref.digest, ref.similarity, tenant_scope)
            except Exception:  # noqa: BLE001 - the invalidation stands; the floor is extra
                log.exception("raising the similarity floor of %s... failed", ref.digest[:12])
        return FeedbackReport(verdict, ref.served, True, report.published)
