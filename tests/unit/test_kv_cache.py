"""The prefix KV block pool (tiercache.engine.kv_cache): keys, trie, LRU leaves, pins, budget.

Pure core: payloads are strings and sizes are given.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence

import pytest

from tiercache.engine.kv_cache import (
    BlockHash,
    KvBlockPool,
    KvLease,
    block_hashes,
    hash_block,
    kv_salt,
)
from tiercache.errors import ConfigError
from tiercache.eviction import LruPolicy, SkipKey, take_victims

B = 4  # tokens per block
SALT = kv_salt("rev1", "tenant-a", "")


def make_pool(max_bytes: int = 1000) -> KvBlockPool[str]:
    return KvBlockPool(max_bytes, B)


def run(
    pool: KvBlockPool[str], tokens: Sequence[int], salt: bytes = SALT, nbytes: int = 10
) -> KvLease[str]:
    """One request as the engine makes it: acquire, insert the new full blocks, release."""
    hashes = block_hashes(tokens, B, salt)
    lease = pool.acquire(hashes, len(tokens))
    for index in range(len(lease.blocks), len(hashes)):
        if not pool.insert(lease, hashes[index], nbytes, lambda i=index: f"block{i}"):
            break
    pool.release(lease)
    return lease


def test_keys_chain_the_parent_and_cover_only_full_blocks() -> None:
    tokens = list(range(11))
    hashes = block_hashes(tokens, B, SALT)
    assert len(hashes) == 2  # 11 tokens: two full blocks, the last 3 tokens have no key
    assert hashes[0] == hash_block(None, tokens[:4], SALT)
    assert hashes[1] == hash_block(hashes[0], tokens[4:8], SALT)
    # The same block after another first block has another key: a key stands for its prefix.
    other = block_hashes([99, 1, 2, 3] + tokens[4:8], B, SALT)
    assert other[1] != hashes[1]
    assert block_hashes(tokens[:3], B, SALT) == []
    assert all(len(h) == 32 for h in hashes)


def test_keys_are_sha256_and_stable() -> None:
    """SHA-256 over domain, parent, salt and little-endian uint32 tokens (never Python's hash)."""
    expected = hashlib.sha256(
        b"tiercache-kv-block\x00" + SALT + (1).to_bytes(4, "little") + (2).to_bytes(4, "little")
    ).digest()
    assert hash_block(None, [1, 2], SALT) == expected
    calls: list[bytes] = []

    def fake_hash(data: bytes) -> bytes:
        calls.append(data)
        return hashlib.sha256(data).digest()

    block_hashes([1, 2, 3, 4], B, SALT, fake_hash)
    assert len(calls) == 1 and calls[0].startswith(b"tiercache-kv-block")


def test_salt_separates_tenants_adapters_and_revisions() -> None:
    salts = {
        kv_salt("rev1", "tenant-a", ""),
        kv_salt("rev1", "tenant-b", ""),
        kv_salt("rev1", "tenant-a", "adapter-digest"),
        kv_salt("rev2", "tenant-a", ""),
    }
    assert len(salts) == 4
    tokens = list(range(8))
    keys = {tuple(block_hashes(tokens, B, salt)) for salt in salts}
    assert len(keys) == 4


def test_second_request_reuses_the_shared_prefix_only() -> None:
    pool = make_pool()
    first = run(pool, list(range(10)))  # blocks [0-3], [4-7]; tokens 8, 9 not cached
    assert (first.reused_tokens, first.computed_tokens) == (0, 10)
    assert len(pool) == 2
    second = run(pool, [0, 1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 53, 54])
    assert (second.reused_tokens, second.computed_tokens) == (8, 5)
    assert second.hit_blocks == 2
    assert len(pool) == 3  # its third block joined
    diverging = run(pool, [0, 1, 2, 3, 9, 9, 9, 9, 9])
    assert (diverging.reused_tokens, diverging.computed_tokens) == (4, 5)


def test_other_tenant_or_adapter_never_reuses() -> None:
    pool = make_pool()
    tokens = list(range(12))
    run(pool, tokens)
    assert run(pool, tokens, kv_salt("rev1", "tenant-b", "")).reused_tokens == 0
    assert run(pool, tokens, kv_salt("rev1", "tenant-a", "digest")).reused_tokens == 0
    assert run(pool, tokens + [1]).reused_tokens == 12


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    pool = make_pool()
    run(pool, list(range(8)))
    lease = run(pool, list(range(8)))
    assert (lease.hit_blocks, lease.reused_tokens, lease.computed_tokens) == (2, 7, 1)
    assert lease.payloads() == ["block0", "block1"]


def test_acquire_rejects_more_blocks_than_the_prompt_holds() -> None:
    pool = make_pool()
    with pytest.raises(ValueError):
        pool.acquire(block_hashes(list(range(8)), B, SALT), 7)


def test_eviction_takes_lru_leaves_only() -> None:
    pool = KvBlockPool[str](40, B, policy=LruPolicy())  # four blocks of 10 bytes
    a = list(range(100, 112))  # a chain of 3 blocks
    run(pool, a)
    run(pool, list(range(200, 204)))  # one block, used after the chain
    chain = block_hashes(a, B, SALT)
    # Released leaf first, the chain's leaf is its least recently used block: it goes first,
    # then its parent, never the root before its children.
    run(pool, list(range(300, 304)))
    assert chain[2] not in pool and chain[1] in pool and chain[0] in pool
    run(pool, list(range(400, 404)))
    assert chain[1] not in pool and chain[0] in pool
    run(pool, list(range(500, 504)))
    assert chain[0] not in pool
    assert pool.stats().evictions == 3


class MostRecentFirst(LruPolicy[BlockHash]):
    """Nominates the most recently told block first: a chain's root, told last at release."""

    def nominate(
        self, count: int = 1, size: int = 0, skip: SkipKey[BlockHash] | None = None
    ) -> list[BlockHash]:
        ranked = [(key, 1) for key in reversed(self._order)]
        return take_victims(ranked, count, size, skip)


def test_the_pool_never_evicts_a_parent_whatever_its_policy_ranks_first() -> None:
    pool = KvBlockPool[str](30, B, policy=MostRecentFirst())  # three blocks of 10 bytes
    a = list(range(100, 112))
    run(pool, a)  # the root is ranked first, then its child: both are parents
    chain = block_hashes(a, B, SALT)
    run(pool, list(range(300, 304)))
    assert chain[2] not in pool and chain[1] in pool and chain[0] in pool


def test_recent_use_protects_a_block() -> None:
    pool = KvBlockPool[str](20, B, policy=LruPolicy())
    old, newer = list(range(4)), list(range(10, 14))
    run(pool, old)
    run(pool, newer)
    run(pool, old + [7])  # touches `old`: `newer` is now the least recently used
    run(pool, list(range(20, 24)))
    assert block_hashes(old, B, SALT)[0] in pool
    assert block_hashes(newer, B, SALT)[0] not in pool


def test_pinned_blocks_are_never_evicted_and_a_block_without_room_is_not_cached() -> None:
    pool = make_pool(max_bytes=30)
    tokens = list(range(8))
    hashes = block_hashes(tokens, B, SALT)
    holder = pool.acquire(hashes, len(tokens))
    assert pool.insert(holder, hashes[0], 10, lambda: "a")
    assert pool.insert(holder, hashes[1], 10, lambda: "b")
    # 20 bytes pinned: a 15-byte block cannot fit without evicting them, so it is not cached.
    other = block_hashes(list(range(50, 54)), B, SALT)
    lease = pool.acquire(other, 4)
    made: list[str] = []
    assert not pool.insert(lease, other[0], 15, lambda: made.append("x") or "x")
    assert made == []  # the payload is never built for a block that is not admitted
    assert hashes[0] in pool and hashes[1] in pool and other[0] not in pool
    # A later block of a chain whose block was refused is refused too (it would have no parent).
    assert not pool.insert(lease, BlockHash(b"\x01" * 32), 1, lambda: "y")
    pool.release(lease)
    assert pool.stats().rejected_blocks == 2
    pool.release(holder)
    # Unpinned now: the same block fits by evicting the LRU leaf.
    lease = pool.acquire(other, 4)
    assert pool.insert(lease, other[0], 15, lambda: "x")
    pool.release(lease)
    assert hashes[1] not in pool and hashes[0] in pool
    assert pool.stats().bytes <= 30


def test_a_block_larger_than_the_budget_evicts_nothing() -> None:
    pool = make_pool(max_bytes=30)
    run(pool, list(range(8)))
    lease = run(pool, list(range(50, 54)), nbytes=31)
    assert lease.reused_tokens == 0
    assert len(pool) == 2 and pool.stats().evictions == 0
    empty = make_pool(max_bytes=0)  # caches nothing, and still serves
    assert not empty.insert(empty.acquire([], 1), BlockHash(b"k" * 32), 1, lambda: "z")


def test_release_is_idempotent_and_insert_after_release_fails() -> None:
    pool = make_pool()
    lease = run(pool, list(range(4)))
    pool.release(lease)
    assert pool.stats().pinned_blocks == 0
    with pytest.raises(ValueError):
        pool.insert(lease, BlockHash(b"k" * 32), 1, lambda: "z")


def test_a_policy_that_raises_leaves_the_pool_usable() -> None:
    """Every block is unpinned before the policy hears of any: a policy failing part way
    (MemoryError while its sketch grows) left the blocks it had not reached pinned for ever.
    And the pool goes on: blocks the policy never heard of are still evicted (in the pool's
    own order) when room is needed or the budget shrinks; an insert that needed room raised
    for good, and a smaller budget never took hold."""

    class Failing(LruPolicy[BlockHash]):
        def admit(self, key: BlockHash, size: int = 1, **kwargs: object) -> None:
            raise MemoryError("the sketch could not grow")

    pool: KvBlockPool[str] = KvBlockPool(30, B, policy=Failing())
    hashes = block_hashes(list(range(12)), B, SALT)
    lease = pool.acquire(hashes, 12)
    for index, key in enumerate(hashes):
        assert pool.insert(lease, key, 10, lambda i=index: f"block{i}")
    pool.release(lease)  # the policy raised at every admission: logged, not raised
    stats = pool.stats()
    assert stats.pinned_blocks == 0 and pool._pinned_bytes == 0  # noqa: SLF001
    pool.release(lease)  # a second release still does nothing
    other = block_hashes(list(range(100, 112)), B, SALT)
    second = pool.acquire(other, 12)
    assert pool.insert(second, other[0], 10, lambda: "other0")  # room made without the policy
    assert pool.stats().bytes <= 30
    pool.release(second)
    pool.resize(10)
    pool.release(pool.acquire(other[:1], 12))  # the budget takes hold at the next request
    assert pool.stats().bytes <= 10


def test_a_pending_cut_keeps_the_prefix_the_arriving_request_reuses() -> None:
    """The budget cut waiting for the next request was applied before its chain was pinned:
    the very prefix it was about to reuse was evicted, computed again, and stored by evicting
    another."""
    pool = make_pool(max_bytes=40)
    first = block_hashes(list(range(8)), B, SALT)  # two blocks, used first (LRU's victim)
    second = block_hashes(list(range(50, 58)), B, SALT)
    for hashes in (first, second):
        lease = pool.acquire(hashes, 9)
        for index, key in enumerate(hashes):
            assert pool.insert(lease, key, 10, lambda i=index: f"b{i}")
        pool.release(lease)
    pool.resize(20)
    lease = pool.acquire(first, 9)
    assert lease.reused_tokens == 8  # kept: the other prompt's blocks went instead
    pool.release(lease)
    assert all(key in pool for key in first) and not any(key in pool for key in second)


def test_byte_budget_is_never_exceeded_under_random_load() -> None:
    rng = random.Random(7)
    budget = 100
    pool = make_pool(max_bytes=budget)
    held: list[KvLease[str]] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(12)]
    for _ in range(400):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        hashes = block_hashes(tokens, B, SALT)
        lease = pool.acquire(hashes, len(tokens))
        assert lease.reused_tokens + lease.computed_tokens == len(tokens)
        for index in range(len(lease.blocks), len(hashes)):
            pool.insert(lease, hashes[index], rng.randrange(5, 25), lambda: "p")
            assert pool.stats().bytes <= budget
        held.append(lease)
        if len(held) > 2 or rng.random() < 0.5:  # up to three requests in flight
            pool.release(held.pop(rng.randrange(len(held))))
    for lease in held:
        pool.release(lease)
    stats = pool.stats()
    assert stats.bytes <= budget and stats.pinned_blocks == 0
    assert stats.evictions > 0 and stats.hit_blocks > 0


class CountingSkips(LruPolicy[BlockHash]):
    """LRU that counts the keys it passes over because the pool keeps them, and those of them
    that are not pinned (kept only as parents)."""

    def __init__(self, pool: Callable[[], KvBlockPool[str]]) -> None:
        super().__init__()
        self.pool = pool
        self.skipped = 0
        self.skipped_unpinned = 0

    def nominate(
        self, count: int = 1, size: int = 0, skip: SkipKey[BlockHash] | None = None
    ) -> list[BlockHash]:
        def counted(key: BlockHash) -> bool:
            kept = skip is not None and skip(key)
            self.skipped += kept
            self.skipped_unpinned += kept and not self.pool().pinned(key)
            return kept

        return super().nominate(count, size, counted)


def test_the_lru_victim_is_found_without_walking_past_unpinned_ancestors() -> None:
    """Leases tell the policy of their blocks at release, leaf first, so the least recently used
    unpinned block is always a leaf: with one request at a time (the engine's way) the policy
    passes over no ancestor it must keep (a root-first release made the pool about twice as
    slow). It does pass over the running request's own pinned blocks, which were last used by
    an earlier request (at most the request's reused blocks per victim)."""
    rng = random.Random(3)
    holder: list[KvBlockPool[str]] = []
    policy = CountingSkips(lambda: holder[0])
    pool: KvBlockPool[str] = KvBlockPool(200, B, policy=policy)
    holder.append(pool)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(8, 60))] for _ in range(10)]
    for _ in range(300):
        run(pool, rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(9))])
    assert pool.stats().evictions > 100
    assert policy.skipped > 0 and policy.skipped_unpinned == 0


def test_stats_count_lookups_blocks_and_tokens() -> None:
    pool = make_pool()
    run(pool, list(range(9)))
    run(pool, list(range(9)))
    run(pool, [7] * 3)
    stats = pool.stats()
    assert (stats.lookups, stats.hit_lookups) == (3, 1)
    assert (stats.looked_up_blocks, stats.hit_blocks) == (4, 2)
    assert (stats.reused_tokens, stats.computed_tokens) == (8, 9 + 1 + 3)
    assert (stats.inserted_blocks, stats.blocks, stats.bytes) == (2, 2, 20)
    assert stats.block_hit_rate == 0.5
    assert stats.token_reuse_rate == pytest.approx(8 / 21)
    assert (stats.max_bytes, stats.tokens_per_block) == (1000, B)


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        KvBlockPool(100, 0)
    with pytest.raises(ConfigError):
        KvBlockPool(-1, 4)


def test_stats_count_the_reuses_evicted_blocks_had() -> None:
    pool = KvBlockPool[str](20, B, policy=LruPolicy())  # two blocks of 10 bytes
    run(pool, list(range(9)))  # two blocks
    run(pool, list(range(9)))  # reuses both
    run(pool, list(range(9)))  # and again
    assert pool.stats().evicted_reuses == 0
    run(pool, list(range(100, 109)))  # evicts both, each reused twice
    stats = pool.stats()
    assert (stats.evictions, stats.evicted_reuses) == (2, 4)


def test_hit_skew_is_the_hottest_one_percents_share_of_reuses() -> None:
    pool = make_pool(10_000)
    assert pool.hit_skew() == 0.0  # nothing reused yet
    for start in range(0, 400, 4):  # 100 one-block prompts, each reused once
        run(pool, list(range(start, start + 5)))
        run(pool, list(range(start, start + 5)))
    assert pool.hit_skew() == pytest.approx(1 / 100)  # spread evenly: the top block's one reuse
    for _ in range(99):
        run(pool, [0, 1, 2, 3, 4])  # one block takes 99 more
    assert pool.hit_skew() == pytest.approx(100 / 199)
