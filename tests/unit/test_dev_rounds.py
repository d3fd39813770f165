"""tiercache_dev.rounds: the serpentine order of interleaved rounds, per-round ratios with their
spread, and the background load a benchmark can start beside itself."""

from __future__ import annotations

import time

import psutil
import pytest

from tiercache_dev.rounds import BackgroundLoad, Spread, paired_ratio, serpentine


def test_serpentine_alternates_direction() -> None:
    order = list(serpentine(["a", "b", "c"], 3))
    assert order == [
        (1, "a"), (1, "b"), (1, "c"),
        (2, "c"), (2, "b"), (2, "a"),
        (3, "a"), (3, "b"), (3, "c"),
    ]  # fmt: skip


def test_serpentine_cancels_a_linear_drift() -> None:
    # A load rising by one unit per slot: over two rounds each configuration's mean slot is equal.
    slots: dict[str, list[int]] = {}
    for slot, (_, config) in enumerate(serpentine(["a", "b", "c"], 2)):
        slots.setdefault(config, []).append(slot)
    assert {sum(v) for v in slots.values()} == {5}


def test_serpentine_refuses_zero_rounds() -> None:
    with pytest.raises(ValueError, match="rounds"):
        list(serpentine(["a"], 0))


def test_paired_ratio_is_per_round() -> None:
    # Round 2 ran on a machine twice as slow for both: the per-round ratio does not move.
    spread = paired_ratio({1: 1.2, 2: 2.4, 3: 1.1}, {1: 1.0, 2: 2.0, 3: 1.0})
    assert spread is not None
    assert spread.values == pytest.approx((1.2, 1.2, 1.1))
    assert spread.median == pytest.approx(1.2)
    assert (spread.low, spread.high) == pytest.approx((1.1, 1.2))
    assert spread.text() == "1.20 (1.10-1.20, 3 rounds)"


def test_paired_ratio_skips_unpaired_and_zero_rounds() -> None:
    spread = paired_ratio({1: 2.0, 2: 3.0, 4: 5.0}, {1: 1.0, 2: 0.0, 3: 1.0})
    assert spread is not None and spread.values == (2.0,)
    assert spread.text() == "2.00 (1 round)"
    assert paired_ratio({1: 1.0}, {2: 1.0}) is None


def test_spread_as_dict() -> None:
    assert Spread((1.0, 3.0, 2.0)).as_dict() == {
        "median": 2.0,
        "low": 1.0,
        "high": 3.0,
        "rounds": [1.0, 3.0, 2.0],
    }


def test_background_load_burns_and_stops() -> None:
    load = BackgroundLoad(1, duty=1.0)
    with load:
        (worker,) = load._workers
        burner = psutil.Process(worker.pid)
        # It burns: 0.3 s of CPU within 30 s however busy the machine is.
        deadline = time.monotonic() + 30
        while burner.cpu_times().user < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert burner.cpu_times().user >= 0.3
    assert not worker.is_alive()
    assert worker.exitcode == 0  # stopped by its event, not killed
    assert "1 busy-loop process started by the run, each busy 100%" in load.describe()


def test_background_load_of_zero_starts_nothing() -> None:
    with BackgroundLoad(0) as load:
        assert load._workers == []
    assert load.describe() == "none started by the run"


@pytest.mark.parametrize(("processes", "duty"), [(-1, 1.0), (1, 0.0), (1, 1.5)])
def test_background_load_refuses_bad_settings(processes: int, duty: float) -> None:
    with pytest.raises(ValueError):
        BackgroundLoad(processes, duty)
