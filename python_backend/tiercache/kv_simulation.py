"""Replay a KV-block trace against eviction policies (issue 19): `tiercache simulate-kv`.

The trace is Mooncake's format (kvcache-ai/Mooncake, `FAST25-release/traces/*.jsonl`): one JSON
object per request, its `hash_ids` the request's prompt as a list of KV block hashes (512 tokens
each), a block's hash standing for its whole prefix. A request reuses its leading cached blocks
and stops at the first missing one, as a paged KV cache with prefix reuse does; every block of
the request is then resident (the missing ones computed), and the request's own blocks are
never evicted to make room for each other (they are in use).

A policy is any `tiercache.eviction.EvictionPolicy` (the KV block pool's seam: the pool's default
runs under the name `default` too), or Belady's offline optimum, which knows every future
request and evicts the resident block whose next use is farthest away (never used again first):
the limit a policy is measured against. The block hit ratio is blocks reused over blocks asked.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.engine.kv_cache import default_kv_policy
from tiercache.errors import InvalidRequest
from tiercache.eviction import NAMED_POLICIES, EvictionPolicy

Trace = list[list[int]]


class TraceError(InvalidRequest):
    """The trace file is missing or a line is malformed (the message names the line)."""


def read_trace(path: Path | str) -> Trace:
    """Each request's `hash_ids`, in file order."""
    where = Path(path)
    try:
        lines = where.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TraceError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{where}: cannot read: {exc}") from None
    requests: Trace = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}:{number}: not JSON: {exc.msg}") from None
        blocks = row.get("hash_ids") if isinstance(row, dict) else None
        if not isinstance(blocks, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in blocks
        ):
            raise TraceError(f"{where}:{number}: 'hash_ids' must be a list of integers")
        requests.append(blocks)
    if not requests:
        raise TraceError(f"{where}: holds no requests")
    return requests


@dataclass(frozen=True, slots=True)
class Replay:
    policy: str
    capacity: int
    hits: int  # blocks reused
    blocks: int  # blocks asked

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


def _check_capacity(capacity: int) -> None:
    if capacity < 1:
        raise InvalidRequest(f"capacity must be >= 1 block, got {capacity}")


def reused(blocks: Sequence[int], resident: Container[int]) -> int:
    """How many of a request's leading blocks are resident (reuse stops at the first miss)."""
    count = 0
    for block in blocks:
        if block not in resident:
            break
        count += 1
    return count


def replay_policy(
    trace: Trace, capacity: int, policy: EvictionPolicy[int], name: str = "policy"
) -> Replay:
    """The trace through a pool of `capacity` blocks evicting in `policy`'s order, telling the
    policy of each request's blocks as `tiercache.engine.kv_cache.KvBlockPool` does: once per
    block, when the request ends, leaf first (an admission for a block it added, an access for
    one it reused); a block in use is never offered for eviction."""
    _check_capacity(capacity)
    resident: set[int] = set()
    hits = asked = 0
    for blocks in trace:
        asked += len(blocks)
        hits += reused(blocks, resident)
        in_use = set(blocks)
        told: list[tuple[int, bool]] = []  # (block, added by this request)
        for block in blocks:
            if block in resident:
                told.append((block, False))
                continue
            if len(resident) >= capacity:
                victims = policy.nominate(1, skip=in_use.__contains__)
                if not victims:
                    continue  # the request alone fills the pool: this block is not kept
                for victim in victims:
                    resident.discard(victim)
                    policy.remove(victim)
            resident.add(block)
            told.append((block, True))
        for block, added in reversed(told):
            if added:
                policy.admit(block, 1)
            else:
                policy.access(block)
    return Replay(name, capacity, hits, asked)


def replay_belady(trace: Trace, capacity: int) -> Replay:
    """The trace through a pool that evicts the block used again farthest in the future, and
    does not keep a new block that is needed later than every evictable one (optional
    admission: the optimum of a pool that may bypass, as Belady's MIN with bypass)."""
    _check_capacity(capacity)
    never = len(trace)
    # next_use[i][j]: the next request after i that asks for trace[i][j]'s block
    next_use: list[list[int]] = [[] for _ in trace]
    last_seen: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = [last_seen.get(block, never) for block in trace[i]]
        for block in trace[i]:
            last_seen[block] = i
    resident: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = asked = 0
    for i, blocks in enumerate(trace):
        asked += len(blocks)
        hits += reused(blocks, resident)
        in_use = set(blocks)
        for block, upcoming in zip(blocks, next_use[i], strict=True):
            if block not in resident and len(resident) >= capacity:
                held = []
                while heap:
                    negative, victim = heapq.heappop(heap)
                    if resident.get(victim) != -negative:
                        continue  # stale
                    if victim in in_use:
                        held.append((negative, victim))
                        continue
                    if -negative <= upcoming:  # the new block is needed later than any: skip it
                        held.append((negative, victim))
                        break
                    del resident[victim]
                    break
                for item in held:
                    heapq.heappush(heap, item)
                if len(resident) >= capacity:
                    continue  # everything resident is in use: this block is not kept
            resident[block] = upcoming
            heapq.heappush(heap, (-upcoming, block))
    return Replay("belady", capacity, hits, asked)


PolicyFactory = Callable[[int], EvictionPolicy[int]]
"""capacity in blocks -> a fresh policy (a policy may size itself by it, or ignore it)."""

POLICIES: dict[str, PolicyFactory] = {
    **NAMED_POLICIES,  # told the capacity
    # the KV block pool's default, built as the pool builds it (not told the capacity)
    "default": lambda capacity: default_kv_policy(),
}


def simulate(trace: Trace, capacities: Sequence[int], names: Sequence[str]) -> list[Replay]:
    """Every named policy (and `belady`) at every capacity."""
    results = []
    for capacity in capacities:
        for name in names:
            if name == "belady":
                results.append(replay_belady(trace, capacity))
            elif name in POLICIES:
                results.append(replay_policy(trace, capacity, POLICIES[name](capacity), name))
            else:
                known = ", ".join([*POLICIES, "belady"])
                raise InvalidRequest(f"unknown policy {name!r}; known: {known}")
    return results


def main_simulate_kv(args: Any) -> int:
    """`tiercache simulate-kv` on parsed arguments: prints a table per capacity, then one
    `policy <name> capacity <N> hit_ratio <x> prefill_tokens_saved <n>` line per run (the
    recomputation a hit saves: the reused blocks' prompt tokens); 0, or 2 on bad input."""
    import sys

    try:
        if args.block_tokens < 1:
            raise InvalidRequest(f"--block-tokens must be >= 1, got {args.block_tokens}")
        trace = read_trace(args.trace)
        names = list(dict.fromkeys(["lru", "belady", "default", *(args.policy or [])]))
        results = simulate(trace, args.capacity_blocks, names)
    except InvalidRequest as exc:
        print(f"tiercache simulate-kv: {exc.client_message()}", file=sys.stderr)
        return 2
    blocks = sum(len(r) for r in trace)
    print(f"trace {Path(args.trace).name}: {len(trace)} requests, {blocks} blocks asked")
    print("| capacity | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    by = {(r.policy, r.capacity): r for r in results}
    for capacity in args.capacity_blocks:
        cells = " | ".join(f"{by[(n, capacity)].hit_ratio:.3f}" for n in names)
        print(f"| {capacity} | {cells} |")
    for r in results:
        print(
            f"policy {r.policy} capacity {r.capacity} hit_ratio {r.hit_ratio:.4f} "
            f"prefill_tokens_saved {r.hits * args.block_tokens}"
        )
    return 0
