"""Cross-replica coalescing (tiercache.exact.leases in tiercache.generation): two Generations
"replicas", each with its own L2, sharing one real redis-server and fake engines."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis_server import RedisServer

from tiercache.exact.keys import Digest
from tiercache.exact.leases import LeaseCoordinator, LeaseState
from tiercache.exact.request import GenerationRequest
from tiercache.exact.tiered import TieredCache
from tiercache.generation import Generations

from .replicas import GatedEngine, Recorder, open_replica, redis_link, wait_until

DIGEST = Digest("c" * 64)
REQUEST = GenerationRequest(prompt="hi", tenant_scope="tenant-scope")
TAGS = ("kb:v1",)

Replica = tuple[Generations, GatedEngine, TieredCache]


@pytest.fixture
def make_replica(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> Iterator[Callable[..., Replica]]:
    stages: list[Generations] = []

    def make(
        name: str, engine: GatedEngine | None = None, url: str = "", **lease: float
    ) -> Replica:
        cache = open_replica(tmp_path / name, url or redis_server.url, redis_prefix, with_l1=False)
        link = redis_link(cache)
        assert link is not None
        engine = engine or GatedEngine()
        leases = LeaseCoordinator(link, **{"ttl_s": 2.0, "wait_s": 10.0, "poll_s": 0.01, **lease})
        stage = Generations(cache, engine, max_workers=4, leases=leases)
        stages.append(stage)
        return stage, engine, cache

    yield make
    for stage in stages:
        stage.close()


def test_identical_misses_on_two_replicas_generate_once(
    make_replica: Callable[..., Replica],
) -> None:
    gate = threading.Event()
    a, engine_a, cache_a = make_replica("a", GatedEngine(gate=gate))
    b, engine_b, cache_b = make_replica("b", GatedEngine(gate=gate))
    ra, rb = Recorder(), Recorder()
    a.submit_miss(REQUEST, DIGEST, "miss", True, ra, tags=TAGS)
    assert engine_a.started.wait(5)  # a leads and holds the lease
    b.submit_miss(REQUEST, DIGEST, "miss", True, rb, tags=TAGS)
    wait_until(lambda: b.stats().remote_waits == 1)
    gate.set()
    assert ra.wait() == ("final", "Hello", "miss")
    assert rb.wait() == ("final", "Hello", "miss")
    assert (engine_a.calls, engine_b.calls) == (1, 0)
    assert (b.stats().remote_waits, b.stats().remote_hits, b.stats().generations) == (1, 1, 0)
    stored = cache_b.get(DIGEST)  # b's L2 now holds a's answer, with a's metadata
    assert stored is not None and stored.entry.tags == ("kb:v1",)
    assert stored.entry.tenant_scope == "tenant-scope"
    link = redis_link(cache_a)
    assert link is not None and not link.client.exists(link.key("lease", DIGEST))  # released


def test_many_concurrent_misses_on_two_replicas_generate_once(
    make_replica: Callable[..., Replica],
) -> None:
    gate = threading.Event()
    a, engine_a, _ = make_replica("a", GatedEngine(gate=gate))
    b, engine_b, _ = make_replica("b", GatedEngine(gate=gate))
    recorders = [Recorder() for _ in range(8)]
    for i, recorder in enumerate(recorders):
        (a if i % 2 else b).submit_miss(REQUEST, DIGEST, "miss", True, recorder, tags=TAGS)
    wait_until(lambda: engine_a.calls + engine_b.calls == 1)
    wait_until(lambda: a.stats().remote_waits + b.stats().remote_waits == 1)
    gate.set()
    assert {r.wait() for r in recorders} == {("final", "Hello", "miss")}
    assert engine_a.calls + engine_b.calls == 1


def test_follower_generates_when_the_leader_died(
    make_replica: Callable[..., Replica], redis_server: RedisServer, redis_prefix: str
) -> None:
    """A replica that took the lease and died: its lease expires (nothing renews it) and the
    waiting replica generates."""
    b, engine_b, _ = make_replica("b")
    client = redis.Redis.from_url(redis_server.url)
    assert client.set(f"{redis_prefix}lease:{DIGEST}", "dead-replica", nx=True, px=500)
    started = time.monotonic()
    rb = Recorder()
    b.submit_miss(REQUEST, DIGEST, "miss", True, rb, tags=TAGS)
    assert rb.wait() == ("final", "Hello", "miss")
    waited = time.monotonic() - started
    assert engine_b.calls == 1
    assert 0.3 < waited < 5.0  # it waited for the lease to expire, not for wait_s (10 s)
    assert (b.stats().remote_waits, b.stats().remote_hits) == (1, 0)


def test_follower_generates_when_the_leaders_generation_fails(
    make_replica: Callable[..., Replica],
) -> None:
    gate = threading.Event()
    a, engine_a, _ = make_replica("a", GatedEngine(gate=gate, finish="error"))
    b, engine_b, _ = make_replica("b", GatedEngine(text="From b"))
    ra, rb = Recorder(), Recorder()
    a.submit_miss(REQUEST, DIGEST, "miss", True, ra, tags=TAGS)
    assert engine_a.started.wait(5)
    b.submit_miss(REQUEST, DIGEST, "miss", True, rb, tags=TAGS)
    wait_until(lambda: b.stats().remote_waits == 1)
    gate.set()
    assert ra.wait()[0] == "error"  # a's own requester sees its engine's failure
    assert rb.wait() == ("final", "From b", "miss")  # b took over once a let go of the lease
    assert (engine_a.calls, engine_b.calls) == (1, 1)


def test_a_long_generation_keeps_its_lease(make_replica: Callable[..., Replica]) -> None:
    """ttl 0.5 s, a generation of about 1.2 s: the renewals keep the other replica waiting."""
    gate = threading.Event()
    a, engine_a, _ = make_replica("a", GatedEngine(gate=gate), ttl_s=0.5)
    b, engine_b, _ = make_replica("b", ttl_s=0.5)
    ra, rb = Recorder(), Recorder()
    a.submit_miss(REQUEST, DIGEST, "miss", True, ra, tags=TAGS)
    assert engine_a.started.wait(5)
    b.submit_miss(REQUEST, DIGEST, "miss", True, rb, tags=TAGS)
    threading.Timer(1.2, gate.set).start()
    assert rb.wait() == ("final", "Hello", "miss")
    assert (engine_a.calls, engine_b.calls) == (1, 0)
    assert ra.wait() == ("final", "Hello", "miss")


def test_no_store_and_bypass_do_not_take_leases(make_replica: Callable[..., Replica]) -> None:
    gate = threading.Event()
    a, engine_a, _ = make_replica("a", GatedEngine(gate=gate))
    b, engine_b, _ = make_replica("b")
    ra = Recorder()
    a.submit_miss(REQUEST, DIGEST, "miss", True, ra, tags=TAGS)
    assert engine_a.started.wait(5)
    rb1, rb2 = Recorder(), Recorder()
    b.submit_miss(REQUEST, DIGEST, "miss", False, rb1)  # no-store: will not store, so no wait
    assert rb1.wait() == ("final", "Hello", "miss")
    b.submit_miss(REQUEST, DIGEST, "bypass", True, rb2)  # no-cache: wants its own generation
    assert rb2.wait() == ("final", "Hello", "bypass")
    assert engine_b.calls == 2 and b.stats().remote_waits == 0
    gate.set()
    ra.wait()


def test_redis_down_means_local_coalescing_only(
    make_replica: Callable[..., Replica], redis_prefix: str
) -> None:
    b, engine_b, cache = make_replica("b", url="redis://127.0.0.1:1/0")
    rb = Recorder()
    b.submit_miss(REQUEST, DIGEST, "miss", True, rb, tags=TAGS)
    assert rb.wait() == ("final", "Hello", "miss")
    assert engine_b.calls == 1
    link = redis_link(cache)
    assert link is not None
    assert LeaseCoordinator(link).acquire("x")[0] is LeaseState.UNAVAILABLE


def test_release_deletes_only_its_own_lease(redis_server: RedisServer, redis_prefix: str) -> None:
    from tiercache.exact.redis_tier import RedisLink

    link = RedisLink.from_url(redis_server.url, redis_prefix)
    one, two = LeaseCoordinator(link, ttl_s=0.2), LeaseCoordinator(link, ttl_s=5.0)
    state, lease = one.acquire("d")
    assert state is LeaseState.ACQUIRED and lease is not None
    assert two.acquire("d") == (LeaseState.HELD, None)
    one.close()  # stops renewing, releases
    state2, lease2 = two.acquire("d")
    assert state2 is LeaseState.ACQUIRED and lease2 is not None
    assert one.release(lease) is False  # an old token never deletes the new holder's lease
    assert two.held("d") is True
    assert two.release(lease2) is True and two.held("d") is False
    two.close()
    link.close()


def test_a_lease_no_replica_could_have_set_is_taken_over(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Leases are not signed: one planted with no expiry, or with a longer one than lease_ttl_s
    (every acquisition and renewal sets it), would make every miss of its digest wait
    `wait_s`. It is taken over at once; a replica's live lease is still waited for."""
    from tiercache.exact.redis_tier import RedisLink

    link = RedisLink.from_url(redis_server.url, redis_prefix)
    leases = LeaseCoordinator(link, ttl_s=2.0)
    client = redis.Redis.from_url(redis_server.url)
    client.set(f"{redis_prefix}lease:forever", b"planted")  # no expiry
    client.set(f"{redis_prefix}lease:long", b"planted", px=3_600_000)  # an hour
    for digest in ("forever", "long"):
        state, lease = leases.acquire(digest)
        assert state is LeaseState.ACQUIRED and lease is not None, digest
        left = client.pttl(f"{redis_prefix}lease:{digest}")
        assert 0 < left <= 2000  # ours now, with a lease's expiry
        assert leases.release(lease)
    other = LeaseCoordinator(link, ttl_s=2.0)
    state, lease = other.acquire("live")
    assert state is LeaseState.ACQUIRED and lease is not None
    assert leases.acquire("live") == (LeaseState.HELD, None)
    assert leases.stats().acquired == 2
    other.close()
    leases.close()
    link.close()


def test_releasing_a_lost_lease_keeps_renewing_a_newer_one_for_the_same_digest(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """One process: a lease expired (a stalled generation), and the next request for that
    digest took a new one; the first generation's late release unregistered the new one, by
    name, which then expired mid-generation (another replica generated the answer again)."""
    from tiercache.exact.redis_tier import RedisLink

    link = RedisLink.from_url(redis_server.url, redis_prefix)
    leases = LeaseCoordinator(link, ttl_s=0.6)
    state, old = leases.acquire("d")
    assert state is LeaseState.ACQUIRED and old is not None
    link.call_or_raise(lambda c: c.delete(old.name))  # it expired meanwhile
    state, new = leases.acquire("d")
    assert state is LeaseState.ACQUIRED and new is not None
    assert leases.release(old) is False  # not its lease any more
    assert leases.stats().active == 1
    time.sleep(1.5)  # well past the TTL: renewed all along
    assert leases.held("d") is True
    assert leases.release(new) is True
    leases.close()
    link.close()
