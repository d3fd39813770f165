"""A new replica warms from Redis (issue 7): semantic rows shared through a Redis stream
(tiercache.semantic.redis_rows) and adapter metadata shared through Redis hashes
(tiercache.lora.fleet), in process, against a real redis-server.

Each "host" is a state dir of its own (its own L2 and semantic row log), as in replicas.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis_server import RedisServer

from tiercache.config import ADAPTERS_DIR_ENV
from tiercache.exact.invalidation import Invalidator
from tiercache.exact.redis_tier import RedisLink
from tiercache.exact.tiered import TieredCache
from tiercache.lora.fleet import AdapterFleet, FleetSync, local_versions
from tiercache.lora.registry import AdapterRegistry
from tiercache.semantic.index import Neighbour, SemanticIndex
from tiercache.semantic.redis_rows import STREAM, RowSharing, SharedRow
from tiercache.semantic.row_log import scope_tag
from tiercache.semantic.stage import EmbeddingCache, SemanticOutcome
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache
from tiercache.server import REDIS_STAGES, Ports, TritonServer, copy_repository
from tiercache.vocabulary import Tier
from tiercache_client import TierCacheClient, read_admin_token

from .conftest import MODEL_REPOSITORY, metric_value
from .replicas import (
    TIMEOUT_S,
    give_secret,
    invalidation_listener,
    open_replica,
    redis_link,
    wait_until,
)

pytestmark = pytest.mark.integration
DIMENSIONS = 8
EMBEDDER = "test-embedder@1"


@dataclass
class Host:
    """One replica's semantic side: its L2 (+ L3 and listener), row log and row sharing."""

    cache: TieredCache
    store: SemanticStore
    sharing: RowSharing
    searcher: SemanticIndex | None = None

    def index(
        self,
        scope: str,
        digest: str,
        prompt: str,
        vector: np.ndarray,
        tenant: str = "",
        **entry: object,
    ) -> None:
        """What the llm stage does for a stored answer: store it, index it, share the row."""
        self.cache.put(digest, f"answer of {prompt}", tenant_scope=tenant, **entry)  # type: ignore[arg-type]
        self.store.append(scope, digest, prompt, vector)
        assert self.sharing.publish(scope, digest, prompt, vector)

    def rows(self, scope: str) -> list[tuple[str, str]]:
        """(digest, prompt) of the scope's live rows in this host's log."""
        seqs = self.store.scope_seqs(scope_tag(scope))
        return [(r.digest, r.prompt) for r in self.store.rows(seqs) if r is not None]

    def search(self, scope: str, vector: np.ndarray) -> Neighbour:
        """The nearest row as this host's embedding_cache would find it."""
        if self.searcher is None:
            self.searcher = SemanticIndex(self.store, DIMENSIONS, persist_graphs=False)
        return self.searcher.search(scope, vector, k=1)[0]

    def close(self) -> None:
        self.sharing.close()
        self.cache.close()
        if self.searcher is not None:
            self.searcher.close()  # closes the store too
        else:
            self.store.close()


@pytest.fixture
def open_host(tmp_path: Path) -> Iterator[Callable[..., Host]]:
    hosts: list[Host] = []

    def make(name: str, url: str, prefix: str, start: bool = True, **sharing: object) -> Host:
        state = tmp_path / name
        cache = open_replica(state, url, prefix, with_l1=False)
        store = SemanticStore(state / "semantic", 1 << 26)
        link = redis_link(cache)
        assert link is not None
        share = RowSharing(
            cache,
            store,
            link,
            embedder=EMBEDDER,
            dimensions=DIMENSIONS,
            retry_s=0.2,
            batch_rows=64,
            **sharing,  # type: ignore[arg-type]
        )
        host = Host(cache, store, share)
        if start:
            listener = invalidation_listener(cache)
            assert listener is not None and listener.wait_connected(TIMEOUT_S)
            share.start()
        hosts.append(host)
        return host

    yield make
    for host in hosts:
        host.close()


def unit(seed: int) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(DIMENSIONS).astype(np.float32)
    return vector / np.linalg.norm(vector)


def scope_name() -> str:
    return f"scope-{uuid.uuid4().hex[:8]}"


def test_a_row_goes_to_the_stream_with_its_answers_metadata(
    open_host: Callable[..., Host], redis_server: RedisServer, redis_prefix: str
) -> None:
    a = open_host("a", redis_server.url, redis_prefix)
    scope, vector = scope_name(), unit(1)
    a.index(scope, "d1", "what is x?", vector, tags=("kb:1",), tenant="tenant-1", ttl_s=60.0)

    client = redis.Redis.from_url(redis_server.url)
    entries: Any = client.xrange(redis_prefix + STREAM)
    assert len(entries) == 1
    row = SharedRow.from_fields(entries[0][1])
    assert (row.scope, row.digest, row.prompt, row.embedder) == (
        scope,
        "d1",
        "what is x?",
        EMBEDDER,
    )
    assert np.array_equal(row.vector, vector)
    assert (row.tags, row.tenant, row.origin) == (("kb:1",), "tenant-1", a.store.log_id.hex())
    assert row.expires_s == pytest.approx(row.created_s + 60.0)
    client.close()


def test_a_fresh_host_catches_up_then_follows_and_a_restart_resumes(
    open_host: Callable[..., Host], redis_server: RedisServer, redis_prefix: str
) -> None:
    a = open_host("a", redis_server.url, redis_prefix)
    scope = scope_name()
    for i in range(150):  # more than two of the follower's batches (64)
        a.index(scope, f"d{i}", f"prompt {i}", unit(i))

    b = open_host("b", redis_server.url, redis_prefix)
    assert b.sharing.follower.wait_caught_up(TIMEOUT_S)
    assert len(b.rows(scope)) == 150
    stats = b.sharing.follower.stats()
    assert (stats.read, stats.added, stats.own, stats.dead) == (150, 150, 0, 0)
    # B's index finds A's rows by vector: the rows reached the scope's shared table.
    best = b.search(scope, unit(42))
    assert (best.digest, best.prompt) == ("d42", "prompt 42")
    assert best.similarity == pytest.approx(1.0, abs=1e-5)

    a.index(scope, "late", "a later prompt", unit(999))  # followed while B runs
    wait_until(lambda: ("late", "a later prompt") in b.rows(scope))
    # A's own follower skipped its rows (they came from its log id), adding nothing.
    assert a.sharing.follower.wait_caught_up(TIMEOUT_S)
    wait_until(lambda: a.sharing.follower.stats().own == 151)
    assert a.sharing.follower.stats().added == 0

    # B restarts: it resumes after the last id it stored and reads nothing again. (The row is
    # visible once its batch's transaction commits; the follower's counts and last id are set
    # just after: wait for them before reading the id.)
    wait_until(lambda: b.sharing.follower.stats().added == 151)
    last_id = b.sharing.follower.stats().last_id
    b.close()
    b2 = open_host("b", redis_server.url, redis_prefix)
    assert b2.sharing.follower.wait_caught_up(TIMEOUT_S)
    assert b2.sharing.follower.stats().read == 0
    assert b2.sharing.follower.stats().last_id == last_id
    assert len(b2.rows(scope)) == 151


def test_a_stream_older_than_the_stored_id_is_read_again(
    open_host: Callable[..., Host], redis_server: RedisServer, redis_prefix: str
) -> None:
    """A Redis restored from an older snapshot: its stream ends before the id this host stored,
    so the host reads it from its start instead of waiting for ids it will never see."""
    a = open_host("a", redis_server.url, redis_prefix)
    scope = scope_name()
    a.index(scope, "d", "a prompt", unit(3))
    b = open_host("b", redis_server.url, redis_prefix, start=False)
    future = f"{int(time.time() * 1000) + 3_600_000}-0"
    b.store.log_rows(
        [], {b"meta:redis-stream:" + (redis_prefix + STREAM).encode(): future.encode()}
    )
    b.sharing.follower.close()  # it read the stored id at construction: make it again
    b.sharing = RowSharing(
        b.cache,
        b.store,
        redis_link(b.cache),
        embedder=EMBEDDER,
        dimensions=DIMENSIONS,  # type: ignore[arg-type]
    )
    assert b.sharing.follower.stats().last_id == future
    b.sharing.start()
    wait_until(lambda: b.rows(scope) == [("d", "a prompt")])


def test_a_row_the_host_already_has_stays_one_row(
    open_host: Callable[..., Host], redis_server: RedisServer, redis_prefix: str
) -> None:
    a = open_host("a", redis_server.url, redis_prefix)
    b = open_host("b", redis_server.url, redis_prefix)
    scope = scope_name()
    # The same answer digest indexed on both hosts (the same prompt answered on each).
    b.index(scope, "same", "the same prompt", unit(7))
    a.index(scope, "same", "the same prompt", unit(7))
    a.index(scope, "other", "another prompt", unit(8))
    wait_until(lambda: b.sharing.follower.stats().read >= 3)
    wait_until(lambda: len(b.rows(scope)) == 2)
    assert sorted(b.rows(scope)) == [("other", "another prompt"), ("same", "the same prompt")]
    stats = b.sharing.follower.stats()
    assert (stats.own, stats.duplicate, stats.added) == (1, 1, 1)


def test_an_invalidated_answer_is_not_brought_back_by_its_row(
    open_host: Callable[..., Host], redis_server: RedisServer, redis_prefix: str
) -> None:
    a = open_host("a", redis_server.url, redis_prefix)
    scope = scope_name()
    a.index(scope, "old", "an old answer's prompt", unit(1), tags=("kb:v1",))
    a.index(scope, "keep", "a kept answer's prompt", unit(2), tags=("kb:v2",))
    a.index(scope, "tenant", "a tenant's prompt", unit(3), tenant="tenant-x")
    admin = Invalidator(a.cache, redis_link(a.cache))
    assert admin.tag("kb:v1", sweep_shared=False).published  # L3 keeps the entry: the
    report = admin.tenant("tenant-x", sweep_shared=False)  # the watermark alone hides it
    assert report.published
    # Generated again after the invalidation (past the clock-skew margin): a new answer for the
    # same digest, shared anew.
    later_s = report.invalidation.at_s + 1.0
    a.index(scope, "tenant", "a tenant's prompt", unit(3), tenant="tenant-x", created_s=later_s)

    b = open_host("b", redis_server.url, redis_prefix)
    assert b.sharing.follower.wait_caught_up(TIMEOUT_S)
    assert sorted(b.rows(scope)) == [
        ("keep", "a kept answer's prompt"),
        ("tenant", "a tenant's prompt"),
    ]
    assert b.sharing.follower.stats().dead == 2  # the first "old" and "tenant" rows
    # The exact cache agrees: the invalidated answer is not served from L3 either.
    assert b.cache.get("old") is None
    assert b.cache.get("tenant") is not None and b.cache.get("keep") is not None


def test_a_replayed_row_stops_hitting_once_its_answer_is_invalidated(
    open_host: Callable[..., Host], redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    a = open_host("a", redis_server.url, redis_prefix)
    b = open_host("b", redis_server.url, redis_prefix)
    scope, vector = scope_name(), unit(5)
    a.index(scope, "d", "how do I reset my password?", vector, tags=("kb:v1",))
    wait_until(lambda: b.rows(scope) == [("d", "how do I reset my password?")])
    # B's embedding cache, as embedding_cache builds it (the guard accepts the best candidate).
    b.searcher = SemanticIndex(b.store, DIMENSIONS, persist_graphs=False)
    stage = EmbeddingCache(
        VectorCache(tmp_path / "b-vectors", DIMENSIONS, 1 << 20, 1 << 24),
        b.searcher,
        b.cache,
        embed=lambda texts: np.stack([vector for _ in texts]),
        choose=lambda query, candidates: 0,
        embedder_key=EMBEDDER,
    )
    hit = stage.search("how can I reset my password?", scope, vector, cached=True)
    assert (hit.outcome, hit.text) == (SemanticOutcome.HIT, "answer of how do I reset my password?")

    assert Invalidator(a.cache, redis_link(a.cache)).tag("kb:v1", sweep_shared=False).published
    wait_until(lambda: b.cache.get("d") is None)  # B's listener noted the watermark
    after = stage.search("how can I reset my password?", scope, vector, cached=True)
    assert (after.outcome, after.text) == (SemanticOutcome.STALE, "")
    stage.vectors.close()


def test_redis_down_then_back(
    open_host: Callable[..., Host], redis_factory: Callable[[], RedisServer], redis_prefix: str
) -> None:
    server = redis_factory()
    a = open_host("a", server.url, redis_prefix)
    b = open_host("b", server.url, redis_prefix)
    scope = scope_name()
    a.index(scope, "before", "before the outage", unit(1))
    wait_until(lambda: len(b.rows(scope)) == 1)

    server.kill()
    a.cache.put("during", "an answer while Redis is down")
    a.store.append(scope, "during", "during the outage", unit(2))
    assert a.sharing.publish(scope, "during", "during the outage", unit(2)) is False
    wait_until(lambda: b.cache.store(Tier.L3) is not None and redis_link(b.cache).breaker.is_open)  # type: ignore[union-attr]
    c = open_host("c", server.url, redis_prefix, start=False)
    c.sharing.start()
    started = time.monotonic()
    assert c.sharing.follower.wait_caught_up(TIMEOUT_S) is False  # Redis is down: no wait
    assert time.monotonic() - started < TIMEOUT_S / 2

    server.start()  # the same port, empty (no persistence)
    a.cache.put("after", "an answer after the outage")
    wait_until(lambda: a.sharing.publish(scope, "after", "after the outage", unit(3)), poll_s=0.1)
    a.store.append(scope, "after", "after the outage", unit(3))
    wait_until(lambda: ("after", "after the outage") in b.rows(scope))
    assert ("during", "during the outage") not in b.rows(scope)  # never reached Redis
    # C, started during the outage, catches up once Redis is back.
    wait_until(lambda: c.rows(scope) == [("after", "after the outage")])
    # The rows are in the log before the follower counts them and marks itself caught up.
    assert c.sharing.follower.wait_caught_up(TIMEOUT_S)
    wait_until(lambda: c.sharing.follower.stats().added == 1)


# -- adapter metadata (tiercache.lora.fleet) -----------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def adapters_folder(root: Path, names: tuple[str, ...] = ("caps", "french")) -> Path:
    for name in names:
        shutil.copytree(REPO / "adapters" / name, root / name)
    return root


def rewrite(folder: Path, mtime_s: float) -> None:
    """Another version of the adapter in `folder` (its config gains a key), dated `mtime_s`."""
    config = folder / "adapter_config.json"
    document = json.loads(config.read_text())
    document["revision"] = uuid.uuid4().hex
    config.write_text(json.dumps(document))
    for file in folder.iterdir():
        os.utime(file, (mtime_s, mtime_s))


def fleet_of(
    tmp_path: Path, name: str, url: str, prefix: str
) -> tuple[AdapterFleet, AdapterRegistry]:
    registry = AdapterRegistry(adapters_folder(tmp_path / name / "adapters"), tmp_path / name)
    link = RedisLink.from_url(url, prefix, retry_s=0.2)
    return AdapterFleet(link, f"replica-{name}"), registry


def test_the_fleets_latest_version_and_a_replica_that_differs(
    tmp_path: Path, redis_server: RedisServer, redis_prefix: str
) -> None:
    a, a_registry = fleet_of(tmp_path, "a", redis_server.url, redis_prefix)
    b, b_registry = fleet_of(tmp_path, "b", redis_server.url, redis_prefix)
    # B's copy of caps is another version with older files: the fleet keeps A's.
    rewrite(b_registry.root / "caps", time.time() - 86400)
    a_local, b_local = local_versions(a_registry), local_versions(b_registry)
    assert a.publish(a_local) and b.publish(b_local)

    found = b.fleet()
    assert found is not None
    latest, _ = found
    caps_a = next(v for v in a_local if v.name == "caps")
    caps_b = next(v for v in b_local if v.name == "caps")
    assert caps_a.digest != caps_b.digest
    assert (latest["caps"].digest, latest["caps"].replica) == (caps_a.digest, "replica-a")
    assert latest["caps"].nbytes == caps_a.nbytes > 0
    assert latest["french"].digest == next(v.digest for v in b_local if v.name == "french")
    report = b.report(b_local)
    assert report["available"] is True and report["mismatched"] == ["caps"]
    row = next(r for r in report["adapters"] if r["name"] == "caps")
    assert (row["digest"], row["local_digest"]) == (caps_a.digest, caps_b.digest)
    assert a.report(a_local)["mismatched"] == []

    # B's folder gets a newer version: it becomes the fleet's latest, and A now differs.
    rewrite(b_registry.root / "caps", time.time() + 5)
    newer = local_versions(b_registry)
    assert b.publish(newer)
    assert a.report(local_versions(a_registry))["mismatched"] == ["caps"]
    assert b.report(newer)["mismatched"] == []
    a.link.close()
    b.link.close()


def test_usage_counts_add_up_across_replicas_and_survive_an_outage(
    tmp_path: Path, redis_factory: Callable[[], RedisServer], redis_prefix: str
) -> None:
    server = redis_factory()
    a, _ = fleet_of(tmp_path, "a", server.url, redis_prefix)
    b, _ = fleet_of(tmp_path, "b", server.url, redis_prefix)
    for _ in range(3):
        a.count_use("french")
    b.count_use("french")
    b.count_use("caps")
    assert a.flush_uses() and b.flush_uses()
    assert a.top(2) == ["french", "caps"]
    assert b.fleet() is not None and b.fleet()[1] == {"french": 4, "caps": 1}  # type: ignore[index]

    server.kill()
    for _ in range(5):
        b.count_use("caps")
    assert b.flush_uses() is False  # kept in memory
    assert b.top(1) == []  # nothing known while Redis is down
    server.start()  # empty: the counts before the outage are gone, B's pending ones are not
    wait_until(b.flush_uses, poll_s=0.1)
    assert a.top(2) == ["caps"]
    found = a.fleet()
    assert found is not None and found[1] == {"caps": 5}
    a.link.close()
    b.link.close()


def test_a_use_count_planted_as_no_integer_is_replaced_and_the_others_counted_once(
    tmp_path: Path, redis_server: RedisServer, redis_prefix: str
) -> None:
    """With one field of the counts hash holding no integer, the pipeline raised after every
    other increment had run, and the flush put them all back: each flush added them again."""
    a, _ = fleet_of(tmp_path, "a", redis_server.url, redis_prefix)
    raw = redis.Redis.from_url(redis_server.url)
    raw.hset(a.uses_key, "french", "notanumber")
    for _ in range(3):
        a.count_use("caps")
    a.count_use("french")
    for _ in range(3):  # flushes after the first have nothing left to add
        assert a.flush_uses()
    found = a.fleet()
    assert found is not None and found[1] == {"caps": 3, "french": 1}
    raw.close()
    a.link.close()


def test_fleet_sync_warms_the_fleets_top_adapters_retrying_until_the_engine_takes_them(
    tmp_path: Path, redis_server: RedisServer, redis_prefix: str
) -> None:
    a, a_registry = fleet_of(tmp_path, "a", redis_server.url, redis_prefix)
    for name, uses in (("french", 5), ("caps", 2), ("gone", 9)):
        for _ in range(uses):
            a.count_use(name)
    assert a.flush_uses()

    b, b_registry = fleet_of(tmp_path, "b", redis_server.url, redis_prefix)
    calls: list[list[str]] = []

    def warm(names: list[str]) -> dict[str, str]:
        calls.append(list(names))
        if len(calls) == 1:  # the engine is still loading
            return dict.fromkeys(names, "error: engine torch_llm is not ready")
        return dict.fromkeys(names, "loaded")

    sync = FleetSync(
        b,
        lambda: local_versions(b_registry),
        sync_s=60,
        warm=warm,
        choose_warm=lambda names: [n for n in names if n in b_registry.names()],
        warm_top=3,
        warm_retry_s=0.05,
    ).start()
    try:
        wait_until(lambda: sync.warmed == {"french": "loaded", "caps": "loaded"})
        assert calls == [["french", "caps"], ["french", "caps"]]  # "gone" is not in B's folder
        found = a.fleet()
        assert found is not None and set(found[0]) == {"caps", "french"}  # B published its own
        assert found[0]["caps"].replica == "replica-b"
    finally:
        sync.close()  # closes b's link
    a.link.close()


# -- through two real tritonservers ----------------------------------------------------------------

FLEET_STAGES = (*REDIS_STAGES, "lora_cache")
MAX_TOKENS = 8


def start_replica(
    root: Path, name: str, redis_url: str, prefix: str, adapters: Path, **lora: str
) -> TritonServer:
    """A tritonserver on a model_repository copy whose Redis-aware stages share one Redis, with
    its own state dir and adapters folder, in one fleet (the fleet's secret given to its state
    dir, as the operator copies it; Redis only checks its fingerprint)."""
    state = root / f"state-{name}"
    give_secret(state)
    shared = {"redis_url": redis_url, "redis_prefix": prefix}
    stages: dict[str, dict[str, str]] = {stage: dict(shared) for stage in FLEET_STAGES}
    stages["lora_cache"].update({"fleet_sync_s": "1", **lora})
    server = TritonServer(
        model_repository=copy_repository(MODEL_REPOSITORY, root / f"repo-{name}", stages),
        state_dir=state,
        ports=Ports.free(),
        exit_timeout_s=5,
        log_path=root / f"triton-warm-{name}.log",
        env_overrides={ADAPTERS_DIR_ENV: str(adapters)},
    )
    server.start()
    try:
        server.wait_ready(timeout_s=600)
    except BaseException:
        server.stop()
        raise
    return server


def test_a_replica_started_later_answers_a_reworded_prompt_from_the_fleet(
    tmp_path: Path, redis_server: RedisServer, redis_prefix: str
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    servers: list[TritonServer] = []
    try:
        a_adapters = adapters_folder(tmp_path / "adapters-a")
        a = start_replica(tmp_path, "a", redis_server.url, redis_prefix, a_adapters)
        servers.append(a)
        tenant = f"warm-{uuid.uuid4().hex[:8]}"
        with TierCacheClient(f"127.0.0.1:{a.ports.grpc}", timeout_s=300) as on_a:
            first = on_a.generate_text(
                "What is the capital of France?", max_tokens=MAX_TOKENS, tenant=tenant
            )
            assert first.cache_status == "miss" and first.text
            styled = on_a.generate_text("Say hi.", max_tokens=4, tenant=tenant, lora_name="caps")
            assert styled.cache_status == "miss"
        # A's row is in the stream; A's use of caps reaches Redis within its fleet_sync_s.
        shared: Any = client.xrange(redis_prefix + STREAM)
        prompts = [SharedRow.from_fields(fields).prompt for _, fields in shared]
        assert any("capital of france" in p.lower() for p in prompts), prompts
        wait_until(lambda: client.hget(redis_prefix + "adapter_uses", "caps") == b"1")

        # B starts afterwards with an empty state dir, an older copy of french, and warms the
        # fleet's most-used adapter.
        b_adapters = adapters_folder(tmp_path / "adapters-b")
        rewrite(b_adapters / "french", time.time() - 86400)
        b = start_replica(
            tmp_path, "b", redis_server.url, redis_prefix, b_adapters, prefetch_fleet_top="1"
        )
        servers.append(b)
        token = read_admin_token(b.admin_token_file)
        with TierCacheClient(b.grpc_url, timeout_s=300, admin_token=token) as on_b:
            reworded = on_b.generate_text(
                "What's the capital of France?", max_tokens=MAX_TOKENS, tenant=tenant
            )
            assert (reworded.cache_status, reworded.text) == ("semantic", first.text)
            assert metric_value(b, "tiercache_semantic_redis_rows_total", event="added") >= 1

            def warmed() -> dict[str, Any]:
                report = on_b.adapters()
                tiers = {row["name"]: row["tier"] for row in report["adapters"]}
                return report if tiers.get("caps") == "engine" else {}

            wait_until(lambda: bool(warmed()), timeout_s=60, poll_s=0.5)
            fleet = warmed()["fleet"]
        assert fleet["available"] is True
        rows = {row["name"]: row for row in fleet["adapters"]}
        assert rows["caps"]["uses"] == 1 and rows["caps"]["digest"] == rows["caps"]["local_digest"]
        assert set(rows) == {"caps", "french"}
        assert fleet["replica"] != rows["caps"]["replica"]  # A published caps first
        # B's french is another, older version: the fleet keeps A's, and B says so.
        assert fleet["mismatched"] == ["french"]
        assert rows["french"]["digest"] != rows["french"]["local_digest"]
    finally:
        for server in servers:
            server.stop()
        client.close()
