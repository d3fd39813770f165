"""Feedback on served answers (issue 19): the `feedback` model's core.

A caller sends back the `answer_id` of a response (tiercache.exact.answer_ids) with a verdict:

- `bad`: the answer's cache entry is invalidated by key (tiercache.exact.invalidation's
  `Invalidator`): with Redis on every replica (L1, L2, L3, and the semantic rows that point to
  it), within the invalidation latency docs/replicas.md measures; without Redis on this host
  (its L2, and its processes' L1 through the host's invalidation log). The entry is generated
  again by the next request that asks for it. A `bad` on an answer that an invalidation of its
  entry has already covered (one issued after the answer was served) invalidates nothing more:
  replaying one id cannot grow the fleet's invalidation log.
- `good`: counted. (Raising the entry's value in the tiers' eviction policies is not built yet:
  docs/kv_reuse.md, "Feedback".)

The id opens only under the tenant scope it was issued to, so feedback is taken only from the
tenant that was served the answer (the caller of the stage resolves the tenant as prompt_cache
does, from the API key when a key file is configured).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

from tiercache.errors import InvalidRequest, Unavailable
from tiercache.exact.answer_ids import AnswerIds, ServedAs
from tiercache.exact.invalidation import Invalidator

REMEMBERED = 65_536  # entries whose last invalidation by feedback is remembered (LRU)


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
    digest: str
    invalidated: bool  # bad: an invalidation was issued now (False: one already covered it)
    published: bool  # that invalidation was recorded in Redis and sent to every replica

    def to_json(self) -> dict[str, object]:
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
            "served": self.served.name.lower(),
            "invalidated": self.invalidated,
            "published": self.published,
            "reaches": reaches,
        }


@dataclass(frozen=True, slots=True)
class FeedbackStats:
    """Totals since start: verdicts taken by kind of service, invalidations they issued."""

    taken: dict[tuple[str, str], int]  # (verdict, served) -> count
    invalidations: int
    already_covered: int  # bad verdicts an earlier invalidation already covered


class Feedback:
    """Opens answer ids and acts on verdicts. Thread-safe."""

    def __init__(self, ids: AnswerIds, invalidator: Invalidator) -> None:
        self.ids = ids
        self.invalidator = invalidator
        self._lock = threading.Lock()
        self._invalidated_at: OrderedDict[str, float] = OrderedDict()
        self._taken: dict[tuple[str, str], int] = {
            (v.value, s.name.lower()): 0 for v in Verdict for s in ServedAs
        }
        self._invalidations = 0
        self._already = 0

    def give(self, answer_id: str, verdict: Verdict, tenant_scope: str) -> FeedbackReport:
        """Act on `verdict` for the answer `answer_id` names, given by `tenant_scope`.
        InvalidRequest for something that is not an answer id, Forbidden for an id not issued
        to this tenant by this deployment; Unavailable when Redis cannot be reached (a bad
        answer is then invalidated on this host only: send the feedback again)."""
        ref = self.ids.open(answer_id, tenant_scope)
        with self._lock:
            self._taken[(verdict.value, ref.served.name.lower())] += 1
        if verdict is Verdict.GOOD:
            return FeedbackReport(verdict, ref.served, ref.digest, False, False)
        with self._lock:
            last_s = self._invalidated_at.get(ref.digest)
            if last_s is not None and last_s >= ref.issued_s:
                self._invalidated_at.move_to_end(ref.digest)
                self._already += 1
                return FeedbackReport(verdict, ref.served, ref.digest, False, False)
        try:
            report = self.invalidator.key(ref.digest)
        except Unavailable:
            self._remember(ref.digest, None)  # applied here; a retry must publish it
            raise
        self._remember(ref.digest, report.invalidation.at_s)
        return FeedbackReport(verdict, ref.served, ref.digest, True, report.published)

    def _remember(self, digest: str, at_s: float | None) -> None:
        with self._lock:
            self._invalidations += at_s is not None
            if at_s is None:
                self._invalidated_at.pop(digest, None)
                return
            self._invalidated_at[digest] = at_s
            self._invalidated_at.move_to_end(digest)
            while len(self._invalidated_at) > REMEMBERED:
                self._invalidated_at.popitem(last=False)

    def stats(self) -> FeedbackStats:
        with self._lock:
            return FeedbackStats(dict(self._taken), self._invalidations, self._already)
