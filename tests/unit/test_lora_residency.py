"""tiercache.lora.residency: the engine mirror, the host tier and the plans between them."""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable

import pytest

from tiercache.adapter_types import AdapterRef, AdapterWeights, held_key
from tiercache.errors import CapacityError, ConfigError, Unavailable
from tiercache.eviction import SkipKey, named_policy, take_victims
from tiercache.lora.residency import LoraPlan, Residency
from tiercache.lora.types import DISK_TIER, ENGINE_TIER, HOST_TIER


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeDisk:
    """The registry's read(): versions by digest, counting reads; a read takes 0.5 s."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.versions: dict[str, AdapterWeights] = {}
        self.latest: dict[str, str] = {}
        self.reads: list[str] = []

    def add(self, name: str, task_id: int, nbytes: int = 100, version: str = "v1") -> AdapterRef:
        digest = hashlib.sha256(f"{name}/{version}".encode()).hexdigest()
        ref = AdapterRef(name, task_id, digest)
        self.versions[digest] = AdapterWeights(ref, "{}", b"w" * (nbytes - 2))
        self.latest[name] = digest
        return ref

    def remove(self, ref: AdapterRef) -> None:
        del self.versions[ref.digest]

    def read(self, ref: AdapterRef) -> AdapterWeights:
        self.reads.append(ref.name)
        self.clock.now += 0.5
        if ref.digest not in self.versions:
            raise Unavailable(f"adapter {ref.name!r} changed since this request was resolved")
        return self.versions[ref.digest]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def disk(clock: FakeClock) -> FakeDisk:
    return FakeDisk(clock)


MakeResidency = Callable[..., Residency]


@pytest.fixture
def make(clock: FakeClock, disk: FakeDisk) -> MakeResidency:
    def make(**kwargs: object) -> Residency:
        settings: dict[str, object] = {
            "engine_slots": 2,
            "host_max_adapters": 4,
            "host_max_bytes": 10_000,
            "latest": disk.latest.get,
            "clock": clock,
        }
        settings.update(kwargs)
        return Residency(**settings)  # type: ignore[arg-type]

    return make


def engine_names(residency: Residency) -> list[str]:
    return [a.name for a in residency.snapshot().engine]


def host_names(residency: Residency) -> list[str]:
    return [a.name for a in residency.snapshot().host]


def test_first_plan_reads_disk_then_the_engine_holds_it(
    make: MakeResidency, disk: FakeDisk
) -> None:
    residency = make()
    a = disk.add("a", 1)
    first = residency.plan(a, disk.read)
    assert (first.tier, first.evict, first.read_s) == (DISK_TIER, (), 0.5)
    assert first.weights is disk.versions[a.digest]
    second = residency.plan(a, disk.read)
    assert second == LoraPlan(a, ENGINE_TIER, None, (), 0.0)
    assert disk.reads == ["a"]
    stats = residency.stats()
    assert stats.hits == {ENGINE_TIER: 1, HOST_TIER: 0, DISK_TIER: 1}
    assert stats.loads == {ENGINE_TIER: 1, HOST_TIER: 1}
    assert (stats.disk_reads, stats.disk_read_s) == (1, 0.5)
    assert stats.resident == {ENGINE_TIER: 1, HOST_TIER: 1}


def test_engine_is_lru_by_slots_and_host_serves_the_evicted(
    make: MakeResidency, disk: FakeDisk
) -> None:
    residency = make(engine_slots=2)
    a, b, c = disk.add("a", 1), disk.add("b", 2), disk.add("c", 3)
    residency.plan(a, disk.read)
    residency.plan(b, disk.read)
    residency.plan(a, disk.read)  # a is now more recent than b
    plan = residency.plan(c, disk.read)
    assert plan.evict == (held_key(b),)
    assert engine_names(residency) == ["c", "a"]
    again = residency.plan(b, disk.read)
    assert (again.tier, again.evict) == (HOST_TIER, (held_key(a),))
    assert again.weights is disk.versions[b.digest]
    assert disk.reads == ["a", "b", "c"]
    assert residency.stats().evictions[ENGINE_TIER] == 2


def test_engine_byte_budget(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make(engine_slots=8, engine_max_bytes=250)
    a, b, c = disk.add("a", 1, 100), disk.add("b", 2, 100), disk.add("c", 3, 120)
    residency.plan(a, disk.read)
    residency.plan(b, disk.read)
    assert residency.plan(c, disk.read).evict == (held_key(a),)  # 100 + 120 <= 250
    big = disk.add("big", 4, 300)
    with pytest.raises(CapacityError, match="engine_max_bytes"):
        residency.plan(big, disk.read)
    assert engine_names(residency) == ["c", "b"]  # unchanged by the refused plan


def test_host_is_lru_by_count_and_bytes(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make(engine_slots=1, host_max_adapters=2, host_max_bytes=250)
    a, b, c = disk.add("a", 1, 100), disk.add("b", 2, 100), disk.add("c", 3, 100)
    for ref in (a, b, c):
        residency.plan(ref, disk.read)
    assert host_names(residency) == ["c", "b"]  # count bound: 2
    d = disk.add("d", 4, 200)
    residency.plan(d, disk.read)
    assert host_names(residency) == ["d"]  # byte bound: 200 + 100 > 250
    assert residency.stats().evictions[HOST_TIER] == 3


def test_host_smaller_than_one_adapter_still_serves(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make(engine_slots=1, host_max_adapters=1, host_max_bytes=50)
    a, b = disk.add("a", 1, 100), disk.add("b", 2, 100)
    plan = residency.plan(a, disk.read)
    assert plan.weights is not None and plan.tier == DISK_TIER
    assert host_names(residency) == []
    residency.plan(b, disk.read)
    again = residency.plan(a, disk.read)  # evicted from the engine, never kept: disk again
    assert again.tier == DISK_TIER and again.weights is not None
    assert residency.stats().loads[HOST_TIER] == 0


@pytest.mark.parametrize("host_max_adapters, host_max_bytes", [(0, 10_000), (4, 0)])
def test_host_tier_can_be_off(
    make: MakeResidency, disk: FakeDisk, host_max_adapters: int, host_max_bytes: int
) -> None:
    residency = make(host_max_adapters=host_max_adapters, host_max_bytes=host_max_bytes)
    plan = residency.plan(disk.add("a", 1), disk.read)
    assert plan.weights is not None and host_names(residency) == []


def test_pinned_adapters_stay_in_the_engine(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make(engine_slots=2, pinned=["a"])
    a, b, c = disk.add("a", 1), disk.add("b", 2), disk.add("c", 3)
    residency.plan(a, disk.read)
    residency.plan(b, disk.read)
    for ref in (c, b, c):  # a is least recently used throughout, yet stays
        assert held_key(a) not in residency.plan(ref, disk.read).evict
    assert sorted(engine_names(residency)) == ["a", "c"]
    assert [x.pinned for x in residency.snapshot().engine if x.name == "a"] == [True]


def test_pins_must_leave_a_free_slot() -> None:
    Residency(engine_slots=3, pinned=["a", "b"])
    with pytest.raises(ConfigError, match="engine_slots >= 3"):
        Residency(engine_slots=2, pinned=["a", "b"])
    with pytest.raises(ConfigError, match="engine_slots must be >= 1"):
        Residency(engine_slots=0)
    with pytest.raises(ConfigError, match="host_max_bytes must be >= 0"):
        Residency(engine_slots=1, host_max_bytes=-1)


def test_pinned_bytes_can_leave_no_room(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make(engine_slots=3, engine_max_bytes=250, pinned=["a"])
    a, b = disk.add("a", 1, 200), disk.add("b", 2, 100)
    residency.plan(a, disk.read)
    with pytest.raises(CapacityError, match="pinned"):
        residency.plan(b, disk.read)
    assert engine_names(residency) == ["a"]


def test_a_plan_that_cannot_fit_withdraws_its_offer(make: MakeResidency, disk: FakeDisk) -> None:
    """No room (the pinned adapter's bytes): the policy nominated `b`, and the plan was refused.
    Under gdsf, `b`'s later removal as a stale version then counted as an eviction and raised
    the aging level to `b`'s value; a refused plan withdraws its offer."""
    from tiercache.eviction import GreedyDualFrequencyPolicy

    policy: GreedyDualFrequencyPolicy[str] = GreedyDualFrequencyPolicy(4)
    residency = make(engine_slots=3, engine_max_bytes=250, pinned=["a"], engine_policy=policy)
    a, b = disk.add("a", 1, 200), disk.add("b", 2, 40)
    residency.plan(a, disk.read)
    residency.plan(b, disk.read)
    with pytest.raises(CapacityError, match="pinned"):
        residency.plan(disk.add("c", 3, 100), disk.read)
    assert residency.plan(disk.add("b", 2, 40, version="v2"), disk.read).evict == (held_key(b),)
    assert policy.inflation == 0.0


def test_new_version_evicts_the_old_one_from_the_engine(
    make: MakeResidency, disk: FakeDisk
) -> None:
    residency = make(engine_slots=3)
    old = disk.add("a", 1, version="v1")
    residency.plan(old, disk.read)
    new = disk.add("a", 1, version="v2")  # the folder changed: same name and task id
    plan = residency.plan(new, disk.read)
    assert plan.tier == DISK_TIER and plan.weights is not None
    assert plan.evict == (held_key(old),)  # even though a free slot was left
    assert [x.digest for x in residency.snapshot().engine] == [new.digest]
    # a late request resolved before the change finishes on the old version, from host memory,
    # without evicting the current one
    disk.remove(old)
    late = residency.plan(old, disk.read)
    assert (late.tier, late.evict) == (HOST_TIER, ())
    assert late.weights is not None and late.weights.ref == old
    # the next request for the current version drops the old one again
    assert residency.plan(new, disk.read).evict == (held_key(old),)


def test_an_old_version_the_host_tier_cannot_hold_stays_in_the_engine_for_late_requests(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """The folder changed and the host tier holds no copy of the old version (larger than
    the tier: it passed through). Evicted from the engine by the new version's first plan, a
    request resolved before the change then failed: the folder no longer has it. It stays in
    the engine (a policy victim like any other) and the late request is an engine hit."""
    residency = make(engine_slots=3, host_max_bytes=50)
    old = disk.add("a", 1, nbytes=100, version="v1")
    residency.plan(old, disk.read)
    new = disk.add("a", 1, nbytes=100, version="v2")
    assert residency.plan(new, disk.read).evict == ()
    disk.remove(old)
    late = residency.plan(old, disk.read)
    assert (late.tier, late.evict) == (ENGINE_TIER, ())
    assert sorted(x.digest for x in residency.snapshot().engine) == sorted([old.digest, new.digest])


def test_with_the_engine_full_the_policys_victim_goes_before_an_old_version_kept_for_late_requests(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """Every slot taken, the old version of `a` held in the engine only (larger than the host
    tier), the folder changed: the new version's first plan evicts the policy's victim, whose
    files the folder still has (a request of its own is loaded again), not the old version,
    which a request resolved before the change could find nowhere else."""
    residency = make(engine_slots=3, host_max_bytes=50)
    b = disk.add("b", 2, nbytes=40)
    residency.plan(b, disk.read)
    c = disk.add("c", 3, nbytes=40)
    residency.plan(c, disk.read)
    old = disk.add("a", 1, nbytes=100, version="v1")
    residency.plan(old, disk.read)
    new = disk.add("a", 1, nbytes=100, version="v2")
    assert residency.plan(new, disk.read).evict == (held_key(b),)  # the least recently used
    disk.remove(old)
    late = residency.plan(old, disk.read)
    assert (late.tier, late.evict) == (ENGINE_TIER, ())


def test_an_old_version_kept_for_late_requests_is_the_first_to_make_room(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """Kept in the engine without a host copy, an old version is the first victim when room is
    needed (the policy would give it up last: it is its name's most recently used), and for a
    pinned name it never keeps the new version out (it was protected as the name's most
    recently used, and every plan for the new one was refused until a restart)."""
    residency = make(engine_slots=3, engine_max_bytes=250, host_max_bytes=50, pinned=["a"])
    other = disk.add("b", 2, nbytes=50)
    residency.plan(other, disk.read)
    old = disk.add("a", 1, nbytes=150, version="v1")
    residency.plan(old, disk.read)
    new = disk.add("a", 1, nbytes=150, version="v2")
    plan = residency.plan(new, disk.read)  # 350 bytes would not fit: the old version goes
    assert plan.evict == (held_key(old),)
    assert sorted(engine_names(residency)) == ["a", "b"]


def test_a_late_request_for_an_old_version_never_evicts_the_pinned_current_one(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """Pinned `a`: its current version stays protected when a late request brings the old one
    back from the host tier (the unpinned least recently used goes instead)."""
    residency = make(engine_slots=3, pinned=["a"])
    v1 = disk.add("a", 1, version="v1")
    residency.plan(v1, disk.read)
    v2 = disk.add("a", 1, version="v2")
    residency.plan(v2, disk.read)  # v1 leaves the engine; the host tier keeps it
    b, c = disk.add("b", 2), disk.add("c", 3)
    residency.plan(b, disk.read)
    residency.plan(c, disk.read)
    late = residency.plan(v1, disk.read)
    assert late.evict == (held_key(b),)


def test_gone_version_is_unavailable(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make(host_max_adapters=0)
    old = disk.add("a", 1, version="v1")
    disk.add("a", 1, version="v2")
    disk.remove(old)
    with pytest.raises(Unavailable, match="changed since"):
        residency.plan(old, disk.read)
    assert engine_names(residency) == []


def test_old_versions_of_a_pinned_name_are_not_pinned(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make(engine_slots=2, pinned=["a"], latest=None)  # no current-version knowledge
    v1 = disk.add("a", 1, version="v1")
    v2 = disk.add("a", 1, version="v2")
    residency.plan(v1, disk.read)
    residency.plan(v2, disk.read)
    b = disk.add("b", 2)
    assert residency.plan(b, disk.read).evict == (held_key(v1),)


def test_forget_then_replan_sends_the_weights(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make()
    a = disk.add("a", 1)
    residency.plan(a, disk.read)
    assert residency.forget(a) is True
    assert residency.forget(a) is False
    plan = residency.plan(a, disk.read)
    assert (plan.tier, plan.weights is not None) == (HOST_TIER, True)
    # reload=True is the same in one call, even while the mirror still lists it
    reload = residency.plan(a, disk.read, reload=True)
    assert (reload.tier, reload.weights is not None) == (HOST_TIER, True)
    assert disk.reads == ["a"]
    assert residency.stats().loads[ENGINE_TIER] == 3


def test_mark_resident_records_a_prefetch(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make(engine_slots=2)
    a, b, c = disk.add("a", 1), disk.add("b", 2), disk.add("c", 3)
    for ref in (a, b):
        assert residency.mark_resident(disk.versions[ref.digest]) == ()
    assert residency.mark_resident(disk.versions[c.digest]) == (held_key(a),)
    assert residency.plan(c, disk.read).tier == ENGINE_TIER
    assert disk.reads == []
    assert host_names(residency) == ["c", "b", "a"]


def test_snapshot_reports_bytes_and_last_use(
    make: MakeResidency, disk: FakeDisk, clock: FakeClock
) -> None:
    residency = make()
    a = disk.add("a", 7, 123)
    clock.now = 10.0
    residency.plan(a, disk.read)  # the read advances the clock by 0.5
    (engine,) = residency.snapshot().engine
    assert (engine.name, engine.task_id, engine.digest, engine.nbytes) == ("a", 7, a.digest, 123)
    assert (engine.pinned, engine.last_use_s) == (False, 10.5)
    assert residency.stats().resident_bytes == {ENGINE_TIER: 123, HOST_TIER: 123}
    assert residency.engine_digests() == frozenset({a.digest})


def test_a_custom_policy_chooses_the_victims(make: MakeResidency, disk: FakeDisk) -> None:
    class BiggestFirst:
        def __init__(self) -> None:
            self.sizes: dict[str, int] = {}

        def admit(
            self,
            key: str,
            size: int = 1,
            *,
            created_s: float = 0.0,
            cost_s: float = 0.0,
            group: int = 0,
        ) -> None:
            self.sizes[key] = size

        def access(self, key: str) -> None:
            pass

        def remove(self, key: str) -> None:
            self.sizes.pop(key, None)

        def nominate(
            self, count: int = 1, size: int = 0, skip: SkipKey[str] | None = None
        ) -> list[str]:
            ranked = sorted(self.sizes.items(), key=lambda item: -item[1])
            return take_victims(ranked, count, size, skip)

        def clear(self) -> None:
            self.sizes.clear()

    # a byte bound: the policy is told each adapter's bytes (by count alone, one slot each)
    residency = make(engine_slots=2, engine_max_bytes=10_000, engine_policy=BiggestFirst())
    big, small = disk.add("big", 1, 500), disk.add("small", 2, 100)
    residency.plan(small, disk.read)
    residency.plan(big, disk.read)
    residency.plan(small, disk.read)
    assert residency.plan(disk.add("c", 3), disk.read).evict == (held_key(big),)


@pytest.mark.parametrize(("policy", "kept"), [("lru", False), ("gdsf", True)])
def test_gdsf_keeps_the_adapter_asked_for_most_where_lru_keeps_the_latest(
    make: MakeResidency, disk: FakeDisk, policy: str, kept: bool
) -> None:
    """lora_cache's `adapter_eviction`: two slots; `popular` (a large adapter) is asked for
    often, then two small one-offs in a row. LRU drops `popular` for the second one-off; GDSF
    drops the first (slots bound this tier, so the popular one's size does not count against
    it)."""
    residency = make(engine_slots=2, host_max_bytes=1 << 20, engine_policy=named_policy(policy, 2))
    popular = disk.add("popular", 1, 100_000)
    for _ in range(4):
        residency.plan(popular, disk.read)
    residency.plan(disk.add("first", 2, 100), disk.read)
    residency.plan(disk.add("second", 3, 100), disk.read)
    assert (popular.digest in residency.engine_digests()) is kept


def test_an_engine_that_obeys_the_plans_always_holds_what_it_needs(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """Random requests over more adapters (and versions) than slots, each plan applied to a
    strict engine: it never needs an adapter it was not sent and never exceeds its slots."""
    rng = random.Random(7)
    residency = make(engine_slots=3, host_max_adapters=2, host_max_bytes=10_000, pinned=["a"])
    refs = [disk.add(name, i + 1) for i, name in enumerate("abcdef")]
    held: set[str] = set()
    for step in range(400):
        if step % 50 == 49:  # an adapter folder changes: a new version of the same name
            old = rng.choice(refs)
            refs[refs.index(old)] = disk.add(old.name, old.task_id, version=f"v{step}")
        ref = rng.choice(refs)
        plan = residency.plan(ref, disk.read)
        held -= set(plan.evict)
        if plan.weights is None:
            assert held_key(ref) in held, f"step {step}: engine lacks {ref.short}"
        else:
            held.add(held_key(ref))
        assert len(held) <= 3
        assert {key.partition(":")[2] for key in held} == residency.engine_digests()


def test_disk_reads_do_not_block_engine_hits(make: MakeResidency, disk: FakeDisk) -> None:
    residency = make()
    a, b = disk.add("a", 1), disk.add("b", 2)
    residency.plan(a, disk.read)
    reading, release = threading.Event(), threading.Event()

    def slow_read(ref: AdapterRef) -> AdapterWeights:
        reading.set()
        assert release.wait(timeout=10)
        return disk.versions[ref.digest]

    worker = threading.Thread(target=residency.plan, args=(b, slow_read))
    worker.start()
    try:
        assert reading.wait(timeout=10)
        assert residency.plan(a, disk.read).tier == ENGINE_TIER  # served while b is being read
    finally:
        release.set()
        worker.join(timeout=10)
    assert set(engine_names(residency)) == {"a", "b"}


def test_evictions_for_the_count_bound_are_no_lost_bytes(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """Four adapters at most, bytes to spare: what the count bound drops would not have stayed
    with more bytes, so the byte budget's shadow does not count it."""
    residency = make(engine_slots=1, host_max_adapters=2, host_max_bytes=10_000)
    a, b, c = (disk.add(name, i + 1) for i, name in enumerate("abc"))
    for ref in (a, b, c, a):  # c's arrival drops a for the count; a is read again
        residency.plan(ref, disk.read)
    stats = residency.stats()
    assert (stats.disk_reads, stats.host_shadow_bytes, stats.host_shadow_gained_s) == (4, 0, 0.0)


def test_the_host_tier_resizes_to_a_budget_and_its_shadow_prices_a_byte_by_disk_reads(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """A version the host tier dropped lately and asked for again is a disk read (0.5 s here)
    one more byte would have saved; tiercache.budgets resizes the tier: versions go at once,
    in its policy's order."""
    residency = make(engine_slots=1, host_max_adapters=8, host_max_bytes=400)  # shadow: 100
    a, b, c, d, e = (disk.add(name, i + 1) for i, name in enumerate("abcde"))  # 100 bytes each
    for ref in (a, b, c, d, e):  # e's arrival drops a (least recently used) into the shadow
        residency.plan(ref, disk.read)
    assert host_names(residency) == ["e", "d", "c", "b"]
    assert residency.stats().host_shadow_bytes == 100
    residency.plan(a, disk.read)  # read again: what one more adapter's bytes would have saved
    stats = residency.stats()
    assert stats.host_shadow_gained_s == pytest.approx(0.5)
    assert host_names(residency) == ["a", "e", "d", "c"]  # b dropped into the shadow now
    residency.plan(b, disk.read)
    assert residency.stats().host_shadow_gained_s == pytest.approx(1.0)
    assert residency.resize_host(200) == 200
    assert host_names(residency) == ["b", "a"]  # d, then e (least recently used) dropped at once
    stats = residency.stats()
    # a 50-byte shadow still keeps the latest version dropped (one of 100 bytes)
    assert (stats.resident_bytes[HOST_TIER], stats.host_shadow_bytes) == (200, 100)
    residency.plan(e, disk.read)  # the latest dropped, in the shadow: a read it would save
    assert residency.stats().host_shadow_gained_s == pytest.approx(1.5)
    with pytest.raises(ConfigError):
        residency.resize_host(0)


def test_an_adapter_no_budget_could_hold_is_no_lost_byte(
    make: MakeResidency, disk: FakeDisk
) -> None:
    residency = make(engine_slots=1, host_max_adapters=8, host_max_bytes=1_000)
    big = disk.add("big", 1, nbytes=2_000)  # larger than the tier's largest budget
    residency.plan(big, disk.read)
    residency.forget(big)
    residency.plan(big, disk.read)
    assert residency.stats().host_shadow_gained_s == 0.0
    residency.resize_host(500)  # a smaller budget: one of 800 bytes would fit at the ceiling
    mid = disk.add("mid", 2, nbytes=800)
    residency.plan(mid, disk.read)
    residency.forget(mid)
    residency.plan(mid, disk.read)  # read again: more bytes (up to 800) would have kept it
    assert residency.stats().host_shadow_gained_s == pytest.approx(0.5)


def test_an_alias_folder_gets_its_own_weights_under_its_own_name(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """Two names over identical files (one digest, two task ids): the engines key adapters by
    task id and digest, so each name's first plan carries the weights, named as that name's
    (a plan for `beta` that reused `alpha`'s identity was refused by llm, on every request)."""
    residency = make()
    alpha = disk.add("alpha", 1)
    beta = AdapterRef("beta", 2, alpha.digest)
    first = residency.plan(alpha, disk.read)
    assert first.weights is not None and first.weights.ref == alpha
    aliased = residency.plan(beta, disk.read)
    assert (aliased.tier, aliased.evict) == (HOST_TIER, ())
    assert aliased.weights is not None and aliased.weights.ref == beta
    assert aliased.weights.weights == first.weights.weights
    # the mirror holds both names, each a slot, as the engines do: alternating requests send
    # no files again (it held one entry per digest, and sent the files on every switch)
    for ref in (beta, alpha, beta, alpha):
        again = residency.plan(ref, disk.read)
        assert (again.tier, again.weights, again.evict) == (ENGINE_TIER, None, ())
    assert disk.reads == ["alpha"]  # one read from disk for both names
    assert {(r.name, r.task_id) for r in residency.snapshot().engine} == {("alpha", 1), ("beta", 2)}
    assert residency.stats().resident[ENGINE_TIER] == 2


def test_an_alias_is_evicted_alone_and_never_its_pinned_or_loading_sibling(
    make: MakeResidency, disk: FakeDisk
) -> None:
    """Evictions name one adapter (task id and digest): evicting one name over shared files
    leaves the other; a name over the files being loaded can make room for it; a pinned
    name's alias is not pinned; and the engine reporting a bare digest gone drops every name
    over it."""
    residency = make(engine_slots=1)
    alpha = disk.add("alpha", 1)
    beta = AdapterRef("beta", 2, alpha.digest)
    residency.plan(alpha, disk.read)
    switched = residency.plan(beta, disk.read)  # one slot: alpha makes room for its alias
    assert switched.evict == (held_key(alpha),) and switched.weights is not None
    pinned = make(engine_slots=2, pinned=["alpha"])
    pinned.plan(alpha, disk.read)
    pinned.plan(beta, disk.read)
    gamma = pinned.plan(disk.add("gamma", 3), disk.read)  # beta goes, pinned alpha stays
    assert gamma.evict == (held_key(beta),)
    assert {r.name for r in pinned.snapshot().engine} == {"alpha", "gamma"}
    assert pinned.drop([held_key(alpha)]) == 1  # one adapter gone
    pinned.plan(beta, disk.read)
    assert pinned.drop([alpha.digest]) == 1  # a bare digest: every name over it (beta)
    assert {r.name for r in pinned.snapshot().engine} == {"gamma"}
