"""tiercache.budgets: budgets shrink (least valuable first, to their floors) when the machine is
short of headroom and grow back (most valuable first, to their ceilings) when it has room; the
caches that resize (L1, the KV pool) give the bytes back."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tiercache.budgets import (
    GIVE_BACK_TICKS,
    LATE,
    MAX_BUDGET_BYTES,
    MAX_LEDGER_BYTES,
    MET,
    OWN,
    QUIET_LOOKS,
    SLACK,
    Budget,
    BudgetController,
    BudgetThread,
    Decision,
    HostLedger,
    LatencyObjective,
    LedgerEntry,
    ShadowValue,
    release_after,
)
from tiercache.engine.kv_cache import KvBlockPool
from tiercache.errors import ConfigError
from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import MemoryStore

MIB = 1 << 20
GIB = 1 << 30


class Cache:
    """A cache that takes any budget it is given and reports a fixed value per byte."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.sizes: list[int] = []

    def resize(self, size: int) -> int:
        self.sizes.append(size)
        return size


def budget(name: str, cache: Cache, floor: int, ceiling: int, current: int) -> Budget:
    return Budget(name, floor, ceiling, current, cache.resize, lambda: cache.value)


class Machine:
    def __init__(self, available: int) -> None:
        self.available = available

    def __call__(self) -> int:
        return self.available


def test_short_of_headroom_the_least_valuable_bytes_go_first_down_to_floors() -> None:
    kv, l1 = Cache(value=3.0), Cache(value=1.0)
    machine = Machine(available=100 * MIB)
    controller = BudgetController(
        [
            budget("kv", kv, 50 * MIB, 500 * MIB, 400 * MIB),
            budget("l1", l1, 10 * MIB, 64 * MIB, 64 * MIB),
        ],
        machine,
        headroom_bytes=200 * MIB,
    )
    # 100 MiB short: L1 (less valuable per byte) gives its 54 MiB above its floor, then the KV
    # pool the other 46
    assert controller.tick() == [
        Decision("l1", 64 * MIB, 10 * MIB, "shrink"),
        Decision("kv", 400 * MIB, 354 * MIB, "shrink"),
    ]
    assert (l1.sizes, kv.sizes) == ([10 * MIB], [354 * MIB])


def test_floors_hold_and_the_shortfall_is_reported() -> None:
    only = Cache(value=1.0)
    controller = BudgetController(
        [budget("only", only, 10 * MIB, 64 * MIB, 20 * MIB)], Machine(0), headroom_bytes=50 * MIB
    )
    assert controller.tick() == [
        Decision("only", 20 * MIB, 10 * MIB, "shrink"),
        Decision("*", 40 * MIB, 0, "floors"),
    ]
    assert controller.tick() == []  # settling: the shrink may not show in the reading yet
    assert controller.tick() == []
    assert controller.tick() == [Decision("*", 50 * MIB, 0, "floors")]  # nothing left to give


def test_bytes_a_cache_still_holds_over_its_budget_count_as_given_back() -> None:
    """The KV pool evicts at its next request: until then the reading does not show the
    shrink, and the controller must not take the same shortfall again from the others."""
    kv, l1 = Cache(value=1.0), Cache(value=2.0)
    held = {"kv": 400 * MIB}
    controller = BudgetController(
        [
            Budget("kv", 0, 400 * MIB, 400 * MIB, kv.resize, lambda: 1.0, lambda: held["kv"]),
            budget("l1", l1, 0, 64 * MIB, 64 * MIB),
        ],
        Machine(available=0),
        headroom_bytes=100 * MIB,
        settle_ticks=0,
    )
    assert controller.tick() == [Decision("kv", 400 * MIB, 300 * MIB, "shrink")]
    # nothing freed yet (no request since), the reading is the same: nothing more is taken
    assert controller.tick() == []
    held["kv"] = 300 * MIB  # the pool evicted; the memory is still short (held by others)
    assert controller.tick() == [Decision("kv", 300 * MIB, 200 * MIB, "shrink")]


def test_room_grows_the_most_valuable_first_by_a_fraction_of_the_surplus_up_to_ceilings() -> None:
    kv, l1 = Cache(value=3.0), Cache(value=1.0)
    machine = Machine(available=1000 * MIB)
    controller = BudgetController(
        [
            budget("kv", kv, 50 * MIB, 500 * MIB, 400 * MIB),
            budget("l1", l1, 10 * MIB, 64 * MIB, 10 * MIB),
        ],
        machine,
        headroom_bytes=200 * MIB,
        hysteresis=0.25,
        grow_fraction=0.5,
    )
    # surplus over 250 MiB: 750; half of it, 375, goes: the KV pool to its ceiling (100), then
    # L1 to its ceiling (54); the rest is left free
    assert controller.tick() == [
        Decision("kv", 400 * MIB, 500 * MIB, "grow"),
        Decision("l1", 10 * MIB, 64 * MIB, "grow"),
    ]
    assert controller.tick() == []  # at the ceilings


def test_an_unfilled_budget_is_memory_promised_and_an_idle_cache_stops_growing() -> None:
    """A budget its cache has not filled uses no memory, so the machine's surplus did not
    move: it was granted half the same surplus again every tick, up to its ceiling, and a
    burst then passed the headroom. The unfilled part counts as promised: the budget settles
    at what the surplus allows over what the cache holds."""
    cache = Cache(value=1.0)
    held = [10 * MIB]
    machine = Machine(available=60 * MIB)
    controller = BudgetController(
        [
            Budget(
                "l1", MIB, 200 * MIB, 15 * MIB, cache.resize, lambda: cache.value,
                used=lambda: held[0],
            )
        ],
        machine,
        headroom_bytes=40 * MIB,
        hysteresis=0.0,
        grow_fraction=0.5,
    )  # fmt: skip
    for _ in range(30):
        controller.tick()
    # the surplus is 20 MiB: the budget may promise at most that past the 10 MiB it holds
    assert controller.budgets[0].current_bytes <= 30 * MIB
    held[0] = 25 * MIB  # the cache fills (and the machine has 15 MiB less)
    machine.available -= 15 * MIB
    for _ in range(30):
        controller.tick()
    assert controller.budgets[0].current_bytes <= 30 * MIB


def test_another_budgets_unfilled_bytes_do_not_keep_a_full_cache_from_growing() -> None:
    """A graph budget its scopes never fill sits at its ceiling with nothing held: L1, full at
    its floor after a squeeze, grows back by the surplus all the same (counting every budget's
    unfilled bytes against the surplus kept it at its floor while the memory sat free)."""
    graphs, l1 = Cache(value=2.0), Cache(value=1.0)
    held_l1 = [MIB]
    controller = BudgetController(
        [
            Budget(
                "graphs", MIB, 512 * MIB, 512 * MIB, graphs.resize, lambda: graphs.value,
                used=lambda: 0,
            ),
            Budget("l1", MIB, 64 * MIB, MIB, l1.resize, lambda: l1.value, used=lambda: held_l1[0]),
        ],
        Machine(available=2 * GIB),
        headroom_bytes=512 * MIB,
        hysteresis=0.0,
        grow_fraction=0.5,
    )  # fmt: skip
    controller.tick()
    assert controller.budgets[1].current_bytes == 64 * MIB


def test_within_the_hysteresis_band_nothing_moves() -> None:
    cache = Cache(value=1.0)
    machine = Machine(available=220 * MIB)
    controller = BudgetController(
        [budget("c", cache, 0, 64 * MIB, 32 * MIB)], machine, headroom_bytes=200 * MIB
    )
    assert controller.tick() == []
    assert cache.sizes == []


def test_a_squeeze_then_its_end_shrinks_then_grows_back() -> None:
    cache = Cache(value=1.0)
    machine = Machine(available=1000 * MIB)
    controller = BudgetController(
        [budget("c", cache, 8 * MIB, 256 * MIB, 256 * MIB)],
        machine,
        headroom_bytes=100 * MIB,
        grow_fraction=1.0,
    )
    machine.available = 40 * MIB  # another process took memory
    assert controller.tick() == [Decision("c", 256 * MIB, 196 * MIB, "shrink")]
    machine.available = 100 * MIB  # what the shrink gave back: at the headroom, inside the band
    assert controller.tick() == []
    machine.available = 1000 * MIB  # the other process is gone
    assert controller.tick() == [Decision("c", 196 * MIB, 256 * MIB, "grow")]


@pytest.mark.parametrize(
    ("floor", "ceiling"), [(-1, 10), (11, 10)], ids=["negative-floor", "floor-over-ceiling"]
)
def test_a_budget_out_of_order_is_a_config_error(floor: int, ceiling: int) -> None:
    with pytest.raises(ConfigError, match="floor"):
        budget("c", Cache(1.0), floor, ceiling, 5)


def test_controller_settings_are_checked() -> None:
    one = budget("c", Cache(1.0), 0, 10, 5)
    with pytest.raises(ConfigError, match="headroom"):
        BudgetController([one], Machine(0), headroom_bytes=-1)
    with pytest.raises(ConfigError, match="grow_fraction"):
        BudgetController([one], Machine(0), headroom_bytes=0, grow_fraction=0.0)
    with pytest.raises(ConfigError, match="distinct"):
        BudgetController([one, budget("c", Cache(1.0), 0, 10, 5)], Machine(0), 0)


def test_the_thread_ticks_and_survives_a_failing_reading() -> None:
    readings = iter([ValueError("probe broke"), 0, 0, 0, 0, 0])
    ticked = threading.Event()
    seen: list[list[Decision]] = []

    def available() -> int:
        item = next(readings, 0)
        if isinstance(item, Exception):
            raise item
        return item

    def on_tick(decisions: list[Decision]) -> None:
        seen.append(decisions)
        ticked.set()

    cache = Cache(value=1.0)
    controller = BudgetController([budget("c", cache, 0, 64 * MIB, 64 * MIB)], available, MIB)
    thread = BudgetThread(controller, interval_s=0.01, on_tick=on_tick).start()
    assert ticked.wait(10.0)
    thread.close()
    assert seen[0] == [Decision("c", 64 * MIB, 63 * MIB, "shrink")]  # after the failed tick


def test_l1_resized_down_evicts_at_once_in_its_policys_order() -> None:
    size = CacheEntry("x" * 100, 0.0).size_bytes
    store = MemoryStore(10 * size)
    for i in range(10):
        store.put(f"k{i}", CacheEntry("x" * 100, 0.0))
    assert store.get("k0") is not None  # most recently used now
    assert store.resize(3 * size) == 3 * size
    stats = store.stats()
    assert (stats.entries, stats.bytes, stats.max_bytes) == (3, 3 * size, 3 * size)
    assert store.get("k0") is not None and store.get("k1") is None
    store.resize(10 * size)  # grown: room again, nothing comes back by itself
    store.put("new", CacheEntry("x" * 100, 0.0))
    assert store.stats().entries == 4
    with pytest.raises(ValueError):
        store.resize(0)


def test_the_kv_pool_applies_a_smaller_budget_on_its_next_request() -> None:
    pool: KvBlockPool[str] = KvBlockPool(max_bytes=10 * 100, tokens_per_block=1)
    lease = pool.acquire([], prompt_tokens=5)
    for key in (b"a", b"b", b"c", b"d"):
        assert pool.insert(lease, key, 100, lambda: "payload")
    pool.release(lease)
    assert pool.stats().bytes == 400
    assert pool.resize(200) == 200
    assert pool.stats().bytes == 400  # the engine thread applies it: at the next request
    pool.release(pool.acquire([], prompt_tokens=2))
    assert pool.stats().bytes == 200  # the two blocks past the budget, leaves first
    with pytest.raises(ConfigError):
        pool.resize(-1)


def test_shadow_value_is_seconds_saved_per_second_per_byte_of_shadow() -> None:
    counters = [(0.0, 0.0)]
    clock = [0.0]
    value = ShadowValue(lambda: counters[-1], clock=lambda: clock[0])
    clock[0] = 1.0
    assert value() == 0.0  # no shadow yet
    counters.append((2.0, 1000.0))  # 2 s saved in 1 s over a shadow of 1,000 bytes
    clock[0] = 2.0
    assert value() == pytest.approx(0.001)  # half of 0.002 (the first estimate was 0)
    clock[0] = 4.0  # 2 s more with no shadow hit: decays
    assert value() == pytest.approx(0.0005)
    clock[0] = 4.0  # no time passed: unchanged, not divided by zero
    assert value() == pytest.approx(0.0005)
    counters.append((4.0, 0.0))  # a hit worth 2 s that emptied the shadow: still counted
    clock[0] = 5.0
    assert value() == pytest.approx((0.0005 + 2.0 / 1000) / 2)
    for look in range(QUIET_LOOKS):  # no hit since: halved each look, then worth nothing
        clock[0] += 1.0
        estimate = value()
        assert estimate > 0.0 if look < QUIET_LOOKS - 1 else estimate == 0.0


def publish_all(*controllers: BudgetController) -> None:
    """Each controller publishes its budgets, as a stage does at its first look."""
    for controller in controllers:
        assert controller.ledger is not None
        controller.ledger.publish(controller._own())


def ledger_budget(name: str, cache: Cache, ceiling: int, current: int) -> Budget:
    return Budget(name, 0, ceiling, current, cache.resize, lambda: cache.value)


def test_processes_of_a_host_share_a_shortfall_by_their_budgets(tmp_path: Path) -> None:
    """Two stage processes read the same memory: each sheds its share (its budgets' bytes over
    both), not the whole shortfall; a file left by a process that is gone does not count."""
    folder = tmp_path / "budgets"
    folder.mkdir()
    (folder / "gone.999999999").write_text(json.dumps([["kv", 10 * GIB, 0.0, 0, 10 * GIB, 0]]))
    machine = Machine(available=0)
    caches = {"a": Cache(1.0), "b": Cache(1.0)}
    controllers = [
        BudgetController(
            [budget("a", caches["a"], 0, 300 * MIB, 300 * MIB)],
            machine,
            headroom_bytes=200 * MIB,
            ledger=HostLedger(folder, "prompt_cache", pid=os.getpid()),
        ),
        BudgetController(
            [budget("b", caches["b"], 0, 100 * MIB, 100 * MIB)],
            machine,
            headroom_bytes=200 * MIB,
            ledger=HostLedger(folder, "torch_llm", pid=os.getppid()),
        ),
    ]
    publish_all(*controllers)  # each publishes its budgets first
    decisions = [c.tick() for c in controllers]
    # 200 MiB short: a holds 3/4 of the host's budgets and sheds 150, b 1/4 and sheds 50
    assert decisions == [
        [Decision("a", 300 * MIB, 150 * MIB, "shrink")],
        [Decision("b", 100 * MIB, 50 * MIB, "shrink")],
    ]
    HostLedger(folder, "prompt_cache", pid=os.getpid()).close()
    assert sorted(p.name for p in folder.iterdir()) == [
        "gone.999999999",
        f"torch_llm.{os.getppid()}",
    ]


def test_under_a_total_bytes_move_across_processes_to_the_more_valuable_cache(
    tmp_path: Path,
) -> None:
    """The answers' L1 (one process) and the KV pool (another) share a total: when the pool's
    next byte saves twice what L1's does, L1 gives a step and the pool's process takes the room
    at its next tick; never more than the total, and nothing moves between near equals."""
    folder = tmp_path / "budgets"
    machine = Machine(available=100 * GIB)
    l1, kv = Cache(1.0), Cache(2.0)
    total = 160 * MIB
    answers = BudgetController(
        [ledger_budget("l1", l1, total, 80 * MIB)],
        machine,
        headroom_bytes=0,
        ledger=HostLedger(folder, "prompt_cache", pid=os.getpid()),
        total_bytes=total,
        settle_ticks=1,
    )
    engine = BudgetController(
        [ledger_budget("kv_pool", kv, total, 80 * MIB)],
        machine,
        headroom_bytes=0,
        ledger=HostLedger(folder, "torch_llm", pid=os.getppid()),
        total_bytes=total,
        settle_ticks=1,
    )
    publish_all(answers, engine)  # both published (a stage publishes as it starts)
    assert engine.tick() == []  # the pool is worth more, but the host is at its total
    assert answers.tick() == [Decision("l1", 80 * MIB, 70 * MIB, "move")]  # a 1/16 step
    assert engine.tick() == [Decision("kv_pool", 80 * MIB, 90 * MIB, "grow")]
    assert answers.tick() == []  # settling: the pool's growth and values show first
    assert answers.tick() == [Decision("l1", 70 * MIB, 60 * MIB, "move")]
    assert answers.tick() == []  # the room is the pool's to take, not l1's
    assert engine.tick() == [Decision("kv_pool", 90 * MIB, 100 * MIB, "grow")]
    kv.value = 1.2  # the pool's next byte is worth about what l1's is: nothing moves
    for _ in range(3):
        assert engine.tick() == [] and answers.tick() == []
    assert sum(b.current_bytes for c in (answers, engine) for b in c.budgets) == total


def test_over_the_total_budgets_shrink_to_it_least_valuable_first() -> None:
    l1, kv = Cache(1.0), Cache(2.0)
    controller = BudgetController(
        [
            ledger_budget("l1", l1, 128 * MIB, 128 * MIB),
            ledger_budget("kv", kv, 128 * MIB, 128 * MIB),
        ],
        Machine(100 * GIB),
        headroom_bytes=0,
        total_bytes=160 * MIB,
    )
    assert controller.tick() == [Decision("l1", 128 * MIB, 32 * MIB, "shrink")]


def test_the_ledger_ignores_torn_stale_or_hostile_files(tmp_path: Path) -> None:
    """The state directory is read as hostile: a bad file costs its writer its say, never a
    failed tick, a blocked read or an unbounded one."""
    folder = tmp_path / "budgets"
    folder.mkdir()
    alive = os.getppid()
    (folder / f"torn.{alive}").write_text('[["kv", 10')
    (folder / f"negative.{alive}").write_text(json.dumps([["kv", -5, 1.0, 0, 10, 0]]))
    (folder / f"nan.{alive}").write_text('[["kv", 5, NaN, 0, 10, 0]]')
    (folder / f"infinite.{alive}").write_text('[["kv", 1e400, 1.0, 0, 10, 0]]')
    (folder / f"over-ceiling.{alive}").write_text(json.dumps([["kv", 11, 1.0, 0, 10, 0]]))
    (folder / f"deep.{alive}").write_text("[" * 100_000)
    (folder / f"many.{alive}").write_text(json.dumps([["kv", 1, 1.0, 0, 10, 0]] * 17))
    (folder / f"huge.{alive}").write_text(" " * (MAX_LEDGER_BYTES + 1) + "[]")
    os.mkfifo(folder / f"fifo.{alive}")  # a read would block forever
    (folder / f"zeros.{alive}").symlink_to("/dev/zero")  # a read would never end
    (folder / "init.1").write_text(json.dumps([["kv", 5, 1.0, 0, 10, 0]]))  # pid 1 always "lives"
    stale = folder / f"stale.{alive}"
    stale.write_text(json.dumps([["kv", 5, 9.0, 0, 10, 0]]))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # left from before a restart
    (folder / f"good.{alive}").write_text(json.dumps([["kv", 5, 1.0, 0, 10, 0]]))
    vast = [["kv", 10**400, 1.0, 0, 10**400, 0]]  # a float of it overflowed every tick
    (folder / f"vast.{alive}").write_text(json.dumps(vast))
    (folder / f"joins-two.{alive}").write_text(json.dumps([["kv", 5, 1.0, 0, 10, 0, 0, 2]]))
    own = [LedgerEntry(OWN, "l1", 3, 0.5, 0, 10)]
    host = HostLedger(folder, "prompt_cache", stale_s=60).publish(own)
    assert host == own + [LedgerEntry(f"good.{alive}", "kv", 5, 1.0, 0, 10)]


def test_the_ledger_refuses_planted_futures_floods_and_links(tmp_path: Path) -> None:
    """A file stamped in the future never went stale (a planted row of 2**53 bytes named for
    pid 2, always alive, made every cut come to nothing); a folder planted full was read
    whole at every look; a link at the fixed temporary name took the ledger's write; a
    ledger folder that is a link led its stale-file removal elsewhere."""
    from tiercache.budgets import MAX_LEDGER_FILES

    folder = tmp_path / "budgets"
    folder.mkdir()
    alive = os.getppid()
    future = folder / f"future.{alive}"
    future.write_text(json.dumps([["kv", 5, 1.0, 0, 10, 0]]))
    os.utime(future, (time.time() + 10**8, time.time() + 10**8))
    target = tmp_path / "precious"
    target.write_text("kept")
    (folder / f"prompt_cache.{os.getpid()}.tmp").symlink_to(target)  # the old fixed name
    own = [LedgerEntry(OWN, "l1", 3, 0.5, 0, 10)]
    assert HostLedger(folder, "prompt_cache", stale_s=60).publish(own) == own
    assert target.read_text() == "kept"
    future.unlink()
    for i in range(MAX_LEDGER_FILES + 10):
        (folder / f"flood{i:03d}.{alive}").write_text(json.dumps([["kv", 1, 1.0, 0, 10, 0]]))
    found = HostLedger(folder, "prompt_cache", stale_s=60).publish(own)
    assert found is not None and len(found) == 1 + MAX_LEDGER_FILES
    linked = tmp_path / "linked"
    linked.symlink_to(folder, target_is_directory=True)
    assert HostLedger(linked, "prompt_cache", stale_s=60).publish(own) is None


def test_a_share_of_a_few_bytes_over_the_total_is_cut_not_rounded_away() -> None:
    """Three processes a byte over the total between them: each part rounded to 0, nobody
    cut, and the host stayed over the total, which blocks every move and growth for good."""
    from tiercache.budgets import _cut_bytes

    entries = [
        LedgerEntry(owner, "l1", held, 1.0, 0, 1000)
        for owner, held in ((OWN, 334), ("b.2", 334), ("c.3", 333))
    ]  # 1,001 held under a total of 1,000: half a byte each for the first two
    assert _cut_bytes(entries, 1000, 1) == 1


def test_an_unusable_ledger_folder_leaves_a_process_alone_and_holding_under_a_total(
    tmp_path: Path,
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    own = [LedgerEntry(OWN, "l1", 3, 0.5, 0, 10)]
    assert HostLedger(blocked / "budgets", "x").publish(own) is None
    cache = Cache(1.0)
    machine = Machine(available=100 * GIB)
    controller = BudgetController(
        [ledger_budget("l1", cache, 64 * MIB, 32 * MIB)],
        machine,
        headroom_bytes=MIB,
        ledger=HostLedger(blocked / "budgets", "x"),
        total_bytes=64 * MIB,
    )
    assert controller.tick() == []  # room under its own view of the total: held, not taken
    machine.available = 0  # memory is still protected
    assert controller.tick() == [Decision("l1", 32 * MIB, 31 * MIB, "shrink")]


def test_no_move_while_room_under_the_total_waits_for_its_taker(tmp_path: Path) -> None:
    """A step given up is the most valuable budget's to take: until it is taken (another
    process's next tick), no second step is given, so a budget nobody grows (a process that
    stopped) cannot drain the others."""
    folder = tmp_path / "budgets"
    folder.mkdir()
    alive = os.getppid()
    # another process's budget worth much more, below its ceiling, 16 MiB under the total
    (folder / f"other.{alive}").write_text(json.dumps([["kv", 48 * MIB, 9.0, 0, 96 * MIB, 0]]))
    l1 = Cache(1.0)
    controller = BudgetController(
        [ledger_budget("l1", l1, 96 * MIB, 32 * MIB)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "prompt_cache"),
        total_bytes=96 * MIB,
        settle_ticks=0,
    )
    for _ in range(5):
        assert controller.tick() == []
    assert l1.sizes == []


def test_a_latency_objective_is_late_met_or_slack_by_its_recent_quantile() -> None:
    clock = [0.0]
    objective = LatencyObjective(
        0.3, window=20, quantile=0.9, slack=0.8, min_requests=10, max_age_s=60,
        clock=lambda: clock[0],
    )  # fmt: skip
    assert objective.state() == SLACK  # too few requests to act on
    for _ in range(20):
        objective.observe(0.1)
    assert objective.state() == SLACK  # p90 0.1 s: well within 0.3
    for _ in range(3):
        objective.observe(0.5)
    assert objective.state() == LATE  # 3 of the last 20 over: the p90 is 0.5 s
    clock[0] = 61.0  # no request for a minute: a burst long past keeps nothing LATE
    assert objective.state() == SLACK
    for _ in range(20):
        objective.observe(0.27)
    assert objective.state() == MET  # within, but not by 20 %
    with pytest.raises(ConfigError):
        LatencyObjective(0.0)


def test_a_missed_objective_grows_its_own_valuable_budget_past_the_total_then_gives_it_back(
    tmp_path: Path,
) -> None:
    """The engine's process misses its TTFT objective (LATE): its budget that more bytes would
    help (its shadow is hit) grows a step a look past the total; the answers' process does not
    cut its own budget for those bytes (published as `over`); met, they are kept; with room to
    spare (SLACK), they go back a step at a time, GIVE_BACK_TICKS looks apart."""
    folder = tmp_path / "budgets"
    kv, l1 = Cache(2.0), Cache(1.0)
    state = [LATE]
    total = 64 * MIB
    engine = BudgetController(
        [ledger_budget("kv_pool", kv, 128 * MIB, 48 * MIB)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "torch_llm", pid=os.getpid()),
        total_bytes=total,
        settle_ticks=0,
        objective=lambda: state[0],
        move_ratio=100.0,
    )
    answers = BudgetController(
        [ledger_budget("l1", l1, 64 * MIB, 16 * MIB)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "prompt_cache", pid=os.getppid()),
        total_bytes=total,
        settle_ticks=0,
        move_ratio=100.0,  # no moves here: the objective alone
    )
    publish_all(engine, answers)  # the host at its total: 48 + 16 MiB
    assert answers.tick() == []
    assert engine.tick() == [Decision("kv_pool", 48 * MIB, 52 * MIB, "grow")]  # a step: 4 MiB
    assert engine.tick() == [Decision("kv_pool", 52 * MIB, 56 * MIB, "grow")]
    assert answers.tick() == []  # the host is 8 MiB over the total, all of it taken for the
    assert l1.sizes == []  # engine's objective: not l1's to cut
    state[0] = MET
    assert engine.tick() == []  # met: what was taken for it is kept
    state[0] = SLACK
    assert engine.tick() == [Decision("kv_pool", 56 * MIB, 52 * MIB, "shrink")]
    for _ in range(GIVE_BACK_TICKS):
        assert engine.tick() == []  # the objective's window refreshes first
    assert engine.tick() == [Decision("kv_pool", 52 * MIB, 48 * MIB, "shrink")]
    assert engine.tick() == []  # nothing past the total left
    published = json.loads((folder / f"torch_llm.{os.getpid()}").read_text())
    assert published == [
        ["kv_pool", 48 * MIB, 2.0, 0, 128 * MIB, SLACK, 0]
    ]  # joining: seven fields
    assert l1.sizes == []  # l1 was never cut or grown for any of it


def test_late_or_not_nothing_grows_past_the_total_that_more_bytes_would_not_help() -> None:
    kv = Cache(0.0)  # its shadow is not hit: more bytes would save nothing
    controller = BudgetController(
        [ledger_budget("kv_pool", kv, 128 * MIB, 64 * MIB)],
        Machine(100 * GIB),
        headroom_bytes=0,
        total_bytes=64 * MIB,
        objective=lambda: LATE,
    )
    for _ in range(3):
        assert controller.tick() == []
    kv.value = 1.0
    assert controller.tick() == [Decision("kv_pool", 64 * MIB, 68 * MIB, "grow")]


def test_a_file_claiming_a_missed_objective_makes_no_other_process_grow(tmp_path: Path) -> None:
    folder = tmp_path / "budgets"
    folder.mkdir()
    alive = os.getppid()
    (folder / f"hostile.{alive}").write_text(json.dumps([["kv", 0, 0.0, 0, 10, LATE, 0]]))
    l1 = Cache(5.0)
    controller = BudgetController(
        [ledger_budget("l1", l1, 96 * MIB, 64 * MIB)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "prompt_cache"),
        total_bytes=64 * MIB,
    )
    for _ in range(3):
        assert controller.tick() == []
    assert l1.sizes == []


def test_an_older_writers_five_field_rows_still_count(tmp_path: Path) -> None:
    folder = tmp_path / "budgets"
    folder.mkdir()
    alive = os.getppid()
    (folder / f"old.{alive}").write_text(json.dumps([["kv", 5, 1.0, 0, 10]]))
    own = [LedgerEntry(OWN, "l1", 3, 0.5, 0, 10)]
    host = HostLedger(folder, "prompt_cache").publish(own)
    assert host == own + [LedgerEntry(f"old.{alive}", "kv", 5, 1.0, 0, 10, SLACK, 0)]


def test_over_the_total_processes_come_to_it_in_proportion(tmp_path: Path) -> None:
    """Both stages start at their ceilings (the whole total each): each cuts its share of the
    excess from the same view, so they meet at half and half, whichever ticks first."""
    folder = tmp_path / "budgets"
    total = 96 * MIB
    controllers = [
        BudgetController(
            [ledger_budget(name, Cache(0.0), total, total)],
            Machine(100 * GIB),
            headroom_bytes=0,
            ledger=HostLedger(folder, stage, pid=pid),
            total_bytes=total,
        )
        for name, stage, pid in (("kv", "torch_llm", os.getppid()), ("l1", "pc", os.getpid()))
    ]
    publish_all(*controllers)
    decisions = [c.tick() for c in controllers]
    assert decisions == [
        [Decision("kv", total, total // 2, "shrink")],
        [Decision("l1", total, total // 2, "shrink")],
    ]


def test_stages_meet_the_total_at_fair_shares_whichever_started_first(tmp_path: Path) -> None:
    """prompt_cache starts first and, alone, cuts itself to the whole total; the engine comes
    later at its ceiling: they meet at half and half (equal ceilings), not 2 : 1."""
    folder = tmp_path / "budgets"
    total = 48 * MIB
    answers = BudgetController(
        [ledger_budget("l1", Cache(0.0), 2 * total, 2 * total)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "prompt_cache", pid=os.getpid()),
        total_bytes=total,
        settle_ticks=0,
    )
    assert answers.tick() == [Decision("l1", 2 * total, total, "shrink")]  # alone
    engine = BudgetController(
        [ledger_budget("kv", Cache(0.0), 2 * total, 2 * total)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "torch_llm", pid=os.getppid()),
        total_bytes=total,
        settle_ticks=0,
    )
    assert answers.tick() == []  # publishes its 48 MiB
    assert engine.tick() == [Decision("kv", 2 * total, total // 2, "shrink")]
    assert answers.tick() == [Decision("l1", total, total // 2, "shrink")]


def test_bytes_kept_for_a_met_objective_survive_a_cut_of_other_excess(tmp_path: Path) -> None:
    """The engine holds 8 MiB past the total for its objective (MET: kept) and the host is
    4 MiB over besides: it cuts its part of those 4, not the 8 (a cut once took both)."""
    folder = tmp_path / "budgets"
    folder.mkdir()
    state = [LATE]
    kv = Cache(2.0)
    engine = BudgetController(
        [ledger_budget("kv_pool", kv, 128 * MIB, 48 * MIB)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "torch_llm"),
        total_bytes=48 * MIB,
        settle_ticks=0,
        objective=lambda: state[0],
        step_fraction=1 / 6,
    )
    assert engine.tick() == [Decision("kv_pool", 48 * MIB, 56 * MIB, "grow")]  # 8 MiB over
    state[0] = MET
    alive = os.getppid()  # another process comes, 4 MiB over its fair share of the total
    (folder / f"other.{alive}").write_text(json.dumps([["l1", 4 * MIB, 0.0, 0, 128 * MIB]]))
    decisions = engine.tick()
    assert len(decisions) == 1 and decisions[0].reason == "shrink"
    assert decisions[0].new_bytes >= 52 * MIB  # never into the 8 MiB kept for the objective
    for _ in range(4):
        engine.tick()
    assert kv.sizes[-1] >= 52 * MIB


def test_a_cache_that_rounds_its_budget_down_never_makes_over_negative() -> None:
    """Grown past the total for a missed objective, a cache that takes less than it was
    given (8 MiB for 68) holds nothing past the total: nothing to give back later."""
    rounded = Budget("kv_pool", 0, 128 * MIB, 64 * MIB, lambda size: 8 * MIB, lambda: 1.0)
    state = [LATE]
    controller = BudgetController(
        [rounded], Machine(100 * GIB), headroom_bytes=0, total_bytes=64 * MIB,
        objective=lambda: state[0],
    )  # fmt: skip
    assert controller.tick() == [Decision("kv_pool", 64 * MIB, 8 * MIB, "grow")]
    assert controller._own()[0].over == 0
    state[0] = SLACK
    assert not [d for d in controller.tick() if d.reason == "shrink"]  # nothing to give back


def test_a_process_held_at_its_floors_leaves_its_part_of_the_excess_to_the_others(
    tmp_path: Path,
) -> None:
    """A: 64 MiB, floor 48 (can give 16); B: 64 MiB, no floor; total 64. Fair shares 32 each:
    A can only give 16 of its 32; B gives its 32 and the 16 A cannot: the host meets it."""
    folder = tmp_path / "budgets"
    a = BudgetController(
        [Budget("a", 48 * MIB, 64 * MIB, 64 * MIB, Cache(0.0).resize, lambda: 0.0)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "a", pid=os.getpid()),
        total_bytes=64 * MIB,
    )
    b = BudgetController(
        [ledger_budget("b", Cache(0.0), 64 * MIB, 64 * MIB)],
        Machine(100 * GIB),
        headroom_bytes=0,
        ledger=HostLedger(folder, "b", pid=os.getppid()),
        total_bytes=64 * MIB,
    )
    publish_all(a, b)
    assert a.tick() == [Decision("a", 64 * MIB, 48 * MIB, "shrink")]
    assert b.tick() == [Decision("b", 64 * MIB, 16 * MIB, "shrink")]


def test_a_budget_past_any_machine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="past any machine"):
        Budget("l1", 0, MAX_BUDGET_BYTES + 1, 0, Cache(1.0).resize, lambda: 1.0)


def test_a_shortfall_is_taken_below_what_a_cache_holds_not_from_its_unfilled_budget() -> None:
    """An L1 of 256 MiB holding 50: cutting its budget to 236 frees nothing, so a 20 MiB
    shortfall brings it to what it holds and takes the 20 below that, at once (cut from the
    budget, the first byte freed came tens of ticks later)."""
    l1 = Cache(value=1.0)
    held = {"l1": 50 * MIB}
    controller = BudgetController(
        [Budget("l1", MIB, 256 * MIB, 256 * MIB, l1.resize, lambda: 1.0,
                used=lambda: held["l1"])],
        Machine(available=80 * MIB),
        headroom_bytes=100 * MIB,
    )  # fmt: skip
    assert controller.tick() == [Decision("l1", 256 * MIB, 30 * MIB, "shrink")]
    quiet = BudgetController(
        [Budget("l1", 40 * MIB, 256 * MIB, 256 * MIB, l1.resize, lambda: 1.0,
                used=lambda: 10 * MIB)],
        Machine(available=80 * MIB),
        headroom_bytes=100 * MIB,
    )  # fmt: skip
    # under its floor already: the budget comes to the floor, and the shortfall is reported
    assert quiet.tick() == [
        Decision("l1", 256 * MIB, 40 * MIB, "shrink"),
        Decision("*", 20 * MIB, 0, "floors"),
    ]


def test_under_a_total_a_stage_with_a_headroom_alone_holds_no_part_of_it(tmp_path: Path) -> None:
    """prompt_cache and the engine share a 96 MiB total; embedding_cache has a headroom only
    (it publishes for the shortfall's shares): its 128 MiB are no excess over the total."""
    folder = tmp_path / "budgets"
    machine = Machine(100 * GIB)
    joined = BudgetController(
        [ledger_budget("l1", Cache(1.0), 64 * MIB, 48 * MIB),
         ledger_budget("kv_pool", Cache(1.0), 64 * MIB, 48 * MIB)],
        machine, headroom_bytes=0, ledger=HostLedger(folder, "joined", pid=os.getpid()),
        total_bytes=96 * MIB,
    )  # fmt: skip
    alone = BudgetController(
        [ledger_budget("vectors", Cache(1.0), 128 * MIB, 128 * MIB)],
        machine, headroom_bytes=MIB, ledger=HostLedger(folder, "alone", pid=os.getppid()),
    )  # fmt: skip
    publish_all(joined, alone)
    assert not [d for d in joined.tick() if d.reason == "shrink"]
    published = json.loads((folder / f"alone.{os.getppid()}").read_text())
    assert len(published[0]) == 8 and published[0][-1] == 0  # it holds no part of a total
    joining = json.loads((folder / f"joined.{os.getpid()}").read_text())
    assert {len(row) for row in joining} == {7}  # as an earlier version writes and reads


def test_equal_values_across_processes_do_not_hold_growth_under_the_total(tmp_path: Path) -> None:
    """Two idle instances of one stage (values 0, equal bytes): every process must pick the
    same budget to grow. Each picked the other's (its own entries sort first) and neither grew:
    5 + 5 MiB of a 64 MiB total, for good."""
    folder = tmp_path / "budgets"
    machine = Machine(100 * GIB)
    caches = [Cache(0.0), Cache(0.0)]
    controllers = [
        BudgetController(
            [ledger_budget("l1", cache, 64 * MIB, 5 * MIB)],
            machine,
            headroom_bytes=0,
            ledger=HostLedger(folder, "embedding_cache", pid=pid),
            total_bytes=64 * MIB,
            settle_ticks=0,
        )  # fmt: skip
        for cache, pid in zip(caches, (os.getpid(), os.getppid()), strict=True)
    ]
    publish_all(*controllers)
    for _ in range(20):
        for controller in controllers:
            controller.tick()
    held = sum(c.budgets[0].current_bytes for c in controllers)
    assert held == 64 * MIB


def test_a_budget_squeezed_to_a_zero_floor_grows_back_without_a_total(tmp_path: Path) -> None:
    """Without a total a surplus is shared by ceilings: shared by bytes, a process whose
    budgets were all at 0 took no part of it and stayed at 0 with the machine free."""
    folder = tmp_path / "budgets"
    machine = Machine(20 * GIB)
    kv = Cache(1.0)
    engine = BudgetController(
        [ledger_budget("kv_pool", kv, 64 * MIB, 0)], machine, headroom_bytes=GIB,
        ledger=HostLedger(folder, "torch_llm", pid=os.getpid()),
    )  # fmt: skip
    answers = BudgetController(
        [ledger_budget("l1", Cache(1.0), 64 * MIB, 64 * MIB)], machine, headroom_bytes=GIB,
        ledger=HostLedger(folder, "prompt_cache", pid=os.getppid()),
    )  # fmt: skip
    publish_all(engine, answers)
    assert engine.tick() == [Decision("kv_pool", 0, 64 * MIB, "grow")]


def test_a_shortfall_at_the_floors_is_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    controller = BudgetController(
        [budget("only", Cache(1.0), 10 * MIB, 64 * MIB, 10 * MIB)], Machine(0),
        headroom_bytes=50 * MIB, settle_ticks=0,
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="tiercache.budgets"):
        for _ in range(5):
            assert controller.tick() == [Decision("*", 50 * MIB, 0, "floors")]
    assert sum("every cache budget at its floor" in r.getMessage() for r in caplog.records) == 1


def test_a_tick_that_shrank_returns_the_freed_heap() -> None:
    trims: list[int] = []

    def trim() -> bool:
        trims.append(1)
        return True

    assert release_after([Decision("l1", 64 * MIB, 32 * MIB, "shrink")], trim)
    assert release_after([Decision("vectors", 8 * MIB, 4 * MIB, "move")], trim)
    assert not release_after([Decision("l1", 32 * MIB, 48 * MIB, "grow")], trim)
    assert not release_after([Decision("*", 20 * MIB, 0, "floors")], trim)
    assert not release_after([], trim)
    assert len(trims) == 2


def test_a_file_left_by_a_process_that_is_gone_is_removed_once_stale(tmp_path: Path) -> None:
    """A killed stage never closed its ledger: its file stayed, one a crash, and every look
    signalled its pid. Gone and stale, it is removed; gone but fresh (a process in another pid
    namespace, which rewrites it each look) it stays; a live one's stale file stays."""
    folder = tmp_path / "budgets"
    folder.mkdir()
    row = json.dumps([["kv", 5, 1.0, 0, 10, 0]])
    old = time.time() - 3600
    for name in ("crashed.999999999", "elsewhere.999999998", f"stuck.{os.getppid()}"):
        (folder / name).write_text(row)
    os.utime(folder / "crashed.999999999", (old, old))
    os.utime(folder / f"stuck.{os.getppid()}", (old, old))
    own = [LedgerEntry(OWN, "l1", 3, 0.5, 0, 10)]
    assert HostLedger(folder, "prompt_cache", stale_s=60).publish(own) == own
    assert sorted(p.name for p in folder.iterdir()) == [
        "elsewhere.999999998",
        f"prompt_cache.{os.getpid()}",
        f"stuck.{os.getppid()}",
    ]
