"""Eviction policies (tiercache.eviction): one contract suite run against every policy, each
policy's own order, and every bounded structure telling its policy what happens and asking it
for victims (the engine's adapter slots: tests/unit/test_engine_adapters.py, which has torch).

As cachetools' CacheTestMixin: a new policy joins POLICIES and must pass the whole suite.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

import pytest

from tiercache.adapter_types import AdapterRef, AdapterWeights, held_key
from tiercache.engine.kv_cache import BlockHash, KvBlockPool, block_hashes, kv_salt
from tiercache.eviction import (
    EvictionPolicy,
    GreedyDualFrequencyPolicy,
    LruPolicy,
    OldestFirstPolicy,
    ShadowChoicePolicy,
    SkipKey,
    named_policy,
)
from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.kv_simulation import replay_policy
from tiercache.lora.residency import Residency

K = TypeVar("K", bound=Hashable)

POLICIES: dict[str, Callable[[], EvictionPolicy[str]]] = {
    "lru": LruPolicy,
    "oldest-first": OldestFirstPolicy,
    "greedy-dual-frequency": GreedyDualFrequencyPolicy,
    "shadow-choice": ShadowChoicePolicy,
}


@pytest.fixture(params=list(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy[str]:
    return POLICIES[request.param]()


def fill(policy: EvictionPolicy[str], sizes: dict[str, int]) -> None:
    """Admit `sizes` in order, each created after the one before (so that every policy here
    ranks them in admission order until told more)."""
    for index, (key, size) in enumerate(sizes.items()):
        policy.admit(key, size, created_s=float(index))


# ---------------------------------------------------------------- contract (every policy)


def test_an_empty_policy_nominates_nothing(policy: EvictionPolicy[str]) -> None:
    assert policy.nominate() == []
    assert policy.nominate(5, 100) == []


def test_nominees_are_admitted_keys_each_once(policy: EvictionPolicy[str]) -> None:
    fill(policy, dict.fromkeys("abcde", 1))
    nominees = policy.nominate(10)
    assert sorted(nominees) == list("abcde")  # best effort: fewer than asked, all there is


def test_nominating_changes_nothing(policy: EvictionPolicy[str]) -> None:
    fill(policy, dict.fromkeys("abcde", 1))
    assert policy.nominate(2) == policy.nominate(2)
    assert policy.nominate(2) == policy.nominate(5)[:2]  # a run from the front of one order


def test_count_is_met_and_not_exceeded(policy: EvictionPolicy[str]) -> None:
    fill(policy, dict.fromkeys("abcde", 1))
    assert len(policy.nominate()) == 1
    assert len(policy.nominate(3)) == 3
    assert policy.nominate(0) == []


def test_size_is_met_by_the_shortest_run(policy: EvictionPolicy[str]) -> None:
    sizes = {"a": 3, "b": 5, "c": 7, "d": 2}
    fill(policy, sizes)
    for needed in (1, 3, 4, 8, 9, 15, 17):
        nominees = policy.nominate(0, needed)
        freed = sum(sizes[key] for key in nominees)
        assert freed >= needed
        assert freed - sizes[nominees[-1]] < needed  # one fewer would not do
    assert len(policy.nominate(3, 1)) == 3  # both bounds hold: three keys, however small


def test_skipped_keys_are_never_nominated(policy: EvictionPolicy[str]) -> None:
    fill(policy, dict.fromkeys("abcde", 1))
    first = policy.nominate()[0]
    nominees = policy.nominate(2, skip=first.__eq__)
    assert first not in nominees and len(nominees) == 2
    assert policy.nominate(10, skip=lambda key: key != "c") == ["c"]


def test_removed_keys_are_never_nominated(policy: EvictionPolicy[str]) -> None:
    fill(policy, dict.fromkeys("abc", 1))
    policy.remove("b")
    policy.remove("never admitted")  # ignored
    policy.access("never admitted")  # ignored, and not admitted by it
    assert sorted(policy.nominate(10)) == ["a", "c"]


def test_readmission_keeps_one_key_with_its_new_size(policy: EvictionPolicy[str]) -> None:
    policy.admit("a", 1, created_s=1.0)
    policy.admit("b", 1, created_s=2.0)
    policy.admit("a", 10, created_s=3.0)
    assert sorted(policy.nominate(10)) == ["a", "b"]
    assert sorted(policy.nominate(0, 11)) == ["a", "b"]  # "a" counts its new size: 10, not 1
    assert "a" in policy.nominate(0, 10)


def test_a_readmitted_key_ranks_as_new_in_recency_orders() -> None:
    for policy in (LruPolicy[str](), OldestFirstPolicy[str]()):
        policy.admit("a", 1, created_s=1.0)
        policy.admit("b", 1, created_s=2.0)
        policy.admit("a", 10, created_s=3.0)
        assert policy.nominate(0, 11) == ["b", "a"]


def test_clear_forgets_every_key(policy: EvictionPolicy[str]) -> None:
    fill(policy, dict.fromkeys("abc", 1))
    policy.clear()
    assert policy.nominate(10) == []
    policy.admit("d", 1)
    assert policy.nominate(10) == ["d"]


# ---------------------------------------------------------------- each policy's order


def test_lru_ranks_by_last_admission_or_access() -> None:
    lru: LruPolicy[str] = LruPolicy()
    fill(lru, dict.fromkeys("abcd", 1))
    lru.access("a")
    lru.admit("b", 1)
    assert lru.nominate(4) == ["c", "d", "a", "b"]


def test_oldest_first_ranks_by_created_s_not_by_use() -> None:
    oldest: OldestFirstPolicy[str] = OldestFirstPolicy()
    for key, created_s in (("c", 3.0), ("a", 1.0), ("d", 4.0), ("b", 2.0), ("a2", 1.0)):
        oldest.admit(key, 1, created_s=created_s)
    oldest.access("a")
    assert oldest.nominate(5) == ["a", "a2", "b", "c", "d"]  # ties in admission order
    assert oldest.nominate(2) == ["a", "a2"]


def evict_one(policy: GreedyDualFrequencyPolicy[str], held: set[str]) -> str:
    """What a store does when full: evict the policy's first nominee and report it."""
    (victim,) = policy.nominate()
    held.discard(victim)
    policy.remove(victim)
    return victim


def full_with_a_hot_key() -> tuple[GreedyDualFrequencyPolicy[str], set[str]]:
    """A policy for a store of 4 keys holding a, b, c, d, where "a" was asked for 3 more times."""
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(capacity=4)
    held = set("abcd")
    fill(gd, dict.fromkeys("abcd", 1))
    for _ in range(3):
        gd.access("a")
    return gd, held


class _AppliedAtOnce(GreedyDualFrequencyPolicy[str]):
    ACCESS_BATCH = 1  # every access applied as it comes, as before accesses were batched


def test_greedy_dual_batched_accesses_rank_as_accesses_applied_at_once() -> None:
    """Accesses recorded and applied in batches (`ACCESS_BATCH`) leave the policy exactly as
    applying each at once does: the same victims, values, sequence numbers and frequencies,
    through admissions, endorsements, removals, nominations and the sketch's growth and
    aging, whatever comes between two accesses."""
    rng = random.Random(7)
    batched: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy()
    at_once = _AppliedAtOnce()
    held: set[str] = set()
    for step in range(40_000):
        key = f"k{int(rng.paretovariate(1.1)) % 3000}"
        roll, size, cost_s = rng.random(), rng.randint(1, 50), rng.random() * 3
        for policy in (batched, at_once):
            if roll < 0.55:
                policy.access(key)
            elif roll < 0.85:
                policy.admit(key, size, cost_s=cost_s, group=step % 2)
            elif roll < 0.88:
                policy.endorse(key, 1)
            elif roll < 0.93:
                policy.remove(key)
        if roll < 0.55:
            pass
        elif roll < 0.85:
            held.add(key)
        elif 0.88 <= roll < 0.93:
            held.discard(key)
        elif roll >= 0.99:
            victims = batched.nominate(3, 40)
            assert victims == at_once.nominate(3, 40)
            for victim in victims:
                batched.remove(victim)
                at_once.remove(victim)
                held.discard(victim)
        if step % 997 == 0:
            assert batched.frequency(key) == at_once.frequency(key)
            assert batched.inflation == at_once.inflation
        if step % 4001 == 0:  # runs of accesses alone: batches applied by `access` itself
            for _ in range(3 * GreedyDualFrequencyPolicy.ACCESS_BATCH + 7):
                reread = f"k{int(rng.paretovariate(1.1)) % 3000}"
                batched.access(reread)
                at_once.access(reread)
            assert len(batched._pending) < GreedyDualFrequencyPolicy.ACCESS_BATCH
    assert batched.nominate(len(held)) == at_once.nominate(len(held))
    assert batched.first_sight_discount() == at_once.first_sight_discount()
    assert batched.sketch_bytes == at_once.sketch_bytes and len(batched) == len(at_once)


def test_greedy_dual_a_failing_recorded_access_costs_only_its_own_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An access that fails when its batch is applied (out of memory in a heap push) is lost
    alone: the removal that applied the batch still removes its key, and the other accesses
    count."""
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy()
    fill(gd, dict.fromkeys("abc", 1))
    gd.access("a")
    gd.access("b")
    access_now = GreedyDualFrequencyPolicy._access_now

    def failing(self: GreedyDualFrequencyPolicy[str], key: str) -> None:
        if key == "a":
            raise MemoryError("a heap push")
        access_now(self, key)

    monkeypatch.setattr(GreedyDualFrequencyPolicy, "_access_now", failing)
    before = gd.frequency("b")  # applies the two: "a" fails, "b" counts
    gd.remove("c")
    assert len(gd) == 2 and "c" not in gd.nominate(3) and before >= 2


def test_greedy_dual_keeps_a_key_asked_for_again_through_a_scan_of_new_ones() -> None:
    gd, held = full_with_a_hot_key()
    evicted = []
    for index in range(8):  # a scan of one-off keys, each into a full store
        evicted.append(evict_one(gd, held))
        key = f"scan{index}"
        gd.admit(key, 1)
        held.add(key)
    assert "a" in held  # LRU would have evicted it at the fourth admission
    assert evicted[:3] == ["b", "c", "d"]  # equal values: the least recently used first
    assert gd.inflation > 0.0  # each eviction raised the level new keys start from


def test_greedy_dual_ages_a_key_no_longer_asked_for() -> None:
    gd, held = full_with_a_hot_key()
    for index in range(40):  # new keys, each asked for twice: the level rises past "a"'s value
        evict_one(gd, held)
        key = f"new{index}"
        gd.admit(key, 1)
        gd.access(key)
        held.add(key)
        if "a" not in held:
            break
    assert "a" not in held


def test_greedy_dual_weighs_cost_per_unit_of_size() -> None:
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(capacity=8)
    gd.admit("slow", 1, cost_s=20.0)
    gd.admit("fast", 1, cost_s=0.3)
    gd.admit("big-slow", 100, cost_s=20.0)  # 0.2 s per unit: below "fast"'s 0.3
    assert gd.nominate(3) == ["big-slow", "fast", "slow"]


def test_greedy_dual_counts_an_unknown_cost_as_the_mean_known_one() -> None:
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(capacity=8)
    assert gd.mean_cost() == 1.0  # nothing known: every cost counts as 1
    gd.admit("cheap", 1, cost_s=2.0)
    gd.admit("dear", 1, cost_s=4.0)
    gd.admit("unknown", 1)  # counts as 3.0
    assert gd.mean_cost() == 3.0
    assert gd.nominate(3) == ["cheap", "unknown", "dear"]


def test_greedy_dual_learns_which_group_is_worth_less() -> None:
    """Sampled answers (group 1) that are never asked for again start below greedy ones (group
    0) that are, by the ratio of the two groups' hits per admission, at least MIN_DISCOUNT; and
    not before both groups have GROUP_EVIDENCE admissions."""
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(capacity=1024)
    evidence = GreedyDualFrequencyPolicy.GROUP_EVIDENCE
    for index in range(evidence):
        gd.admit(f"greedy{index}", 1, group=0)
        gd.access(f"greedy{index}")
        if index == evidence // 2:
            assert gd.group_discount(1) == 1.0  # no evidence for group 1 yet
        gd.admit(f"sampled{index}", 1, group=1)
    assert gd.group_discount(0) == 1.0  # the best group is never discounted
    assert gd.group_discount(1) == GreedyDualFrequencyPolicy.MIN_DISCOUNT
    gd.admit("new-sampled", 1, group=1)
    gd.admit("new-greedy", 1, group=0)
    ranked = gd.nominate(len(gd))
    assert ranked.index("new-sampled") < ranked.index("new-greedy")
    # the traffic changes: sampled answers come back; the discount follows (3 of 4 hit: 0.75)
    for index in range(3 * evidence):
        gd.admit(f"again{index}", 1, group=1)
        gd.access(f"again{index}")
    assert gd.group_discount(1) == pytest.approx(0.75, abs=0.01)


def test_greedy_dual_with_one_group_never_discounts_by_group() -> None:
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(capacity=1024)
    for index in range(2 * GreedyDualFrequencyPolicy.GROUP_EVIDENCE):
        gd.admit(f"k{index}", 1, group=3)
    assert gd.group_discount(3) == 1.0


def test_greedy_dual_a_removal_is_an_eviction_only_when_nominated() -> None:
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(capacity=4)
    fill(gd, dict.fromkeys("ab", 1))
    gd.remove("b")  # deleted, not evicted: the level stays
    assert gd.inflation == 0.0
    assert gd.nominate() == ["a"]
    gd.remove("a")
    # "a"'s value: level 0 plus one request, at a never-seen key's weight (no hits yet: halved)
    assert gd.inflation == 1.0 * GreedyDualFrequencyPolicy.MIN_DISCOUNT


def test_greedy_dual_learns_how_much_never_seen_keys_are_worth() -> None:
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(capacity=64)
    for round_ in range(20):  # keys seen before are hit while held; never-seen ones are not
        for key in ("p", "q"):
            gd.admit(key, 1)
            gd.access(key)
            gd.remove(key)
        gd.admit(f"one-off{round_}", 1)
        gd.remove(f"one-off{round_}")
    assert gd.first_sight_discount() == GreedyDualFrequencyPolicy.MIN_DISCOUNT
    for round_ in range(200):  # now never-seen keys are hit as often as the others
        for key in (f"new{round_}", "p"):
            gd.admit(key, 1)
            gd.access(key)
            gd.remove(key)
    assert gd.first_sight_discount() > 0.9  # the twenty unhit one-offs still count a little
    gd.admit("fresh", 1)
    gd.admit("p", 1)
    assert gd.nominate(2) == ["fresh", "p"]  # "p" was asked for far more often


def test_greedy_dual_a_nominee_used_again_is_not_evicted_when_removed() -> None:
    gd: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(capacity=4)
    fill(gd, dict.fromkeys("ab", 1))
    assert gd.nominate() == ["a"]
    gd.access("a")  # used again after it was offered: its removal now is a deletion
    gd.remove("a")
    assert gd.inflation == 0.0


def test_greedy_dual_without_a_capacity_grows_its_sketch_and_keeps_counting() -> None:
    gd: GreedyDualFrequencyPolicy[int] = GreedyDualFrequencyPolicy()
    for _ in range(5):
        gd.admit(7, 1)  # counted five times before the sketch grows
    for key in range(3000):  # past the starting size of 1,024 keys, twice over
        gd.admit(key, 1)
    assert gd._sketch.capacity == 4096  # grew twice  # noqa: SLF001
    assert gd.frequency(7) >= 6  # its counts came along
    gd.access(7)
    assert len(gd) == 3000
    assert gd.frequency(7) >= 2 and gd.frequency(2999) >= 1
    assert 7 not in gd.nominate(3000 - 1)[:2000]  # asked for twice: among the last to go


def test_a_growing_sketch_stays_within_its_limit_and_shrinks_to_a_new_one() -> None:
    """A sketch costs about 256 bytes per key of capacity: L1 with many short answers held as
    much again in it (64 MiB beside 64 MiB of entries). `limit_sketch` bounds it."""
    from tiercache.frequency_sketch import sketch_bytes

    gd: GreedyDualFrequencyPolicy[int] = GreedyDualFrequencyPolicy()
    start = gd.sketch_bytes
    gd.limit_sketch(start * 4)  # room for one growth (x4 capacity is about x4 bytes)
    for _ in range(5):
        gd.admit(7, 1)
    for key in range(20_000):
        gd.admit(key, 1)
    assert gd.sketch_bytes <= start * 4 and gd._sketch.capacity == 4096  # noqa: SLF001
    assert sketch_bytes(4096 * 4) > start * 4  # the next growth would not have fit
    assert gd.frequency(7) >= 6  # counts kept through the growth
    gd.limit_sketch(1)  # below the start: rebuilt at the start's size, counts kept
    assert gd.sketch_bytes == start and gd.frequency(7) >= 6
    assert len(gd) == 20_000 and 7 not in gd.nominate(19_000)[:10_000]


def test_l1s_sketch_takes_at_most_an_eighth_of_its_budget_beyond_it() -> None:
    from tiercache.exact.codec import CacheEntry
    from tiercache.exact.stores import SKETCH_SHARE, MemoryStore

    budget = 16 << 20
    store = MemoryStore(budget, named_policy("gdsf"))
    for i in range(60_000):  # short answers: about 930 bytes each counted, 18,000 of them fit
        store.put(f"k{i}", CacheEntry(f"answer {i} " + "x" * 100, created_s=1.0))
    policy = store._policy  # noqa: SLF001
    assert store.stats().entries > 16_384  # unbounded, the sketch grew to 65,536 keys: 16 MiB
    assert policy.sketch_bytes <= budget // SKETCH_SHARE
    store.resize(1 << 20)
    assert policy.sketch_bytes <= max((1 << 20) // SKETCH_SHARE, 256 << 10)


def _single_block_hits(policy: EvictionPolicy[int], keys: list[int], capacity: int) -> int:
    """Hits of one-key requests through a store of `capacity` keys evicting in `policy`'s
    order (tiercache.kv_simulation's replay, each request one block)."""
    return replay_policy([[key] for key in keys], capacity, policy).hits


def test_shadow_choice_evicts_in_frequencys_order_where_its_shadow_hits_more() -> None:
    """A hot set asked half the time through a stream of one-off keys: GDSF's shadow hits more,
    so the store evicts in GDSF's order and hits as GDSF does, far above LRU."""
    rng = random.Random(5)
    stream = [rng.randrange(300) if rng.random() < 0.5 else 10_000 + i for i in range(40_000)]
    shadow: ShadowChoicePolicy[int] = ShadowChoicePolicy()
    hits = _single_block_hits(shadow, stream, 400)
    assert shadow.order == "gdsf"
    assert hits > 1.5 * _single_block_hits(LruPolicy(), stream, 400)
    assert hits > 0.97 * _single_block_hits(GreedyDualFrequencyPolicy(), stream, 400)


def test_shadow_choice_evicts_in_recencys_order_where_its_shadow_hits_more() -> None:
    """Keys asked for many times and then never again, followed by a window of new keys each
    asked a few times: counting uses keeps the dead keys (GDSF hits less than LRU), LRU's
    shadow hits more, so the store evicts in recency's order and hits as LRU does."""
    rng = random.Random(6)
    dead = [rng.randrange(400) for _ in range(12_000)]
    window = [100_000 + max(0, t // 4 - rng.randrange(300)) for t in range(60_000)]
    stream = dead + window
    shadow: ShadowChoicePolicy[int] = ShadowChoicePolicy()
    hits = _single_block_hits(shadow, stream, 400)
    assert shadow.order == "lru"
    lru = _single_block_hits(LruPolicy(), stream, 400)
    assert hits >= lru > 1.05 * _single_block_hits(GreedyDualFrequencyPolicy(), stream, 400)
    shadow.clear()
    assert shadow.order == "lru" and len(shadow) == 0 and shadow.nominate(1) == []


def test_shadow_choice_follows_a_store_that_grows_and_shrinks() -> None:
    """The sample is chosen at each nomination from the keys held: every key while the store is
    small, thinned in place to 1 in 8 as it grows, more again when it shrinks; the shadows stay
    within their share of the store; a key the store does not hold is no request; and GDSF's
    order ages while LRU's evicts."""
    policy: ShadowChoicePolicy[int] = ShadowChoicePolicy()
    held: list[int] = []

    def fill_to(count: int, start: int) -> int:
        key = start
        while len(held) < count:
            policy.admit(key, 1)
            held.append(key)
            key += 1
        return key

    def evict(count: int) -> None:
        for victim in policy.nominate(count):
            held.remove(victim)
            policy.remove(victim)

    key = fill_to(200, 0)
    evict(1)
    assert policy.sample == 1 and policy.order == "lru"
    for _ in range(3):  # turnover in LRU's order: GDSF's level rises as if it evicted
        key = fill_to(len(held) + 50, key)
        evict(50)
    assert policy._gdsf.inflation > 0
    key = fill_to(2100, key)
    evict(1)
    assert policy.sample == 8
    for shadow in policy._shadows:
        assert len(shadow.sizes) <= 2100 // 8 + 1
    policy.access(10**9)  # not held: not a request
    assert all(10**9 not in shadow.sizes for shadow in policy._shadows)
    evict(len(held) - 20)
    key = fill_to(21, key)
    evict(1)
    assert policy.sample == 1
    key = fill_to(100, key)
    for shadow in policy._shadows:
        assert 0 < shadow.total <= len(held)  # sized after what the store holds


def test_greedy_dual_rejects_a_negative_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        GreedyDualFrequencyPolicy(capacity=-1)


# ---------------------------------------------------------------- every store asks its policy


class Recording(LruPolicy[K]):
    """LRU that notes what it was told and asked."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []
        self.nominated: list[list[K]] = []

    def admit(
        self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0, group: int = 0
    ) -> None:
        self.calls.append(("admit", key))
        super().admit(key, size, created_s=created_s, cost_s=cost_s, group=group)

    def access(self, key: K) -> None:
        self.calls.append(("access", key))
        super().access(key)

    def remove(self, key: K) -> None:
        self.calls.append(("remove", key))
        super().remove(key)

    def nominate(self, count: int = 1, size: int = 0, skip: SkipKey[K] | None = None) -> list[K]:
        nominees = super().nominate(count, size, skip)
        self.calls.append(("nominate", tuple(nominees)))
        self.nominated.append(nominees)
        return nominees

    def told(self, kind: str) -> list[object]:
        return [arg for what, arg in self.calls if what == kind]


def test_l1_tells_its_policy_and_evicts_its_nominees() -> None:
    policy: Recording[str] = Recording()
    size = CacheEntry("x", 0.0).size_bytes
    store = MemoryStore(2 * size, policy=policy)
    store.put("a", CacheEntry("x", 0.0))
    store.put("b", CacheEntry("x", 0.0))
    assert store.get("a") is not None
    store.put("c", CacheEntry("x", 0.0))
    assert policy.told("admit") == ["a", "b", "c"]
    assert policy.told("access") == ["a"]
    assert policy.told("nominate") == [("b",)] and policy.told("remove") == ["b"]
    assert store.get("b") is None and store.stats().evictions == 1


def test_l1_evicts_in_the_order_of_an_injected_policy() -> None:
    size = CacheEntry("x", 0.0).size_bytes
    store = MemoryStore(2 * size, policy=OldestFirstPolicy())
    store.put("new", CacheEntry("x", created_s=2.0))
    store.put("old", CacheEntry("x", created_s=1.0))
    assert store.get("new") is not None  # a read does not save it from an age-ordered policy
    store.put("c", CacheEntry("x", created_s=3.0))
    assert store.get("old") is None and store.get("new") is not None


def test_l2_rebuilds_its_policys_view_at_each_eviction(tmp_path: Path) -> None:
    policy: Recording[str] = Recording()
    store = LmdbStore(tmp_path / "l2", 256 * 1024, policy=policy)
    for i in range(400):
        store.put(f"k{i:04d}", CacheEntry("x" * 1_000, created_s=float(i)))
    evicted = [key for nominees in policy.nominated for key in nominees]
    assert evicted and store.stats().evictions == len(evicted)
    assert all(store.get(key) is None for key in evicted)
    assert "k0000" in evicted and policy.told("admit")
    assert len(policy) == 0  # cleared after each eviction: other processes write L2 too
    store.close()


def test_the_kv_pool_offers_only_unpinned_leaves_and_evicts_its_nominees() -> None:
    policy: Recording[BlockHash] = Recording()
    pool: KvBlockPool[str] = KvBlockPool(30, 4, policy=policy)
    salt = kv_salt("rev", "tenant", "")
    chain = block_hashes(list(range(8)), 4, salt)
    lease = pool.acquire(chain, 8)
    for key in chain:
        assert pool.insert(lease, key, 10, lambda: "payload")
    assert policy.calls == []  # pinned: nothing to rank until the request ends
    pool.release(lease)
    assert policy.told("admit") == chain[::-1]  # once per block, leaf first
    assert policy.told("access") == []
    reuse = pool.acquire(chain, 8)
    pool.release(reuse)
    assert policy.told("access") == chain[::-1]  # a reuse is one access per block
    other = block_hashes(list(range(50, 58)), 4, salt)
    lease = pool.acquire(other, 8)
    assert pool.insert(lease, other[0], 10, lambda: "p")
    assert pool.insert(lease, other[1], 10, lambda: "p")  # needs room: the old chain's leaf
    pool.release(lease)
    assert policy.told("nominate") == [(chain[1],)] and policy.told("remove") == [chain[1]]
    assert chain[0] in pool and chain[1] not in pool  # never the root before its child


def test_residency_tells_each_tiers_policy() -> None:
    engine: Recording[str] = Recording()
    host: Recording[str] = Recording()
    residency = Residency(engine_slots=2, engine_policy=engine, host_policy=host)
    refs, versions = [], {}
    for task_id, name in enumerate("abc", start=1):
        ref = AdapterRef(name, task_id, hashlib.sha256(name.encode()).hexdigest())
        versions[ref.digest] = AdapterWeights(ref, "{}", b"w" * 100)
        refs.append(ref)
    for ref in (refs[0], refs[1], refs[0], refs[2]):
        residency.plan(ref, lambda r: versions[r.digest])
    digests = [ref.digest for ref in refs]
    keys = [held_key(ref) for ref in refs]  # the engine holds (task id, digest)
    assert engine.told("admit") == keys
    assert keys[0] in engine.told("access")
    assert (keys[1],) in engine.told("nominate") and engine.told("remove") == [keys[1]]
    assert host.told("admit") == digests and digests[0] in host.told("access")
    assert residency.engine_digests() == {digests[0], digests[2]}


# ---------------------------------------------------------------- review findings (2026-12-06)


def test_a_skip_that_raises_leaves_every_key_in_the_order(policy: EvictionPolicy[str]) -> None:
    fill(policy, {"a": 1, "b": 1, "c": 1, "d": 1})

    def broken(key: str) -> bool:
        if key == "c":
            raise KeyError(key)
        return False

    with pytest.raises(KeyError):
        policy.nominate(4, skip=broken)
    assert sorted(policy.nominate(4)) == ["a", "b", "c", "d"]  # none lost for good


def test_greedy_dual_admits_when_seen_keys_have_no_hits_left() -> None:
    """Seen keys admitted millions of times and never read halve their hit count to 0.0: a
    never-seen key's discount divided by it and every admission of a new key failed."""
    policy: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy()
    policy._hits[1] = 0.0  # where 5.3 million unread admissions of seen keys leave it
    assert policy.first_sight_discount() == 1.0
    policy.admit("brand-new", 10, cost_s=1.0)
    assert policy.nominate(1) == ["brand-new"]


def test_endorsements_rank_a_held_value_once_not_again_at_each_admission() -> None:
    """An endorsed answer evicted and copied back from L2 is no more wanted than before: its
    verdicts ranked it again at every admission (4, 8, 12, 16 against 1, 2, 3, 4), and they
    counted as reads in the admission prior."""
    endorsed: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy()
    plain: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy()
    store = MemoryStore(1 << 20, policy=endorsed)
    other = MemoryStore(1 << 20, policy=plain)
    for _ in range(4):
        store.put("k", CacheEntry("answer", 0.0, endorsements=3))
        other.put("k", CacheEntry("answer", 0.0))
        store.delete("k")
        other.delete("k")
    store.put("k", CacheEntry("answer", 0.0, endorsements=3))
    other.put("k", CacheEntry("answer", 0.0))
    assert endorsed._sketch.estimate("k") == plain._sketch.estimate("k") == 5
    assert endorsed._entries["k"][0] == pytest.approx(
        plain._entries["k"][0] * (5 + 3) / 5
    )  # ranked as 3 more requests, once
    assert "k" in endorsed._unproven  # not read: proves nothing about new keys


def test_a_policy_that_fails_an_admission_leaves_nothing_stored() -> None:
    """Stored but unknown to its policy, an entry could never be evicted; once such entries
    filled the budget every put failed."""

    class Failing(LruPolicy[str]):
        def admit(
            self, key: str, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0,
            group: int = 0,
        ) -> None:  # fmt: skip
            if key == "bad":
                raise ZeroDivisionError("a policy's bug")
            super().admit(key, size, created_s=created_s, cost_s=cost_s, group=group)

    size = CacheEntry("x", 0.0).size_bytes
    store = MemoryStore(2 * size, policy=Failing())
    with pytest.raises(ZeroDivisionError):
        store.put("bad", CacheEntry("x", 0.0))
    assert store.get("bad") is None and store.stats().bytes == 0
    store.put("a", CacheEntry("x", 0.0))
    store.put("b", CacheEntry("x", 0.0))
    store.put("c", CacheEntry("x", 0.0))  # room made by evicting "a"
    assert store.get("a") is None and store.get("c") is not None


def _structure_bytes(policy_name: str, count: int = 5000) -> float:
    """What L1 holds per entry, the frequency sketch aside (its share of the budget is bounded
    apart), with a third of the keys read three times."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = MemoryStore(1 << 30, policy=named_policy(policy_name))
        for i in range(count):
            key = hashlib.sha256(str(i).encode()).hexdigest()
            store.put(key, CacheEntry(f"answer {i}", 0.0, generation_s=0.5))
        for _ in range(3):
            for i in range(0, count, 3):  # each lookup with its own copy of the key
                store.get(hashlib.sha256(str(i).encode()).hexdigest())
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return (held - getattr(store._policy, "sketch_bytes", 0)) / count


def test_l1_counts_what_gdsf_holds_per_entry_beyond_an_lru() -> None:
    """ENTRY_OVERHEAD_BYTES counts an LRU's slots; GDSF holds more per key (ranked tuples,
    heap items, the unproven record), which it reports and L1 adds to each entry's size
    (uncounted, an L1 held 2.0 times what it counted in short answers, the sketch aside)."""
    extra = _structure_bytes("gdsf") - _structure_bytes("lru")
    counted = GreedyDualFrequencyPolicy.entry_overhead_bytes
    assert 0.8 * counted <= extra <= 1.1 * counted  # 451 B measured at 5,000 answers
    size = CacheEntry("x", 0.0).size_bytes
    store = MemoryStore(1 << 20, policy=named_policy("gdsf"))
    store.put("k", CacheEntry("x", 0.0))
    assert store.stats().bytes == size + counted
