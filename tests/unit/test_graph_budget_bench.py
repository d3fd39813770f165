"""tiercache_dev.bench.graph_budget: one short run measures a scope with and without its graph
and prints what the budget charges for it."""

from __future__ import annotations

import pytest

from tiercache_dev.bench.graph_budget import main


def test_a_short_run_measures_both_ways_and_the_charge(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "600", "--queries", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 2  # the header and one size
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    assert cells[0] == "600"
    graph_ms, flat_ms, saved_ms, charged_mib = (float(c) for c in cells[1:5])
    assert graph_ms > 0 and flat_ms > 0
    assert saved_ms == pytest.approx(flat_ms - graph_ms, abs=2e-3)
    assert charged_mib > 2.5  # at least the graph's fixed part
