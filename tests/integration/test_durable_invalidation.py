"""Durable invalidation through a real redis-server: a watermark is forgotten only once no tier
can still hold what it covers (the entry lifetime horizon, `ttl_s`), a restarted replica sweeps
its L2 for what was invalidated while it was down, and Redis must not be able to evict the
control keys (the start-up check of its eviction policy, `check_eviction_policy`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_server import RedisServer

from tiercache.errors import ConfigError
from tiercache.exact.codec import CacheEntry
from tiercache.exact.invalidation import Invalidator, signed_member
from tiercache.exact.keys import REDIS_INVALIDATIONS
from tiercache.exact.redis_tier import ALLOW_ALLKEYS_ENV, Signer
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import Invalidation
from tiercache.vocabulary import InvalidationKind, Tier

from .replicas import (
    FLEET_SECRET,
    TIMEOUT_S,
    open_replica,
    redis_link,
    restart_sweeper,
)

MAX_EVENTS = 5  # small, so that a test issues many more invalidations than the old bound


@pytest.fixture
def evicting_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of its own that may evict any key when full, as docs once recommended."""
    server = RedisServer(
        tmp_path / "evicting",
        extra_args=("--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru"),
    ).start()
    yield server
    server.stop()


def holds(cache: TieredCache, tier: Tier, key: str) -> bool:
    store = cache.store(tier)
    assert store is not None, f"no {tier.value} in this cache"
    return store.get(key) is not None


# ------------------------------------------------------------------ the eviction policy check


def test_allkeys_eviction_with_maxmemory_is_refused_unless_overridden(
    evicting_redis: RedisServer, redis_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = evicting_redis.url
    with pytest.raises(ConfigError, match="volatile-lru") as refused:
        open_replica(tmp_path / "a", url, redis_prefix, environ={})
    message = str(refused.value)
    assert "allkeys-lru" in message and "invalidation log" in message
    assert "secret_fingerprint" in message and ALLOW_ALLKEYS_ENV in message

    caplog.set_level(logging.WARNING, logger="tiercache")
    overridden = open_replica(tmp_path / "a", url, redis_prefix, environ={ALLOW_ALLKEYS_ENV: "1"})
    assert any("starting anyway" in r.getMessage() for r in caplog.records)
    overridden.close()

    client = redis.Redis.from_url(url)
    client.config_set("maxmemory", 0)  # allkeys-lru without a memory bound never evicts
    open_replica(tmp_path / "a", url, redis_prefix, environ={}).close()
    client.config_set("maxmemory", "10mb")
    client.config_set("maxmemory-policy", "volatile-lru")
    caplog.clear()
    open_replica(tmp_path / "a", url, redis_prefix, environ={}).close()
    assert not any("maxmemory" in r.getMessage() for r in caplog.records)

    # volatile-lru, but L3 entries without a TTL: Redis could evict nothing; warned, started.
    open_replica(
        tmp_path / "a", url, redis_prefix, environ={}, redis_max_ttl_s=0.0, ttl_s=0.0
    ).close()
    assert any("can evict nothing" in r.getMessage() for r in caplog.records)


def test_a_redis_that_refuses_config_is_warned_about_and_used(
    evicting_redis: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A managed Redis or an ACL user without `config|get`: the policy cannot be read; the
    replica starts and the log says what to check."""
    admin = redis.Redis.from_url(evicting_redis.url)
    admin.acl_setuser(
        "app", enabled=True, passwords=["+app-pw"], keys=["*"], channels=["*"],
        commands=["+@all", "-config"],
    )  # fmt: skip
    url = f"redis://app@127.0.0.1:{evicting_redis.port}/0"
    caplog.set_level(logging.WARNING, logger="tiercache")
    monkeypatch.setenv("TIERCACHE_REDIS_PASSWORD", "app-pw")
    cache = open_replica(tmp_path / "a", url, redis_prefix, environ={})
    warned = [r.getMessage() for r in caplog.records if "refused CONFIG GET" in r.getMessage()]
    assert warned and "volatile-" in warned[0] and "app-pw" not in warned[0]
    cache.put("k", "answer")
    assert cache.get("k") is not None
    cache.close()


def test_control_keys_never_expire_and_every_l3_entry_does(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """volatile-lru evicts only keys with a TTL: the entries, never the fingerprint or the log."""
    client = redis.Redis.from_url(redis_server.url)
    cache = open_replica(tmp_path / "a", redis_server.url, redis_prefix)  # redis_max_ttl_s 7 days
    cache.put("k", "answer")
    Invalidator(cache, redis_link(cache)).key("other")
    assert client.ttl(f"{redis_prefix}secret_fingerprint") == -1
    assert client.ttl(f"{redis_prefix}invalidated") == -1
    assert 0 < client.ttl(f"{redis_prefix}e:k") <= 7 * 86400
    cache.close()
    own_ttl = open_replica(
        tmp_path / "b", redis_server.url, redis_prefix, redis_max_ttl_s=0.0, ttl_s=60.0
    )
    own_ttl.put("k2", "answer")
    assert 0 < client.ttl(f"{redis_prefix}e:k2") <= 60
    own_ttl.close()


# ------------------------------------------------------------------ forgetting by the horizon


def test_a_replica_down_during_an_unswept_invalidation_never_serves_it_again(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """`sweep_shared: false` leaves the L3 copy; the replica that wrote it was down, so its L2
    kept one too. Many more invalidations follow than `max_events`: with ttl_s 0 (no horizon)
    every watermark is kept, in Redis and in each table, so neither copy is ever served; the
    restarted replica's sweep at start removes its L2 copy, and a second restart sweeps
    nothing."""
    url, client = redis_server.url, redis.Redis.from_url(redis_server.url)
    host = open_replica(tmp_path / "host", url, redis_prefix, max_events=MAX_EVENTS)
    host.put("k", "old answer", tags=("kb:v1",), created_s=time.time() - 1)
    host.close()  # down: its L2 keeps the entry
    admin = open_replica(tmp_path / "admin", url, redis_prefix, max_events=MAX_EVENTS)
    invalidator = Invalidator(admin, redis_link(admin))
    assert invalidator.max_events == MAX_EVENTS  # the table's
    assert invalidator.tag("kb:v1", sweep_shared=False).dropped_shared == 0
    for i in range(4 * MAX_EVENTS):
        invalidator.key(f"other-{i}")
    events = f"{redis_prefix}invalidated"
    assert client.zcard(events) == 4 * MAX_EVENTS + 1  # nothing forgotten: no horizon
    assert invalidator.kept_past_max > 0
    assert len(admin.invalidations) == 4 * MAX_EVENTS + 1
    assert client.exists(f"{redis_prefix}e:k") == 1  # the L3 copy, left by sweep_shared false

    fresh = open_replica(tmp_path / "fresh", url, redis_prefix, max_events=MAX_EVENTS)
    assert fresh.get("k") is None  # found in L3, refused ...
    assert client.exists(f"{redis_prefix}e:k") == 0  # ... and dropped there
    restarted = open_replica(tmp_path / "host", url, redis_prefix, max_events=MAX_EVENTS)
    report = restart_sweeper(restarted).wait(TIMEOUT_S)
    assert report is not None
    assert (report.watermarks, report.removed) == (4 * MAX_EVENTS + 1, 1)
    assert not holds(restarted, Tier.L2, "k") and restarted.get("k") is None
    restarted.close()
    again = open_replica(tmp_path / "host", url, redis_prefix, max_events=MAX_EVENTS)
    second = restart_sweeper(again).wait(TIMEOUT_S)
    assert second is not None and (second.watermarks, second.removed) == (0, 0)
    for cache in (again, fresh, admin):
        cache.close()


def test_the_redis_log_forgets_only_what_the_horizon_has_passed(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Past max_events, members older than ttl_s (plus the skew allowance, on Redis's clock)
    go, however few; younger ones stay, however many. Without a horizon none go."""
    url, client = redis_server.url, redis.Redis.from_url(redis_server.url)
    events = f"{redis_prefix}invalidated"
    signer = Signer(FLEET_SECRET, REDIS_INVALIDATIONS)
    now_s = time.time()
    ancient = {
        signed_member(signer, events, Invalidation(InvalidationKind.TAG, f"old{i}", at_s)): at_s
        for i, at_s in enumerate((now_s - 7_300, now_s - 7_200, now_s - 3_700))
    }
    young_s = now_s - 600  # within the horizon below
    young = signed_member(signer, events, Invalidation(InvalidationKind.TAG, "young", young_s))
    client.zadd(events, {**ancient, young: young_s})

    never = open_replica(tmp_path / "never", url, redis_prefix, max_events=MAX_EVENTS)
    for i in range(MAX_EVENTS):
        Invalidator(never, redis_link(never)).key(f"a-{i}")
    assert client.zcard(events) == 4 + MAX_EVENTS  # ttl_s 0: no horizon, all kept
    never.close()

    admin = open_replica(
        tmp_path / "admin", url, redis_prefix, max_events=MAX_EVENTS, ttl_s=3_600.0
    )
    invalidator = Invalidator(admin, redis_link(admin))
    assert invalidator.horizon_s == 3_600.0
    for i in range(2 * MAX_EVENTS):
        invalidator.key(f"b-{i}")
    kept = [m.decode().rsplit("|", 1)[1] for m in client.zrange(events, 0, -1)]
    assert not any(v.startswith("tag:old") for v in kept)  # past the horizon: forgotten
    assert "tag:young" in kept  # within it: kept although far past max_events
    assert len(kept) == 1 + 3 * MAX_EVENTS and invalidator.kept_past_max > 0
    late = open_replica(tmp_path / "late", url, redis_prefix, ttl_s=3_600.0)
    assert late.invalidations.covers("x", CacheEntry("answer", young_s - 1, tags=("young",)))
    late.close()
    admin.close()
