"""tiercache.semantic.entry_trust: each entry's acceptance moves with its own outcomes."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np
import pytest
from redis_down import tiers_with_l3_down

from tiercache.exact.answer_ids import AnswerIds, AnswerRef, ServedAs
from tiercache.exact.invalidation import Invalidator
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.feedback import Feedback, Verdict
from tiercache.semantic.entry_trust import (
    LENGTH_CLASSES,
    Calibration,
    Decision,
    EntryTrust,
    TrustGate,
    TrustPolicy,
    decode_trust,
    encode_trust,
    feedback_stamp,
    length_class,
    pooled_trust_key,
    read_tenant_trust,
    read_trust,
    record_outcome,
    replay,
    tenant_trust_key,
    trust_key,
    verification_stamp,
)
from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.stage import EmbeddingCache, SemanticOutcome
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache
from tiercache.vocabulary import Tier

DIGEST = hashlib.sha256(b"the neighbour's answer").hexdigest()
DIM = 8


def test_without_outcomes_the_calibrated_score_decides() -> None:
    fresh = EntryTrust()
    # the prior is centred on the score: a fresh entry's P(right) follows it, a little shrunk
    assert fresh.p_right(0.5) == pytest.approx(0.5, abs=1e-6)
    assert 0.9 < fresh.p_right(0.99) < 0.99 and 0.01 < fresh.p_right(0.01) < 0.1
    assert fresh.p_right(0.8) < fresh.p_right(0.9) < fresh.p_right(0.99)


def test_refutations_tighten_and_verifications_loosen_one_entry_only() -> None:
    refuted, verified, other = EntryTrust(), EntryTrust(), EntryTrust()
    for _ in range(5):
        refuted.observe(0.95, right=False)
        verified.observe(0.8, right=True)
    assert refuted.p_right(0.95) < other.p_right(0.95) - 0.3
    assert verified.p_right(0.8) > other.p_right(0.8) + 0.1
    policy = TrustPolicy(max_error=0.05)
    assert policy.decide(other, 0.99, can_verify=False) is Decision.SERVE
    once = EntryTrust()
    once.observe(0.95, right=False)  # one refutation: no longer served, still worth a check
    assert policy.decide(once, 0.99, can_verify=False) is Decision.MISS
    assert policy.decide(once, 0.99, can_verify=True) is Decision.VERIFY
    # five: not even checked any more at 0.95 (P(right) 0.34)
    assert policy.decide(refuted, 0.95, can_verify=True) is Decision.MISS
    assert policy.decide(other, 0.8, can_verify=False) is Decision.MISS


def test_a_credible_bound_asks_more_of_an_entry_the_less_is_known_of_it() -> None:
    """bound_quantile: P(right) at a lower quantile of the posterior: under the predictive
    mean, by less the more outcomes the entry has; a fresh entry the mean serves waits for
    outcomes under the bound."""
    fresh, known = EntryTrust(), EntryTrust()
    for _ in range(40):
        known.observe(0.98, right=True)
    for trust in (fresh, known):
        assert trust.p_right(0.98, lower=0.2) < trust.p_right(0.98)
    fresh_gap = fresh.p_right(0.98) - fresh.p_right(0.98, lower=0.2)
    known_gap = known.p_right(0.98) - known.p_right(0.98, lower=0.2)
    assert known_gap < fresh_gap
    bound = TrustPolicy(max_error=0.05, bound_quantile=0.2)
    assert TrustPolicy(max_error=0.05).decide(fresh, 0.98, can_verify=False) is Decision.SERVE
    assert bound.decide(fresh, 0.98, can_verify=True) is Decision.VERIFY
    assert bound.decide(known, 0.98, can_verify=False) is Decision.SERVE
    for quantile in (0.5, 0.9, -0.1, float("nan")):  # 0.5 and up: no lower bound
        with pytest.raises(ValueError, match="bound_quantile"):
            TrustPolicy(bound_quantile=quantile)
        with pytest.raises(ValueError, match="quantile"):
            fresh.p_right(0.98, lower=quantile)
    # what is verified is still chosen by the predictive P(right): a fresh entry the bound
    # does not serve at 0.8 (mean 0.70, inside the band) is verified, not missed
    assert bound.decide(fresh, 0.8, can_verify=True) is Decision.VERIFY


def test_only_the_most_recent_outcomes_are_kept_and_scores_must_be_probabilities() -> None:
    trust = EntryTrust()
    for i in range(100):
        trust.observe(0.9, right=i >= 36)  # the first 36 refuted, then right
    assert len(trust.observations) == 64 and all(right for _, right, _ in trust.observations)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="probability"):
            trust.observe(bad, right=True)
    with pytest.raises(ValueError, match="max_error"):
        TrustPolicy(max_error=0.0)


def test_the_stated_error_rate_holds_where_a_fixed_threshold_breaks_it() -> None:
    """Two kinds of entries offered at the same calibrated-looking scores: good ones (right 99 %
    of the time) and bad ones (right 40 %). A fixed threshold serves both and errs far above
    the stated 5 %; the learned policy verifies, learns the bad entries, and keeps to it."""
    rng = random.Random(7)
    events = []
    for _ in range(4000):
        entry = rng.randrange(40)
        good = entry < 30
        score = rng.uniform(0.9, 1.0)
        events.append((f"e{entry}", score, rng.random() < (0.99 if good else 0.4)))
    fixed_served = [right for _, score, right in events if score >= 0.96]
    fixed_error = 1 - sum(fixed_served) / len(fixed_served)
    counts = replay(TrustPolicy(max_error=0.05), events)
    served = counts["served_right"] + counts["served_wrong"]
    assert fixed_error > 0.10
    assert served > 1000 and counts["served_wrong"] / served <= 0.05
    assert counts["refuted"] > 0  # it learned by exploring, and no refuted answer was served


def tiers(tmp_path: Path) -> TieredCache:
    return TieredCache(
        [(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, LmdbStore(tmp_path / "l2", 1 << 20))]
    )


def test_an_entrys_outcomes_are_kept_beside_it_per_tenant_and_an_id_counts_once(
    tmp_path: Path,
) -> None:
    cache = tiers(tmp_path)
    assert read_trust(cache, DIGEST, "scope-a").observations == []
    check = verification_stamp("r" * 64, DIGEST, "the answer")
    assert check == verification_stamp("r" * 64, DIGEST, "the answer") and check % 1 == 0
    assert check != verification_stamp("r" * 64, DIGEST, "another answer")
    assert record_outcome(cache, DIGEST, 0.9, False, "scope-a", check)
    assert not record_outcome(cache, DIGEST, 0.9, False, "scope-a", check)  # the same check
    assert record_outcome(cache, DIGEST, 0.8, True, "scope-a", 1234.5)
    assert not record_outcome(cache, DIGEST, 0.8, True, "scope-a", 1234.5)  # a replayed id
    assert read_trust(cache, DIGEST, "scope-a").observations == [
        (0.9, False, check),
        (0.8, True, 1234.5),
    ]
    assert len(read_tenant_trust(cache, "scope-a").observations) == 2
    assert read_trust(cache, DIGEST, "scope-b").observations == []  # another tenant's record
    assert trust_key(DIGEST) not in (DIGEST,) and len(trust_key(DIGEST)) == 64
    # a copy in a process's L1 does not hide outcomes recorded since in L2 (another process)
    l1, l2 = cache.store(Tier.L1), cache.store(Tier.L2)
    assert l1 is not None and l2 is not None
    stale = l2.get(trust_key(DIGEST))
    assert stale is not None
    l1.put(trust_key(DIGEST), stale)
    record_outcome(TieredCache([(Tier.L2, l2)]), DIGEST, 0.7, False, "scope-a", 99.0)
    assert len(read_trust(cache, DIGEST, "scope-a").observations) == 3
    cache.close()


@pytest.mark.parametrize(
    "text",
    [
        "semantic-trust:not json",
        "semantic-trust:{}",
        "semantic-trust:[[0.5, 2, 0]]",
        "semantic-trust:[[1.5, 1, 0]]",
        'semantic-trust:[["0.5", 1, 0]]',
        "semantic-trust:[[NaN, 1, 0]]",
        "semantic-trust:" + str([[0.5, 1, 0]] * 65),
        "semantic-trust:[[0.5, 1, " + "9" * 400 + "]]",
        "semantic-trust:" + "[" * 100_000,
        "semantic-floor:0.9",
    ],
)
def test_a_record_that_does_not_parse_is_the_prior_alone(tmp_path: Path, text: str) -> None:
    with pytest.raises((ValueError, TypeError)):
        decode_trust(text)
    cache = tiers(tmp_path)
    cache.put(trust_key(DIGEST), text, tenant_scope="scope-a")
    assert read_trust(cache, DIGEST, "scope-a").observations == []
    assert record_outcome(cache, DIGEST, 0.9, True, "scope-a", 7.0)  # replaced by a good one
    assert decode_trust(encode_trust(read_trust(cache, DIGEST, "scope-a"))).observations == [
        (0.9, True, 7.0)
    ]
    cache.close()


def test_the_gate_fails_closed_on_a_record_that_does_not_parse(tmp_path: Path) -> None:
    """A record that does not parse held outcomes nobody can read now (refutations among them):
    the gate takes it as unknown, as an unreadable tier, and verifies or misses instead of
    serving on the prior; a new outcome replaces it, and the gate decides again."""
    cache = tiers(tmp_path)
    policy = TrustPolicy(0.5, 0.25, audit_rate=0.0)  # lenient: the prior alone serves
    gate = TrustGate(cache, policy, lambda q, c, cos: 0.995)
    assert gate.decide(DIGEST, 0.995, "scope-a", can_verify=False) is Decision.SERVE
    cache.put(trust_key(DIGEST), "semantic-trust:[[NaN", tenant_scope="scope-a")
    assert gate.decide(DIGEST, 0.995, "scope-a", can_verify=False) is Decision.MISS
    assert gate.decide(DIGEST, 0.995, "scope-a", can_verify=True) is Decision.VERIFY
    assert record_outcome(cache, DIGEST, 0.995, True, "scope-a", 7.0)
    assert gate.decide(DIGEST, 0.995, "scope-a", can_verify=False) is Decision.SERVE
    cache.close()


def unit(*values: float) -> np.ndarray:
    vector = np.zeros(DIM, dtype=np.float32)
    vector[: len(values)] = values
    return vector / np.linalg.norm(vector)


def test_the_gate_serves_verifies_or_misses_a_chosen_candidate_by_its_entrys_record(
    tmp_path: Path,
) -> None:
    """A new tenant's hits are verified (greedy requests) or missed (`untrusted`: others) until
    its outcomes show that its scores hold; then a high score is served, until its own entry is
    refuted; bad feedback on a hit the gate served counts against the entry too, good feedback
    for it, each answer id once."""
    answers = tiers(tmp_path)
    scores = {"score": 0.995}
    policy = TrustPolicy(0.05, 0.25, audit_rate=0.0)
    gate = TrustGate(answers, policy, lambda q, c, cos: scores["score"])
    stage = EmbeddingCache(
        VectorCache(tmp_path / "vec", DIM),
        SemanticIndex(SemanticStore(tmp_path / "sem"), DIM),
        answers,
        lambda texts: np.stack([unit(1, 0.2) for _ in texts]),
        lambda q, candidates: 0 if candidates else None,
        "emb@1",
        min_similarity=0.5,
        trust=gate,
    )
    answers.put(DIGEST, "the neighbour's answer", tenant_scope="scope-a")
    stage.index.add("scope", DIGEST, "p", unit(1, 0))
    # a tenant with no outcomes yet: its scores are not taken at their word
    verify, sampled = stage.lookup(["reworded", "sampled"], ["scope"] * 2, ["scope-a"] * 2,
                                   [True, False])  # fmt: skip
    assert verify.outcome is SemanticOutcome.HIT and verify.verify and verify.score == 0.995
    assert sampled.outcome is SemanticOutcome.UNTRUSTED and not sampled.text
    length = length_class("the neighbour's answer")  # answers of its length calibrate it
    for i in range(40):  # its other entries' hits at such scores were verified right
        other = hashlib.sha256(f"entry {i}".encode()).hexdigest()
        record_outcome(answers, other, 0.99, True, "scope-a", float(i + 1), "", length)
    (hit,) = stage.lookup(["reworded"], ["scope"], ["scope-a"], [False])
    assert hit.outcome is SemanticOutcome.HIT and (hit.score, hit.verify) == (0.995, False)
    for stamp in (100.0, 101.0):  # this entry refuted twice (one refutation leaves 0.9503)
        record_outcome(answers, DIGEST, 0.995, False, "scope-a", stamp)
    verify, sampled = stage.lookup(["reworded", "sampled"], ["scope"] * 2, ["scope-a"] * 2,
                                   [True, False])  # fmt: skip
    assert verify.outcome is SemanticOutcome.HIT and verify.verify
    assert sampled.outcome is SemanticOutcome.UNTRUSTED
    (elsewhere,) = stage.lookup(["reworded"], ["scope"], ["scope-b"], [False])
    assert elsewhere.outcome is SemanticOutcome.STALE  # another tenant's answer: never served
    # feedback on a hit the gate decided: its id carries the score
    ids = AnswerIds(bytes(32))
    feedback = Feedback(ids, Invalidator(answers))
    held = answers.peek(DIGEST)
    assert held is not None
    served = held.created_s + 10.0  # when its hits were served
    good = ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.9, served, 0.99), "scope-a")
    for _ in range(3):
        feedback.give(good, Verdict.GOOD, "scope-a")  # replayed: counted once
    again = ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.9, served + 1, 0.99), "scope-a")
    feedback.give(again, Verdict.GOOD, "scope-a")  # the answer served again: counted once
    bad = ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.9, served + 2, 0.98), "scope-a")
    feedback.give(bad, Verdict.BAD, "scope-a")
    ungated = ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.9, served + 3), "scope-a")
    feedback.give(ungated, Verdict.GOOD, "scope-a")  # no score: nothing to learn at
    assert read_trust(answers, DIGEST, "scope-a").observations == [
        (0.995, False, 100.0),
        (0.995, False, 101.0),
        (pytest.approx(0.99), True, feedback_stamp(DIGEST, held.created_s, True)),
        (pytest.approx(0.98), False, feedback_stamp(DIGEST, held.created_s, False)),
    ]
    stage.close()


def test_a_tenants_outcomes_calibrate_its_new_entries_and_audits_keep_checking(
    tmp_path: Path,
) -> None:
    """A tenant's calibration: with no outcomes its scores are not taken at their word; where
    its hits at 0.99 were right three times in four, a new entry at 0.99 is predicted right
    about that often; where they all held, served, and then a share of those is audited (only
    when the request can be verified). Each tenant's record is its own."""
    fresh = EntryTrust()
    assert fresh.p_right(0.99, Calibration()) < fresh.p_right(0.99) < 0.99
    often_wrong = Calibration([(0.99, i % 4 != 0, 0.0) for i in range(200)])
    assert fresh.p_right(0.99, often_wrong) == pytest.approx(0.75, abs=0.05)
    holds = Calibration([(0.99, True, 0.0)] * 200)
    assert fresh.p_right(0.99, holds) > 0.97
    policy = TrustPolicy(0.05)
    assert policy.decide(fresh, 0.99, True, holds) is Decision.SERVE  # draw 1.0: no audit
    assert policy.decide(fresh, 0.99, True, holds, draw=0.01) is Decision.VERIFY
    assert policy.decide(fresh, 0.99, False, holds, draw=0.01) is Decision.SERVE
    assert policy.decide(fresh, 0.99, True, often_wrong) is Decision.VERIFY  # within the band
    assert policy.decide(fresh, 0.99, False, often_wrong) is Decision.MISS
    cache = tiers(tmp_path)
    for _ in range(3):
        record_outcome(cache, DIGEST, 0.9, False, "scope-a", float(_ + 1))
    assert len(read_tenant_trust(cache, "scope-a").observations) == 3
    assert read_tenant_trust(cache, "scope-b").observations == []
    cache.close()


def replica(tmp_path: Path, name: str, shared: MemoryStore) -> TieredCache:
    """A host: its own L1 and L2, and the fleet's L3 (`shared`, standing in for Redis)."""
    return TieredCache(
        [
            (Tier.L1, MemoryStore(1 << 20)),
            (Tier.L2, LmdbStore(tmp_path / f"l2-{name}", 1 << 20)),
            (Tier.L3, shared),
        ]
    )


def test_replicas_merge_their_outcomes_and_count_each_stamp_once(tmp_path: Path) -> None:
    """Each host's L2 holds what it wrote; L3 what any host wrote last: a record is read merged
    from both, so neither host's outcomes are lost, and a stamp counted on one host is not
    counted again on the other."""
    shared = MemoryStore(1 << 20)
    a, b = replica(tmp_path, "a", shared), replica(tmp_path, "b", shared)
    assert record_outcome(a, DIGEST, 0.9, True, "scope-a", 1.0)
    assert record_outcome(b, DIGEST, 0.8, False, "scope-a", 2.0)
    assert record_outcome(a, DIGEST, 0.7, True, "scope-a", 3.0)
    for host in (a, b):
        held = read_trust(host, DIGEST, "scope-a").observations
        assert sorted(stamp for _, _, stamp in held) == [1.0, 2.0, 3.0]
        assert len(read_tenant_trust(host, "scope-a").observations) == 3
    assert not record_outcome(b, DIGEST, 0.9, True, "scope-a", 1.0)  # counted on host a
    with pytest.raises(ValueError, match="stamp"):
        record_outcome(a, DIGEST, 0.9, True, "scope-a", 0.0)
    # unstamped outcomes (an in-memory record's) are never merged in again: no doubling
    held = EntryTrust([(0.5, False, 0.0), (0.6, True, 5.0)])
    for _ in range(3):
        held.merge(EntryTrust([(0.5, False, 0.0), (0.6, True, 5.0), (0.7, True, 6.0)]))
    assert held.observations == [(0.5, False, 0.0), (0.6, True, 5.0), (0.7, True, 6.0)]
    a.close()
    b.close()


class Unreachable(MemoryStore):
    """An L3 that cannot be asked (Redis down): `get` says nothing, `get_or_raise` raises."""

    def get(self, key: str) -> None:  # type: ignore[override]
        return None

    def get_or_raise(self, key: str) -> None:
        raise RuntimeError("Redis is unavailable")


def test_an_unreadable_shared_tier_loses_the_outcome_never_the_record(tmp_path: Path) -> None:
    shared = MemoryStore(1 << 20)
    host = replica(tmp_path, "a", shared)
    for stamp in (1.0, 2.0, 3.0):
        assert record_outcome(host, DIGEST, 0.9, True, "scope-a", stamp)
    down = Unreachable(1 << 20)
    l2 = host.store(Tier.L2)
    assert l2 is not None
    other = TieredCache([(Tier.L2, l2), (Tier.L3, down)])
    assert not record_outcome(other, DIGEST, 0.5, False, "scope-a", 4.0)
    assert len(read_trust(host, DIGEST, "scope-a").observations) == 3  # nothing overwritten
    assert len(read_tenant_trust(host, "scope-a").observations) == 3
    host.close()


def test_an_entrys_own_outcomes_are_not_counted_twice_through_its_tenant() -> None:
    """The tenant's calibration learnt from the entry's outcomes too; the entry's prediction
    takes them out of it before counting them itself: the same as a calibration that never
    had them."""
    others = [(0.9, True, float(i + 1)) for i in range(10)]
    own = [(0.9, True, 100.0), (0.9, True, 101.0), (0.9, False, 102.0)]
    entry = EntryTrust(list(own))
    with_own, without = Calibration(others + own), Calibration(others)
    assert entry.p_right(0.9, with_own) == pytest.approx(entry.p_right(0.9, without), abs=1e-9)
    assert EntryTrust().p_right(0.9, with_own) != pytest.approx(
        EntryTrust().p_right(0.9, without), abs=1e-6
    )


def test_the_prediction_stays_ordered_at_the_scores_ends() -> None:
    """A calibration whose log-odds run past the grid holds them at its ends: predictions stay
    finite and never fall as the score rises, up to a score of 1."""
    steep = Calibration([(0.99, True, float(i + 1)) for i in range(50)])
    scores = [1e-6, 0.01, 0.5, 0.9, 0.99, 0.999999, 1.0]
    predicted = [EntryTrust().p_right(s, steep) for s in scores]
    assert all(np.isfinite(predicted))
    assert all(b >= a - 1e-9 for a, b in zip(predicted, predicted[1:], strict=False))


def test_the_gate_fails_closed_when_a_shared_tier_cannot_be_read(tmp_path: Path) -> None:
    """Redis down: an entry's refutations recorded only there are unknown, and the prior alone
    served it. Now such an entry is verified when it can be, else missed."""

    answers = tiers_with_l3_down(tmp_path)
    policy = TrustPolicy(0.5, 0.25, audit_rate=0.0)  # lenient: the prior alone serves
    gate = TrustGate(answers, policy, lambda q, c, cos: 0.995)
    assert gate.decide(DIGEST, 0.995, "scope-a", can_verify=False) is Decision.MISS
    assert gate.decide(DIGEST, 0.995, "scope-a", can_verify=True) is Decision.VERIFY
    readable = TieredCache([(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, answers.store(Tier.L2))])
    served = TrustGate(readable, policy, lambda q, c, cos: 0.995)
    assert served.decide(DIGEST, 0.995, "scope-a", can_verify=False) is Decision.SERVE
    answers.close()


def test_an_adapters_outcomes_calibrate_that_adapters_entries_alone(tmp_path: Path) -> None:
    """A key limited to adapter A could send verdicts on A's hits and move the calibration of
    every entry of its tenant (the base model's, adapter B's). The calibration is per adapter
    now; an outcome whose entry's adapter is unknown (gone) teaches no calibration."""
    cache = tiers(tmp_path)
    a = "a" * 64
    for i in range(5):
        assert record_outcome(cache, DIGEST, 0.9, True, "scope-a", 100.0 + i, adapter=a)
    assert len(read_tenant_trust(cache, "scope-a", a).observations) == 5
    assert not read_tenant_trust(cache, "scope-a").observations  # the base model's: untouched
    assert not read_tenant_trust(cache, "scope-a", "b" * 64).observations
    assert record_outcome(cache, DIGEST, 0.9, False, "scope-a", 200.0, adapter=None)
    assert len(read_tenant_trust(cache, "scope-a", a).observations) == 5
    assert not read_tenant_trust(cache, "scope-a").observations
    cache.close()


def test_answer_lengths_calibrate_their_own_class(tmp_path: Path) -> None:
    """How often an engine's answer is exactly the cached one depends on its length: a key
    verifying rewordings at max_tokens 1 (one-token answers: nearly always right) filled the
    tenant's calibration, and its long answers were then served unverified. Each length class
    of a tenant and adapter calibrates its own."""
    assert [length_class("x" * n) for n in (0, 1, 3, 4, 15, 16, 63, 64, 255, 256, 4095, 9999)] == [
        0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6,
    ]  # fmt: skip
    assert length_class("é" * 2) == 1  # by UTF-8 bytes
    cache = tiers(tmp_path)
    short = length_class("Yes")
    for i in range(20):
        assert record_outcome(cache, f"{i:064x}", 0.8, True, "scope-a", 100.0 + i, "", short)
    assert len(read_tenant_trust(cache, "scope-a", "", short).observations) == 20
    long_answer = length_class("a long answer " * 40)
    assert not read_tenant_trust(cache, "scope-a", "", long_answer).observations
    gate = TrustGate(cache, TrustPolicy(max_error=0.05), lambda q, c, s: s)
    learnt, untaught = gate.calibration("scope-a", "", short), gate.calibration("scope-b")
    assert learnt.slope != untaught.slope
    assert gate.calibration("scope-a", "", long_answer).slope == untaught.slope
    with pytest.raises(ValueError, match="length class"):
        tenant_trust_key("scope-a", "", LENGTH_CLASSES)
    cache.close()


def test_a_verdict_of_each_kind_counts_once_per_answer() -> None:
    first = feedback_stamp(DIGEST, 100.0, True)
    assert first == feedback_stamp(DIGEST, 100.0, True)  # another id, the same answer
    assert first != feedback_stamp(DIGEST, 100.0, False)  # a `bad` on it counts apart
    assert first != feedback_stamp(DIGEST, 101.0, True)  # the answer made again
    assert 2**49 <= first < 2**50
    assert not 2**48 <= first < 2**49  # never a verification's stamp


def test_a_class_without_outcomes_reads_the_tenants_record_from_before_the_classes(
    tmp_path: Path,
) -> None:
    """An upgrade must not start every tenant over from the prior: a length class with no
    record of its own is judged by the refutations of the tenant's pooled record (read only)
    until it has one; the pooled record's verifications never make a class kinder."""
    cache = tiers(tmp_path)
    pooled = EntryTrust(limit=256)
    for i in range(30):
        pooled.observe(0.95, False, 10.0 + i)  # this tenant's hits were refuted: too kind
    cache.put(pooled_trust_key("scope-a"), encode_trust(pooled), tenant_scope="scope-a")
    gate = TrustGate(cache, TrustPolicy(max_error=0.05), lambda q, c, s: s)
    untaught = gate.calibration("scope-b", "", 3)
    before = gate.calibration("scope-a", "", 3)
    assert before.slope != untaught.slope  # the pooled record's lesson holds
    assert record_outcome(cache, DIGEST, 0.9, True, "scope-a", 500.0, "", 3)
    own = gate.calibration("scope-a", "", 3)
    assert own.slope == Calibration([(0.9, True, 500.0)]).slope  # its own record from then on
    # a pooled record of verifications (short answers, by the hundred) makes no class kinder:
    # only its refutations are read
    kind = EntryTrust(limit=256)
    for i in range(200):
        kind.observe(0.6, True, 10.0 + i)
    kind.observe(0.99, False, 999.0)
    cache.put(pooled_trust_key("scope-c"), encode_trust(kind), tenant_scope="scope-c")
    judged = gate.calibration("scope-c", "", 4)
    assert judged.slope == Calibration([(0.99, False, 999.0)]).slope
    assert judged.slope != Calibration(kind.observations).slope
    cache.close()


def test_the_calibrations_kept_are_bounded() -> None:
    """Each calibration kept the versions of itself without an entry's own outcomes, up to 256
    of about 20 KB, for each of 1,024 tenants: 5.4 GB at worst. Now MEMO_EXCLUDING each, the
    least recently used out, and a version not kept is computed again alike."""
    from tiercache.semantic import entry_trust

    outcomes = [(0.5 + i / 200, i % 3 != 0, 100.0 + i) for i in range(64)]
    tenant = Calibration(outcomes)
    versions = [tenant.excluding([one]) for one in outcomes]
    assert len(tenant._without) <= entry_trust.MEMO_EXCLUDING
    again = tenant.excluding([outcomes[0]])  # dropped long since: computed again, the same
    assert np.array_equal(again.weights, versions[0].weights)
    recent = tenant.excluding([outcomes[-1]])  # among the kept: the same object
    assert recent is versions[-1]
