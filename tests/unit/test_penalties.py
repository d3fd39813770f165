"""tiercache.semantic.penalties: bad feedback on a semantic hit raises the served answer's
similarity floor; a rewording under it is not served that answer again, even once it is
regenerated; the floor is per tenant, never lowered, read from the shared tiers only."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from redis_down import tiers_with_l3_down

from tiercache.exact.answer_ids import AnswerIds, AnswerRef, ServedAs
from tiercache.exact.invalidation import Invalidator
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.feedback import Feedback, Verdict
from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.penalties import MARGIN, floor_key, raise_floor, read_floor
from tiercache.semantic.stage import EmbeddingCache, SemanticOutcome
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache
from tiercache.vocabulary import Tier

DIM = 8
DIGEST = hashlib.sha256(b"the neighbour's answer").hexdigest()


def unit(*values: float) -> np.ndarray:
    vector = np.zeros(DIM, dtype=np.float32)
    vector[: len(values)] = values
    return vector / np.linalg.norm(vector)


def semantic_stage(tmp_path: Path, answers: TieredCache, query: np.ndarray) -> EmbeddingCache:
    """embedding_cache's core over `answers`, every prompt embedded as `query`, the first
    candidate chosen."""
    return EmbeddingCache(
        VectorCache(tmp_path / "vec", DIM),
        SemanticIndex(SemanticStore(tmp_path / "sem"), DIM),
        answers,
        lambda texts: np.stack([query for _ in texts]),
        lambda q, candidates: 0 if candidates else None,
        "emb@1",
        min_similarity=0.5,
    )


def tiers(tmp_path: Path) -> TieredCache:
    l2 = LmdbStore(tmp_path / "l2", 1 << 20)
    return TieredCache([(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, l2)])


def test_the_floor_rises_never_falls_and_belongs_to_its_tenant(tmp_path: Path) -> None:
    cache = tiers(tmp_path)
    assert read_floor(cache, DIGEST) is None
    assert raise_floor(cache, DIGEST, 0.9, "scope-a") == round(0.9 + MARGIN, 6)
    assert raise_floor(cache, DIGEST, 0.8, "scope-a") == round(0.9 + MARGIN, 6)  # not lowered
    assert raise_floor(cache, DIGEST, 0.95, "scope-a") == round(0.95 + MARGIN, 6)
    assert read_floor(cache, DIGEST, "scope-a") == round(0.95 + MARGIN, 6)
    assert read_floor(cache, DIGEST, "scope-b") is None
    assert floor_key(DIGEST) != DIGEST and len(floor_key(DIGEST)) == 64
    # a copy in a process's L1 does not hide a floor raised since in L2 (by another process)
    l1, l2 = cache.store(Tier.L1), cache.store(Tier.L2)
    assert l1 is not None and l2 is not None
    stale = l2.get(floor_key(DIGEST))
    assert stale is not None
    l1.put(floor_key(DIGEST), stale)
    raise_floor(TieredCache([(Tier.L2, l2)]), DIGEST, 0.97, "scope-a")
    assert read_floor(cache, DIGEST, "scope-a") == round(0.97 + MARGIN, 6)
    cache.close()


def test_bad_feedback_on_a_semantic_hit_keeps_the_regenerated_answer_from_that_rewording(
    tmp_path: Path,
) -> None:
    answers = tiers(tmp_path)
    stage = semantic_stage(tmp_path, answers, unit(1, 0.3))
    answers.put(DIGEST, "a wrong answer for it", tenant_scope="scope-a")
    stage.index.add("scope", DIGEST, "p", unit(1, 0))
    (hit,) = stage.lookup(["reworded"], ["scope"], ["scope-a"])
    assert hit.outcome is SemanticOutcome.HIT and hit.digest == DIGEST
    ids = AnswerIds(bytes(32))
    answer_id = ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, hit.similarity), "scope-a")
    report = Feedback(ids, Invalidator(answers)).give(answer_id, Verdict.BAD, "scope-a")
    assert report.invalidated
    (gone,) = stage.lookup(["reworded"], ["scope"], ["scope-a"])
    assert gone.outcome is SemanticOutcome.STALE  # the answer itself was invalidated
    # Its own prompt generates it again (later than the invalidation's skew allowance) ...
    answers.put(DIGEST, "the same answer", tenant_scope="scope-a", created_s=answers.now() + 1)
    (refused,) = stage.lookup(["reworded"], ["scope"], ["scope-a"])
    assert refused.outcome is SemanticOutcome.PENALISED  # ... and the rewording still misses
    # a closer rewording clears the floor
    closer = unit(1, 0.05)
    stage._embed = lambda texts: np.stack([closer for _ in texts])  # type: ignore[method-assign]
    (near,) = stage.lookup(["closer"], ["scope"], ["scope-a"])
    assert near.outcome is SemanticOutcome.HIT
    answers.close()


def test_a_second_bad_verdict_raises_the_floor_although_the_answer_was_replaced(
    tmp_path: Path,
) -> None:
    """The neighbour's answer served to two rewordings (at 0.80 and at 0.90) and judged `bad`
    by both: the second verdict comes after the first one's invalidation, which covers the
    answer it names, yet the floor is about the neighbour and the similarity it was served at:
    it rises to 0.91 (it stayed at 0.81, and the regenerated answer was served to the second
    rewording again)."""
    answers = tiers(tmp_path)
    answers.put(DIGEST, "a wrong answer for both", tenant_scope="scope-a")
    ids = AnswerIds(bytes(32))
    issued = answers.now()
    first, second = (
        ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, at, issued_s=issued), "scope-a")
        for at in (0.80, 0.90)
    )
    feedback = Feedback(ids, Invalidator(answers))
    assert feedback.give(first, Verdict.BAD, "scope-a").invalidated
    assert read_floor(answers, DIGEST, "scope-a") == round(0.80 + MARGIN, 6)
    answers.put(DIGEST, "generated again", tenant_scope="scope-a", created_s=answers.now() + 1)
    assert not feedback.give(second, Verdict.BAD, "scope-a").invalidated  # not this answer
    assert read_floor(answers, DIGEST, "scope-a") == round(0.90 + MARGIN, 6)
    answers.close()


def test_a_floor_that_cannot_be_read_is_never_taken_for_none(tmp_path: Path) -> None:
    """With a shared tier unreadable (Redis down), a floor a `bad` verdict left only there is
    unknown: the hit is verified by the engine when it can be, else a miss (it was served as
    if no floor had been set)."""

    answers = tiers_with_l3_down(tmp_path)
    stage = semantic_stage(tmp_path, answers, unit(1, 0.3))
    answers.put(DIGEST, "an answer", tenant_scope="scope-a")
    stage.index.add("scope", DIGEST, "p", unit(1, 0))
    (missed,) = stage.lookup(["reworded"], ["scope"], ["scope-a"])
    assert missed.outcome is SemanticOutcome.UNTRUSTED
    (checked,) = stage.lookup(["reworded"], ["scope"], ["scope-a"], can_verify=[True])
    assert checked.outcome is SemanticOutcome.HIT and checked.verify
    assert stage.unread_records == 2
    answers.close()


def test_a_floor_that_does_not_parse_is_never_taken_for_none(tmp_path: Path) -> None:
    """A floor that does not parse (a writer's bug, a damaged tier) was raised by a `bad`
    verdict nobody can read now: the hit is verified when it can be, else a miss, as for an
    unreadable tier; raising the floor again replaces it."""
    answers = tiers(tmp_path)
    stage = semantic_stage(tmp_path, answers, unit(1, 0.3))
    answers.put(DIGEST, "an answer", tenant_scope="scope-a")
    stage.index.add("scope", DIGEST, "p", unit(1, 0))
    answers.put(floor_key(DIGEST), "semantic-floor:not a number", tenant_scope="scope-a")
    (missed,) = stage.lookup(["reworded"], ["scope"], ["scope-a"])
    assert missed.outcome is SemanticOutcome.UNTRUSTED and stage.unread_records == 1
    (checked,) = stage.lookup(["reworded"], ["scope"], ["scope-a"], can_verify=[True])
    assert checked.outcome is SemanticOutcome.HIT and checked.verify
    assert raise_floor(answers, DIGEST, 0.5, "scope-a") == 0.5 + MARGIN
    (served,) = stage.lookup(["reworded"], ["scope"], ["scope-a"])
    assert served.outcome is SemanticOutcome.HIT and not served.verify
    answers.close()


def test_the_stage_memoizes_guard_profiles_per_scope(tmp_path: Path) -> None:
    """embedding_cache's search opens the guard's profile memo for its scope: the same prompt
    looked up in another tenant's scope is profiled again (the memo's saving is no signal of
    what another tenant asked), and again in the first scope is not."""
    from tiercache.semantic import features as feats

    answers = tiers(tmp_path)
    stage = semantic_stage(tmp_path, answers, unit(1, 0.3))

    def score_first(query: str, candidates: list[tuple[str, float]]) -> None:
        feats.features(query, *candidates[0])  # the guard's work, then no choice: a miss

    stage._choose = score_first  # type: ignore[method-assign]
    for scope in ("scope-a", "scope-b"):
        stage.index.add(scope, hashlib.sha256(scope.encode()).hexdigest(), "p", unit(1, 0))
    stage.lookup(["the same words"], ["scope-a"], ["scope-a"])
    misses = feats.profile_memo_misses()
    stage.lookup(["the same words"], ["scope-a"], ["scope-a"])
    assert feats.profile_memo_misses() == misses
    stage.lookup(["the same words"], ["scope-b"], ["scope-b"])
    assert feats.profile_memo_misses() == misses + 2  # the query and its candidate, again
    answers.close()


def test_a_floor_raised_on_a_stale_read_keeps_the_higher_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process raised the floor between this one's read and its write (simulated: its
    read sees none): L2 compares and writes in one transaction, so the higher floor stays."""
    from tiercache.semantic import penalties

    cache = tiers(tmp_path)
    raise_floor(cache, DIGEST, 0.95, "scope-a")
    monkeypatch.setattr(penalties, "read_floor", lambda *args: None)
    raise_floor(cache, DIGEST, 0.8, "scope-a")
    monkeypatch.undo()
    assert read_floor(cache, DIGEST, "scope-a") == round(0.95 + MARGIN, 6)
    raise_floor(cache, DIGEST, 0.97, "scope-a")  # a higher one still goes in
    assert read_floor(cache, DIGEST, "scope-a") == round(0.97 + MARGIN, 6)


def test_a_tier_already_holding_a_higher_floor_answers_while_another_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raising a floor L2 already holds higher, while L3 cannot be reached: L2 needed no change
    and answered, so the raise is not reported as failed (L3's failure alone is not raised)."""
    from tiercache.exact.codec import CacheEntry
    from tiercache.semantic import penalties

    class Unreachable(MemoryStore):
        def peek(self, key: str) -> CacheEntry | None:
            raise ConnectionError("Redis is down")

    l2 = LmdbStore(tmp_path / "l2", 1 << 20)
    cache = TieredCache([(Tier.L2, l2), (Tier.L3, Unreachable(1 << 20))])
    raise_floor(cache, DIGEST, 0.95, "scope-a")
    monkeypatch.setattr(penalties, "read_floor", lambda *args: None)  # a read before L2's
    assert raise_floor(cache, DIGEST, 0.8, "scope-a") == round(0.8 + MARGIN, 6)
    monkeypatch.undo()
    assert read_floor(cache, DIGEST, "scope-a") == round(0.95 + MARGIN, 6)
    with pytest.raises(ConnectionError):  # every tier failed: said
        TieredCache([(Tier.L3, Unreachable(1 << 20))]).merge_side("k", lambda held: "x", "s")


def test_a_tier_that_missed_a_floor_gets_it_at_the_next_raise_and_its_failures_are_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A floor raised while L3 was down reached L2 only: the next raise, even a lower one,
    offers the highest floor known to every tier, so L3 gets the one L2 holds; and L3's
    failure, not raised while L2 answered, is logged rather than lost."""
    from tiercache.exact import tiered
    from tiercache.exact.codec import CacheEntry
    from tiercache.log_throttle import LogThrottle

    down = [True]

    class Flaky(MemoryStore):
        def peek(self, key: str) -> CacheEntry | None:
            if down[0]:
                raise ConnectionError("Redis is down")
            return self.get(key)

    monkeypatch.setattr(tiered, "_SIDE_FAILURES_LOG", LogThrottle())
    l2, l3 = LmdbStore(tmp_path / "l2", 1 << 20), Flaky(1 << 20)
    cache = TieredCache([(Tier.L2, l2), (Tier.L3, l3)])
    assert raise_floor(cache, DIGEST, 0.95, "scope-a") == round(0.95 + MARGIN, 6)
    assert "was not merged into L3: Redis is down" in caplog.text
    down[0] = False
    assert raise_floor(cache, DIGEST, 0.9, "scope-a") == round(0.95 + MARGIN, 6)
    only_l3 = TieredCache([(Tier.L3, l3)])
    assert read_floor(only_l3, DIGEST, "scope-a") == round(0.95 + MARGIN, 6)
    assert read_floor(cache, DIGEST, "scope-a") == round(0.95 + MARGIN, 6)
