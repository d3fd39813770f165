"""tiercache.shadow: a cache's recently evicted keys tell what one more byte of it would save;
L1 credits a miss with what serving it cost instead (a lower tier's read, or the generation),
the KV pool with the prefill of the chain's evicted blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.engine.kv_cache import KvBlockPool
from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.shadow import ShadowQueue
from tiercache.vocabulary import Tier


def test_the_queue_keeps_the_latest_evictions_within_its_bytes() -> None:
    shadow: ShadowQueue[str] = ShadowQueue(max_bytes=300)
    for key in ("a", "b", "c", "d"):
        shadow.add(key, 100, 2.0)
    assert "a" not in shadow and shadow.bytes == 300  # the oldest fell out
    assert shadow.credit("b") and shadow.gained_s == 2.0
    assert not shadow.credit("b")  # once
    assert shadow.credit("c", saves_s=0.5) and shadow.gained_s == 2.5
    shadow.discard("d")  # cached again, or deleted: no lost hit
    assert not shadow.credit("d") and shadow.hits == 2
    shadow.add("huge", 301, 9.0)  # larger than the whole span: kept alone (the latest)
    assert "huge" in shadow and "c" not in shadow and shadow.bytes == 301
    shadow.add("e", 100, 1.0)  # the older, larger one goes
    assert "huge" not in shadow and shadow.bytes == 100
    shadow.resize(0)
    assert shadow.bytes == 0 and "e" not in shadow


def entry(text: str, generation_s: float = 0.0) -> CacheEntry:
    return CacheEntry(text, 0.0, generation_s=generation_s)


def test_l1_credits_a_miss_on_an_evicted_answer_with_its_generation_seconds() -> None:
    size = entry("x" * 100).size_bytes
    l1 = MemoryStore(4 * size)  # its shadow spans a quarter of it: one entry
    cache = TieredCache([(Tier.L1, l1)])
    l1.put("a", entry("x" * 100, generation_s=3.0))
    for key in ("b", "c", "d", "e"):  # "a" is evicted (LRU) into the shadow
        l1.put(key, entry("x" * 100, generation_s=1.0))
    assert cache.get("a") is None  # a miss the engine serves
    assert l1.stats().shadow_gained_s == pytest.approx(3.0)
    assert cache.get("a") is None
    assert l1.stats().shadow_gained_s == pytest.approx(3.0)  # once per eviction


def test_l1_credits_a_miss_served_by_l2_with_l2s_read_time_not_the_generation(
    tmp_path: Path,
) -> None:
    size = entry("x" * 100).size_bytes
    l1 = MemoryStore(4 * size)
    l2 = LmdbStore(tmp_path / "l2", max_bytes=1 << 24)
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)])
    for key in ("a", "b", "c", "d", "e"):
        answer = entry("x" * 100, generation_s=50.0)
        l1.put(key, answer)
        l2.put(key, answer)
    found = cache.get("a")
    assert found is not None and found.tier is Tier.L2
    gained = l1.stats().shadow_gained_s
    assert 0.0 < gained < 1.0  # an L2 read, not the 50 s generation
    l2.close()


def test_a_deleted_answer_is_no_lost_hit() -> None:
    size = entry("x" * 100).size_bytes
    l1 = MemoryStore(4 * size)
    for key in ("a", "b", "c", "d", "e"):
        l1.put(key, entry("x" * 100, generation_s=2.0))
    l1.delete("a")  # already evicted: an invalidation of it clears the shadow too
    l1.credit_miss("a")
    assert l1.stats().shadow_gained_s == 0.0


def test_the_kv_pool_credits_the_evicted_rest_of_a_prompts_chain_with_prefill() -> None:
    pool: KvBlockPool[str] = KvBlockPool(max_bytes=4 * 100, tokens_per_block=1)
    pool.observe_prefill(seconds=0.8, computed_tokens=4)  # 0.2 s a block
    assert pool.block_cost_s == pytest.approx(0.2)
    first = [b"a1", b"a2", b"a3", b"a4"]
    lease = pool.acquire([], prompt_tokens=5)
    for key in first:
        assert pool.insert(lease, key, 100, lambda: "kv")
    pool.release(lease)
    lease = pool.acquire([], prompt_tokens=3)
    for key in (b"b1", b"b2"):  # evicts a4, a3 (leaves first)
        assert pool.insert(lease, key, 100, lambda: "kv")
    pool.release(lease)
    assert pool.stats().shadow_bytes == 100  # a quarter of 400: the latest eviction, a3
    # the prompt again: a1, a2 found; a3 is in the shadow (0.2 s saved with one more block);
    # a4 fell out of the shadow: the chain's credit stops there
    lease = pool.acquire(first, prompt_tokens=5)
    assert lease.reused_tokens == 2
    assert pool.stats().shadow_gained_s == pytest.approx(0.2)
    pool.release(lease)


def test_a_blocks_prefill_cost_leaves_out_the_fixed_part_of_a_forward_pass() -> None:
    """0.1 s a forward pass plus 1 ms a token: a reused 32-token block saves 32 ms, not the
    ratio of a short prefill's seconds to its tokens (a 20-token one: 6 ms a token)."""
    pool: KvBlockPool[str] = KvBlockPool(max_bytes=1000, tokens_per_block=32)
    pool.observe_prefill(seconds=0.1 + 0.001 * 20, computed_tokens=20)
    assert pool.block_cost_s == pytest.approx(0.12 / 20 * 32)  # one point: the ratio
    for tokens in (256, 20, 300, 24, 512, 18, 200):
        pool.observe_prefill(seconds=0.1 + 0.001 * tokens, computed_tokens=tokens)
    assert pool.block_cost_s == pytest.approx(0.032, rel=1e-6)


def test_no_credit_when_a_lower_tier_held_the_answer_unusable_or_the_read_is_no_request(
    tmp_path: Path,
) -> None:
    """An expired copy below: a larger L1 would have missed too (and the shadow forgets the
    key). A draft's or a row's lookup is not a request: nothing credited."""
    size = entry("x" * 100).size_bytes
    l1 = MemoryStore(4 * size)
    l2 = LmdbStore(tmp_path / "l2", max_bytes=1 << 24)
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)])
    for key in ("a", "b", "c", "d", "e"):  # "a" evicted into the shadow (one entry's span)
        l1.put(key, entry("x" * 100, generation_s=5.0))
    l2.put("a", CacheEntry("x" * 100, 0.0, ttl_s=1.0, generation_s=5.0))  # long expired
    assert cache.get("a") is None
    assert l1.stats().shadow_gained_s == 0.0
    l1.credit_miss("a")  # forgotten: nothing left to credit
    assert l1.stats().shadow_gained_s == 0.0
    l1.put("f", entry("x" * 100, generation_s=5.0))  # "b" evicted into the shadow
    assert cache.get("b", request=False) is None  # not a request's read: nothing credited
    assert l1.stats().shadow_gained_s == 0.0
    assert cache.get("b") is None  # a request's: its generation seconds
    assert l1.stats().shadow_gained_s == pytest.approx(5.0)
    l2.close()


def test_a_budget_cut_to_nothing_still_measures_its_latest_eviction() -> None:
    """A budget of 0 had a shadow of 0 bytes, which keeps nothing: its value read 0 for good,
    and under a total it was never given bytes again while any other budget showed some."""
    from tiercache.shadow import shadow_bytes

    shadow: ShadowQueue[str] = ShadowQueue(shadow_bytes(0))
    shadow.add("block", 4096, 0.5)
    assert shadow.credit("block") and shadow.gained_s == 0.5
