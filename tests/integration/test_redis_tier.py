"""L3 on a real redis-server (tiercache.exact.redis_tier): TTL, corruption, the breaker when
Redis is killed during traffic and when it returns, the shared secret, replicas sharing answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis_server import RedisServer

from tiercache.exact.codec import CacheEntry
from tiercache.exact.keys import EngineIdentity, load_or_create_secret
from tiercache.exact.prompt_cache import PromptCache
from tiercache.exact.redis_tier import Breaker, RedisLink, RedisStore, shared_secret
from tiercache.exact.request import RawInputs
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.generation import Generations
from tiercache.vocabulary import CacheStatus, Tier

from .replicas import (
    GatedEngine,
    Recorder,
    load_secret,
    open_replica,
    redis_link,
    replica_config,
    wait_until,
)

ENGINE = EngineIdentity("model", "rev")


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def test_entry_ttl_becomes_redis_expiry_capped_by_max_ttl(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    now = 1_000.0
    store = RedisStore(RedisLink.from_url(redis_server.url, redis_prefix), max_ttl_s=60.0,
                       clock=lambda: now)  # fmt: skip
    client = raw_client(redis_server)
    store.put("short", CacheEntry("a", created_s=now - 2.0, ttl_s=3.0))  # 1 s left
    store.put("forever", CacheEntry("b", created_s=now))  # no TTL of its own: the cap
    store.put("gone", CacheEntry("c", created_s=now - 5.0, ttl_s=3.0))  # expired: not written
    assert 900 <= client.pttl(f"{redis_prefix}e:short") <= 1_000
    assert 59_000 <= client.pttl(f"{redis_prefix}e:forever") <= 60_000
    assert client.exists(f"{redis_prefix}e:gone") == 0
    uncapped = RedisStore(RedisLink.from_url(redis_server.url, redis_prefix), clock=lambda: now)
    uncapped.put("forever", CacheEntry("b", created_s=now))
    assert client.pttl(f"{redis_prefix}e:forever") == -1  # no expiry: Redis's maxmemory policy
    store.close()
    uncapped.close()


def test_redis_expiry_removes_the_entry(redis_server: RedisServer, redis_prefix: str) -> None:
    store = RedisStore(RedisLink.from_url(redis_server.url, redis_prefix))
    store.put("k", CacheEntry("a", created_s=time.time(), ttl_s=0.2))
    assert store.get("k") is not None
    wait_until(lambda: store.get("k") is None, timeout_s=5.0)
    store.close()


def test_corrupt_redis_value_is_a_counted_miss_and_dropped(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    store = RedisStore(RedisLink.from_url(redis_server.url, redis_prefix), stats_max_age_s=0)
    client = raw_client(redis_server)
    client.set(f"{redis_prefix}e:bad", b"TCE1 not really an entry")
    assert store.get("bad") is None
    assert client.exists(f"{redis_prefix}e:bad") == 0
    stats = store.stats()
    assert (stats.corrupt, stats.misses) == (1, 1)
    store.close()


def test_breaker_short_circuits_then_probes_once_per_interval() -> None:
    now = [0.0]
    breaker = Breaker(retry_s=1.0, clock=lambda: now[0])
    assert breaker.allow() and not breaker.is_open
    assert breaker.failed() is True  # an outage starts
    assert breaker.failed() is False  # the same outage
    assert breaker.allow() is False
    now[0] = 1.0
    assert breaker.allow() is True  # one probe ...
    assert breaker.allow() is False  # ... per interval
    assert breaker.succeeded() is True and breaker.allow()
    assert breaker.outages == 1


def test_dead_redis_is_a_miss_costing_microseconds_and_l3_resumes(
    redis_factory: Callable[[], RedisServer], redis_prefix: str, tmp_path: Path
) -> None:
    server = redis_factory()
    link = RedisLink.from_url(server.url, redis_prefix, timeout_s=0.25, retry_s=0.3)
    l1, l2 = MemoryStore(1 << 20), LmdbStore(tmp_path / "l2", 1 << 22)
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2), (Tier.L3, RedisStore(link))])
    cache.put("before", "kept locally")
    server.kill()

    for i in range(100):
        cache.put(f"during{i}", "x")  # L3 write skipped, never raised
        found = cache.get("before")
        assert found is not None and found.entry.text == "kept locally"
        assert cache.get(f"missing{i}") is None
    l3 = cache.store(Tier.L3)
    assert l3 is not None
    started = time.perf_counter()
    for i in range(10_000):
        assert l3.get(f"missing{i}") is None
    per_call_us = (time.perf_counter() - started) / 10_000 * 1e6
    health = link.health()
    assert (health.available, health.outages) == (False, 1)
    assert health.short_circuits > 10_000  # almost every call never touched the network
    # A socket timeout per call would be 250,000 us; the breaker makes it a clock read.
    assert per_call_us < 100, f"{per_call_us:.1f} us per L3 read with Redis dead"

    server.start()  # the same port, empty (no persistence), as after a crash
    client = raw_client(server)

    def l3_written() -> bool:
        cache.put("after", "back in L3")
        return client.exists(f"{redis_prefix}e:after") == 1

    wait_until(l3_written, timeout_s=5.0)
    assert link.health().available
    assert link.health().outages == 1
    cache.close()


def test_killed_during_traffic_zero_failed_requests_then_resumes(
    redis_factory: Callable[[], RedisServer], redis_prefix: str, tmp_path: Path
) -> None:
    """A prompt_cache and an llm stage of one replica serve a stream of requests while Redis is
    killed and restarted: every request is answered, none fails."""
    server = redis_factory()
    secret = b"s" * 32
    front = PromptCache(open_replica(tmp_path / "a", server.url, redis_prefix), secret, ENGINE)
    engine = GatedEngine(text="generated")
    # The llm process of the same host: its own view of the same L2 and L3 (one LMDB environment
    # per process, so the stores are shared here rather than opened twice).
    shared = front.cache
    shared_tiers = [t for t in shared.tiers if t.tier is not Tier.L1]
    back_cache = TieredCache(shared_tiers, invalidations=shared.invalidations)
    stage = Generations(back_cache, engine, max_workers=8)
    outcomes: list[tuple[str, object, object]] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            lookup = front.lookup(RawInputs(f"prompt {i // 3}"))  # a miss, then two hits
            if lookup.status is CacheStatus.EXACT:
                outcomes.append(("final", lookup.text, "exact"))
            else:
                recorder = Recorder()
                stage.submit_miss(lookup.request, lookup.digest, "miss", True, recorder)
                outcomes.append(recorder.wait())
            i += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    wait_until(lambda: len(outcomes) > 100)
    server.kill()
    killed_at = len(outcomes)
    wait_until(lambda: len(outcomes) > killed_at + 200)
    server.start()
    client = raw_client(server)
    wait_until(lambda: bool(client.keys(f"{redis_prefix}e:*")))  # new answers reach L3 again
    stop.set()
    worker.join()
    assert [o for o in outcomes if o[0] != "final"] == []
    assert {o[1] for o in outcomes} == {"generated"}
    assert redis_link(back_cache) is not None
    stage.close()
    front.cache.close()  # closes the shared stores a second time: harmless


def test_replicas_share_answers_through_l3(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    a = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    b = open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    secret = load_secret(replica_config(tmp_path / "a", redis_server.url, redis_prefix), a)
    assert load_secret(replica_config(tmp_path / "b", redis_server.url, redis_prefix), b) == secret
    front_a, front_b = PromptCache(a, secret, ENGINE), PromptCache(b, secret, ENGINE)
    first = front_a.lookup(RawInputs("What is Triton?", tenant="acme"))
    assert first.status is CacheStatus.MISS and first.digest is not None
    a.put(first.digest, "An inference server.", created_s=a.now())
    other = front_b.lookup(RawInputs("  What is   Triton? ", tenant="acme"))
    assert (other.status, other.tier, other.text) == (
        CacheStatus.EXACT,
        Tier.L3,
        "An inference server.",
    )
    again = front_b.lookup(RawInputs("What is Triton?", tenant="acme"))
    assert again.tier is Tier.L1  # the L3 hit filled B's L1 (and L2)
    b_l2 = b.store(Tier.L2)
    assert b_l2 is not None and b_l2.get(first.digest) is not None
    fresh_only = front_b.lookup(
        RawInputs("What is Triton?", tenant="acme", cache_control="max-age=0")
    )
    assert fresh_only.status is CacheStatus.MISS and not fresh_only.semantic_lookup
    a.close()
    b.close()
    assert not [t for t in threading.enumerate() if t.name == "tiercache-invalidations"]


def test_secret_is_shared_and_written_to_each_host(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    first = load_or_create_secret(tmp_path / "a" / "secret")
    second = load_or_create_secret(tmp_path / "b" / "secret")
    assert first != second
    a = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    b = open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    assert load_secret(replica_config(tmp_path / "a", redis_server.url, redis_prefix), a) == first
    assert load_secret(replica_config(tmp_path / "b", redis_server.url, redis_prefix), b) == first
    assert (tmp_path / "b" / "secret").read_bytes() == first  # a start without Redis agrees
    assert (tmp_path / "b" / "secret").stat().st_mode & 0o777 == 0o600
    dead = RedisLink.from_url("redis://127.0.0.1:1/0", redis_prefix)
    assert shared_secret(dead, second) == second  # Redis away: the host's own
    a.close()
    b.close()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0"])
def test_replica_starts_and_serves_with_redis_down(
    url: str, redis_prefix: str, tmp_path: Path
) -> None:
    cache = open_replica(tmp_path, url, redis_prefix)
    cache.put("k", "v")
    found = cache.get("k")
    assert found is not None and found.tier is Tier.L1
    link = redis_link(cache)
    assert link is not None and not link.health().available
    cache.close()
