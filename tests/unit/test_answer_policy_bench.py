"""The answer-tier benchmark's offline limits (tiercache_dev.bench.answer_policy): the cost
optimum is a real optimum (it equals Belady's hit count when every answer costs the same, and no
policy or rule saves more), and the replays count what they claim."""

from __future__ import annotations

import random

import pytest

from tiercache.eviction import GreedyDualFrequencyPolicy, LruPolicy
from tiercache_dev.bench.answer_policy import (
    CostBlind,
    next_uses,
    replay_cost_optimum,
    replay_fewest_misses,
    replay_store,
)


def zipf_trace(seed: int, length: int = 600, keys: int = 120) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(keys)]
    return rng.choices(range(keys), weights, k=length)


def test_next_uses() -> None:
    assert next_uses([1, 2, 1, 1, 3]) == [2, 5, 3, 5, 5]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("capacity", [1, 5, 20])
def test_with_equal_costs_the_cost_optimum_is_belady(seed: int, capacity: int) -> None:
    trace = zipf_trace(seed)
    costs = [1.0] * (max(trace) + 1)
    optimum = replay_cost_optimum(trace, capacity, costs)
    belady = replay_fewest_misses(trace, capacity, costs)
    assert optimum.hits == belady.hits
    assert optimum.saved == pytest.approx(belady.saved)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("capacity", [1, 5, 20])
def test_nothing_saves_more_than_the_cost_optimum(seed: int, capacity: int) -> None:
    trace = zipf_trace(seed)
    rng = random.Random(seed + 100)
    costs = [rng.lognormvariate(0.0, 1.5) for _ in range(max(trace) + 1)]
    optimum = replay_cost_optimum(trace, capacity, costs)
    others = [
        replay_fewest_misses(trace, capacity, costs),
        replay_store(trace, capacity, LruPolicy(), costs),
        replay_store(trace, capacity, GreedyDualFrequencyPolicy(capacity), costs),
        replay_store(trace, capacity, CostBlind(GreedyDualFrequencyPolicy(capacity)), costs),
    ]
    for other in others:
        assert other.saved <= optimum.saved + 1e-9
    # Belady has the most hits; the cost optimum trades hits for cost when costs differ
    assert others[0].hits >= optimum.hits
    assert others[0].saved < optimum.saved


def test_the_store_replay_counts_hits_and_their_cost() -> None:
    # one answer held, LRU: a b a a b -> only the fourth request (a, right after a) hits
    outcome = replay_store([0, 1, 0, 0, 1], 1, LruPolicy(), [2.0, 3.0])
    assert (outcome.hits, outcome.saved) == (1, 2.0)


def test_every_policy_gets_room_for_the_same_count_of_answers() -> None:
    """L1 adds GDSF's own bytes per entry to each size: a store sized by answers alone held
    half as many under gdsf as under the others, which the comparison then charged to gdsf."""
    from tiercache.eviction import named_policy
    from tiercache_dev.bench.answer_policy import CostBlind, replay_store

    trace = list(range(100)) * 2  # 100 distinct answers, asked twice in turn
    costs = [1.0] * 100
    for policy in (named_policy("gdsf"), named_policy("lru"), CostBlind(named_policy("gdsf"))):
        assert replay_store(trace, 100, policy, costs).hits == 100, policy
