"""tiercache_dev.perf.l2_eviction_stall: one short run times both modes; the early one's
evictions run ahead of the writes, the inline one's in them."""

from __future__ import annotations

import json
from pathlib import Path

from tiercache_dev.perf.l2_eviction_stall import main


def test_a_short_run_times_both_modes(tmp_path: Path) -> None:
    args = ["--map-mib", "16", "--answer-chars", "2000", "--rate", "1000", "--evictions", "1"]
    assert main([*args, "--rounds", "1", "--out-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "l2_eviction_stall.json").read_text())
    rows = {row["mode"]: row for row in summary["rows"]}
    assert set(rows) == {"inline", "early"}
    assert rows["inline"]["evictions_ahead"] == 0
    assert rows["early"]["evictions_ahead"] >= 1
    for row in rows.values():
        assert row["entries"] > 1000 and row["writes"] > 0
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
    text = (tmp_path / "l2_eviction_stall.md").read_text()
    assert text.splitlines()[-1].startswith("ratio early/inline slowest write")
