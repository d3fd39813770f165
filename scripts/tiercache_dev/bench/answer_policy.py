"""Eviction policies for the answer tiers on the soak's realistic mix, against the offline optimum
(issue 19): hit ratio and recomputation saved, side by side.

Usage::

    python -m tiercache_dev.bench.answer_policy [--entries 8000] [--seeds 0,1,2]
        [--capacities 50,100,200,400,800,1600] [--pairs FILE]
        [--lengths TRACE.jsonl --prefill-weight 0.05] [--l2]

Builds the request stream `tiercache_dev.perf.soak` sends (its `build_mix`: four tenants, the
committed adapters, new questions, Zipf-popular exact repeats and rewordings) for each seed and
replays its exact keys (tenant, adapter, question) through L1 itself (`MemoryStore`, every
answer the same size, `--capacities` of them held) with each of
`tiercache.eviction.NAMED_POLICIES`, `gdsf` also told no cost (`gdsf-blind`: what weighing
generation seconds adds), oldest first one at a time (`oldest`), with `--l2` L2's own way (a
tenth of the store at once, ranked by `tiercache.exact.l2_values.L2Values` in a scratch folder,
`l2-gdsf`, or oldest first, `l2-oldest`), and against two offline limits: Belady's optimum
(fewest misses) and the optimum for recomputation saved (the most generation cost hit, the same
store with the future known; a minimum-cost flow, Carlisle and Lloyd's for weighted intervals).
A repeat of a held key is a hit; a rewording is a miss here (the exact tier never serves it).

What an answer costs: without `--lengths`, the same for every answer (the soak's answers are
all 8 tokens), so recomputation saved equals the hit ratio. With `--lengths`, a trace in
Mooncake's format (`input_length`, `output_length` per request: real prompt and answer lengths,
e.g. its FAST'25 conversation trace) gives each distinct question the lengths of one of its
requests (shuffled by the seed), and an answer costs `output_length + prefill_weight x
input_length` generated-token equivalents, stored as the entry's generation seconds (a prompt
token costs `--prefill-weight` of a generated one: the engine's ratio, which varies by engine and
batch; pass yours). Prints one table per seed (hit ratio and share of the cost saved; each
policy's ratio to LRU) and lines `policy <name> capacity <N> hit_ratio <x> saved <y>` for the
first seed. Seed 0 is the soak's own; the others are mixes no policy was tuned on.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.eviction import (
    NAMED_POLICIES,
    EvictionPolicy,
    GreedyDualFrequencyPolicy,
    OldestFirstPolicy,
)
from tiercache.exact.codec import CacheEntry
from tiercache.exact.l2_values import MIN_MAP_BYTES, L2Values
from tiercache.exact.stores import MemoryStore
from tiercache_dev.console import invocation
from tiercache_dev.paths import DEFAULT_PAIRS
from tiercache_dev.perf import soak

COST_SCALE = 1000  # the flow's costs are integers: answer costs in thousandths


def key_trace(entries: int, seed: int, pairs: Path) -> list[int]:
    """The mix's requests as keys, one int per (tenant, adapter, question) in first-asked order."""
    args = soak.parse_args(["--entries", str(entries), "--seed", str(seed), "--pairs", str(pairs)])
    ids: dict[tuple[str, str, str], int] = {}
    return [
        ids.setdefault((a.tenant, a.adapter, a.question), len(ids)) for a in soak.build_mix(args)
    ]


def read_lengths(path: Path) -> list[tuple[int, int]]:
    """(input_length, output_length) of every request of a Mooncake-format trace."""
    lengths = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                lengths.append((int(row["input_length"]), int(row["output_length"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"{path}:{number}: not a Mooncake request ({exc})") from None
    if not lengths:
        raise SystemExit(f"{path}: holds no requests")
    return lengths


def answer_costs(
    keys: int, lengths: list[tuple[int, int]] | None, prefill_weight: float, seed: int
) -> list[float]:
    """Each key's cost in generated-token equivalents (1.0 each without lengths)."""
    if lengths is None:
        return [1.0] * keys
    rng = random.Random(seed)
    drawn = [lengths[rng.randrange(len(lengths))] for _ in range(keys)]
    return [max(out + prefill_weight * prompt, 1e-3) for prompt, out in drawn]


@dataclass(frozen=True, slots=True)
class Outcome:
    hits: int
    saved: float  # cost of the requests served from the store

    def ratios(self, requests: int, total_cost: float) -> tuple[float, float]:
        return self.hits / requests, self.saved / total_cost


def replay_store(
    trace: Sequence[int], capacity: int, policy: EvictionPolicy[str], costs: Sequence[float]
) -> Outcome:
    """The trace through an L1 of `capacity` equal-size answers (whatever each policy holds per
    entry besides: every policy gets room for the same count, as the optimum is given it): a
    miss stores the answer with its cost as its generation seconds."""
    size = CacheEntry("", 0.0).size_bytes + int(getattr(policy, "entry_overhead_bytes", 0))
    store = MemoryStore(capacity * size, policy)
    hits, saved = 0, 0.0
    for index, key in enumerate(trace):
        name = str(key)
        if store.get(name) is not None:
            hits += 1
            saved += costs[key]
        else:
            store.put(name, CacheEntry("", float(index), generation_s=costs[key]))
    return Outcome(hits, saved)


def replay_l2(
    trace: Sequence[int], capacity: int, costs: Sequence[float], folder: Path | None
) -> Outcome:
    """The trace through a store evicting as L2 does: a tenth of its `capacity` equal-size
    answers at once when full, ranked by the real `L2Values` (in `folder`), or oldest first
    (`folder` None)."""
    size = CacheEntry("", 0.0).size_bytes
    values = None if folder is None else L2Values(folder, MIN_MAP_BYTES)
    held: dict[int, float] = {}  # key -> created (request index)
    hits, saved = 0, 0.0
    try:
        for index, key in enumerate(trace):
            name = str(key)
            if key in held:
                hits += 1
                saved += costs[key]
                if values is not None:
                    values.hit(name)
                continue
            if len(held) >= capacity:
                ages = sorted((str(k).encode(), created) for k, created in held.items())
                count = max(1, capacity // 10)
                chosen = None if values is None else values.nominate(ages, count)
                if chosen is None:
                    chosen = [k for k, _ in sorted(ages, key=lambda item: item[1])[:count]]
                for victim in chosen:
                    del held[int(victim)]
                if values is not None:
                    values.evicted(chosen)
            held[key] = float(index)
            if values is not None:
                values.admitted(name, size, costs[key], created_s=float(index))
    finally:
        if values is not None:
            values.close()
    return Outcome(hits, saved)


def next_uses(trace: Sequence[int]) -> list[int]:
    """next_uses[i]: the index of the next request for trace[i]'s key (len(trace): none)."""
    never = len(trace)
    upcoming: list[int] = [never] * len(trace)
    last: dict[int, int] = {}
    for index in range(len(trace) - 1, -1, -1):
        upcoming[index] = last.get(trace[index], never)
        last[trace[index]] = index
    return upcoming


def replay_cost_optimum(trace: Sequence[int], capacity: int, costs: Sequence[float]) -> Outcome:
    """The most cost a store of `capacity` answers can save with the future known (it may also
    not keep an answer): keeping a key from request i to its next request j saves that request's
    cost and takes one slot after requests i to j-1, so the optimum is the heaviest set of such
    intervals with at most `capacity` overlapping anywhere: a minimum-cost flow of `capacity`
    units along the requests, each interval an arc of capacity 1 and cost minus its saving."""
    import networkx as nx  # a dependency of torch; only this benchmark uses it

    upcoming = next_uses(trace)
    never = len(trace)
    graph = nx.DiGraph()
    graph.add_node(0, demand=-capacity)
    graph.add_node(never, demand=capacity)
    for index in range(never):
        graph.add_edge(index, index + 1, capacity=capacity, weight=0)
    intervals: dict[tuple[int, int], int] = {}
    for index, following in enumerate(upcoming):
        if following < never:
            intervals[(index, following)] = index
            # a parallel arc needs a node of its own (DiGraph: one arc per pair)
            middle = ("keep", index)
            weight = -round(costs[trace[following]] * COST_SCALE)
            graph.add_edge(index, middle, capacity=1, weight=weight)
            graph.add_edge(middle, following, capacity=1, weight=0)
    flow = nx.network_simplex(graph)[1]
    hits, saved = 0, 0.0
    for (index, following), _ in intervals.items():
        if flow[index].get(("keep", index), 0):
            hits += 1
            saved += costs[trace[following]]
    return Outcome(hits, saved)


def replay_fewest_misses(trace: Sequence[int], capacity: int, costs: Sequence[float]) -> Outcome:
    """Belady's optimum: keep the keys asked for soonest, and do not keep a new key needed later
    than every held one (the same rule as `tiercache.kv_simulation.replay_belady`, for one-key
    requests, also adding up the cost its hits save)."""
    upcoming = next_uses(trace)
    held: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries skipped
    hits, saved = 0, 0.0
    for index, key in enumerate(trace):
        following = upcoming[index]
        if key in held:
            hits += 1
            saved += costs[key]
        elif len(held) >= capacity:
            while heap and held.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)  # stale
            if not heap or -heap[0][0] <= following:
                continue  # every held key is needed sooner than this one: not kept
            del held[heapq.heappop(heap)[1]]
        held[key] = following
        heapq.heappush(heap, (-following, key))
    return Outcome(hits, saved)


def policies() -> dict[str, Callable[[int], EvictionPolicy[str]]]:
    made: dict[str, Callable[[int], EvictionPolicy[str]]] = dict(NAMED_POLICIES)
    made["gdsf-blind"] = lambda capacity: CostBlind(GreedyDualFrequencyPolicy(capacity))
    made["oldest"] = lambda capacity: OldestFirstPolicy()  # L2's, one eviction at a time
    return made


class CostBlind:
    """A policy told every admission without its cost: what weighing cost adds, measured."""

    def __init__(self, inner: EvictionPolicy[str]) -> None:
        self._inner = inner
        self.access = inner.access
        self.remove = inner.remove
        self.endorse = inner.endorse
        self.entry_overhead_bytes = getattr(inner, "entry_overhead_bytes", 0)
        limit = getattr(inner, "limit_sketch", None)
        if limit is not None:  # the store bounds its sketch as it bounds gdsf's own
            self.limit_sketch = limit
        self.nominate = inner.nominate
        self.clear = inner.clear

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def admit(
        self,
        key: str,
        size: int = 1,
        *,
        created_s: float = 0.0,
        cost_s: float = 0.0,
        group: int = 0,
    ) -> None:
        self._inner.admit(key, size, created_s=created_s, group=group)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=8000, help="requests per mix")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated mix seeds")
    parser.add_argument("--capacities", default="50,100,200,400,800,1600", help="answers held")
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="the soak's prompt pairs")
    parser.add_argument(
        "--lengths", type=Path, help="a Mooncake-format trace to draw answer lengths from"
    )
    parser.add_argument(
        "--prefill-weight",
        type=float,
        default=0.05,
        help="what a prompt token costs, in generated tokens (with --lengths)",
    )
    parser.add_argument(
        "--l2",
        action="store_true",
        help="also replay L2's batch eviction: its values (l2-gdsf) and oldest first",
    )
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    capacities = [int(c) for c in args.capacities.split(",")]
    lengths = read_lengths(args.lengths) if args.lengths else None
    made = policies()
    names = [*made, *(["l2-gdsf", "l2-oldest"] if args.l2 else []), "belady", "optimum"]
    print(f"`{invocation('tiercache_dev.bench.answer_policy', argv)}`\n")
    lines: list[str] = []
    for seed in seeds:
        trace = key_trace(args.entries, seed, args.pairs)
        costs = answer_costs(max(trace) + 1, lengths, args.prefill_weight, seed)
        total = sum(costs[key] for key in trace)
        print(f"mix seed {seed}: {len(trace)} requests, {len(costs)} distinct exact keys\n")
        print("| capacity | " + " | ".join(f"{n} hits / saved" for n in names) + " | saved / lru |")
        print("|---:|" + "---:|" * len(names) + "---|")
        for capacity in capacities:
            outcomes = {
                name: replay_store(trace, capacity, factory(capacity), costs)
                for name, factory in made.items()
            }
            if args.l2:
                with tempfile.TemporaryDirectory() as folder:
                    outcomes["l2-gdsf"] = replay_l2(trace, capacity, costs, Path(folder) / "v")
                outcomes["l2-oldest"] = replay_l2(trace, capacity, costs, None)
            outcomes["belady"] = replay_fewest_misses(trace, capacity, costs)
            outcomes["optimum"] = replay_cost_optimum(trace, capacity, costs)
            ratios = {name: o.ratios(len(trace), total) for name, o in outcomes.items()}
            cells = [f"{hit:.3f} / {saved:.3f}" for hit, saved in ratios.values()]
            lru_saved = ratios["lru"][1]
            over = ", ".join(
                f"{n} {ratios[n][1] / lru_saved:.2f}x" for n in names if n != "lru" and lru_saved
            )
            print(f"| {capacity} | " + " | ".join(cells) + f" | {over} |")
            if seed == seeds[0]:
                lines += [
                    f"policy {name} capacity {capacity} hit_ratio {hit:.4f} saved {saved:.4f}"
                    for name, (hit, saved) in ratios.items()
                ]
            sys.stdout.flush()
        print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
