"""Cache budgets that follow the machine (issue 20): the decision core.

Each cache that holds memory (an L1, the KV block pool, the adapter slots, ...) registers a
`Budget`: its operator's floor and ceiling (the fixed parameter it had is the ceiling), how to
resize it, and what one more byte of it is worth now (`value_per_byte`: hits its evictions gave
up per byte evicted, lately; the caches measure it). `BudgetController.tick` reads what the
machine has left (`tiercache.machine`) and keeps `headroom_bytes` free:

- short of headroom: budgets shrink, the least valuable per byte first, each down to its floor
  at most, until the shortfall is covered. What a cache still holds over its budget (`held`: the
  KV pool evicts at its next request, not at once) counts as already given back, and after a
  shrink the next `settle_ticks` ticks shrink nothing more: freed memory reaches the reading
  late (the allocator keeps some), and taking the same shortfall again each tick would drive
  every budget to its floor;
- with more than `headroom_bytes x (1 + hysteresis)` free: budgets grow back toward their
  ceilings, the most valuable per byte first, by at most `grow_fraction` of the surplus per tick
  (growing is cheap to undo, but never all at once: other processes read the same machine);
- otherwise nothing moves.

A cache never goes under its floor: if the floors alone leave less than the headroom, the
controller says so (`Decision.reason` "floors") and holds them; it cannot stop another process
from taking memory, only give back what the caches hold. One controller per process, over that
process's caches; the stage processes of a host read the same memory, so each takes only its
share of a shortfall or a surplus (`share`: its budgets' bytes over all of the host's, which
each controller publishes in a folder of the state directory, `HostShares`); without one, every
process would shed the whole shortfall. Not thread-safe: ticked from one thread
(`BudgetThread`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Budget:
    """One cache's budget. `resize(bytes)` applies a new one (evicting down to it) and returns
    the budget it took (a cache may round it); `value_per_byte()` is what one more byte is
    worth now (any non-negative unit, the same for every budget of a controller)."""

    name: str
    floor_bytes: int
    ceiling_bytes: int
    current_bytes: int
    resize: Callable[[int], int]
    value_per_byte: Callable[[], float]
    # what the cache holds now (None: it evicts at once when resized, nothing to wait for)
    held: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.floor_bytes <= self.ceiling_bytes:
            raise ConfigError(
                f"budget {self.name}: floor {self.floor_bytes} must be within 0..ceiling "
                f"{self.ceiling_bytes}"
            )
        self.current_bytes = min(max(self.current_bytes, self.floor_bytes), self.ceiling_bytes)


@dataclass(frozen=True, slots=True)
class Decision:
    name: str
    old_bytes: int
    new_bytes: int
    reason: str  # "shrink", "grow" or "floors" (short of headroom with every budget at its floor)


class BudgetController:
    """See the module docstring. `available` returns the bytes the machine has left now (for
    host memory: `HostMemoryProbe().read().available_bytes`)."""

    def __init__(
        self,
        budgets: Sequence[Budget],
        available: Callable[[], int],
        headroom_bytes: int,
        hysteresis: float = 0.25,
        grow_fraction: float = 0.5,
        settle_ticks: int = 2,
        share: Callable[[int], float] | None = None,
    ) -> None:
        """`share(own_bytes)`: this controller's part of the host's shortfall or surplus, given
        its budgets' total now (None: all of it)."""
        if headroom_bytes < 0:
            raise ConfigError(f"headroom must be >= 0 bytes, got {headroom_bytes}")
        if not 0.0 < grow_fraction <= 1.0:
            raise ConfigError(f"grow_fraction must be in (0, 1], got {grow_fraction}")
        names = [b.name for b in budgets]
        if len(set(names)) != len(names):
            raise ConfigError(f"budget names must be distinct, got {names}")
        self.budgets = list(budgets)
        self._available = available
        self.headroom_bytes = headroom_bytes
        self.hysteresis = hysteresis
        self.grow_fraction = grow_fraction
        self.settle_ticks = settle_ticks
        self._share = share
        self._settling = 0  # ticks left before another shrink
        self.last_available = 0

    def tick(self) -> list[Decision]:
        """Read, decide, apply; the budgets that changed (and a "floors" note when the
        headroom cannot be kept)."""
        available = self.last_available = int(self._available())
        part = 1.0
        if self._share is not None:
            part = min(max(self._share(sum(b.current_bytes for b in self.budgets)), 0.0), 1.0)
        shortfall = self.headroom_bytes - available
        if self._settling > 0:
            self._settling -= 1
            if shortfall > 0:
                return []  # the last shrink may not show yet
        if shortfall > 0:
            # bytes a cache still holds over its budget are on their way back
            shortfall -= sum(
                max(b.held() - b.current_bytes, 0) for b in self.budgets if b.held is not None
            )
            if shortfall <= 0:
                return []
            return self._shrink(max(int(shortfall * part), 1))
        surplus = available - int(self.headroom_bytes * (1.0 + self.hysteresis))
        if surplus > 0:
            return self._grow(int(surplus * self.grow_fraction * part))
        return []

    def _shrink(self, shortfall: int) -> list[Decision]:
        decisions = []
        for budget in sorted(self.budgets, key=lambda b: b.value_per_byte()):
            if shortfall <= 0:
                break
            take = min(budget.current_bytes - budget.floor_bytes, shortfall)
            if take <= 0:
                continue
            decisions.append(self._apply(budget, budget.current_bytes - take, "shrink"))
            shortfall -= take
            self._settling = self.settle_ticks
        if shortfall > 0:
            decisions.append(Decision("*", shortfall, 0, "floors"))
            log.warning(
                "memory headroom short by %d bytes with every cache budget at its floor",
                shortfall,
            )
        return decisions

    def _grow(self, room: int) -> list[Decision]:
        decisions = []
        for budget in sorted(self.budgets, key=lambda b: -b.value_per_byte()):
            if room <= 0:
                break
            give = min(budget.ceiling_bytes - budget.current_bytes, room)
            if give <= 0:
                continue
            decisions.append(self._apply(budget, budget.current_bytes + give, "grow"))
            room -= give
        return decisions

    @staticmethod
    def _apply(budget: Budget, target: int, reason: str) -> Decision:
        old = budget.current_bytes
        taken = budget.resize(target)
        budget.current_bytes = min(max(taken, budget.floor_bytes), budget.ceiling_bytes)
        return Decision(budget.name, old, budget.current_bytes, reason)


class RecentValue:
    """A cache's `value_per_byte` from its cumulative counters `read()` -> (value given up by
    evictions, bytes evicted): the ratio over what was evicted since the last call, averaged
    half and half with the previous estimate (0.0 before any eviction; unchanged while nothing
    is evicted)."""

    def __init__(self, read: Callable[[], tuple[float, float]]) -> None:
        self._read = read
        self._last = read()
        self.estimate = 0.0

    def __call__(self) -> float:
        now = self._read()
        value, nbytes = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        if nbytes > 0:
            fresh = max(value, 0.0) / nbytes
            self.estimate = fresh if self.estimate == 0.0 else (self.estimate + fresh) / 2
        return self.estimate


class HostShares:
    """Each stage process's budget total, published as `<folder>/<name>.<pid>` (written
    atomically each tick), so a controller takes its share of the host's shortfall: its own
    total over the live processes' (files of processes that are gone are ignored). A folder
    that cannot be read or written leaves the share at 1 (logged once)."""

    def __init__(self, folder: Path, name: str, pid: int | None = None) -> None:
        self.folder = folder
        self.pid = os.getpid() if pid is None else pid
        self.path = folder / f"{name}.{self.pid}"
        self._warned = False

    def __call__(self, own_bytes: int) -> float:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(self.path.name + ".tmp")
            temporary.write_text(str(own_bytes))
            os.replace(temporary, self.path)
            total = 0
            for entry in self.folder.iterdir():
                pid = entry.name.rsplit(".", 1)[-1]
                if not pid.isdigit() or not _alive(int(pid)):
                    continue
                try:
                    total += max(int(entry.read_text().strip() or 0), 0)
                except (OSError, ValueError):
                    continue
        except OSError:
            if not self._warned:
                self._warned = True
                log.warning("budget shares in %s unavailable; this process takes all", self.folder)
            return 1.0
        return own_bytes / total if total > 0 else 1.0

    def close(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cache_budget(
    name: str,
    floor_bytes: int,
    ceiling_bytes: int,
    resize: Callable[[int], int],
    given_up: Callable[[], tuple[float, float]],
    held: Callable[[], int] | None = None,
) -> Budget:
    """A cache's budget starting at its fixed size (`ceiling_bytes`, the floor capped to it),
    valued by what its evictions gave up per byte evicted lately (`given_up`: its cumulative
    (value, bytes) counters, `RecentValue`)."""
    floor = min(floor_bytes, ceiling_bytes)
    return Budget(
        name, floor, ceiling_bytes, ceiling_bytes, resize, RecentValue(given_up), held=held
    )


class BudgetThread:
    """Ticks a controller every `interval_s` on a daemon thread until `close`; a tick that
    raises is logged and the next one runs. `on_tick` sees each tick's decisions (metrics)."""

    def __init__(
        self,
        controller: BudgetController,
        interval_s: float = 1.0,
        on_tick: Callable[[list[Decision]], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.controller = controller
        self._on_close = on_close
        self.interval_s = interval_s
        self._on_tick = on_tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="budgets", daemon=True)

    def start(self) -> BudgetThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                decisions = self.controller.tick()
                if self._on_tick is not None:
                    self._on_tick(decisions)
            except Exception:  # noqa: BLE001 - the caches keep their budgets; next tick retries
                log.exception("a budget tick failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if self._on_close is not None:
            self._on_close()
