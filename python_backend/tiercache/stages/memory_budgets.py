"""A stage's cache budgets following the host's memory (tiercache.budgets), with their metrics.

`start_budgets` is what a stage that owns cache memory calls after opening its caches: with a
headroom or a total it starts a controller thread over them and exports each budget, what one
more byte of it is worth, the memory available and every change; with neither (0, the
defaults) it does nothing and the budgets stay fixed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from tiercache.budgets import (
    Budget,
    BudgetController,
    BudgetThread,
    Decision,
    HostLedger,
    cache_budget,
    release_after,
)
from tiercache.exact.stores import MemoryStore
from tiercache.machine import HostMemoryProbe
from tiercache.triton import metrics as tm

REASONS = ("shrink", "grow", "move")
OBJECTIVES = {
    "ttft": "The engine's time-to-first-token objective",
    "hit": "The exact hits' latency objective (prompt_cache's lookup time of a hit)",
}


def start_budgets(
    headroom_bytes: int,
    interval_s: float,
    budgets: Sequence[Budget],
    metrics: tm.Metrics,
    state_dir: Path,
    name: str,
    available: Callable[[], int] | None = None,
    total_bytes: int = 0,
    objective: Callable[[], int] | None = None,
    objective_name: str = "ttft",
    memory: str = "host",
    on_close: Callable[[], None] | None = None,
    trim: bool = True,
) -> BudgetThread | None:
    """The started controller thread (the caller closes it), or None when `headroom_bytes` and
    `total_bytes` are 0. Its budgets are published under `state_dir`/budgets as `name`
    (`HostLedger`). `available` (default: this process's host memory, `HostMemoryProbe`) is
    for tests. `objective`: this process's latency objective's state (`LatencyObjective.state`),
    which lets the host's budgets pass the total while it is missed; `objective_name` names
    its gauge (`tiercache_<name>_objective_state`: ttft for the engine's, hit for exact hits').
    `memory`: what `available` reads ("host", or "gpu-<uuid>" for a card's memory: its ledger
    is `state_dir`/budgets-gpu-<uuid>, shared with the processes on the same card only); the
    label of the headroom and available gauges. `on_close`: run when the thread closes (after
    the ledger's file is removed), e.g. to release the probe. `trim`: after a tick that shrank
    a budget of host memory, return the freed heap to the machine (`release_after`; a stage's
    `memory_trim_interval_s` 0 turns it off; a card's budgets never trim the host's heap)."""
    if (headroom_bytes <= 0 and total_bytes <= 0) or not budgets:
        return None
    if available is None:
        probe = HostMemoryProbe()

        def available() -> int:
            return probe.read().available_bytes

    # a process that has not published for ten looks (at least 30 s, three looks of the
    # slowest interval a stage may have: each reader judges by its own) is gone or stuck
    folder = "budgets" if memory == "host" else f"budgets-{memory}"
    ledger = HostLedger(state_dir / folder, name, stale_s=max(10 * interval_s, 30.0))
    controller = BudgetController(
        budgets,
        available,
        headroom_bytes,
        ledger=ledger,
        total_bytes=total_bytes,
        objective=objective,
    )
    late = (
        metrics.gauge(
            f"tiercache_{objective_name}_objective_state",
            f"{OBJECTIVES.get(objective_name, objective_name)} over its recent requests: 0 met "
            "with room, 1 met, 2 missed (then the budgets may pass cache_memory_bytes)",
        )
        if objective is not None
        else None
    )
    sizes = {
        b.name: metrics.gauge(
            "tiercache_budget_bytes", "A cache's byte budget now (docs/budgets.md)", cache=b.name
        )
        for b in budgets
    }
    values = {
        b.name: metrics.gauge(
            "tiercache_budget_value_per_mib",
            "Engine seconds per second one more MiB of a cache would save, as its shadow queue "
            "measured lately (docs/budgets.md)",
            cache=b.name,
        )
        for b in budgets
    }
    held = {
        b.name: (
            b.held,
            metrics.gauge(
                "tiercache_budget_held_bytes",
                "What a cache that frees its bytes later still counts against its budget: the "
                "KV pool's and the semantic graphs' bytes held now; the engine's adapter slots': "
                "the budget in force plus what its next request frees (docs/budgets.md)",
                cache=b.name,
            ),
        )
        for b in budgets
        if b.held is not None
    }
    kind = "host" if memory == "host" else "gpu"
    metrics.gauge(
        "tiercache_memory_headroom_bytes",
        "Memory the budgets keep free (memory: host, memory_headroom_bytes; gpu, torch_llm's "
        "gpu_memory_headroom_bytes; 0: none)",
        memory=kind,
    ).set(headroom_bytes)
    metrics.gauge(
        "tiercache_cache_memory_bytes",
        "What the host's cache budgets may hold together (cache_memory_bytes; 0: no total)",
    ).set(total_bytes)
    free = metrics.gauge(
        "tiercache_memory_available_bytes",
        "Memory this process may still take (memory: host, or gpu: its engine's card through "
        "NVML), as the budget controller last read it",
        memory=kind,
    )
    changes = {
        (b.name, reason): metrics.counter(
            "tiercache_budget_changes_total",
            "Budget changes by cache and direction (shrink: memory short of the headroom or "
            "over the total; move: given to a more valuable cache)",
            cache=b.name,
            reason=reason,
        )
        for b in budgets
        for reason in REASONS
    }
    short = metrics.counter(
        "tiercache_budget_short_total",
        "Ticks that found memory short of the headroom with every budget at its floor",
    )

    def on_tick(decisions: list[Decision]) -> None:
        if trim and memory == "host":
            release_after(decisions)
        free.set(controller.last_available)
        if late is not None:
            late.set(controller.objective_state)
        for decision in decisions:
            if decision.reason == "floors":
                short.increment(1)
            else:
                changes[(decision.name, decision.reason)].increment(1)
        for budget in budgets:
            sizes[budget.name].set(budget.current_bytes)
            values[budget.name].set(controller.values[budget.name] * (1 << 20))
        for read, gauge in held.values():
            gauge.set(read())

    for budget in budgets:
        sizes[budget.name].set(budget.current_bytes)

    def close() -> None:
        ledger.close()
        if on_close is not None:
            on_close()

    return BudgetThread(controller, interval_s, on_tick, on_close=close).start()


class L1BudgetConfig(Protocol):
    """What a stage with an answers' L1 configures for its budget (prompt_cache's and
    embedding_cache's configs)."""

    @property
    def memory_headroom_bytes(self) -> int: ...
    @property
    def cache_memory_bytes(self) -> int: ...
    @property
    def budget_interval_s(self) -> float: ...
    @property
    def l1_min_bytes(self) -> int: ...
    @property
    def l1_max_bytes(self) -> int: ...
    def state_path(self) -> Path: ...


def follow_l1(
    config: L1BudgetConfig,
    l1: object,
    metrics: tm.Metrics,
    name: str,
    others: Sequence[Budget] = (),
    objective: Callable[[], int] | None = None,
) -> BudgetThread | None:
    """`start_budgets` over a stage's answers' L1 (when it is a `MemoryStore`), between
    `l1_min_bytes` and its fixed size, valued by what one more byte would save (misses on
    answers it evicted lately: the lower tier's read, or the generation), and the stage's
    `others` (embedding_cache: its vectors' L1). `objective`: the exact hits' latency
    objective's state (prompt_cache's `hit_objective_s`)."""
    budgets = list(others)
    if isinstance(l1, MemoryStore):
        budgets.insert(
            0,
            cache_budget(
                "l1",
                config.l1_min_bytes,
                config.l1_max_bytes,
                l1.resize,
                l1.shadow_reading,
                used=l1.used_bytes,
            ),  # fmt: skip
        )
    return start_budgets(
        config.memory_headroom_bytes,
        config.budget_interval_s,
        budgets,
        metrics,
        config.state_path(),
        name,
        total_bytes=config.cache_memory_bytes,
        objective=objective,
        objective_name="hit",
    )
