"""Semantic rows an attacker writes straight into the shared stream (tiercache.semantic.redis_rows)
of a real redis-server: unsigned, signed with another secret, a genuine row altered, a genuine tag
for another stream. A host catching up skips each, counts it as forged, and indexes only the
fleet's genuine row."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from redis_server import RedisServer

from tiercache.exact.codec import CacheEntry
from tiercache.exact.keys import REDIS_SEMANTIC_ROWS
from tiercache.exact.redis_tier import Signer
from tiercache.exact.tiered import TieredCache
from tiercache.semantic import redis_rows
from tiercache.semantic.redis_rows import STREAM, RowSharing, SharedRow, sign_fields
from tiercache.semantic.row_log import scope_tag
from tiercache.semantic.store import SemanticStore

from .replicas import (
    FLEET_SECRET,
    TIMEOUT_S,
    invalidation_listener,
    open_replica,
    redis_link,
)

DIMENSIONS = 8
EMBEDDER = "test-embedder@1"


class Host:
    """One replica's semantic side: its L2 and L3 (with listener), row log and row sharing."""

    def __init__(self, state: Path, url: str, prefix: str) -> None:
        self.cache: TieredCache = open_replica(state, url, prefix, with_l1=False)
        self.store = SemanticStore(state / "semantic", 1 << 26)
        link = redis_link(self.cache)
        assert link is not None
        self.link = link
        self.sharing = RowSharing(
            self.cache,
            self.store,
            link,
            embedder=EMBEDDER,
            dimensions=DIMENSIONS,
            retry_s=0.2,
            listener=invalidation_listener(self.cache),
        )

    def rows(self, scope: str) -> list[tuple[str, str]]:
        seqs = self.store.scope_seqs(scope_tag(scope))
        return [(r.digest, r.prompt) for r in self.store.rows(seqs) if r is not None]

    def close(self) -> None:
        self.sharing.close()
        self.cache.close()
        self.store.close()


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    """Hosts a test opens, closed after it (also when it fails)."""
    opened: list[Host] = []
    yield opened
    for host in opened:
        host.close()


def unit(seed: int) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(DIMENSIONS).astype(np.float32)
    return vector / np.linalg.norm(vector)


def test_forged_semantic_rows_are_skipped_and_counted(
    hosts: list[Host], redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    a = Host(tmp_path / "a", redis_server.url, redis_prefix)
    hosts.append(a)
    scope = "scope-shared"
    a.cache.put("d-genuine", "the real answer", created_s=time.time() - 1)
    a.store.append(scope, "d-genuine", "genuine prompt", unit(1))
    assert a.sharing.publish(scope, "d-genuine", "genuine prompt", unit(1))

    client = redis.Redis.from_url(redis_server.url)
    key = redis_prefix + STREAM
    entries: Any = client.xrange(key)
    assert len(entries) == 1
    genuine = {name.decode(): value for name, value in entries[0][1].items()}
    assert set(genuine) == {"m", "v", "t"}
    # A row that would make a reworded prompt land on another answer (the attacker's pick).
    planted = SharedRow.of_entry(
        scope,
        "d-victim",
        "planted prompt",
        unit(2),
        EMBEDDER,
        CacheEntry("", created_s=time.time() - 1),
        origin="attacker",
    ).to_fields()
    altered_meta = json.loads(genuine["m"])
    altered_meta["digest"] = "d-victim"
    forged = [
        planted,  # unsigned, as an older release published
        sign_fields(Signer(b"x" * 32, REDIS_SEMANTIC_ROWS), key, planted),  # another secret
        {**genuine, "m": json.dumps(altered_meta).encode()},  # the fleet's tag, altered row
        {**genuine, "v": unit(3).tobytes()},  # the fleet's tag, another vector
        sign_fields(Signer(FLEET_SECRET, REDIS_SEMANTIC_ROWS), f"{key}:other", planted),
    ]
    for fields in forged:
        client.xadd(key, fields)  # type: ignore[arg-type]
    client.close()

    b = Host(tmp_path / "b", redis_server.url, redis_prefix)
    hosts.append(b)
    b.sharing.start()
    assert b.sharing.follower.wait_caught_up(TIMEOUT_S)
    assert b.rows(scope) == [("d-genuine", "genuine prompt")]
    stats = b.sharing.follower.stats()
    assert (stats.read, stats.added, stats.malformed) == (1 + len(forged), 1, 0)
    assert stats.forged == len(forged)
    assert b.link.health().forged[REDIS_SEMANTIC_ROWS] == len(forged)


def test_oversized_rows_are_never_read_whole(
    hosts: list[Host],
    redis_server: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows planted larger than MAX_ROW_BYTES come to the follower as a marker (counted as
    forged, skipped, the id past them), and a batch stops at MAX_BATCH_BYTES: a flooded stream
    costs a reader its bounds, not the rows' size. The genuine rows around them are indexed."""
    monkeypatch.setattr(redis_rows, "MAX_ROW_BYTES", 4096)
    monkeypatch.setattr(redis_rows, "MAX_BATCH_BYTES", 3 * 4096)
    a = Host(tmp_path / "a", redis_server.url, redis_prefix)
    hosts.append(a)
    scope = "scope-shared"
    client = redis.Redis.from_url(redis_server.url)
    key = redis_prefix + STREAM
    prompts = [f"prompt {i} " + "p" * 3000 for i in range(4)]  # rows of about 3.4 KB
    for i, prompt in enumerate(prompts):
        digest = f"d-{i}"
        a.cache.put(digest, f"answer {i}", created_s=time.time() - 1)
        a.store.append(scope, digest, prompt, unit(i))
        assert a.sharing.publish(scope, digest, prompt, unit(i))
        client.xadd(key, {"m": b"x" * 10_000, "v": b"", "t": b""})  # planted, oversized
    read_sizes: list[int] = []
    original = redis_rows.RowFollower._apply

    def spy(self: Any, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        read_sizes.append(sum(len(v) for _, fields in entries for v in fields.values()))
        original(self, entries)

    monkeypatch.setattr(redis_rows.RowFollower, "_apply", spy)
    b = Host(tmp_path / "b", redis_server.url, redis_prefix)
    hosts.append(b)
    b.sharing.start()
    assert b.sharing.follower.wait_caught_up(TIMEOUT_S)
    assert sorted(b.rows(scope)) == [(f"d-{i}", prompts[i]) for i in range(4)]
    stats = b.sharing.follower.stats()
    assert (stats.read, stats.added, stats.forged) == (8, 4, 4)
    assert len(read_sizes) >= 2  # the four genuine rows do not fit one batch's budget
    assert max(read_sizes) <= 3 * 4096 + 4096  # one row past the budget at most
    client.close()
