"""Cache budgets that follow the machine (issue 20): the decision core.

Each cache that holds memory (an L1, the KV block pool, the adapter slots, ...) registers a
`Budget`: its operator's floor and ceiling (the fixed parameter it had is the ceiling), how to
resize it, and what one more byte of it is worth now (`value_per_byte`: the engine seconds per
second that one more byte would save, measured by the cache's shadow queue of keys it evicted
lately, `tiercache.shadow`; one unit for every cache, so bytes can move between them).
`BudgetController.tick` reads what the machine has left (`tiercache.machine`) and keeps
`headroom_bytes` free:

- short of headroom: budgets shrink, the least valuable per byte first, each down to its floor
  at most, until the shortfall is covered. What a cache still holds over its budget (`held`: the
  KV pool evicts at its next request, not at once) counts as already given back, and after a
  shrink the next `settle_ticks` ticks shrink nothing more: freed memory reaches the reading
  late (the allocator keeps some), and taking the same shortfall again each tick would drive
  every budget to its floor;
- without a total (`total_bytes` 0), with more than `headroom_bytes x (1 + hysteresis)` free:
  budgets grow back toward their ceilings, the most valuable per byte first, by at most
  `grow_fraction` of the surplus per tick (never all at once: other processes read the same
  machine);
- with a total (what all of the host's cache budgets may hold together, in every stage
  process): over it, budgets shrink as for a shortfall; under it, bytes *move*: when the host's
  most valuable budget below its ceiling is worth `move_ratio` times this process's least
  valuable one, a step (`step_fraction` of the total) of the least valuable is given up, and the
  room under the total goes to the host's most valuable budget (at once when it is this
  process's, at its own process's next tick otherwise); with a headroom, only while memory is
  above it. So the same bytes follow the workload: to the KV pool when many tenants' prompts
  need it, to the answers when repeats do;
- with a total and a latency objective (`LatencyObjective`): while this process misses it,
  its own most valuable budget may grow past the total (published as `over`, which the others
  do not cut), and gives it back a step every `GIVE_BACK_TICKS` looks once the objective has
  room to spare;
- otherwise nothing moves.

A cache never goes under its floor: if the floors alone leave less than the headroom, the
controller says so (`Decision.reason` "floors") and holds them; it cannot stop another process
from taking memory, only give back what the caches hold. One controller per process, over that
process's caches; the stage processes of a host read the same memory, so each takes only its
share of a shortfall or a surplus (its budgets' bytes over all of the host's), and sees the
others' budgets and values, through a folder of the state directory where each publishes its
own (`HostLedger`); without it, every process would shed the whole shortfall. Not thread-safe:
ticked from one thread (`BudgetThread`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache.errors import ConfigError
from tiercache.log_throttle import LogThrottle
from tiercache.memory import malloc_trim
from tiercache.threads import NamedThread

log = logging.getLogger(__name__)

MAX_BUDGET_BYTES = 1 << 53
"""No budget, floor or published row is larger (8 PiB: past any machine, exact in a float)."""


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
    # what a cache that evicts at once holds now (None: unknown, or `held` says it); the part of
    # a budget the cache does not fill frees no memory when cut, so a shortfall is taken below
    # it (a half-empty L1 or pool cut by its budget freed nothing for tens of ticks)
    used: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.floor_bytes <= self.ceiling_bytes:
            raise ConfigError(
                f"budget {self.name}: floor {self.floor_bytes} must be within 0..ceiling "
                f"{self.ceiling_bytes}"
            )
        if self.ceiling_bytes > MAX_BUDGET_BYTES:
            raise ConfigError(
                f"budget {self.name}: ceiling {self.ceiling_bytes} bytes is past any machine "
                f"(at most {MAX_BUDGET_BYTES})"
            )
        self.current_bytes = min(max(self.current_bytes, self.floor_bytes), self.ceiling_bytes)


@dataclass(frozen=True, slots=True)
class Decision:
    name: str
    old_bytes: int
    new_bytes: int
    # "shrink" (short of memory, or over the total), "grow", "move" (given to a more valuable
    # budget) or "floors" (short of headroom with every budget at its floor)
    reason: str


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
        ledger: HostLedger | None = None,
        total_bytes: int = 0,
        move_ratio: float = 1.5,
        step_fraction: float = 1 / 16,
        objective: Callable[[], int] | None = None,
    ) -> None:
        """`ledger`: the host's other stage processes' budgets (None: this process is alone).
        `total_bytes` (0: none): what all of the host's budgets may hold together; bytes then
        move between them (`move_ratio`, `step_fraction`: see the module docstring).
        `objective`: this process's latency objective now (SLACK, MET or LATE;
        `LatencyObjective.state`), published for the host's controllers (None: none)."""
        if headroom_bytes < 0:
            raise ConfigError(f"headroom must be >= 0 bytes, got {headroom_bytes}")
        if total_bytes < 0:
            raise ConfigError(f"the total of the cache budgets must be >= 0, got {total_bytes}")
        if not 0.0 < grow_fraction <= 1.0:
            raise ConfigError(f"grow_fraction must be in (0, 1], got {grow_fraction}")
        if move_ratio < 1.0:
            raise ConfigError(f"move_ratio must be >= 1, got {move_ratio}")
        names = [b.name for b in budgets]
        if len(set(names)) != len(names):
            raise ConfigError(f"budget names must be distinct, got {names}")
        self.budgets = list(budgets)
        self._available = available
        self.headroom_bytes = headroom_bytes
        self.hysteresis = hysteresis
        self.grow_fraction = grow_fraction
        self.settle_ticks = settle_ticks
        self.ledger = ledger
        self.total_bytes = total_bytes
        self.move_ratio = move_ratio
        self.step_bytes = max(int(total_bytes * step_fraction), 1)
        self._settling = 0  # ticks left before another shrink for memory
        self._cooling = 0  # ticks left before another move or shrink under the total
        self._giving = 0  # ticks left before another step given back past the total
        self._publish_after = False
        self._shrunk_short = 0
        self._objective = objective
        self.objective_state = SLACK
        # bytes each budget holds past the total, taken for this process's missed objective
        self._over: dict[str, int] = {b.name: 0 for b in self.budgets}
        self.last_available = 0
        self.values: dict[str, float] = {b.name: 0.0 for b in self.budgets}  # as last read
        # ties between the host's budgets are broken by a name every process sees alike (its
        # ledger file's): by OWN, each process preferred the other's and neither grew
        self._own_key = ledger.path.name if ledger is not None else OWN
        self._floors_log = LogThrottle()

    def tick(self) -> list[Decision]:
        """Read, decide, apply; the budgets that changed (and a "floors" note when the
        headroom cannot be kept). Changes under the total are published at once (the others'
        room); a shrink for memory is not: the reading the others share it by has not
        changed yet."""
        available = self.last_available = int(self._available())
        self.values = {b.name: max(float(b.value_per_byte()), 0.0) for b in self.budgets}
        if self._objective is not None:
            self.objective_state = self._objective()
        host = self.ledger.publish(self._own()) if self.ledger is not None else self._own()
        decisions = self._decide(available, host)
        if self.ledger is not None and self._publish_after and decisions:
            self.ledger.publish(self._own())
        return decisions

    def _own(self) -> list[LedgerEntry]:
        return [
            LedgerEntry(OWN, b.name, b.current_bytes, self.values[b.name], b.floor_bytes,
                        b.ceiling_bytes, self.objective_state, self._over[b.name],
                        self.total_bytes > 0)
            for b in self.budgets
        ]  # fmt: skip

    def _decide(self, available: int, host: list[LedgerEntry] | None) -> list[Decision]:
        """`host` None: the ledger could not be read (this process holds under a total)."""
        self._publish_after = False  # set for changes under the total
        entries = host if host is not None else self._own()
        own_bytes = sum(b.current_bytes for b in self.budgets)
        host_bytes = sum(e.bytes for e in entries)
        part = own_bytes / host_bytes if host_bytes > 0 else 1.0
        # a surplus is shared by ceilings: by bytes, a process squeezed to zero floors took
        # none of it and stayed at 0 for good
        own_ceilings = sum(b.ceiling_bytes for b in self.budgets)
        host_ceilings = sum(e.ceiling for e in entries)
        grow_part = own_ceilings / host_ceilings if host_ceilings > 0 else 1.0
        shortfall = self.headroom_bytes - available
        settling = self._settling > 0
        if settling:
            self._settling -= 1
        cooling = self._cooling > 0
        if cooling:
            self._cooling -= 1
        if shortfall > 0:
            if settling:
                return []  # the last shrink may not show yet
            # bytes a cache still holds over its budget are on their way back
            shortfall -= sum(
                max(b.held() - b.current_bytes, 0) for b in self.budgets if b.held is not None
            )
            if shortfall <= 0:
                return []
            decisions = self._shrink(
                max(int(shortfall * part), 1), "shrink", take_over=True, unfilled=True
            )
            if any(d.reason == "shrink" for d in decisions):
                self._settling = self.settle_ticks
            if self._shrunk_short > 0:
                decisions.append(Decision("*", self._shrunk_short, 0, "floors"))
                if self._floors_log.ready():  # every tick while short: once a minute
                    log.warning(
                        "memory headroom short by %d bytes with every cache budget at its "
                        "floor (%d such ticks not logged)",
                        self._shrunk_short,
                        self._floors_log.suppressed,
                    )
            return decisions
        room = available - int(self.headroom_bytes * (1.0 + self.hysteresis))
        if self.total_bytes <= 0:
            # a budget grows by what its own cache has not filled less (`_grow`: growing an
            # unfilled budget uses no memory, so an idle cache was granted half the same
            # surplus again every tick, up to its ceiling, and a burst then passed the headroom)
            return (
                self._grow(int(room * self.grow_fraction * grow_part), fill_first=True)
                if room > 0
                else []
            )
        if host is None:
            return []  # without the others' budgets, growing could pass the total: hold
        # under the total, only the budgets of processes that joined it (a stage with a
        # headroom alone publishes too, for the shortfall's shares, but holds no part of it)
        entries = [e for e in entries if e.joins_total]
        host_bytes = sum(e.bytes for e in entries)
        giving = self._giving > 0
        if giving:
            self._giving -= 1
        # bytes past the total taken for an objective (any process's) are not the others' to
        # cut; the rest of an excess is
        excess = host_bytes - self.total_bytes - sum(e.over for e in entries)
        if excess > 0 and not cooling:  # floors above the total hold (said by the metrics)
            # not republished: every process cuts its part from the same view (republished,
            # the first to cut shrank the base of the next ones' parts: 39 / 57 MiB, measured)
            cut = _cut_bytes(entries, self.total_bytes, excess)
            decisions = self._shrink(cut, "shrink") if cut > 0 else []
            if decisions:
                self._cooling = self.settle_ticks
                return decisions
        if self.objective_state == LATE:
            grown = self._beyond_total(room)
            if grown:
                return grown
        elif self.objective_state == SLACK and any(v > 0 for v in self._over.values()):
            if not giving:
                return self._give_back()
        if excess > 0:
            return []
        # room under the total nobody took yet: its owner grows next; no new move meanwhile
        unclaimed = -excess
        self._publish_after = True
        if unclaimed < self.step_bytes and not cooling:
            moved = self._move(entries)
            if moved:
                self._cooling = self.settle_ticks
                return moved
        # room under the total (and in memory, with a headroom) goes to the host's most
        # valuable budget that can grow, if it is ours, a step at a time
        grow_room = min(unclaimed, room) if self.headroom_bytes > 0 else unclaimed
        best = _most_valuable(entries, self._own_key)
        if grow_room <= 0 or best is None or best.owner != OWN:
            return []
        budget = next(b for b in self.budgets if b.name == best.name)
        give = min(budget.ceiling_bytes - budget.current_bytes, grow_room, self.step_bytes)
        return [self._apply(budget, budget.current_bytes + give, "grow")] if give > 0 else []

    def _beyond_total(self, room: int) -> list[Decision]:
        """This process misses its latency objective: its most valuable budget that more bytes
        would help now (its shadow was hit lately: value > 0) grows a step past the total, up
        to its ceiling, while memory stays above the headroom. Only its own: the objective is
        this process's, and a file in the ledger claiming one cannot make others grow."""
        growable = [b for b in self.budgets if b.current_bytes < b.ceiling_bytes]
        if not growable or (self.headroom_bytes > 0 and room <= 0):
            return []
        best = max(growable, key=lambda b: (self.values[b.name], b.name))
        if self.values[best.name] <= 0.0:
            return []
        give = min(best.ceiling_bytes - best.current_bytes, self.step_bytes)
        if self.headroom_bytes > 0:
            give = min(give, room)
        if give <= 0:
            return []
        decision = self._apply(best, best.current_bytes + give, "grow")
        grown = max(decision.new_bytes - decision.old_bytes, 0)
        self._over[best.name] = min(self._over[best.name] + grown, best.current_bytes)
        self._publish_after = True
        return [decision]

    def _give_back(self) -> list[Decision]:
        """The objective is met with room to spare: a step of what was taken past the total
        goes back, then `GIVE_BACK_TICKS` looks pass (the objective's window must refresh
        before the next, or a step that makes it missed again would not show in time)."""
        name = max(self._over, key=lambda n: self._over[n])  # over > 0: the caller checked
        budget = next(b for b in self.budgets if b.name == name)
        take = min(self._over[name], self.step_bytes, budget.current_bytes - budget.floor_bytes)
        if take <= 0:  # at its floor: nothing past the total is left to give
            self._over[name] = 0
            return []
        self._giving = GIVE_BACK_TICKS
        self._publish_after = True
        return [self._apply(budget, budget.current_bytes - take, "shrink", take_over=True)]

    def _move(self, host: Sequence[LedgerEntry]) -> list[Decision]:
        """Give a step of this process's least valuable budget to the host's most valuable one
        (when worth `move_ratio` times as much); ours: it grows at once, another process's:
        it grows at that process's next tick, from the room under the total."""
        givers = [b for b in self.budgets if b.current_bytes > b.floor_bytes]
        if not givers:
            return []
        low = min(givers, key=lambda b: (self.values[b.name], b.name))
        best = _most_valuable(
            [e for e in host if not (e.owner == OWN and e.name == low.name)], self._own_key
        )
        low_value = self.values[low.name]
        if best is None or best.value <= 0.0 or best.value < self.move_ratio * low_value:
            return []
        take = min(self.step_bytes, low.current_bytes - low.floor_bytes, best.ceiling - best.bytes)
        if take <= 0:
            return []
        decisions = [self._apply(low, low.current_bytes - take, "move")]
        if best.owner == OWN:
            gainer = next(b for b in self.budgets if b.name == best.name)
            decisions.append(self._apply(gainer, gainer.current_bytes + take, "grow"))
        return decisions

    def _shrink(
        self, shortfall: int, reason: str, take_over: bool = False, unfilled: bool = False
    ) -> list[Decision]:
        """Shrink the least valuable first, to floors at most; what could not be taken is
        left in `_shrunk_short`. `unfilled` (memory short): a budget is first brought down to
        what its cache holds (`Budget.used`, or `held`), which frees nothing and so covers
        none of the shortfall; what it takes below that does."""
        decisions = []
        for budget in sorted(self.budgets, key=lambda b: self.values[b.name]):
            if shortfall <= 0:
                break
            start = budget.current_bytes
            if unfilled:
                holds = budget.used if budget.used is not None else budget.held
                if holds is not None:
                    start = min(start, max(int(holds()), budget.floor_bytes))
            take = min(start - budget.floor_bytes, shortfall)
            if take > 0:
                decisions.append(self._apply(budget, start - take, reason, take_over))
                shortfall -= take
            elif start < budget.current_bytes:
                decisions.append(self._apply(budget, start, reason, take_over))
        self._shrunk_short = max(shortfall, 0)
        return decisions

    @staticmethod
    def _unfilled(budget: Budget) -> int:
        """The bytes `budget` allows that its cache does not hold (by the reading a shrink
        takes: `used`, else `held`; 0 without one)."""
        holds = budget.used if budget.used is not None else budget.held
        return 0 if holds is None else max(budget.current_bytes - int(holds()), 0)

    def _grow(self, room: int, fill_first: bool = False) -> list[Decision]:
        """Give `room` to the budgets, the most valuable per byte first, up to their ceilings.
        `fill_first`: a budget is given `room` less what its cache has not filled of it yet
        (another budget's unfilled bytes do not hold it back: a graph budget its scopes never
        fill must not keep L1 at its floor after a squeeze)."""
        decisions = []
        for budget in sorted(self.budgets, key=lambda b: -self.values[b.name]):
            if room <= 0:
                break
            allowed = room - self._unfilled(budget) if fill_first else room
            give = min(budget.ceiling_bytes - budget.current_bytes, allowed)
            if give <= 0:
                continue
            decisions.append(self._apply(budget, budget.current_bytes + give, "grow"))
            room -= give
        return decisions

    def _apply(self, budget: Budget, target: int, reason: str, take_over: bool = False) -> Decision:
        """Resize; with `take_over` (bytes past the total given back, or memory short) what
        the budget gives up comes out of its `over` first. Never more over than it holds."""
        old = budget.current_bytes
        taken = budget.resize(target)
        budget.current_bytes = min(max(taken, budget.floor_bytes), budget.ceiling_bytes)
        over = self._over.get(budget.name, 0)
        if take_over and budget.current_bytes < old:
            over -= old - budget.current_bytes
        self._over[budget.name] = min(max(over, 0), budget.current_bytes)
        return Decision(budget.name, old, budget.current_bytes, reason)


OWN = ""
"""`LedgerEntry.owner` of this process's own budgets."""

SLACK, MET, LATE = 0, 1, 2
"""A latency objective's state (`LatencyObjective`): met with room (or none), met, missed."""

GIVE_BACK_TICKS = 8
"""Looks between two steps given back past the total (`BudgetController._give_back`)."""


class LatencyObjective:
    """A latency objective (the engine's time to first token, prompt_cache's exact hits'
    lookup time) over a process's recent requests: LATE when the
    `quantile` of the last `window` requests of the last `max_age_s` is over `objective_s`,
    SLACK when it is under `slack` x the objective (or fewer than `min_requests` are that
    recent: nothing to act on, and a burst long past is not kept LATE), else MET. `observe`
    is called from the serving thread, `state` from the budget thread."""

    def __init__(
        self,
        objective_s: float,
        window: int = 64,
        quantile: float = 0.9,
        slack: float = 0.8,
        min_requests: int = 16,
        max_age_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if objective_s <= 0:
            raise ConfigError(f"a latency objective must be > 0 s, got {objective_s}")
        self.objective_s = objective_s
        self.quantile, self.slack, self.min_requests = quantile, slack, min_requests
        self.max_age_s = max_age_s
        self._clock = clock
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)  # (when, seconds)
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._recent.append((self._clock(), seconds))

    def state(self) -> int:
        since = self._clock() - self.max_age_s
        with self._lock:
            recent = sorted(seconds for when, seconds in self._recent if when >= since)
        if len(recent) < self.min_requests:
            return SLACK
        at = recent[min(int(self.quantile * len(recent)), len(recent) - 1)]
        if at > self.objective_s:
            return LATE
        return SLACK if at < self.slack * self.objective_s else MET


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One budget of the host as its process last published it."""

    owner: str  # the publishing process's file name; OWN for this process's
    name: str
    bytes: int
    value: float  # value per byte (tiercache.shadow: engine seconds one more byte saves / s)
    floor: int
    ceiling: int
    # the publishing process's latency objective: SLACK (none, or met with room), MET (met,
    # close to it: hold) or LATE (missed): see `LatencyObjective`
    objective: int = 0
    over: int = 0  # bytes of it past the total, taken for that process's missed objective
    # its process holds it under a total (cache_memory_bytes); one with a headroom alone
    # publishes for the shortfall's shares and counts toward no total
    joins_total: bool = True


def _cut_bytes(entries: Sequence[LedgerEntry], total: int, excess: int) -> int:
    """This process's part of an excess over the total, in bytes: first what each process holds
    over its fair share (the total split by the processes' ceilings), as far as its floors let
    it cut, each its part of that; what those cannot cover, by what each can still cut. So the
    stages meet the total at their fair shares whichever started first (the first to start,
    alone, cuts itself to the whole total; cut by bytes, it then kept more than the later
    ones: 32 / 16 MiB, measured), and a process held at its floors leaves its part to the
    others instead of the host staying over the total."""
    owners: dict[str, list[float]] = {}  # owner -> held (bytes less over), floors, ceilings
    for e in entries:
        row = owners.setdefault(e.owner, [0.0, 0.0, 0.0])
        row[0] += e.bytes - e.over
        row[1] += e.floor
        row[2] += e.ceiling
    ceilings = sum(row[2] for row in owners.values())
    cuttable = {o: max(held - floors, 0.0) for o, (held, floors, _) in owners.items()}
    overage = {
        o: min(max(held - total * ceiling / ceilings, 0.0), cuttable[o]) if ceilings else 0.0
        for o, (held, _, ceiling) in owners.items()
    }
    first = min(float(excess), sum(overage.values()))
    own = first * overage.get(OWN, 0.0) / sum(overage.values()) if first > 0 else 0.0
    rest = excess - first
    left = {o: cuttable[o] - overage[o] for o in owners}
    if rest > 0 and sum(left.values()) > 0:
        own += min(rest, sum(left.values())) * left.get(OWN, 0.0) / sum(left.values())
    # up, not to the nearest: with three processes each one's part of a few bytes rounded to
    # 0, the host stayed a byte over the total, and being over blocks every move and growth
    return math.ceil(own) if own > 0 else 0


def _most_valuable(entries: Sequence[LedgerEntry], own_key: str = OWN) -> LedgerEntry | None:
    """The entry below its ceiling worth the most per byte (ties: the smallest, then by its
    process's ledger file name, `own_key` standing for this process's, so every process picks
    the same one, then by name)."""
    growable = [e for e in entries if e.bytes < e.ceiling]
    if not growable:
        return None
    return max(
        growable,
        key=lambda e: (e.value, -e.bytes, own_key if e.owner == OWN else e.owner, e.name),
    )


QUIET_LOOKS = 10
"""A shadow not hit for this many looks is worth nothing more per byte (`ShadowValue`)."""


class ShadowValue:
    """A cache's `value_per_byte` from `read()` -> (seconds its shadow queue's hits would have
    saved, cumulative; the bytes the shadow spans now): the seconds saved per second per byte of
    shadow since the last call (tiercache.shadow: what one more byte is worth), averaged half
    and half with the previous estimate; 0 once the shadow has not been hit for `QUIET_LOOKS`
    looks."""

    def __init__(
        self, read: Callable[[], tuple[float, float]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._read = read
        self._clock = clock
        first = read()
        self._last = (first[0], clock(), first[1])
        self.estimate = 0.0
        self._quiet = 0  # looks since the shadow was last hit

    def __call__(self) -> float:
        gained, span = self._read()
        now = self._clock()
        elapsed = now - self._last[1]
        if elapsed <= 0:
            return self.estimate
        # the span the hits came from: the shadow's hits take their keys out of it
        before = max(span, self._last[2])
        fresh = max(gained - self._last[0], 0.0) / elapsed / before if before > 0 else 0.0
        self._last = (gained, now, span)
        self._quiet = 0 if fresh > 0 else self._quiet + 1
        # halving alone would leave one old hit worth something for ~1,000 looks
        self.estimate = 0.0 if self._quiet >= QUIET_LOOKS else (self.estimate + fresh) / 2
        return self.estimate


class HostLedger:
    """Each stage process's budgets (bytes, value per byte, floor, ceiling), published as JSON
    in `<folder>/<name>.<pid>` (written atomically each tick), so that a controller takes its
    share of the host's shortfall (its bytes over the live processes') and bytes move between
    the processes' caches under a total.

    The folder is the state directory's: what is in it is read as hostile. A file counts only
    if it is a regular file (not a link, a FIFO or a device) of this user's of at most
    `MAX_LEDGER_BYTES`, written within `stale_s` and not in the future (a process that stopped
    publishing, or a file left from before a restart whose pid was reused, is ignored), named
    for a live process other than pid 0 or 1, among the first `MAX_LEDGER_FILES` a look reads,
    and holds at most `MAX_LEDGER_ENTRIES` well-formed entries (a budget within its floor and
    ceiling, a finite value >= 0); anything else costs that file its say, nothing more. The
    folder is made 0700, and one that is a link or another user's is not used; each write
    goes through a temporary file of its own (O_EXCL). A folder that cannot be read or
    written: `publish` returns None (logged once)."""

    def __init__(
        self, folder: Path, name: str, pid: int | None = None, stale_s: float = 30.0
    ) -> None:
        self.folder = folder
        self.pid = os.getpid() if pid is None else pid
        self.path = folder / f"{name}.{self.pid}"
        self.stale_s = stale_s
        self._warned = False

    def publish(self, own: Sequence[LedgerEntry]) -> list[LedgerEntry] | None:
        """Write `own`; every live process's entries (`own` as given, owner OWN), or None when
        the folder cannot be used."""
        # the eighth field only for a budget outside the total: a reader of an earlier
        # version refuses rows of more than seven fields (the whole file), and its default,
        # joining, is what every other row says
        document = [
            [e.name, e.bytes, e.value, e.floor, e.ceiling, e.objective, e.over]
            + ([] if e.joins_total else [0])
            for e in own
        ]
        entries = list(own)
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder = os.lstat(self.folder)
            if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.geteuid():
                # a link to elsewhere, or another user's: its files are not ours to remove
                raise OSError(f"{self.folder} is a link or another user's folder")
            # a name of its own (O_EXCL, 0600): at a fixed name, a planted link took the write
            fd, temporary = tempfile.mkstemp(dir=self.folder, prefix=self.path.name + ".")
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(document))
            os.replace(temporary, self.path)
            names = [p for p in self.folder.iterdir() if p != self.path]
        except OSError:
            if not self._warned:
                self._warned = True
                log.warning("budget ledger in %s unavailable; this process alone", self.folder)
            return None
        now = time.time()
        read = 0
        for path in names:
            pid = path.name.rsplit(".", 1)[-1]
            if not pid.isdigit() or int(pid) <= 1:
                continue
            if not _alive(int(pid)):
                _remove_left(path, now - self.stale_s)
                continue
            if read >= MAX_LEDGER_FILES:  # a folder planted full: the rest have no say
                break
            read += 1
            entries.extend(_read_entries(path, now - self.stale_s, now))
        return entries

    def close(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


MAX_LEDGER_BYTES = 64 << 10
MAX_LEDGER_ENTRIES = 16
MAX_LEDGER_FILES = 64  # other processes' files read a look (a host runs a few stages)
LEDGER_CLOCK_SLACK_S = 5.0  # a file written later than now by more than this is planted


def _remove_left(path: Path, fresh_after: float) -> None:
    """A file left by a process that is gone (killed: `close` never ran), once it is stale
    too: the folder grew by one a crash, and each look signalled every pid in it. A live
    process in another pid namespace sharing the folder looks gone from here, but its file is
    fresh (rewritten each look), so it stays; one removed all the same is written again at
    that process's next look."""
    try:
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode) and info.st_mtime < fresh_after:
            path.unlink()
    except OSError:
        pass


def _read_entries(path: Path, fresh_after: float, now: float | None = None) -> list[LedgerEntry]:
    """One process's entries, or none when its file is not what a stage writes (see
    `HostLedger`): another user's file (another local user could plant one naming pid 2,
    always alive, with a budget of 2**53 bytes: every cut then came to nothing), one stamped
    in the future (it would never go stale), or one out of bounds."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_LEDGER_BYTES:
            return []
        if info.st_uid != os.geteuid():
            return []
        if info.st_mtime < fresh_after:
            return []
        if now is not None and info.st_mtime > now + LEDGER_CLOCK_SLACK_S:
            return []
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_LEDGER_BYTES + 1)
        if len(raw) > MAX_LEDGER_BYTES:
            return []
        document = json.loads(raw)
        if not isinstance(document, list) or len(document) > MAX_LEDGER_ENTRIES:
            return []
        entries = [_entry(path.name, row) for row in document]
    except Exception:  # noqa: BLE001 - a torn or hostile file: no say, never a failed tick
        return []
    ok = all(
        0 <= e.floor <= e.bytes <= e.ceiling <= MAX_BUDGET_BYTES
        and 0 <= e.over <= e.bytes
        and math.isfinite(e.value)
        and e.value >= 0
        for e in entries
    )
    return entries if ok else []


def _entry(owner: str, row: list[object]) -> LedgerEntry:
    """One published row: name, bytes, value, floor, ceiling, then (newer writers) objective,
    over and whether it joins the total; a writer of an older version has its say without
    them (joining the total, as every budget did then). ValueError otherwise."""
    if not isinstance(row, list) or not 5 <= len(row) <= 8:
        raise ValueError("a ledger row has 5 to 8 fields")
    name, nbytes, value, floor, ceiling, *rest = row
    objective, over, joins = (list(rest) + [SLACK, 0, 1][len(rest) :])[:3]
    if joins not in (0, 1):
        raise ValueError("joins_total is 0 or 1")
    return LedgerEntry(
        owner,
        str(name),
        int(nbytes),  # type: ignore[call-overload]
        float(value),  # type: ignore[arg-type]
        int(floor),  # type: ignore[call-overload]
        int(ceiling),  # type: ignore[call-overload]
        min(max(int(objective), SLACK), LATE),  # type: ignore[call-overload]
        int(over),  # type: ignore[call-overload]
        joins == 1,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, OSError):
        return False
    return True


def cache_budget(
    name: str,
    floor_bytes: int,
    ceiling_bytes: int,
    resize: Callable[[int], int],
    gained: Callable[[], tuple[float, float]],
    held: Callable[[], int] | None = None,
    used: Callable[[], int] | None = None,
) -> Budget:
    """A cache's budget starting at its fixed size (`ceiling_bytes`, the floor capped to it),
    valued by what one more byte of it would save (`gained`: its shadow queue's cumulative
    seconds saved and its span in bytes, `ShadowValue`)."""
    floor = min(floor_bytes, ceiling_bytes)
    return Budget(
        name, floor, ceiling_bytes, ceiling_bytes, resize, ShadowValue(gained), held=held,
        used=used,
    )  # fmt: skip


def release_after(decisions: Sequence[Decision], trim: Callable[[], bool] = malloc_trim) -> bool:
    """After a tick that shrank a budget, return the freed heap to the machine (`trim`): what
    the caches let go stays in the process otherwise (glibc keeps freed pages), the reading
    never improved, and the next shrinks took the same shortfall again, down to the floors
    (an L1 of 40,000 answers, 89 MiB, resized to 1 MiB: the process's RSS stayed 80 MiB over
    where it started, 5 after a trim). Whether it trimmed."""
    if any(d.new_bytes < d.old_bytes for d in decisions if d.reason != "floors"):
        trim()
        return True
    return False


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
        self._thread = NamedThread(target=self._run, name="budgets", daemon=True)

    def start(self) -> BudgetThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        logged_s, failed = float("-inf"), 0
        while not self._stop.wait(self.interval_s):
            try:
                decisions = self.controller.tick()
                if self._on_tick is not None:
                    self._on_tick(decisions)
            except Exception:  # noqa: BLE001 - the caches keep their budgets; next tick retries
                failed += 1
                now = time.monotonic()
                if now - logged_s >= 60.0:  # a reading that keeps failing: once a minute
                    logged_s = now
                    log.exception("a budget tick failed (%d since the last report)", failed)
                    failed = 0

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if self._on_close is not None:
            self._on_close()
