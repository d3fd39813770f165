"""Two tritonserver replicas sharing one Redis (issue 7): an answer generated on one is an
`exact` hit on the other, and an invalidation sent to one replica's cache_admin stops the other
serving the entry.

Each replica has its own state dir (its own L1 and L2, as on separate hosts) and a copy of
model_repository whose prompt_cache, embedding_cache, llm and cache_admin carry the same
`redis_url` and `redis_prefix`. The redis-server is the session fixture (tests/conftest.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis_server import RedisServer

from tiercache.server import Ports, TritonServer, copy_repository
from tiercache_client import GenerationResult, TierCacheClient

from .conftest import MODEL_REPOSITORY

pytestmark = pytest.mark.integration
MAX_TOKENS = 8
REDIS_STAGES = ("prompt_cache", "embedding_cache", "llm", "cache_admin")
PROPAGATION_TIMEOUT_S = 10.0


def replica_repository(root: Path, redis_url: str, redis_prefix: str) -> Path:
    """A copy of model_repository under `root` whose Redis-aware stages share one Redis."""
    shared = {"redis_url": redis_url, "redis_prefix": redis_prefix}
    return copy_repository(
        MODEL_REPOSITORY, root / "model_repository", dict.fromkeys(REDIS_STAGES, shared)
    )


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[tuple[TritonServer, TritonServer]]:
    prefix = f"r{uuid.uuid4().hex[:12]}:"
    servers: list[TritonServer] = []
    try:
        for name in ("a", "b"):
            state = tmp_path_factory.mktemp(f"replica-{name}")
            server = TritonServer(
                model_repository=replica_repository(state, redis_server.url, prefix),
                state_dir=state,
                ports=Ports.free(),
                exit_timeout_s=5,
                log_path=state / f"triton-replica-{name}.log",
            )
            servers.append(server)
            server.start()
        for server in servers:
            server.wait_ready(timeout_s=600)
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def clients(
    replicas: tuple[TritonServer, TritonServer],
) -> Iterator[tuple[TierCacheClient, TierCacheClient]]:
    a, b = replicas
    with (
        TierCacheClient(f"127.0.0.1:{a.ports.grpc}", timeout_s=300) as ca,
        TierCacheClient(f"127.0.0.1:{b.ports.grpc}", timeout_s=300) as cb,
    ):
        yield ca, cb


def poll(ask: Callable[[], GenerationResult], done: Callable[[GenerationResult], bool]) -> None:
    """Ask until `done` holds, back to back, up to PROPAGATION_TIMEOUT_S (no fixed sleep)."""
    deadline = time.monotonic() + PROPAGATION_TIMEOUT_S
    while not done(result := ask()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not done within {PROPAGATION_TIMEOUT_S} s: {result}")


def test_answer_from_one_replica_is_exact_hit_on_the_other(
    clients: tuple[TierCacheClient, TierCacheClient],
) -> None:
    a, b = clients
    tenant = f"rep-{uuid.uuid4().hex[:8]}"
    prompt = f"Name one planet ({uuid.uuid4().hex[:6]})."
    first = a.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
    assert first.cache_status == "miss" and first.text

    on_b = b.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
    assert (on_b.cache_status, on_b.text) == ("exact", first.text)
    again = b.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)  # now from B's L1
    assert (again.cache_status, again.text) == ("exact", first.text)


def test_invalidation_sent_to_one_replica_reaches_the_other(
    clients: tuple[TierCacheClient, TierCacheClient],
) -> None:
    a, b = clients
    tenant = f"inv-{uuid.uuid4().hex[:8]}"
    prompt = f"Name one colour ({uuid.uuid4().hex[:6]})."
    other_tenant = f"keep-{uuid.uuid4().hex[:8]}"
    generated = a.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
    kept = a.generate_text(prompt, tenant=other_tenant, max_tokens=MAX_TOKENS)
    assert (generated.cache_status, kept.cache_status) == ("miss", "miss")
    # B serves both, so each sits in B's L1 and L2 as well as in L3.
    for t in (tenant, other_tenant):
        assert b.generate_text(prompt, tenant=t, max_tokens=MAX_TOKENS).cache_status == "exact"
        assert b.generate_text(prompt, tenant=t, max_tokens=MAX_TOKENS).cache_status == "exact"

    report = a.invalidate(tenant=tenant)
    assert report["published"] is True

    poll(
        lambda: b.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS),
        lambda r: r.cache_status != "exact",
    )
    # The other tenant's entry is untouched on B.
    still = b.generate_text(prompt, tenant=other_tenant, max_tokens=MAX_TOKENS)
    assert (still.cache_status, still.text) == ("exact", kept.text)
