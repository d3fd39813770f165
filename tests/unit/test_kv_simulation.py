"""tiercache.kv_simulation (`tiercache simulate-kv`): prefix reuse, LRU and Belady on small
traces whose answers are worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.eviction import LruPolicy
from tiercache.kv_simulation import TraceError, read_trace, replay_belady, replay_policy


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
    assert lines == [
        "policy lru capacity 2 hit_ratio 0.0000",
        "policy belady capacity 2 hit_ratio 0.3333",
        "policy default capacity 2 hit_ratio 0.0000",
        "policy lru capacity 3 hit_ratio 0.5000",
        "policy belady capacity 3 hit_ratio 0.5000",
        "policy default capacity 3 hit_ratio 0.5000",
    ]
    assert main(["simulate-kv", "--trace", str(path), "--capacity-blocks", "0"]) == 2
    bad = ["simulate-kv", "--trace", str(path), "--capacity-blocks", "2", "--policy", "mru"]
    assert main(bad) == 2
    assert "unknown policy 'mru'" in capsys.readouterr().err
