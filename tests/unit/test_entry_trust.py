"""tiercache.semantic.entry_trust: each entry's acceptance moves with its own outcomes."""

from __future__ import annotations

import random

import pytest

from tiercache.semantic.entry_trust import Decision, EntryTrust, TrustPolicy, replay


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


def test_only_the_most_recent_outcomes_are_kept_and_scores_must_be_probabilities() -> None:
    trust = EntryTrust()
    for i in range(100):
        trust.observe(0.9, right=i >= 36)  # the first 36 refuted, then right
    assert len(trust.observations) == 64 and all(right for _, right in trust.observations)
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
