"""A stage's cache budgets following the host's memory (tiercache.budgets), with their metrics.

`start_budgets` is what a stage that owns cache memory calls after opening its caches: with a
headroom it starts a controller thread over them and exports each budget, the memory available
and every change; without one (0, the default) it does nothing and the budgets stay fixed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tiercache.budgets import Budget, BudgetController, BudgetThread, Decision, HostShares
from tiercache.machine import HostMemoryProbe
from tiercache.triton import metrics as tm

REASONS = ("shrink", "grow")


def start_budgets(
    headroom_bytes: int,
    interval_s: float,
    budgets: Sequence[Budget],
    metrics: tm.Metrics,
    state_dir: Path,
    name: str,
    available: Callable[[], int] | None = None,
) -> BudgetThread | None:
    """The started controller thread (the caller closes it), or None when `headroom_bytes` is
    0. Its share of the host's shortfall is published under `state_dir`/budgets as `name`
    (`HostShares`). `available` (default: this process's host memory, `HostMemoryProbe`) is
    for tests."""
    if headroom_bytes <= 0 or not budgets:
        return None
    if available is None:
        probe = HostMemoryProbe()

        def available() -> int:
            return probe.read().available_bytes

    shares = HostShares(state_dir / "budgets", name)
    controller = BudgetController(budgets, available, headroom_bytes, share=shares)
    sizes = {
        b.name: metrics.gauge(
            "tiercache_budget_bytes", "A cache's byte budget now (docs/budgets.md)", cache=b.name
        )
        for b in budgets
    }
    free = metrics.gauge(
        "tiercache_memory_available_bytes",
        "Host memory this process may still take, as the budget controller last read it",
    )
    changes = {
        (b.name, reason): metrics.counter(
            "tiercache_budget_changes_total",
            "Budget changes by cache and direction (shrink: memory short of the headroom)",
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
        free.set(controller.last_available)
        for decision in decisions:
            if decision.reason == "floors":
                short.increment(1)
            else:
                changes[(decision.name, decision.reason)].increment(1)
        for budget in budgets:
            sizes[budget.name].set(budget.current_bytes)

    for budget in budgets:
        sizes[budget.name].set(budget.current_bytes)
    return BudgetThread(controller, interval_s, on_tick, on_close=shares.close).start()
