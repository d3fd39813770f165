"""Interleaved rounds and paired ratios: how the comparisons here stay meaningful on a shared
machine whose load moves while they run.

A comparison of configurations A, B, C runs them in rounds, in a serpentine order (A B C, then
C B A, then A B C ...), so a load that rises or falls steadily through the run charges each
configuration alike. A ratio is computed per round, between the measurements taken minutes
apart in that round, and reported as the median of the rounds with its spread (lowest and
highest): `1.12 (1.05-1.20, 3 rounds)`. A ratio of medians taken far apart would mix the load
of different moments.

`BackgroundLoad` starts a known CPU load beside a run (N processes, each busy for a given share
of every 100 ms), so a result can be checked on a busy machine the run itself makes busy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tiercache_dev.stats import median

__all__ = [
    "BackgroundLoad",
    "Spread",
    "add_background_load_arguments",
    "check_background_load_arguments",
    "paired_ratio",
    "serpentine",
]

T = TypeVar("T")


def serpentine(configs: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, config) in the order to run them: round 1 forwards, round 2 backwards, ...
    (rounds count from 1)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for round_no in range(1, rounds + 1):
        order = configs if round_no % 2 else list(reversed(configs))
        for config in order:
            yield round_no, config


def level_pairs(
    configs: Sequence[T], rounds: int, levels: Sequence[int]
) -> Iterator[tuple[int, int, T]]:
    """(round, level, config) in the order to run them: in each round, for each level, every
    configuration back to back, so each ratio pairs measurements taken seconds apart; the order
    reversed from one level to the next within a round, and each level's order reversed from
    one round to the next (numbered through the blocks instead, with two levels, each level
    kept its order in every round: a drift or a warm server biased its ratios one way)."""
    if rounds < 1 or not levels:
        raise ValueError("level_pairs needs at least one round and one level")
    for round_no in range(1, rounds + 1):
        for index, level in enumerate(levels):
            forwards = (round_no + index) % 2 == 1
            for config in configs if forwards else list(reversed(configs)):
                yield round_no, level, config


@dataclass(frozen=True, slots=True)
class Spread:
    """A ratio over rounds: the median of the per-round values and their range."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def text(self, spec: str = ".2f") -> str:
        """`1.12 (1.05-1.20, 3 rounds)`; one round shows just its value."""
        if len(self.values) == 1:
            return f"{self.median:{spec}} (1 round)"
        return (
            f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}}, "
            f"{len(self.values)} rounds)"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "rounds": list(self.values),
        }


def paired_ratio(numerator: Mapping[int, float], denominator: Mapping[int, float]) -> Spread | None:
    """numerator[r] / denominator[r] for every round r measured in both (a zero denominator
    skips its round); None when no round has both."""
    values = tuple(
        numerator[r] / denominator[r]
        for r in sorted(numerator.keys() & denominator.keys())
        if denominator[r]
    )
    return Spread(values) if values else None


def _burn(duty: float, stop: multiprocessing.synchronize.Event) -> None:
    period_s = 0.1
    busy_s = period_s * duty
    x = 0
    while not stop.is_set():
        start = time.monotonic()
        while time.monotonic() - start < busy_s:
            x = (x * 1_103_515_245 + 12_345) & 0xFFFF_FFFF
        if busy_s < period_s:
            time.sleep(period_s - busy_s)


class BackgroundLoad:
    """`processes` CPU burners, each busy `duty` (0-1] of every 100 ms, for the length of a
    `with` block; nothing at all when `processes` is 0."""

    def __init__(self, processes: int, duty: float = 1.0) -> None:
        if processes < 0 or not 0 < duty <= 1:
            raise ValueError(f"need processes >= 0 and 0 < duty <= 1, got {processes}, {duty}")
        self.processes, self.duty = processes, duty
        self._stop = multiprocessing.get_context("spawn").Event()
        self._workers: list[multiprocessing.process.BaseProcess] = []

    def describe(self) -> str:
        if not self.processes:
            return "none started by the run"
        return (
            f"{self.processes} busy-loop process{'es' if self.processes > 1 else ''} started "
            f"by the run, each busy {self.duty:.0%} of the time"
        )

    def __enter__(self) -> BackgroundLoad:
        ctx = multiprocessing.get_context("spawn")
        for _ in range(self.processes):
            worker = ctx.Process(target=_burn, args=(self.duty, self._stop), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
        self._workers.clear()


def add_background_load_arguments(p: argparse.ArgumentParser) -> None:
    """`--background-load N` and `--background-duty F`, for a script that runs a BackgroundLoad."""
    p.add_argument(
        "--background-load",
        type=int,
        default=0,
        metavar="N",
        help="start N CPU-burning processes for the whole run",
    )
    p.add_argument(
        "--background-duty", type=float, default=1.0, help="share of time each burner is busy"
    )


def check_background_load_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (p.error) what BackgroundLoad would refuse."""
    if args.background_load < 0 or not 0 < args.background_duty <= 1:
        p.error("--background-load must be >= 0 and --background-duty in (0, 1]")
