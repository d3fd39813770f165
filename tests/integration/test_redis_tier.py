"""L3 on a real redis-server (tiercache.exact.redis_tier): TTL, corruption, the breaker when
Redis is killed during traffic and when it returns, replicas sharing answers, and Redis as an
attacker's: forged values refused and counted, the secret never in Redis (only its fingerprint;
a replica with another secret refuses to start), the password from the environment, redacted."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import RedisServer

from tiercache.errors import ConfigError, Unavailable
from tiercache.exact import redis_tier
from tiercache.exact.codec import CacheEntry, encode_entry
from tiercache.exact.keys import (
    REDIS_VALUES,
    EngineIdentity,
    load_or_create_secret,
    replace_secret,
    secret_fingerprint,
)
from tiercache.exact.prompt_cache import PromptCache
from tiercache.exact.redis_tier import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    Breaker,
    RedisLink,
    RedisStore,
    Signer,
    check_fleet_secret,
)
from tiercache.exact.request import RawInputs
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.generation import Generations
from tiercache.lora.fleet import MAX_METADATA_BYTES, AdapterFleet, AdapterVersion
from tiercache.vocabulary import CacheStatus, Tier

from .replicas import (
    FLEET_SECRET,
    GatedEngine,
    Recorder,
    give_secret,
    load_secret,
    open_replica,
    redis_link,
    replica_config,
    restart_sweeper,
    wait_until,
)

ENGINE = EngineIdentity("model", "rev")


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def sent_by(client: redis.Redis) -> Callable[[], int]:
    """What Redis sends its clients from now on, in bytes (INFO's total_net_output_bytes; a
    call of it counts the INFO reply before it, a few KiB)."""
    before = int(client.info("stats")["total_net_output_bytes"])
    return lambda: int(client.info("stats")["total_net_output_bytes"]) - before


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
    """Signed with the fleet's secret but not an entry (damaged): `corrupt`, dropped."""
    secret = b"k" * 32
    link = RedisLink.from_url(redis_server.url, redis_prefix, secret=secret)
    store = RedisStore(link, stats_max_age_s=0)
    client = raw_client(redis_server)
    name = f"{redis_prefix}e:bad"
    client.set(name, Signer(secret, REDIS_VALUES).seal(name, b"TCE1 not really an entry"))
    assert store.get("bad") is None
    assert client.exists(name) == 0
    stats = store.stats()
    assert (stats.corrupt, stats.misses, store.forged) == (1, 1, 0)
    store.close()


def test_forged_l3_values_are_counted_misses_never_served_nor_copied(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """An attacker who can write Redis plants answers: an unsigned value (also what an older
    release wrote), one signed with another secret, and a genuine one copied to another key.
    None is served or copied into L2/L1; each is counted and left in Redis."""
    replica = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    link = redis_link(replica)
    assert link is not None
    client = raw_client(redis_server)
    poison = encode_entry(CacheEntry("attacker's text", created_s=time.time() - 1))

    def name(key: str) -> str:
        return f"{redis_prefix}e:{key}"

    replica.put("genuine", "the real answer", created_s=time.time() - 1)
    genuine = client.get(name("genuine"))
    assert genuine is not None and genuine.startswith(b"TCA1")
    planted = {
        "unsigned": poison,
        "other-secret": Signer(b"x" * 32, REDIS_VALUES).seal(name("other-secret"), poison),
        "moved": genuine,  # the fleet's tag, but bound to another key name
        "truncated-tag": genuine[:20],
    }
    for key, value in planted.items():
        client.set(name(key), value)
    l2, l3 = replica.store(Tier.L2), replica.store(Tier.L3)
    assert l2 is not None and isinstance(l3, RedisStore)
    for key in planted:
        assert replica.get(key) is None, key
        assert l2.get(key) is None, key  # never copied into a local tier
        assert client.exists(name(key)) == 1, key  # left alone (the next write-back replaces it)
    assert l3.forged == len(planted)
    assert link.health().forged[REDIS_VALUES] == len(planted)
    client.set(f"{redis_prefix}e:".encode() + b"\xff\xfe", genuine)  # a name no fleet writes
    assert [key for key, _ in l3.scan()] == ["genuine"]  # a sweep sees only signed entries
    assert l3.forged == 2 * len(planted)  # the undecodable name skipped before its value
    assert all(l3.peek(key) is None for key in planted)  # a background read counts nothing
    assert l3.forged == 2 * len(planted)
    found = replica.get("genuine")
    assert found is not None and found.entry.text == "the real answer"
    replica.put("unsigned", "generated again", created_s=time.time())  # the write-back
    found = replica.get("unsigned")
    assert found is not None and found.entry.text == "generated again"
    replica.close()


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
    for i in range(10_000):
        assert l3.get(f"missing{i}") is None
    health = link.health()
    assert (health.available, health.outages) == (False, 1)
    # Every one of these reads was answered by the breaker without touching the network (a socket
    # timeout each would be 0.25 s); what a read costs then is timed by
    # `python -m tiercache_dev.bench.redis_tier`, not here.
    assert health.short_circuits > 10_000

    server.start()  # the same port, empty (no persistence), as after a crash
    client = raw_client(server)

    def l3_written() -> bool:
        cache.put("after", "back in L3")
        return client.exists(f"{redis_prefix}e:after") == 1

    wait_until(l3_written, timeout_s=5.0)
    assert link.health().available
    assert link.health().outages == 1
    cache.close()


def test_with_redis_down_a_merged_record_is_not_written_over_l3(
    redis_factory: Callable[[], RedisServer], redis_prefix: str, tmp_path: Path
) -> None:
    """A side record written back whole (a semantic entry's outcomes) is read merged from L2
    and L3: with Redis down `get_or_raise` says so (where `get` says miss), and the outcome is
    not recorded, rather than L2's copy written over what L3 holds from other replicas."""
    from tiercache.errors import Unavailable
    from tiercache.semantic.entry_trust import read_trust, record_outcome, trust_key

    server = redis_factory()
    link = RedisLink.from_url(server.url, redis_prefix, timeout_s=0.25, retry_s=0.3)
    l3 = RedisStore(link)
    cache = TieredCache(
        [(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, LmdbStore(tmp_path / "l2", 1 << 22)),
         (Tier.L3, l3)]
    )  # fmt: skip
    digest = "d" * 64
    for stamp in (1.0, 2.0):
        assert record_outcome(cache, digest, 0.9, True, "scope-a", stamp)
    assert l3.get_or_raise(trust_key(digest)) is not None
    server.kill()
    with pytest.raises(Unavailable):
        l3.get_or_raise(trust_key(digest))
    assert l3.get(trust_key(digest)) is None  # a plain read cannot tell
    assert not record_outcome(cache, digest, 0.2, False, "scope-a", 3.0)
    assert [s for _, _, s in read_trust(cache, digest, "scope-a").observations] == [1.0, 2.0]
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
    background = ("tiercache-invalidations", "tiercache-restart-sweep")
    assert not [t for t in threading.enumerate() if t.name in background]  # joined at close


def test_the_secret_never_reaches_redis_only_its_fingerprint(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    a = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    b = open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    config = replica_config(tmp_path / "b", redis_server.url, redis_prefix)
    assert load_secret(config, b) == FLEET_SECRET
    a.put("k", "answer", created_s=time.time() - 1)
    client = raw_client(redis_server)
    names = {n.decode() for n in client.keys(f"{redis_prefix}*")}
    assert f"{redis_prefix}secret" not in names
    fingerprint = client.get(f"{redis_prefix}secret_fingerprint")
    assert fingerprint == secret_fingerprint(FLEET_SECRET).encode()
    for n in names:
        if client.type(n) == b"string":
            assert FLEET_SECRET not in client.get(n), n
    a.close()
    b.close()


def test_a_replica_with_another_secret_refuses_to_start(
    redis_server: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    restart_sweeper(a).close()  # its sweep at start (nothing to do) joined: a stable thread set
    threads = {t.name for t in threading.enumerate()}
    other = load_or_create_secret(tmp_path / "b" / "secret")  # a new host's own, random
    with pytest.raises(ConfigError, match="TIERCACHE_SECRET_FILE") as refused:
        open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    assert "not the fleet's" in refused.value.message
    assert {t.name for t in threading.enumerate()} == threads  # no listener left behind
    assert (tmp_path / "b" / "secret").read_bytes() == other  # nothing adopted
    # The operator gives it the fleet's secret through the environment: it starts.
    fleet_file = tmp_path / "fleet-secret"
    replace_secret(fleet_file, FLEET_SECRET)
    monkeypatch.setenv("TIERCACHE_SECRET_FILE", str(fleet_file))
    b = open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    a.put("k", "from a", created_s=time.time() - 1)
    found = b.get("k")
    assert found is not None and (found.tier, found.entry.text) == (Tier.L3, "from a")
    a.close()
    b.close()


def test_an_older_releases_clear_secret_is_deleted_or_refused_never_adopted(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    client = raw_client(redis_server)
    legacy = f"{redis_prefix}secret"
    # The fleet's own secret in clear (the older release put it there): deleted on start.
    client.set(legacy, FLEET_SECRET)
    a = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    assert client.exists(legacy) == 0
    assert client.get(f"{redis_prefix}secret_fingerprint") == (
        secret_fingerprint(FLEET_SECRET).encode()
    )
    a.close()
    # Another secret in clear: refused, kept for the operator to resolve, never adopted.
    other = b"o" * 32
    client.set(legacy, other)
    with pytest.raises(ConfigError, match="distributed as a file"):
        open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    assert client.get(legacy) == other
    assert (tmp_path / "b" / "secret").read_bytes() == FLEET_SECRET
    dead = RedisLink.from_url("redis://127.0.0.1:1/0", redis_prefix)
    assert check_fleet_secret(dead, other, "a test") is False  # Redis away: not checked


def test_entry_names_longer_than_a_replicas_are_never_read(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Names are filtered by length inside Redis when L3 is scanned (a sweep, the entry count
    of the metrics): one planted a megabyte long is counted, never sent to the process."""
    replica = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    l3 = replica.store(Tier.L3)
    assert isinstance(l3, RedisStore)
    replica.put("k", "an answer", created_s=time.time() - 1)
    client = raw_client(redis_server)
    client.set(f"{redis_prefix}e:" + "x" * 1_000_000, b"planted")
    sent = sent_by(client)
    assert [key for key, _ in l3.scan()] == ["k"]
    assert l3.stats().entries == 1
    assert sent() < 100_000
    assert l3.long_names == 2  # once by the scan, once by the count
    replica.close()
    assert redis_tier.logged_name("a\nb" * 100).endswith("(cut)")
    assert "\n" not in redis_tier.logged_name("a\nb")


def test_a_starting_replica_reads_only_a_short_fingerprint(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """A value planted a megabyte long where the fleet keeps its secret's fingerprint refuses
    the replica (not the fleet's, as any other value would) for the cost of 256 bytes."""
    client = raw_client(redis_server)
    client.set(f"{redis_prefix}secret_fingerprint", b"f" * 1_000_000)
    sent = sent_by(client)
    with pytest.raises(ConfigError, match="not the fleet's"):
        open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    assert sent() < 100_000


@pytest.mark.parametrize("name", ["secret_fingerprint", "secret"])
def test_a_fingerprint_key_of_another_type_refuses_the_replica(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, name: str
) -> None:
    """A hash planted where the fleet keeps its secret's fingerprint (or the legacy key): the
    secret cannot be checked, so the replica does not start, saying which key to delete
    (before, Redis's WRONGTYPE read as "did not answer": it started unchecked)."""
    client = raw_client(redis_server)
    client.hset(f"{redis_prefix}{name}", "x", "y")
    try:
        with pytest.raises(ConfigError, match="another type"):
            open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    finally:
        client.delete(f"{redis_prefix}{name}")


def test_the_password_comes_from_the_environment_and_is_never_shown(
    redis_factory: Callable[[], RedisServer],
    redis_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_factory()
    password = "s3cr3t-pass"
    raw_client(server).config_set("requirepass", password)
    password_file = tmp_path / "redis-password"
    password_file.write_text(password + "\n")
    for environ in ({PASSWORD_ENV: password}, {PASSWORD_FILE_ENV: str(password_file)}):
        link = RedisLink.from_url(server.url, redis_prefix, environ=environ)
        assert link.call(lambda c: c.ping(), False) is True
        link.close()
    no_password = RedisLink.from_url(server.url, redis_prefix, environ={})
    assert no_password.call(lambda c: c.ping(), None) is None  # NOAUTH: an error, counted
    no_password.close()
    in_url = server.url.replace("redis://", f"redis://:{password}@")
    with pytest.raises(ConfigError, match="given twice") as twice:
        RedisLink.from_url(in_url, redis_prefix, environ={PASSWORD_ENV: password})
    assert password not in twice.value.message
    give_secret(tmp_path / "a")
    caplog.set_level("WARNING")
    replica = open_replica(tmp_path / "a", in_url.replace(password, "wrong"), redis_prefix)
    link = redis_link(replica)
    assert link is not None and link.url == server.url.replace("redis://", "redis://:***@")
    replica.close()
    assert "wrong" not in caplog.text and "redis://:***@" in caplog.text


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


def test_malformed_fleet_metadata_is_skipped(redis_server: RedisServer, redis_prefix: str) -> None:
    """Adapter fleet metadata is not signed (docs/security.md): a nested, oversized or
    malformed value is skipped with a warning, never an error for the fleet's readers."""
    link = RedisLink.from_url(redis_server.url, redis_prefix)
    fleet = AdapterFleet(link, "replica-a")
    assert fleet.publish([AdapterVersion("caps", "d" * 64, 1000, time.time(), "replica-a")])
    client = raw_client(redis_server)
    client.hset(
        link.key("adapters"),
        mapping={
            "nested": "[" * 100_000,
            "huge": "x" * (MAX_METADATA_BYTES + 1),
            "not-json": "{",
            "wrong-shape": "[]",
            "far-future": json.dumps(
                {"digest": "e" * 64, "bytes": 1, "updated_s": 1e300, "replica": "x"}
            ),
            "not-a-time": '{"digest": "x", "bytes": 1, "updated_s": NaN}',
            "infinite-size": '{"digest": "%s", "bytes": 1e400, "updated_s": 1}' % ("e" * 64),
            "not-a-digest": json.dumps({"digest": "x" * 4000, "bytes": 1, "updated_s": 1}),
        },
    )
    found = fleet.fleet()
    assert found is not None
    versions, _ = found
    assert list(versions) == ["caps"]
    assert fleet.report([])  # the admin's list reads them: no error (was OverflowError)
    # a value or a name planted a megabyte long is left in Redis, never sent to a reader
    client.hset(link.key("adapters"), "huge-value", "x" * 1_000_000)
    client.hset(link.key("adapter_uses"), "y" * 1_000_000, 1)
    client.hset(link.key("adapter_uses"), "caps", "9" * 1_000_000)
    sent = sent_by(client)
    found = fleet.fleet()
    assert sent() < 100_000
    assert found is not None and list(found[0]) == ["caps"] and "caps" not in found[1]
    link.close()


def test_l3_values_are_read_only_up_to_the_bound(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value longer than MAX_VALUE_BYTES is read no further and refused as forged (a reader
    pays the bound, not the value's size), a name holding no string is a plain miss (no breaker
    opened), and an entry too long to share is kept in L1 and L2 only."""
    monkeypatch.setattr(redis_tier, "MAX_VALUE_BYTES", 2000)
    replica = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    l3 = replica.store(Tier.L3)
    assert isinstance(l3, RedisStore)
    client = raw_client(redis_server)
    replica.put("short", "x" * 100, created_s=time.time() - 1)
    replica.put("long", "y" * 3000, created_s=time.time() - 1)
    assert client.exists(f"{redis_prefix}e:short") == 1
    assert client.exists(f"{redis_prefix}e:long") == 0  # never shared
    found = replica.get("long")
    assert found is not None and found.tier is Tier.L1
    genuine = client.get(f"{redis_prefix}e:short")
    assert genuine is not None
    client.set(f"{redis_prefix}e:padded", genuine + b"z" * 1_000_000)  # huge, planted
    client.hset(f"{redis_prefix}e:hash", mapping={"a": "b"})
    sent = sent_by(client)
    assert l3.get("padded") is None and l3.get("hash") is None
    assert sent() < 100_000  # the bound read (2,000 bytes), not the megabyte
    assert l3.forged == 1  # the oversized one; the hash is no value at all
    assert redis_link(replica) is not None and not redis_link(replica).breaker.is_open  # type: ignore[union-attr]
    assert sorted(key for key, _ in l3.scan()) == ["short"]
    replica.close()


def test_a_scan_reads_values_in_calls_bounded_in_bytes(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep scans L3 in batches of names: the values are sized inside Redis, one over
    MAX_VALUE_BYTES is never sent (refused as forged), and one call returns at most
    MAX_BATCH_BYTES of values, so values planted at the bound under many names cost a reader
    the batch bound a call, not the batch's size."""
    monkeypatch.setattr(redis_tier, "MAX_VALUE_BYTES", 2000)
    monkeypatch.setattr(redis_tier, "MAX_BATCH_BYTES", 3000)
    replica = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    l3 = replica.store(Tier.L3)
    assert isinstance(l3, RedisStore)
    for i in range(6):
        replica.put(f"k{i}", f"{i}" * 700, created_s=time.time() - 1)
    client = raw_client(redis_server)
    genuine = client.get(f"{redis_prefix}e:k0")
    assert genuine is not None and 700 < len(genuine) <= 2000
    for i in range(4):
        client.set(f"{redis_prefix}e:planted{i}", b"z" * 1_000_000)
    replies: list[int] = []
    real_eval = client.eval

    def measured(*args: object) -> object:
        reply = real_eval(*args)  # type: ignore[arg-type]
        replies.append(sum(len(v) for v in reply if isinstance(v, bytes)))  # type: ignore[union-attr]
        return reply

    monkeypatch.setattr(client, "eval", measured)
    names = sorted(client.scan_iter(match=f"{redis_prefix}e:*"))
    values = redis_tier.bounded_mget(client, names)
    assert len(values) == len(names) == 10
    assert sum(v is redis_tier.OVERSIZED for v in values) == 4
    assert sum(isinstance(v, bytes) and v.startswith(genuine[:8]) for v in values) >= 1
    assert len(replies) >= 2 and max(replies) <= 3000  # six values of ~850 bytes: 3 a call
    assert sorted(key for key, _ in l3.scan()) == [f"k{i}" for i in range(6)]
    assert l3.forged == 4
    replica.close()


def test_fleet_warnings_are_kept_per_adapter_whatever_redis_offers(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """A writer cycling the fleet's digest for one adapter cannot grow a replica's memory of
    what it warned about: one entry per local adapter."""
    link = RedisLink.from_url(redis_server.url, redis_prefix)
    fleet = AdapterFleet(link, "replica-a")
    mine = AdapterVersion("caps", "d" * 64, 1000, 1.0, "replica-a")
    for i in range(200):
        theirs = AdapterVersion("caps", f"{i:064x}", 1000, 2.0, "x")
        assert fleet.mismatched([mine], {"caps": theirs}) == [(mine, theirs)]
    assert len(fleet._warned) == 1


def test_a_sweep_deletes_only_what_it_found_in_two_round_trips_a_batch(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`delete_unchanged` deletes an entry only while Redis holds the bytes the sweep found:
    one rewritten by another replica since the scan or since the batch's read, one deleted, and
    one replaced by a forged value stay as they are; the rest go, a batch at a time in two calls
    (values, then one compare-and-delete script), not two a key."""
    monkeypatch.setattr(redis_tier, "_SCAN_BATCH", 3)
    replica = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    l3 = replica.store(Tier.L3)
    assert isinstance(l3, RedisStore)
    for i in range(8):
        replica.put(f"k{i}", f"answer {i}", created_s=time.time() - 1)
    found = sorted(l3.scan())
    assert [key for key, _ in found] == [f"k{i}" for i in range(8)]
    other = open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    other.put("k1", "answer 1, generated again", created_s=time.time())
    client = raw_client(redis_server)
    client.delete(f"{redis_prefix}e:k4")
    client.set(f"{redis_prefix}e:k6", b"forged" * 10)
    link = redis_link(replica)
    assert link is not None
    calls: list[str] = []
    real_eval = link.client.eval

    def counted(*args: object) -> object:
        calls.append("eval")
        return real_eval(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(link.client, "eval", counted)
    real_mget = redis_tier.bounded_mget

    def rewritten_after_reading(c: redis.Redis, names: list[bytes]) -> list[bytes | None]:
        """Another replica writes between the batch's read and its delete: k2 the same
        length (the script's SHA-1 keeps it), k5 another length (its STRLEN keeps it)."""
        values = real_mget(c, names)
        for name in names:
            if name.endswith((b":k2", b":k5")):
                value = client.get(name)
                assert value is not None
                grown = b"x" if name.endswith(b":k5") else b""
                client.set(name, value[:-1] + bytes([value[-1] ^ 1]) + grown)
        return values

    monkeypatch.setattr(redis_tier, "bounded_mget", rewritten_after_reading)
    removed = l3.delete_unchanged(found)
    assert sorted(removed) == ["k0", "k3", "k7"]
    assert len(calls) == 6  # three batches of three: a read and a delete each
    for kept in ("k2", "k5"):
        assert client.exists(f"{redis_prefix}e:{kept}") == 1
    assert client.get(f"{redis_prefix}e:k6") == b"forged" * 10  # left, as a get leaves it
    assert client.exists(f"{redis_prefix}e:k4") == 0
    again = l3.get("k1")
    assert again is not None and again.text == "answer 1, generated again"
    assert sorted(key for key, _ in l3.scan()) == ["k1"]  # k2 and k5 no longer verify
    other.close()
    replica.close()


def test_a_fleet_hash_planted_past_its_bound_is_not_read(
    redis_server: RedisServer, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet's hashes are unsigned: one planted with 200,000 fields cost each replica's
    sync 167 MiB and seconds, every sync. Sized first, one past the bound reads as empty; the
    other is read as before."""
    from tiercache.lora import fleet as fleet_module

    monkeypatch.setattr(fleet_module, "MAX_FLEET_FIELDS", 5)
    link = RedisLink.from_url(redis_server.url, redis_prefix)
    fleet = AdapterFleet(link, "replica-a")
    client = raw_client(redis_server)
    client.hset(fleet.uses_key, mapping={f"planted{i}": 1 for i in range(6)})
    version = AdapterVersion("caps", "d" * 64, 1000, 1.0, "replica-a")
    client.hset(fleet.adapters_key, "caps", version.to_json())
    found = fleet.fleet()
    assert found is not None
    versions, uses = found
    assert list(versions) == ["caps"] and uses == {}
    # a value planted long is left unread: sized inside Redis, never copied there either
    client.delete(fleet.uses_key)
    client.hset(fleet.uses_key, mapping={"caps": 3, "brief": "9" * (1 << 20)})
    client.config_resetstat()
    found = fleet.fleet()
    assert found is not None and found[1] == {"caps": 3}
    stats = client.info("commandstats")
    assert "cmdstat_hgetall" not in stats and stats["cmdstat_hstrlen"]["calls"] >= 2


def test_replicas_writing_side_records_at_once_keep_both_changes(
    redis_server: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Side records (a similarity floor, a semantic entry's outcomes) are merged into each
    shared tier as they are written, compared and set as one step: a replica whose read came
    before another replica's write (simulated: its read sees nothing) keeps the higher floor
    and both outcomes in L3, where writing back what it read kept only its own; a compare-and-
    set that another writer beats is made again from what Redis holds then."""
    from tiercache.semantic import entry_trust, penalties

    def l3_store() -> RedisStore:
        return RedisStore(RedisLink.from_url(redis_server.url, redis_prefix, secret=FLEET_SECRET))

    def replica(name: str) -> tuple[TieredCache, RedisStore]:
        l3 = l3_store()
        tiers = [(Tier.L2, LmdbStore(tmp_path / name, 1 << 22)), (Tier.L3, l3)]
        return TieredCache(tiers), l3

    (a, _), (b, _), (c, l3) = replica("a"), replica("b"), replica("c")
    digest = "e" * 64
    assert penalties.raise_floor(a, digest, 0.90, "scope-a") == pytest.approx(0.91)
    assert entry_trust.record_outcome(a, digest, 0.9, False, "scope-a", 1.0)
    stale_floor = penalties.read_floor
    monkeypatch.setattr(penalties, "read_floor", lambda *args: None)  # read before a's write
    penalties.raise_floor(b, digest, 0.85, "scope-a")
    monkeypatch.setattr(penalties, "read_floor", stale_floor)
    stale_read = entry_trust._read

    def before_a(cache: TieredCache, key: str, scope: str | None, limit: int) -> object:
        return entry_trust.EntryTrust(limit=limit), True, True

    monkeypatch.setattr(entry_trust, "_read", before_a)
    assert entry_trust.record_outcome(b, digest, 0.8, False, "scope-a", 2.0)
    monkeypatch.setattr(entry_trust, "_read", stale_read)
    # a third replica, whose L2 holds nothing, reads what L3 kept
    assert penalties.read_floor(c, digest, "scope-a") == pytest.approx(0.91)
    stamps = [s for _, _, s in entry_trust.read_trust(c, digest, "scope-a").observations]
    assert sorted(stamps) == [1.0, 2.0]

    key, seen = "f" * 64, []

    def append(held: CacheEntry | None) -> CacheEntry:
        seen.append(None if held is None else held.text)
        if len(seen) == 1:  # another replica writes between this read and this write
            l3_store().put(key, CacheEntry("theirs", 1.0))
        return CacheEntry(f"{seen[-1] or ''}+mine", 2.0)

    assert l3.merge(key, append)
    assert seen == [None, "theirs"]  # made again from what Redis held then
    found = l3.get(key)
    assert found is not None and found.text == "theirs+mine"
    for cache in (a, b, c):
        cache.close()


def test_a_merge_over_a_planted_empty_value_or_without_scripts_compares_and_sets(
    redis_server: RedisServer, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty string planted under a record's name reads as none, and the compare-and-set
    takes it as none too (it never matched: every merge failed); a user whose ACL refuses
    scripts gets the same compare-and-set by a transaction (another replica's write between
    the read and the set is read and merged, not overwritten); one that refuses transactions
    too gets nothing written (Unavailable), not a plain write."""
    client = raw_client(redis_server)
    l3 = RedisStore(RedisLink.from_url(redis_server.url, redis_prefix, secret=FLEET_SECRET))
    key = "9" * 64
    client.set(redis_prefix + "e:" + key, b"")
    assert l3.merge(key, lambda held: CacheEntry(f"{held is None}", 1.0))
    found = l3.get(key)
    assert found is not None and found.text == "True"
    client.acl_setuser(
        "noscripts", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
        commands=["+@all", "-@scripting"],
    )  # fmt: skip
    url = f"redis://noscripts:pw@127.0.0.1:{redis_server.port}/0"
    limited = RedisStore(RedisLink.from_url(url, redis_prefix, secret=FLEET_SECRET))
    evals: list[str] = []
    real_eval = redis.Redis.eval

    def counted_eval(self: redis.Redis, script: str, *args: Any) -> Any:
        evals.append(script)
        return real_eval(self, script, *args)

    monkeypatch.setattr(redis.Redis, "eval", counted_eval)
    assert limited.merge(key, lambda held: CacheEntry(f"{held.text if held else ''}+1", 2.0))
    found = l3.get(key)
    assert found is not None and found.text == "True+1"
    assert evals == [redis_tier._SET_IF_SAME]  # refused once: the next merges skip it
    assert limited.merge(key, lambda held: CacheEntry(f"{held.text if held else ''}", 2.5))
    assert len(evals) == 1
    monkeypatch.setattr(redis_tier, "SCRIPTS_RETRY_S", 0.0)  # the retry's time come: asked again
    limited._scripts_off_until = 0.0
    assert limited.merge(key, lambda held: CacheEntry(f"{held.text if held else ''}", 2.6))
    assert len(evals) == 2
    monkeypatch.undo()
    seen: list[str | None] = []

    def append(held: CacheEntry | None) -> CacheEntry:
        seen.append(held.text if held else None)
        if len(seen) == 1:  # another replica writes between this read and the set
            l3.put(key, CacheEntry("theirs", 3.0))
        return CacheEntry(f"{held.text if held else ''}+mine", 4.0)

    assert limited.merge(key, append)
    assert seen == ["True+1", "theirs"]
    found = l3.get(key)
    assert found is not None and found.text == "theirs+mine"
    # a write after WATCH and the transaction's own read: EXEC refuses, read and made again
    real_get, raced = redis_tier.bounded_get, []

    def racing_get(client: Any, name: str) -> bytes | None:
        value = real_get(client, name)
        if isinstance(client, redis.client.Pipeline) and not raced:
            raced.append(name)
            l3.put(key, CacheEntry("raced", 6.0))
        return value

    monkeypatch.setattr(redis_tier, "bounded_get", racing_get)
    seen.clear()
    assert limited.merge(key, lambda held: CacheEntry(f"{held.text if held else ''}+2", 7.0))
    monkeypatch.undo()
    assert raced
    found = l3.get(key)
    assert found is not None and found.text == "raced+2"
    client.acl_setuser(
        "nomerge", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
        commands=["+@all", "-@scripting", "-@transaction"],
    )  # fmt: skip
    url = f"redis://nomerge:pw@127.0.0.1:{redis_server.port}/0"
    refused = RedisStore(RedisLink.from_url(url, redis_prefix, secret=FLEET_SECRET))
    with pytest.raises(Unavailable, match="refuses both scripts and transactions"):
        refused.merge(key, lambda held: CacheEntry("a plain write", 5.0))
    found = l3.get(key)
    assert found is not None and found.text == "raced+2"
    # a flush scans with a script too: it says why it cannot, rather than "send it again"
    with pytest.raises(Unavailable, match="refuses scripts"):
        limited.clear()
    assert l3.get(key) is not None


def test_an_endorsement_never_reverts_an_answer_another_replica_wrote_since(
    redis_server: RedisServer, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`good` feedback raises L3's copy of the answer it was given on only while L3 still holds
    that answer: one generated again by another replica between the endorsement's read
    (simulated: the read still sees the old one) and its write stays, unreverted."""
    l3 = RedisStore(RedisLink.from_url(redis_server.url, redis_prefix, secret=FLEET_SECRET))
    cache = TieredCache([(Tier.L3, l3)])
    key, served = "a" * 64, CacheEntry("the served answer", 100.0)
    l3.put(key, CacheEntry("generated again elsewhere", 200.0))
    monkeypatch.setattr(l3, "peek", lambda k: served)  # read before the other replica's write
    assert cache.endorse_entry(key, 100.0, 1) == 0
    monkeypatch.undo()
    found = l3.get(key)
    assert found is not None and (found.text, found.endorsements) == (
        "generated again elsewhere",
        0,
    )
    l3.put(key, served)
    assert cache.endorse_entry(key, 100.0, 1) == 1
    found = l3.get(key)
    assert found is not None and (found.text, found.endorsements) == ("the served answer", 1)
    cache.close()
