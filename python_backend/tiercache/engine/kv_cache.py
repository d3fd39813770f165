"""Paged prefix KV reuse with TensorRT-LLM's block semantics, independent of any engine or tensor
library (torch-free: the engine stores its own tensors as opaque payloads).

- A prompt is split into blocks of `tokens_per_block` tokens; only full blocks are cached.
- Each block's key is SHA-256 over its parent's key, a salt and its token ids, so a block stands
  for its whole prefix. The salt covers the model revision, the tenant scope and the adapter
  digest: reuse never crosses tenants, adapters or weights (vLLM's `hash_block_tokens` with its
  LoRA and cache-salt extra keys).
- Blocks form a trie: a block exists only below its parent. Eviction takes *leaves* only (a
  parent is never dropped before its children, which would strand them), and never a block
  pinned by a request (`KvLease`), in the order of an eviction policy (`default_kv_policy`:
  GreedyDual-Size-Frequency over a TinyLFU sketch, which keeps blocks asked for again over new
  ones, or recency, whichever a sampled shadow of each hits more; docs/kv_reuse.md).
- The pool is bounded in bytes; a block that does not fit after evicting every unpinned block is
  not cached, and the request goes on without it (never over the budget, never a failure).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NewType, TypeVar

from tiercache.budgets import Budget, cache_budget
from tiercache.errors import ConfigError
from tiercache.eviction import EvictionPolicy, ShadowChoicePolicy
from tiercache.log_throttle import LogThrottle
from tiercache.shadow import ShadowQueue, shadow_bytes
from tiercache.stats import top_share

log = logging.getLogger(__name__)

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest (32 bytes) of a block's parent key, salt and token ids."""

HashFn = Callable[[bytes], bytes]
"""bytes -> a digest of fixed length (the chain relies on fixed-width parent keys and salts)."""

P = TypeVar("P")

KV_HASH_VERSION = 1
_BLOCK_DOMAIN = b"tiercache-kv-block\x00"


def sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def kv_salt(
    model_revision: str, tenant_scope: str, adapter_digest: str, hash_fn: HashFn = sha256_digest
) -> bytes:
    """What, besides the tokens, changes a block's KV values: the weights (revision), the tenant
    (its scope HMAC, so two tenants never share blocks) and the LoRA adapter's content digest."""
    document = {
        "v": KV_HASH_VERSION,
        "revision": model_revision,
        "scope": tenant_scope,
        "adapter_digest": adapter_digest,
    }
    encoded = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hash_fn(encoded.encode("utf-8"))


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    salt: bytes,
    hash_fn: HashFn = sha256_digest,
) -> BlockHash:
    """The key of one block: hash of (domain, parent key or empty for the first block, salt,
    token ids as little-endian uint32). Parent and salt are fixed-width digests, so the encoding
    is unambiguous."""
    encoded = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return BlockHash(hash_fn(_BLOCK_DOMAIN + (parent or b"") + salt + encoded))


def block_hashes(
    token_ids: Sequence[int],
    tokens_per_block: int,
    salt: bytes,
    hash_fn: HashFn = sha256_digest,
) -> list[BlockHash]:
    """Chained keys of the full blocks of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = hash_block(parent, token_ids[start : start + tokens_per_block], salt, hash_fn)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class KvStats:
    """A snapshot of the pool's counters (cumulative) and its current size."""

    lookups: int  # acquire() calls
    hit_lookups: int  # ... that reused at least one token
    looked_up_blocks: int  # full prompt blocks asked for
    hit_blocks: int  # ... found in the pool
    reused_tokens: int  # prompt tokens served from the pool
    computed_tokens: int  # prompt tokens the engine had to compute
    inserted_blocks: int
    rejected_blocks: int  # not cached: no room even after evicting every unpinned block
    evictions: int
    evicted_reuses: int  # reuses the evicted blocks had had while held: the value given up
    blocks: int
    pinned_blocks: int
    bytes: int
    max_bytes: int
    tokens_per_block: int
    evicted_bytes: int = 0  # what evictions freed (with evicted_reuses: value per byte)
    # prefill seconds the misses on recently evicted blocks would have saved (cumulative), and
    # the bytes those blocks span (tiercache.shadow: with both, what one more byte saves)
    shadow_gained_s: float = 0.0
    shadow_bytes: int = 0
    block_cost_s: float = 0.0  # prefill seconds one block takes lately (`observe_prefill`)
    evict_s: float = 0.0  # time requests spent evicting to make room (cumulative): a stall

    @property
    def block_hit_rate(self) -> float:
        """Found blocks over looked-up blocks (0.0 before any lookup)."""
        return self.hit_blocks / self.looked_up_blocks if self.looked_up_blocks else 0.0

    @property
    def token_reuse_rate(self) -> float:
        """Reused prompt tokens over all prompt tokens looked up."""
        total = self.reused_tokens + self.computed_tokens
        return self.reused_tokens / total if total else 0.0


class _Block(Generic[P]):
    """A trie node: one block's payload; `children` and `refs` decide whether it may go."""

    __slots__ = ("key", "parent", "payload", "nbytes", "children", "refs", "reuses")

    def __init__(self, key: BlockHash, parent: _Block[P] | None, payload: P, nbytes: int) -> None:
        self.key = key
        self.parent = parent
        self.payload = payload
        self.nbytes = nbytes
        self.children = 0
        self.refs = 0
        self.reuses = 0  # requests that found it here after the one that added it

    @property
    def evictable(self) -> bool:
        return self.children == 0 and self.refs == 0


class KvLease(Generic[P]):
    """The blocks one request holds pinned, root first: those it reused (`hit_blocks`), then
    those it added. Give it back with `KvBlockPool.release` when the request ends."""

    __slots__ = (
        "admitted",
        "blocks",
        "broken",
        "hit_blocks",
        "prompt_tokens",
        "released",
        "reused_tokens",
    )

    def __init__(self, blocks: list[_Block[P]], prompt_tokens: int, reused_tokens: int) -> None:
        self.blocks = blocks
        self.admitted: set[BlockHash] = set()  # the blocks this lease added
        self.hit_blocks = len(blocks)
        self.prompt_tokens = prompt_tokens
        self.reused_tokens = reused_tokens
        self.broken = False  # a block could not be cached: no later block of this chain can be
        self.released = False

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    def payloads(self) -> list[P]:
        """The reused blocks' payloads, root first (they stay valid while the lease is held)."""
        return [block.payload for block in self.blocks[: self.hit_blocks]]


def default_kv_policy() -> ShadowChoicePolicy[Any]:
    """The pool's policy unless told otherwise: `ShadowChoicePolicy` (GDSF's order or LRU's,
    whichever its sampled shadows hit more), sizing its sketch and its shadows as the pool fills
    (the pool is bounded in bytes and does not know its block count up front). `tiercache
    simulate-kv` replays it under the name `default`."""
    return ShadowChoicePolicy()


class KvBlockPool(Generic[P]):
    """Prefix blocks bounded by `max_bytes`, evicted from the leaves, pinned while used.

    Not thread-safe: one engine thread calls it (the engine runs one request at a time).
    `policy` (default: `default_kv_policy()`) hears of each block once per request that uses it,
    when the request's lease is released: admitted (size: its bytes) if the request added it,
    accessed if it reused it; removed when evicted. Once, so that a frequency-aware policy counts
    requests (counted on pin and on unpin, a block reached the sketch's ceiling two or three
    times as fast). It nominates one victim at a time and never a block the pool keeps (pinned,
    or with children), since evicting a leaf can make its parent the next victim.
    """

    def __init__(
        self,
        max_bytes: int,
        tokens_per_block: int,
        policy: EvictionPolicy[BlockHash] | None = None,
    ) -> None:
        if tokens_per_block < 1:
            raise ConfigError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if max_bytes < 0:
            raise ConfigError(f"kv_pool_max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.tokens_per_block = tokens_per_block
        self._policy: EvictionPolicy[BlockHash] = (
            policy if policy is not None else default_kv_policy()
        )
        self._blocks: dict[BlockHash, _Block[P]] = {}
        self._bytes = 0
        self._pinned_bytes = 0
        self._pinned_blocks = 0
        self._lookups = 0
        self._hit_lookups = 0
        self._looked_up_blocks = 0
        self._hit_blocks = 0
        self._reused_tokens = 0
        self._computed_tokens = 0
        self._inserted = 0
        self._rejected = 0
        self._evictions = 0
        self._evicted_reuses = 0
        self._evicted_bytes = 0
        self._target: int | None = None  # a budget `resize` recorded for the next request
        self._shadow: ShadowQueue[BlockHash] = ShadowQueue(shadow_bytes(max_bytes))
        self.block_cost_s = 0.0
        self._fit = (0.0, 0.0, 0.0, 0.0, 0.0)  # decayed n, sum x, sum y, sum xx, sum xy
        self._evict_s = 0.0
        self._target_lock = threading.Lock()
        self._policy_failures = 0  # policy calls that raised (the pool went on without them)
        self._policy_log = LogThrottle()

    # ---- requests ---------------------------------------------------------------------------

    def settle_budget(self) -> None:
        """Take up a new budget `resize` recorded, evicting unpinned blocks down to it: on the
        engine thread, at each lookup (`acquire`) and at each request that looks nothing up
        (reuse switched off, a caller gone before its prefill), so a lowered budget is not
        left waiting for a lookup."""
        with self._target_lock:
            target, self._target = self._target, None
        if target is not None:
            self.max_bytes = target
            self._shadow.resize(shadow_bytes(target))
        if self._bytes > self.max_bytes:
            self._shrink()

    def acquire(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> KvLease[P]:
        """Pin the longest cached chain of `hashes` (a prompt's `block_hashes`) and count the
        lookup. The lease's `reused_tokens` leave at least one prompt token to compute, so the
        engine has logits for the next token: when every block of a prompt whose length is a
        multiple of the block size is cached, the last cached token is computed again."""
        if len(hashes) * self.tokens_per_block > prompt_tokens:
            raise ValueError(
                f"{len(hashes)} blocks of {self.tokens_per_block} tokens are more than the "
                f"{prompt_tokens} prompt tokens"
            )
        found: list[_Block[P]] = []
        for key in hashes:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._pin(block)
            block.reuses += 1
        # after the chain is pinned: shrinking first evicted the very prefix this request was
        # about to reuse, to compute it again and evict another for it
        self.settle_budget()
        for key in hashes[len(found) :]:  # the chain goes on among blocks evicted lately
            if not self._shadow.credit(key):
                break
        reused = min(len(found) * self.tokens_per_block, max(prompt_tokens - 1, 0))
        self._lookups += 1
        self._hit_lookups += reused > 0
        self._looked_up_blocks += len(hashes)
        self._hit_blocks += len(found)
        self._reused_tokens += reused
        self._computed_tokens += prompt_tokens - reused
        return KvLease(found, prompt_tokens, reused)

    def insert(
        self, lease: KvLease[P], key: BlockHash, nbytes: int, make_payload: Callable[[], P]
    ) -> bool:
        """Add the block that follows `lease`'s last block (root when the lease is empty) and pin
        it in the lease. `make_payload` is called only if the block is admitted. Returns whether
        the block is now cached; False (nothing evicted) when it cannot fit even after evicting
        every unpinned block, and then for every later block of this lease."""
        if lease.released:
            raise ValueError("insert into a released lease")
        parent = lease.blocks[-1] if lease.blocks else None
        existing = self._blocks.get(key)
        if existing is not None and not lease.broken:
            if existing.parent is not parent:
                raise ValueError("block key already cached under another parent")
            self._pin(existing)
            existing.reuses += 1
            lease.blocks.append(existing)
            return True
        if lease.broken or not self._make_room(nbytes):
            lease.broken = True
            self._rejected += 1
            return False
        block = _Block(key, parent, make_payload(), nbytes)
        self._blocks[key] = block
        self._shadow.discard(key)
        self._bytes += nbytes
        lease.admitted.add(key)  # told to the policy at release: pinned until then anyway
        if parent is not None:
            parent.children += 1
        self._pin(block)
        lease.blocks.append(block)
        self._inserted += 1
        return True

    def release(self, lease: KvLease[P]) -> None:
        """Unpin the lease's blocks and tell the policy of each: an admission for a block this
        lease added (a pinned block cannot be evicted, so the policy needs to know of it only
        now), an access for one it reused; a second release does nothing.

        Leaf first, so that every unpinned block was used after its descendants: the least
        recently used unpinned block is then a leaf, and the LRU policy finds its victim without
        walking past ancestors. The order within one lease never decides between two victims:
        its blocks form one chain, of which at most one is a leaf. Every block is unpinned
        before the policy hears of any: a policy that raises part way (out of memory while its
        sketch grows) cannot leave the rest pinned for ever."""
        if lease.released:
            return
        lease.released = True
        for block in lease.blocks:
            self._unpin(block)
        for block in reversed(lease.blocks):
            try:
                if block.key in lease.admitted:
                    self._policy.admit(block.key, block.nbytes)
                else:
                    self._policy.access(block.key)
            except Exception:  # noqa: BLE001 - the pool stays usable: `_victim` finds such blocks
                self._policy_failed("telling the policy of a released block")

    # ---- queries ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def pinned(self, key: BlockHash) -> bool:
        """Whether the block under `key` is held by a request now (False if not cached)."""
        block = self._blocks.get(key)
        return block is not None and block.refs > 0

    def stats(self) -> KvStats:
        return KvStats(
            lookups=self._lookups,
            hit_lookups=self._hit_lookups,
            looked_up_blocks=self._looked_up_blocks,
            hit_blocks=self._hit_blocks,
            reused_tokens=self._reused_tokens,
            computed_tokens=self._computed_tokens,
            inserted_blocks=self._inserted,
            rejected_blocks=self._rejected,
            evictions=self._evictions,
            evicted_reuses=self._evicted_reuses,
            blocks=len(self._blocks),
            pinned_blocks=self._pinned_blocks,
            bytes=self._bytes,
            max_bytes=self.max_bytes,
            tokens_per_block=self.tokens_per_block,
            evicted_bytes=self._evicted_bytes,
            shadow_gained_s=self._shadow.gained_s,
            shadow_bytes=self._shadow.bytes,
            block_cost_s=self.block_cost_s,
            evict_s=self._evict_s,
        )

    def hit_skew(self, hottest: float = 0.01) -> float:
        """The share of the held blocks' reuses taken by the `hottest` fraction of them (at least
        one block): the seeds' cache-skew-ratio. 1.0 when one block in a hundred takes every
        reuse, about `hottest` when reuses spread evenly; 0.0 before any reuse. O(n log k)."""
        return top_share([block.reuses for block in self._blocks.values()], hottest)

    # ---- internals --------------------------------------------------------------------------

    def _pin(self, block: _Block[P]) -> None:
        if block.refs == 0:
            self._pinned_blocks += 1
            self._pinned_bytes += block.nbytes
        block.refs += 1

    def _unpin(self, block: _Block[P]) -> None:
        if block.refs <= 0:
            raise RuntimeError("KV block unpinned more often than pinned")
        block.refs -= 1
        if block.refs == 0:
            self._pinned_blocks -= 1
            self._pinned_bytes -= block.nbytes

    def _kept(self, key: BlockHash) -> bool:
        """Whether the block under `key` cannot go now: pinned, or a parent."""
        return not self._blocks[key].evictable

    def resize(self, max_bytes: int) -> int:
        """A new byte budget (tiercache.budgets, from its own thread); returns it. The pool
        belongs to the engine thread, so the budget is only recorded here and takes effect,
        evicting unpinned blocks down to it, when the next request starts (`acquire`): a
        budget changing under a request's insertion would strand it."""
        if max_bytes < 0:
            raise ConfigError(f"kv_pool_max_bytes must be >= 0, got {max_bytes}")
        with self._target_lock:
            self._target = max_bytes
        return max_bytes

    def shadow_reading(self) -> tuple[float, float]:
        """(prefill seconds its shadow's hits saved, cumulative; the bytes it spans): a
        budget's `ShadowValue` reads it (plain numbers, read from the budget thread)."""
        return self._shadow.gained_s, float(self._shadow.bytes)

    def observe_prefill(self, seconds: float, computed_tokens: int) -> None:
        """The engine computed `computed_tokens` prompt tokens in `seconds`. What one more
        block costs to compute (`block_cost_s`, what reusing it saves) is the slope of a line
        fitted to these (seconds = fixed + per-token x tokens, recent ones weighing most): a
        prefill has a fixed part (a forward pass, attention over the reused prefix) that a
        reused block does not save; while the tokens seen vary too little for a slope, the
        ratio of the two, an upper bound."""
        if computed_tokens <= 0 or seconds <= 0:
            return
        decay = 0.95
        n, sx, sy, sxx, sxy = (decay * v for v in self._fit)
        x = float(computed_tokens)
        self._fit = (n + 1, sx + x, sy + seconds, sxx + x * x, sxy + x * seconds)
        n, sx, sy, sxx, sxy = self._fit
        spread = sxx - sx * sx / n
        if spread > 1.0 * n * self.tokens_per_block**2:  # tokens vary by about a block or more
            slope = (sxy - sx * sy / n) / spread
            if slope > 0:
                self.block_cost_s = slope * self.tokens_per_block
                return
        self.block_cost_s = sy / sx * self.tokens_per_block

    @property
    def budget_bytes(self) -> int:
        """The budget in force at the next request (a pending `resize`, else `max_bytes`)."""
        with self._target_lock:
            return self.max_bytes if self._target is None else self._target

    def _victim(self) -> _Block[P] | None:
        """The next block to evict: the policy's nominee when it names an unpinned leaf, else
        (a policy that failed to hear of a block, or names one it was told to skip) any
        unpinned leaf the pool holds, so a broken policy degrades the order, never the pool;
        None when every block is pinned or a parent."""
        try:
            victims = self._policy.nominate(1, skip=self._kept)
        except Exception:  # noqa: BLE001 - as below
            victims = []
            self._policy_failed("asking the policy for a victim")
        block = self._blocks.get(victims[0]) if victims else None
        if block is not None and block.evictable:
            return block
        found = next((b for b in self._blocks.values() if b.evictable), None)
        if found is not None:
            self._policy_failed("the policy named no evictable block where the pool holds one")
        return found

    def _policy_failed(self, what: str) -> None:
        self._policy_failures += 1
        if self._policy_log.ready():
            log.exception(
                "KV pool: %s failed (%d failures so far; the pool goes on in its own order)",
                what,
                self._policy_failures,
            )

    def _shrink(self) -> None:
        """Evict unpinned blocks, the policy's order, until the pool is within its budget or
        only pinned blocks (and their parents) are left."""
        began = time.perf_counter()
        try:
            while self._bytes > self.max_bytes:
                victim = self._victim()
                if victim is None:
                    return
                self._evict(victim)
        finally:
            self._evict_s += time.perf_counter() - began

    def _make_room(self, nbytes: int) -> bool:
        """Evict the policy's victims among unpinned leaves until `nbytes` more fit; False,
        evicting nothing, if they cannot fit even with every unpinned block gone. Every ancestor
        of a pinned block is pinned (leases pin whole chains from the root), so all unpinned
        blocks are reachable by peeling leaves (`_victim` falls back to that when the policy
        names none: a policy that failed once broke every later insert)."""
        if self._pinned_bytes + nbytes > self.max_bytes:
            return False
        if self._bytes + nbytes <= self.max_bytes:
            return True
        began = time.perf_counter()
        try:
            while self._bytes + nbytes > self.max_bytes:
                victim = self._victim()
                if victim is None:  # only pinned bytes and their parents: not cached
                    return False
                self._evict(victim)
        finally:
            self._evict_s += time.perf_counter() - began
        return True

    def _evict(self, block: _Block[P]) -> None:
        del self._blocks[block.key]
        self._bytes -= block.nbytes
        self._evictions += 1
        self._evicted_reuses += block.reuses
        self._evicted_bytes += block.nbytes
        self._shadow.add(block.key, block.nbytes, self.block_cost_s)
        parent = block.parent
        if parent is not None:  # before the policy hears of it: one that raises keeps no parent
            parent.children -= 1
        try:
            self._policy.remove(block.key)
        except Exception:  # noqa: BLE001 - the pool's own count is already right
            self._policy_failed("telling the policy of an eviction")


def kv_pool_budget(pool: KvBlockPool[Any], floor_bytes: int, ceiling_bytes: int) -> Budget:
    """The KV pool's budget: between its floor and its fixed size, valued by what one more
    byte would save (prefill of blocks it evicted lately, asked for again; a smaller budget is
    applied by the engine thread, at the next request, so what it still holds counts as
    `held`: `KvBlockPool.resize`)."""
    return cache_budget(
        "kv_pool", floor_bytes, ceiling_bytes, pool.resize, pool.shadow_reading,
        lambda: pool.stats().bytes,
    )  # fmt: skip
