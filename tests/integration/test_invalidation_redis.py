"""Invalidation across replicas through a real redis-server (tiercache.exact.invalidation): another
process drops its L1/L2 copies, a listener that was cut off catches up, a replica started later
never serves what was invalidated before it started, the `tiercache invalidate` command, and
invalidations an attacker writes straight into Redis (messages and records), ignored and counted."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import RedisServer

from tiercache.cli import main as tiercache_main
from tiercache.errors import InvalidRequest, Unavailable
from tiercache.exact import invalidation as invalidation_module
from tiercache.exact.codec import CacheEntry
from tiercache.exact.invalidation import Invalidator, recorded_members, signed_member
from tiercache.exact.keys import REDIS_INVALIDATIONS, tenant_scope
from tiercache.exact.redis_tier import Signer
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import Invalidation
from tiercache.vocabulary import InvalidationKind, Tier

from .replicas import (
    FLEET_SECRET,
    TIMEOUT_S,
    give_secret,
    invalidation_listener,
    load_secret,
    open_replica,
    redis_link,
    replica_config,
    restart_sweeper,
    wait_until,
)

CHILD = Path(__file__).with_name("invalidation_child.py")
ENTRIES = {
    "k-tag": {"tags": ["kb:v1"]},
    "k-tag2": {"tags": ["kb:v1", "faq"], "scope": "scope-b"},
    "k-tenant": {"scope": "scope-a"},
    "k-adapter": {"adapter": "adapter-1"},
    "k-key": {},
    "k-kept": {"tags": ["kb:v2"], "scope": "scope-b"},
}


@pytest.fixture
def child(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> Iterator[subprocess.Popen[str]]:
    give_secret(tmp_path / "child")  # one fleet with the replicas this test opens
    process = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path / "child"), redis_server.url, redis_prefix,
         json.dumps(ENTRIES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    yield process
    if process.stdin is not None:
        process.stdin.close()
    process.wait(timeout=10)


def holds(cache: TieredCache, tier: Tier, key: str) -> bool:
    """Whether `tier` of `cache` holds `key`, read there directly (no fill, no expiry check)."""
    store = cache.store(tier)
    assert store is not None, f"no {tier.value} in this cache"
    return store.get(key) is not None


def next_report(process: subprocess.Popen[str]) -> dict[str, object]:
    assert process.stdout is not None
    return dict(json.loads(process.stdout.readline()))


def test_invalidations_reach_another_process(
    child: subprocess.Popen[str], redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    invalidator = Invalidator(admin, redis_link(admin))
    client = redis.Redis.from_url(redis_server.url)
    assert client.exists(f"{redis_prefix}e:k-tag") == 1  # the child wrote through to L3

    report = invalidator.tag("kb:v1")
    assert (report.published, report.dropped_shared) == (True, 2)  # L3 swept here
    seen = next_report(child)
    assert (seen["kind"], seen["value"], seen["dropped"]) == ("tag", "kb:v1", ["k-tag", "k-tag2"])
    assert "k-tag" not in seen["l1"] and "k-tag" not in seen["l2"]  # type: ignore[operator]
    assert client.exists(f"{redis_prefix}e:k-tag") == 0

    expected = [
        (InvalidationKind.TENANT, "scope-a", ["k-tenant"]),
        (InvalidationKind.ADAPTER, "adapter-1", ["k-adapter"]),
        (InvalidationKind.KEY, "k-key", ["k-key"]),
    ]
    for kind, value, dropped in expected:
        invalidator.invalidate(kind, value)
        seen = next_report(child)
        assert (seen["kind"], seen["value"], seen["dropped"]) == (kind.value, value, dropped)
    assert seen["l1"] == seen["l2"] == ["k-kept"]
    assert sorted(k.decode() for k in client.keys(f"{redis_prefix}e:*")) == [
        f"{redis_prefix}e:k-kept"
    ]
    admin.close()


def test_a_cut_off_listener_catches_up_when_redis_returns(
    redis_factory: Callable[[], RedisServer], redis_prefix: str, tmp_path: Path
) -> None:
    server = redis_factory()
    admin = open_replica(tmp_path / "admin", server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", server.url, redis_prefix, redis_retry_s=1.0)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    replica.put("k", "old answer", tags=("kb:v1",), created_s=time.time() - 1)
    server.kill()
    wait_until(lambda: not listener.stats().connected)
    server.start()  # empty: the replica's listener reconnects within its retry interval (1 s)
    link = redis_link(admin)
    assert link is not None
    wait_until(lambda: link.call(lambda c: c.ping(), False))
    Invalidator(admin, link).tag("kb:v1")  # sent while the replica was not subscribed
    wait_until(lambda: listener.stats().connected and listener.stats().caught_up >= 1)
    wait_until(lambda: not holds(replica, Tier.L1, "k"))
    assert listener.stats().received == 0  # it came from the recorded watermarks, not the channel
    assert replica.get("k") is None
    admin.close()
    replica.close()


def test_a_catch_up_notes_every_watermark_before_it_sweeps(
    redis_factory: Callable[[], RedisServer], redis_prefix: str, tmp_path: Path
) -> None:
    """After an outage the recorded key invalidations are all noted before the first sweep
    (each key's sweep reads L3 too): none of their answers is served while the sweeps of
    the ones before it run."""
    server = redis_factory()
    admin = open_replica(tmp_path / "admin", server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", server.url, redis_prefix, redis_retry_s=1.0)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    keys = [f"{i}" * 64 for i in range(1, 4)]
    for key in keys:
        replica.put(key, "old answer", created_s=time.time() - 1)
    served_at_first_sweep: list[list[bool]] = []
    apply = listener._apply

    def first_sweep_looks(inv: Any, **kwargs: Any) -> Any:
        if not served_at_first_sweep:
            served_at_first_sweep.append([replica.get(key) is not None for key in keys])
        return apply(inv, **kwargs)

    listener._apply = first_sweep_looks  # type: ignore[method-assign]
    server.kill()
    wait_until(lambda: not listener.stats().connected)
    server.start()
    link = redis_link(admin)
    assert link is not None
    wait_until(lambda: link.call(lambda c: c.ping(), False))
    invalidator = Invalidator(admin, link)
    for key in keys:  # sent while the replica was not subscribed
        invalidator.key(key)
    wait_until(lambda: listener.stats().connected and listener.stats().caught_up >= len(keys))
    wait_until(lambda: not any(holds(replica, Tier.L1, key) for key in keys))
    assert served_at_first_sweep == [[False, False, False]]
    admin.close()
    replica.close()


def test_a_replica_started_later_never_serves_what_was_invalidated(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    old = open_replica(tmp_path / "host", redis_server.url, redis_prefix)
    old.put("k", "old answer", tags=("kb:v1",), created_s=time.time() - 1)
    old.close()  # the host's L2 keeps the entry while no process runs
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    Invalidator(admin, redis_link(admin)).tag("kb:v1")
    restarted = open_replica(tmp_path / "host", redis_server.url, redis_prefix)
    # No wait here: opening the cache waited for the listener to note the recorded watermarks,
    # so the entry is never served, whether or not the sweep at start has removed it yet.
    assert restarted.get("k") is None
    listener = invalidation_listener(restarted)
    assert listener is not None and listener.stats().connected
    report = restart_sweeper(restarted).wait(TIMEOUT_S)
    assert report is not None and report.watermarks >= 1
    assert not holds(restarted, Tier.L2, "k")
    admin.close()
    restarted.close()


def test_an_answer_generated_during_the_invalidation_is_dropped(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """created_s is when the generation started: a write that lands after the invalidation of
    its tag is still covered (no stale answer slips in behind the sweep)."""
    a = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    b = open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    started_s = time.time()
    report = Invalidator(a, redis_link(a)).tag("kb:v1")
    b.put("k", "generated from the old knowledge base", tags=("kb:v1",), created_s=started_s)
    assert a.get("k") is None  # read from L3, covered by the watermark, dropped
    after = report.invalidation.at_s + 0.1  # past the skew allowance (0.05 s): a new answer
    b.put("k", "generated from the new one", tags=("kb:v1",), created_s=after)
    found = a.get("k")
    assert found is not None and found.entry.text == "generated from the new one"
    a.close()
    b.close()


def test_a_log_key_of_another_type_still_lets_invalidations_reach_the_replicas(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Redis's invalidation log replaced by a key of another type (`SET <prefix>invalidated
    x`): recording fails, but the message is still published, so the replicas listening drop
    what it covers (before, the script stopped at the record, nothing was published, and every
    invalidation and bad verdict stayed on its own replica)."""
    a = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    b = open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    b.put("k", "answer", created_s=time.time() - 1)
    assert b.get("k") is not None
    client = redis.Redis.from_url(redis_server.url)
    client.delete(f"{redis_prefix}invalidated")
    client.set(f"{redis_prefix}invalidated", "x")
    try:
        report = Invalidator(a, redis_link(a)).key("k")
        assert report.published
        wait_until(lambda: b.get("k") is None)
    finally:
        client.delete(f"{redis_prefix}invalidated")
        a.close()
        b.close()


def test_redis_down_invalidation_is_local_and_reported(redis_prefix: str, tmp_path: Path) -> None:
    started = time.monotonic()
    cache = open_replica(tmp_path, "redis://127.0.0.1:1/0", redis_prefix)
    assert time.monotonic() - started < 2.0  # a refused connection does not hold the start
    cache.put("k", "answer", tags=("t",), created_s=time.time() - 1)
    with pytest.raises(Unavailable, match="applied on this replica only"):
        Invalidator(cache, redis_link(cache)).tag("t")
    assert cache.get("k") is None
    cache.close()


def test_a_redis_clock_off_this_hosts_is_warned_about(
    redis_server: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Watermarks are timed by Redis's clock and compared with the replicas' clocks: an
    issuer finding Redis's 2 s behind its own says so (an answer made here just before would
    not be covered); one within the skew allowance says nothing."""
    cache = open_replica(tmp_path, redis_server.url, redis_prefix)
    invalidator = Invalidator(cache, redis_link(cache))
    invalidator.tag("in-step")
    offset = invalidator.redis_clock_offset_s
    assert offset is not None and abs(offset) < 1.0  # one machine, one clock
    assert "Redis's clock" not in caplog.text
    real = invalidator._redis_time
    monkeypatch.setattr(
        invalidator, "_redis_time", lambda: (lambda s: None if s is None else s - 2.0)(real())
    )
    invalidator.tag("behind")
    assert invalidator.redis_clock_offset_s is not None
    assert invalidator.redis_clock_offset_s < -1.5
    assert "Redis's clock is" in caplog.text and "behind" in caplog.text
    cache.close()


def test_semantic_rows_are_forgotten_through_the_listener(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    forgotten: list[tuple[Invalidation, list[str]]] = []
    listener.on_dropped(lambda inv, digests: forgotten.append((inv, digests)))
    Invalidator(admin, redis_link(admin)).key("never-cached-here")
    wait_until(lambda: len(forgotten) == 1)
    assert forgotten[0][1] == ["never-cached-here"]  # a key's rows go even if another process swept
    admin.close()
    replica.close()


def test_cli_invalidates_a_tenant_with_the_fleets_secret(
    redis_server: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command reads the fleet's secret from a file (`--state-dir`'s, or
    $TIERCACHE_SECRET_FILE), never from Redis, and signs what it publishes with it."""
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    secret = load_secret(
        replica_config(tmp_path / "replica", redis_server.url, redis_prefix), replica
    )
    assert secret == FLEET_SECRET
    scope = tenant_scope(secret, "acme")
    replica.put("k", "answer", tenant_scope=scope, created_s=time.time() - 1)
    replica.put(
        "other", "answer", tenant_scope=tenant_scope(secret, "other"), created_s=time.time() - 1
    )
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    give_secret(tmp_path / "admin-host")  # the operator's copy of the fleet's secret file
    code = tiercache_main(
        ["invalidate", "--tenant", "acme", "--redis-url", redis_server.url,
         "--redis-prefix", redis_prefix, "--state-dir", str(tmp_path / "admin-host")]
    )  # fmt: skip
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kind"] == "tenant" and printed["value"] == scope
    assert (printed["dropped_l3"], printed["published"]) == (1, True)
    wait_until(lambda: not holds(replica, Tier.L1, "k"))
    assert replica.get("other") is not None
    assert listener.stats().forged == 0
    # A host with another secret is refused before it publishes anything.
    give_secret(tmp_path / "stranger", b"z" * 32)
    assert tiercache_main(
        ["invalidate", "--tag", "x", "--redis-url", redis_server.url,
         "--redis-prefix", redis_prefix, "--state-dir", str(tmp_path / "stranger")]
    ) == 1  # fmt: skip
    assert "TIERCACHE_SECRET_FILE" in capsys.readouterr().err
    assert tiercache_main(["invalidate", "--tag", "x", "--redis-url", "redis://127.0.0.1:1/0",
                           "--state-dir", str(tmp_path / "admin-host")]) == 1  # fmt: skip
    # a tenant that is not valid Unicode, a tag no request can carry: one line, no traceback
    for bad in (["--tenant", "\udc80"], ["--tag", "kb v7"]):
        assert tiercache_main(["invalidate", *bad, "--redis-url", redis_server.url,
                               "--redis-prefix", redis_prefix,
                               "--state-dir", str(tmp_path / "admin-host")]) == 1  # fmt: skip
        err = capsys.readouterr().err
        assert err.startswith("tiercache: ") and "Traceback" not in err
    replica.close()


def test_the_cli_never_makes_a_secret_nor_registers_one(
    redis_server: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run from a host without the fleet's secret (a wrong --state-dir), the command refuses
    and creates no secret there; run against a Redis no replica has registered a fingerprint in
    (a fresh one, a restarted one), it publishes without registering its own: a secret that was
    not the fleet's would otherwise lock every replica out at its next start."""
    monkeypatch.delenv("TIERCACHE_SECRET_FILE", raising=False)
    empty = tmp_path / "not-a-state-dir"
    code = tiercache_main(
        ["invalidate", "--tag", "x", "--redis-url", redis_server.url,
         "--redis-prefix", redis_prefix, "--state-dir", str(empty)]
    )  # fmt: skip
    assert code == 1 and "no server secret" in capsys.readouterr().err
    assert not (empty / "secret").exists()
    give_secret(tmp_path / "admin-host")
    assert tiercache_main(
        ["invalidate", "--tag", "x", "--redis-url", redis_server.url,
         "--redis-prefix", redis_prefix, "--state-dir", str(tmp_path / "admin-host")]
    ) == 0  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    assert client.exists(f"{redis_prefix}secret_fingerprint") == 0


def test_forged_invalidations_are_ignored_and_counted(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Written straight into Redis by someone without the fleet's secret: on the channel and in
    the record every replica catches up from. None wipes an entry; each is counted."""
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    replica.put("k", "answer", tags=("kb:v1",), tenant_scope="scope-a", created_s=time.time() - 1)
    client = redis.Redis.from_url(redis_server.url)
    channel, events = f"{redis_prefix}invalidations", f"{redis_prefix}invalidated"
    later_s = time.time() + 3600  # would kill everything generated before it
    wipe = Invalidation(InvalidationKind.TAG, "kb:v1", later_s, "attacker")
    stranger = Signer(b"x" * 32, REDIS_INVALIDATIONS)
    fleet = Signer(FLEET_SECRET, REDIS_INVALIDATIONS)
    other_channel = f"{redis_prefix}elsewhere"
    messages = [
        wipe.to_json().encode(),  # unsigned, as an older release published
        stranger.seal(channel, wipe.to_json().encode()),  # another secret
        fleet.seal(other_channel, wipe.to_json().encode()),  # the fleet's, for another channel
        b"TCA1",  # truncated
    ]
    for message in messages:
        client.publish(channel, message)
    Invalidator(admin, redis_link(admin)).key("unrelated")  # a genuine one, after them
    wait_until(lambda: listener.stats().received == 1)
    assert listener.stats().forged == len(messages)
    link = redis_link(replica)
    assert link is not None and link.health().forged[REDIS_INVALIDATIONS] == len(messages)
    assert holds(replica, Tier.L1, "k") and replica.get("k") is not None

    # The record: a replica that starts later reads it; forged members are skipped.
    # Scored now (in the range a catch-up reads, the member's own at_s a later one) or in the
    # future (never written by a replica: not even read).
    genuine = signed_member(fleet, events, Invalidation(InvalidationKind.TAG, "kb:v0", 5.0))
    body = genuine.split("|", 1)[1]
    now_s = time.time() - 1
    members = {
        wipe.member(): now_s,  # an older release's format, unsigned
        signed_member(stranger, events, wipe): now_s,  # another secret
        genuine.replace("kb:v0", "kb:v1"): now_s,  # a genuine record altered
        genuine.replace(body, f"{later_s!r}|tag:kb:v0"): now_s,  # a later at_s for it
        signed_member(fleet, f"{redis_prefix}other", wipe): now_s,  # bound to another key
    }
    client.zadd(events, members)
    client.zadd(events, {f"future-{i}": later_s for i in range(3000)})  # three pages' worth
    give_secret(tmp_path / "late")
    late = open_replica(tmp_path / "late", redis_server.url, redis_prefix)
    late_listener = invalidation_listener(late)
    assert late_listener is not None and late_listener.stats().connected
    assert late_listener.stats().forged == len(members)  # the future ones never read
    assert late_listener.stats().caught_up == 1  # the genuine "unrelated" key only
    late.put("k2", "answer", tags=("kb:v1", "kb:v0"), created_s=time.time() - 1)
    assert late.get("k2") is not None
    for cache in (admin, replica, late):
        cache.close()


def test_two_caches_in_one_process_do_not_skip_each_others_messages(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    a: TieredCache = open_replica(tmp_path / "a", redis_server.url, redis_prefix)
    b: TieredCache = open_replica(tmp_path / "b", redis_server.url, redis_prefix)
    listener = invalidation_listener(b)
    assert listener is not None and listener.wait_connected(5)
    b.put("k", "answer", created_s=time.time() - 1)
    Invalidator(a, redis_link(a)).key("k")
    wait_until(lambda: not holds(b, Tier.L1, "k"))
    a.close()
    b.close()


def test_a_replayed_key_message_spares_the_answer_generated_since(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Someone with access to Redis captures a genuine key invalidation and publishes it again
    after the answer was generated anew: the new answer stays in every tier, and its semantic
    row is not forgotten."""
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    forgotten: list[list[str]] = []
    listener.on_dropped(lambda inv, digests: forgotten.append(digests))
    client = redis.Redis.from_url(redis_server.url)
    spy = client.pubsub(ignore_subscribe_messages=True)
    spy.subscribe(f"{redis_prefix}invalidations")
    replica.put("k", "the old answer", created_s=time.time() - 1)
    Invalidator(admin, redis_link(admin)).key("k")
    wait_until(lambda: forgotten == [["k"]])
    captured = None
    deadline = time.monotonic() + TIMEOUT_S
    while captured is None and time.monotonic() < deadline:
        message = spy.get_message(timeout=0.1)  # None also for the subscription's own reply
        if message is not None and message["type"] == "message":
            captured = message["data"]
    assert captured is not None
    assert not holds(replica, Tier.L1, "k")
    time.sleep(0.2)  # past the skew allowance (0.05 s): an answer generated after it
    replica.put("k", "the new answer", created_s=time.time())
    for _ in range(3):
        client.publish(f"{redis_prefix}invalidations", captured)
    wait_until(lambda: listener.stats().received == 4)
    assert holds(replica, Tier.L1, "k") and holds(replica, Tier.L2, "k")
    found = replica.get("k")
    assert found is not None and found.entry.text == "the new answer"
    assert forgotten == [["k"]]  # the replays forgot no row
    assert listener.stats().dropped == 2  # the first message's L1 and L2 copies only
    spy.close()
    admin.close()
    replica.close()


def test_a_late_key_message_spares_a_row_whose_answer_another_replica_made_since(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """A key invalidation heard late (the listener was away; here handed to it directly),
    after another replica generated the answer again: that answer is only in L3, not in this
    host's tiers, and the row (which names the digest; its answer is read from the tiers) is
    not forgotten; nor is it when this host's L2 still held the old copy, which is dropped."""
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    forgotten: list[list[str]] = []
    listener.on_dropped(lambda inv, digests: forgotten.append(digests))
    issued_s = time.time() - 1.0
    admin.put("k", "the new answer", created_s=time.time())  # L3 (and admin's host) only
    late = Invalidation(InvalidationKind.KEY, "k", issued_s, origin="elsewhere")
    listener._apply(late, sweep_local=True)
    assert forgotten == [[]]
    local_l2 = replica.store(Tier.L2)
    assert local_l2 is not None
    local_l2.put("k", CacheEntry("the old answer", issued_s - 1.0))
    listener._apply(late, sweep_local=True)
    assert forgotten == [[], []]  # the old copy dropped, the row kept for the new answer
    assert local_l2.peek("k") is None
    found = replica.get("k")
    assert found is not None and found.entry.text == "the new answer"
    gone = Invalidation(InvalidationKind.KEY, "gone", issued_s, origin="elsewhere")
    listener._apply(gone, sweep_local=True)  # nothing generated since: its row is forgotten
    assert forgotten[-1] == ["gone"]
    admin.close()
    replica.close()


def test_recorded_members_reads_every_member_once_in_pages(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Pages follow the scores; a run of one score longer than a page is read by offset; the
    bounds hold."""
    client = redis.Redis.from_url(redis_server.url)
    events = f"{redis_prefix}paged"
    members = {f"same-{i:04d}": 10.0 for i in range(2500)}
    members |= {f"spread-{i:04d}": 11.0 + i / 1000 for i in range(1500)}
    members |= {"early": 1.0, "future": 1e12}
    client.zadd(events, members)
    read = list(recorded_members(client, events, 5.0, 1e9, page=1000))
    assert len(read) == len(set(read)) == 4000
    assert {m.decode() for m in read} == set(members) - {"early", "future"}
    everything = list(recorded_members(client, events, None, 1e12, page=7))
    assert len(everything) == len(members)
    assert list(recorded_members(client, events, 1e11, 1e11)) == []


def test_a_failing_catch_up_keeps_the_subscription(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catch-up that fails (a slow or flooded record) is retried on its own; the listener
    stays subscribed meanwhile and applies what is published."""
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    original = invalidation_module.recorded_members
    failures = [2]

    def flaky(*args: object, **kwargs: object) -> Iterator[bytes]:
        if failures[0] > 0 and threading.current_thread() is listener._thread:
            failures[0] -= 1
            raise redis.exceptions.TimeoutError("a flooded record")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(invalidation_module, "recorded_members", flaky)
    client = redis.Redis.from_url(redis_server.url)
    client.client_kill_filter(_type="pubsub")  # the listener reconnects, then catches up
    wait_until(lambda: listener.stats().catch_up_failures >= 1)
    assert not listener.stats().connected  # not every recorded watermark noted yet
    replica.put("k", "answer", created_s=time.time() - 1)
    Invalidator(admin, redis_link(admin)).key("k")
    wait_until(lambda: not holds(replica, Tier.L1, "k"))  # heard while the catch-up failed
    wait_until(lambda: listener.stats().connected)  # the third attempt read the record
    assert listener.stats().catch_up_failures == 2
    admin.close()
    replica.close()


def test_a_flooded_record_is_read_up_to_the_cap(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Junk scored in range past CATCH_UP_MAX_FORGED members: the catch-up stops there, counts
    it, and the listener does not report connected (not every watermark was read); it stays
    subscribed and applies what is published meanwhile."""
    monkeypatch.setattr(invalidation_module, "CATCH_UP_MAX_FORGED", 50)
    client = redis.Redis.from_url(redis_server.url)
    client.zadd(f"{redis_prefix}invalidated", {f"junk-{i}": time.time() - 10 for i in range(80)})
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    give_secret(tmp_path / "late")
    late = open_replica(tmp_path / "late", redis_server.url, redis_prefix)
    listener = invalidation_listener(late)
    assert listener is not None and not listener.stats().connected
    assert listener.stats().truncated >= 1 and listener.stats().forged >= 50
    late.put("k", "answer", created_s=time.time() - 1)
    Invalidator(admin, redis_link(admin)).key("k")
    wait_until(lambda: not holds(late, Tier.L1, "k"))  # heard on the channel all the same
    admin.close()
    late.close()


def test_a_replica_reads_no_l3_value_until_it_has_caught_up_on_the_record(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone with access to Redis captures a signed answer, sets it again after its key was
    invalidated, and floods the invalidation record ahead of the watermark so that a replica
    starting now cannot catch up: that replica served the replayed answer from L3 (it had no
    watermark for it). L3 is read only once the listener has every recorded watermark; once
    the flood is gone and the catch-up completes, the watermark keeps the answer out."""
    monkeypatch.setattr(invalidation_module, "CATCH_UP_MAX_FORGED", 50)
    monkeypatch.setattr(invalidation_module, "CATCH_UP_TRUNCATED_RETRY_S", 0.2)
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    admin.put("k", "the old answer", created_s=time.time() - 1)
    client = redis.Redis.from_url(redis_server.url)
    captured = client.get(f"{redis_prefix}e:k")
    assert captured is not None
    Invalidator(admin, redis_link(admin)).key("k")
    assert client.get(f"{redis_prefix}e:k") is None
    client.set(f"{redis_prefix}e:k", captured)  # replayed
    junk = {f"junk-{i}": time.time() - 10 for i in range(80)}  # scored ahead of the watermark
    client.zadd(f"{redis_prefix}invalidated", junk)  # type: ignore[arg-type]
    give_secret(tmp_path / "late")
    late = open_replica(tmp_path / "late", redis_server.url, redis_prefix)
    listener = invalidation_listener(late)
    assert listener is not None and not listener.caught_up()
    assert late.get("k") is None  # not read from L3 (before: "the old answer")
    client.zrem(f"{redis_prefix}invalidated", *junk)
    wait_until(listener.caught_up)
    assert late.get("k") is None  # read now, and covered by the watermark
    admin.close()
    late.close()


def test_a_retried_catch_up_starts_where_the_failed_one_did(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica away while a tag was invalidated, whose catch-up fails until after it heard a
    later message: that message raises its newest watermark, and a retry starting from there
    would skip the record of its absence. It starts where the failed one would have."""
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    away = open_replica(tmp_path / "away", redis_server.url, redis_prefix)
    away.put("k", "the old answer", tags=("kb:v1",), created_s=time.time() - 1)
    away.close()
    invalidator = Invalidator(admin, redis_link(admin))
    invalidator.tag("kb:v1")  # recorded while the replica is away
    original = invalidation_module.recorded_members
    allow = threading.Event()

    def flaky(*args: object, **kwargs: object) -> Iterator[bytes]:
        if not allow.is_set():
            raise redis.exceptions.TimeoutError("a slow record")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(invalidation_module, "recorded_members", flaky)
    back = open_replica(tmp_path / "away", redis_server.url, redis_prefix)
    listener = invalidation_listener(back)
    assert listener is not None and listener.stats().catch_up_failures >= 1
    time.sleep(0.3)  # past twice the skew allowance: a later watermark's window excludes it
    invalidator.tag("kb:other")  # heard on the channel while the catch-up keeps failing
    wait_until(lambda: listener.stats().received >= 1)
    allow.set()
    wait_until(lambda: listener.stats().connected)
    assert listener.stats().caught_up == 2  # kb:v1 as well as kb:other
    assert back.get("k") is None
    admin.close()
    back.close()


def test_members_planted_oversized_reach_a_reader_as_markers(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Redis takes sorted-set members of up to 512 MB: a writer planting a few huge ones in the
    record must not cost each listener their size. They come as short markers, refused as
    forged; the genuine members around them are all read."""
    client = redis.Redis.from_url(redis_server.url)
    events = f"{redis_prefix}invalidated"
    past = time.time() - 10
    client.zadd(events, {f"huge-{i}-".encode() + b"x" * (4 << 20): past for i in range(3)})
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    Invalidator(admin, redis_link(admin)).key("k")  # a genuine one after them
    read = list(recorded_members(client, events, None, time.time() + 1, page=2))
    assert len(read) == 4
    assert max(len(m) for m in read) <= invalidation_module.MAX_MEMBER_BYTES
    assert sum(m.startswith(b"oversized:") for m in read) == 3
    give_secret(tmp_path / "late")
    late = open_replica(tmp_path / "late", redis_server.url, redis_prefix)
    listener = invalidation_listener(late)
    assert listener is not None and listener.stats().connected
    assert listener.stats().forged == 3 and listener.stats().caught_up == 1
    late.put("k", "answer", created_s=time.time() - 5)
    assert late.get("k") is None  # the genuine watermark, read past the planted ones
    with pytest.raises(InvalidRequest, match="at most 512 characters"):
        Invalidator(admin, redis_link(admin)).tag("t" * 513)
    admin.close()
    late.close()


def test_an_oversized_message_is_refused_before_its_signature(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    fleet = Signer(FLEET_SECRET, REDIS_INVALIDATIONS)
    channel = f"{redis_prefix}invalidations"
    inv = Invalidation(InvalidationKind.KEY, "k", time.time(), "elsewhere")
    padded = json.dumps({**json.loads(inv.to_json()), "pad": "x" * 10_000}).encode()
    client = redis.Redis.from_url(redis_server.url)
    client.publish(channel, fleet.seal(channel, padded))  # signed, yet longer than any we send
    Invalidator(admin, redis_link(admin)).key("unrelated")
    wait_until(lambda: listener.stats().received == 1)
    assert listener.stats().forged == 1
    admin.close()
    replica.close()


def test_a_record_written_late_is_caught_up_after_a_newer_one_was_heard(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An issuer reads Redis's clock, then spends a while (its host log, a long local sweep)
    before recording. Meanwhile another issuer's later invalidation reaches a replica, whose
    subscription then drops; the late record is published while it is away. On reconnecting
    the replica catches up from the newest invalidation it heard (less the skew): the record
    is scored by when it was written, so the catch-up reads it although its `at_s` is older."""
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    listener = invalidation_listener(replica)
    assert listener is not None and listener.wait_connected(5)
    link = redis_link(admin)
    assert link is not None
    invalidator = Invalidator(admin, link)
    slow_at_s = float(link.client.time()[0]) + float(link.client.time()[1]) / 1e6
    time.sleep(0.5)  # the slow issuer is busy; another one invalidates meanwhile
    invalidator.key("other")
    wait_until(lambda: listener.stats().received == 1)
    replica.put("k", "the old answer", created_s=slow_at_s - 5)
    gate = threading.Event()
    subscribe = listener._subscribe

    def held() -> object:
        gate.wait(TIMEOUT_S)
        return subscribe()

    monkeypatch.setattr(listener, "_subscribe", held)
    redis.Redis.from_url(redis_server.url).client_kill_filter(_type="pubsub")
    wait_until(lambda: listener.stats().reconnects >= 1)
    late = Invalidation(InvalidationKind.KEY, "k", slow_at_s, admin.invalidations.origin)
    link.call_or_raise(lambda c: invalidator._record(c, link, late))  # heard by nobody
    gate.set()
    wait_until(lambda: listener.stats().connected and listener.stats().caught_up >= 1)
    assert replica.get("k") is None
    admin.close()
    replica.close()


def test_a_connection_that_stops_answering_pings_is_replaced(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer gone without closing the socket (a black-holed route) sends no pong: after two
    pings unanswered the listener reconnects, catches up, and applies what it missed."""
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    link = redis_link(replica)
    assert link is not None
    listener = invalidation_module.InvalidationListener(
        link, replica, poll_s=0.05, retry_s=0.1, ping_s=0.2
    )
    deaf = [True]
    subscribe = listener._subscribe

    def silent() -> object:
        pubsub: Any = subscribe()
        if deaf[0]:  # pings go nowhere and nothing arrives: as a black hole would
            deaf[0] = False
            pubsub.ping = lambda *a, **k: None
            pubsub.get_message = lambda *a, **k: time.sleep(0.05)
        return pubsub

    monkeypatch.setattr(listener, "_subscribe", silent)
    listener.start()
    try:
        assert listener.wait_connected(5)
        replica.put("k", "answer", created_s=time.time() - 1)
        Invalidator(admin, redis_link(admin)).key("k")  # published while it hears nothing
        wait_until(lambda: listener.stats().reconnects >= 1)
        wait_until(lambda: not holds(replica, Tier.L1, "k"))
    finally:
        listener.close()
    admin.close()
    replica.close()


def test_a_slow_first_catch_up_holds_the_start_until_it_ends(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis answers, its invalidation record takes longer to read than the start waits for
    an answer (a long record: every bad verdict adds a member): the stage started serving its
    own tiers, invalidated entries among them, and logged that Redis did not answer. It waits
    for the record now (up to CATCH_UP_WAIT_S)."""
    replica = open_replica(tmp_path / "replica", redis_server.url, redis_prefix)
    link = redis_link(replica)
    assert link is not None
    listener = invalidation_module.InvalidationListener(link, replica, poll_s=0.05, retry_s=0.1)
    catch_up = listener._catch_up

    def slow(*args: Any, **kwargs: Any) -> bool:
        time.sleep(2.0)
        return catch_up(*args, **kwargs)

    monkeypatch.setattr(listener, "_catch_up", slow)
    listener.start()
    try:
        started = time.monotonic()
        assert listener.wait_first_attempt(0.5, catching_up_s=30.0)
        assert time.monotonic() - started >= 1.5 and listener.subscribed
    finally:
        listener.close()
    replica.close()


def test_a_process_started_later_on_the_host_knows_what_the_host_heard_without_redis_record(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    """Redis's invalidation record lost (a restart without persistence; members deleted by
    whoever can write to it: signatures stop forged records, not deleted ones): a process of
    the host started afterwards served an L2 entry invalidated while the host's other process
    was running. What a process hears is kept in the host's log, once per watermark."""
    running = open_replica(tmp_path / "host", redis_server.url, redis_prefix)
    running.put("k", "old answer", created_s=time.time() - 1)
    admin = open_replica(tmp_path / "admin", redis_server.url, redis_prefix)
    Invalidator(admin, redis_link(admin)).key("k")
    listener = invalidation_listener(running)
    assert listener is not None
    wait_until(lambda: listener.stats().received >= 1)
    link = redis_link(admin)
    assert link is not None
    link.call_or_raise(lambda c: c.delete(link.key("invalidated")))  # the record is gone
    marks = running.host_marks
    assert marks is not None
    assert marks.keep_heard([Invalidation(InvalidationKind.KEY, "k", time.time() - 0.5)]) == 0
    l2 = running.store(Tier.L2)
    assert l2 is not None
    l2.put("k", CacheEntry("old answer", time.time() - 1))  # a copy the sweep did not reach
    running.close()  # the host restarts
    started = open_replica(tmp_path / "host", redis_server.url, redis_prefix)
    assert started.get("k") is None  # the host's log refuses it
    admin.close()
    started.close()
