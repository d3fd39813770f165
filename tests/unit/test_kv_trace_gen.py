"""tiercache_dev.perf.kv_trace: the generated KV-block trace is Mooncake's format, the same for a
seed, and its block ids stand for whole prefixes."""

from __future__ import annotations

from pathlib import Path

from tiercache.kv_simulation import read_trace
from tiercache_dev.perf import kv_trace


def test_the_trace_reads_back_is_seeded_and_its_ids_name_whole_prefixes(tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    assert kv_trace.main(["--out", str(out), "--requests", "3000", "--seed", "7"]) == 0
    trace = read_trace(out)
    assert trace == kv_trace.generate(3000, 7)
    assert trace != kv_trace.generate(3000, 8)
    parent: dict[int, int] = {}
    for blocks in trace:
        assert blocks and len(set(blocks)) == len(blocks)
        for before, block in zip([0, *blocks], blocks, strict=False):
            assert parent.setdefault(block, before) == before  # one prefix per id
    # sessions continue: most requests extend an earlier request's blocks, some share only
    # a system prompt's, and document sessions repeat shared documents
    earlier: set[tuple[int, ...]] = set()
    extended = 0
    for blocks in trace:
        extended += any(tuple(blocks[:-k]) in earlier for k in (1, 2, 3, 4))
        earlier.add(tuple(blocks))
    assert 0.4 < extended / len(trace) < 0.8
    firsts = {blocks[0] for blocks in trace}
    assert len(firsts) <= kv_trace.SYSTEM_PROMPTS
