"""tiercache.kv_simulation (`tiercache simulate-kv`): prefix reuse, LRU and Belady on small
traces whose answers are worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.eviction import GreedyDualFrequencyPolicy, LruPolicy
from tiercache.kv_simulation import (
    POLICIES,
    TraceError,
    read_trace,
    replay_belady,
    replay_policy,
)


def test_reuse_stops_at_the_first_missing_block() -> None:
    trace = [[1, 2, 3], [1, 2, 3], [9, 2, 3]]  # the third's first block is new: no reuse at all
    for replay in (replay_policy(trace, 10, LruPolicy()), replay_belady(trace, 10)):
        assert (replay.hits, replay.blocks) == (3, 9)


def test_a_cycle_one_larger_than_the_pool_thrashes_lru_and_not_belady() -> None:
    trace = [[1], [2], [3], [1], [2], [3]]
    assert replay_policy(trace, 2, LruPolicy()).hits == 0
    # Belady keeps 1 and 2 and does not keep 3 (needed later than both): 1 and 2 hit
    assert replay_belady(trace, 2).hits == 2


def test_a_request_never_evicts_its_own_blocks() -> None:
    trace = [[1, 2, 3, 4], [1, 2], [1, 2, 3]]  # pool of 2: the first keeps 1 and 2 only
    for replay in (replay_policy(trace, 2, LruPolicy()), replay_belady(trace, 2)):
        assert replay.hits == 4  # [1, 2] twice; 3 was never kept


def test_bad_traces_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [1, "x"]}\n')
    with pytest.raises(TraceError, match=":2: 'hash_ids'"):
        read_trace(path)
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(path)
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "none.jsonl")


def test_the_command_prints_one_line_per_policy_and_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "hash_ids": ids} for ids in ([1], [2], [3], [1], [2], [3])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["simulate-kv", "--trace", str(path), "--capacity-blocks", "2", "3"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("policy ")]
    assert lines == [  # 6 blocks asked; a block is 512 tokens unless told
        "policy lru capacity 2 hit_ratio 0.0000 prefill_tokens_saved 0",
        "policy belady capacity 2 hit_ratio 0.3333 prefill_tokens_saved 1024",
        "policy default capacity 2 hit_ratio 0.0000 prefill_tokens_saved 0",
        "policy lru capacity 3 hit_ratio 0.5000 prefill_tokens_saved 1536",
        "policy belady capacity 3 hit_ratio 0.5000 prefill_tokens_saved 1536",
        "policy default capacity 3 hit_ratio 0.5000 prefill_tokens_saved 1536",
    ]
    tokens = ["--capacity-blocks", "3", "--block-tokens", "16"]
    assert main(["simulate-kv", "--trace", str(path), *tokens]) == 0
    assert (
        "policy lru capacity 3 hit_ratio 0.5000 prefill_tokens_saved 48" in capsys.readouterr().out
    )
    assert (
        main(["simulate-kv", "--trace", str(path), "--capacity-blocks", "3", "--block-tokens", "0"])
        == 2
    )
    assert "--block-tokens must be >= 1" in capsys.readouterr().err
    assert main(["simulate-kv", "--trace", str(path), "--capacity-blocks", "0"]) == 2
    bad = ["simulate-kv", "--trace", str(path), "--capacity-blocks", "2", "--policy", "mru"]
    assert main(bad) == 2
    assert "unknown policy 'mru'" in capsys.readouterr().err


def popular_beside_a_scan(rounds: int) -> list[list[int]]:
    """A popular two-block prefix asked for every fourth request, one-off two-block prompts
    between: LRU in a pool of 4 blocks loses the prefix to each scan of three."""
    trace: list[list[int]] = []
    fresh = 100
    for _ in range(rounds):
        trace.append([1, 2])
        for _ in range(3):
            trace.append([fresh, fresh + 1])
            fresh += 2
    return trace


def test_the_default_policy_keeps_a_popular_prefix_through_one_off_prompts() -> None:
    trace = popular_beside_a_scan(20)
    lru = replay_policy(trace, 4, LruPolicy())
    default = replay_policy(trace, 4, POLICIES["default"](4))
    gdsf = replay_policy(trace, 4, GreedyDualFrequencyPolicy(4))
    assert lru.hits == 0
    # the default starts in LRU's order and takes GDSF's once GDSF's shadow hits more: a few
    # repeats later than GDSF alone
    assert gdsf.hits - 2 * 3 <= default.hits <= gdsf.hits
    # the first repeats miss (its count is still below the pool's turnover), then all hit
    assert 2 * 19 > default.hits >= 2 * 15
    late = (
        replay_policy(trace, 4, POLICIES["default"](4)).hits
        - replay_policy(trace[: 10 * 4], 4, POLICIES["default"](4)).hits
    )
    assert late == 2 * 10  # every one of the last ten repeats
    assert default.hits <= replay_belady(trace, 4).hits
