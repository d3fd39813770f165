"""Two tritonserver replicas sharing one Redis (issue 7): an answer generated on one is an
`exact` hit on the other, and an invalidation sent to one replica's cache_admin stops the other
serving the entry.

Each replica has its own state dir (its own L1 and L2, as on separate hosts) and a copy of
model_repository whose prompt_cache, embedding_cache, llm and cache_admin carry the same
`redis_url` and `redis_prefix`. The replicas are one fleet: they are given one secret file
(`$TIERCACHE_SECRET_FILE`), since Redis never holds the secret and a replica with another one
refuses to start. The redis-server is the session fixture (tests/conftest.py).
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from redis_server import RedisServer

from tiercache.exact.keys import replace_secret
from tiercache.server import REDIS_STAGES, Ports, TritonServer, copy_repository
from tiercache_client import GenerationResult, TierCacheClient, read_admin_token

from .conftest import METRICS_FLUSH_S, MODEL_REPOSITORY, metric_value

pytestmark = pytest.mark.integration
MAX_TOKENS = 8
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
    fleet_secret = tmp_path_factory.mktemp("fleet") / "secret"
    replace_secret(fleet_secret, secrets.token_bytes(32))
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
                env_overrides={"TIERCACHE_SECRET_FILE": str(fleet_secret)},
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
        TierCacheClient(
            a.grpc_url, timeout_s=300, admin_token=read_admin_token(a.admin_token_file)
        ) as ca,
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


def test_bad_feedback_sent_to_one_replica_stops_the_answer_on_both(
    clients: tuple[TierCacheClient, TierCacheClient],
) -> None:
    """Issue 19: an answer served by B, judged bad through A's feedback model, is served by
    neither replica again (B's L1 and L2 copies dropped through the invalidation channel)."""
    a, b = clients
    tenant = f"fb-{uuid.uuid4().hex[:8]}"
    prompt = f"Name one mountain ({uuid.uuid4().hex[:6]})."
    assert a.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS).cache_status == "miss"
    for _ in range(2):  # B serves it from L3, then from its own L1
        served = b.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
        assert served.cache_status == "exact" and served.answer_id is not None
    report = a.feedback(served.answer_id, "bad", tenant=tenant)
    assert (report["invalidated"], report["published"]) == (True, True)
    poll(
        lambda: b.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS),
        lambda r: r.cache_status != "exact",
    )


def test_identical_misses_on_both_replicas_generate_once(
    replicas: tuple[TritonServer, TritonServer],
    clients: tuple[TierCacheClient, TierCacheClient],
) -> None:
    """Cross-replica coalescing through the servers: a prompt A is generating, sent to B too, is
    not generated again: B waits on A's Redis lease and serves A's answer."""
    servers = replicas
    tenant = f"lease-{uuid.uuid4().hex[:8]}"
    # A long answer (96 tokens, seconds on a CPU) so that B's request reaches llm meanwhile.
    prompt = f"Count from 1 to 200, separated by commas ({uuid.uuid4().hex[:6]})."
    names = (
        "tiercache_llm_generations_total",
        "tiercache_lease_waits_total",
        "tiercache_lease_remote_hits_total",
    )

    def totals() -> dict[str, float]:
        return {n: sum(metric_value(s, n) for s in servers) for n in names}

    time.sleep(4 * METRICS_FLUSH_S)  # earlier tests' generations are counted by now
    before = totals()
    with ThreadPoolExecutor(2) as pool:
        on_a = pool.submit(clients[0].generate_text, prompt, tenant=tenant, max_tokens=96)
        deadline = time.monotonic() + 120
        while metric_value(servers[0], "tiercache_leases_active") < 1:  # A holds the lease
            assert time.monotonic() < deadline and not on_a.done(), "A never took a lease"
            time.sleep(0.05)
        on_b = pool.submit(clients[1].generate_text, prompt, tenant=tenant, max_tokens=96)
        first, second = on_a.result(), on_b.result()
    assert (first.cache_status, second.cache_status) == ("miss", "miss")  # B's was a miss too
    assert first.text and second.text == first.text
    time.sleep(4 * METRICS_FLUSH_S)
    delta = {n: v - before[n] for n, v in totals().items()}
    assert delta == dict.fromkeys(names, 1.0), delta


def test_a_replica_stopped_during_an_invalidation_never_serves_the_entry_again(
    replicas: tuple[TritonServer, TritonServer],
    clients: tuple[TierCacheClient, TierCacheClient],
) -> None:
    """B is down while A invalidates a tenant; B's L2 still holds the tenant's answer when it
    starts again, and B replays the watermark from Redis before serving: a miss, never the
    invalidated text. (B restarts on the same ports, so later tests find it up.)"""
    a, b = clients
    server_b = replicas[1]
    tenant = f"down-{uuid.uuid4().hex[:8]}"
    prompt = f"Name one river ({uuid.uuid4().hex[:6]})."
    generated = a.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
    assert generated.cache_status == "miss"
    assert b.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS).cache_status == "exact"

    server_b.stop()
    assert a.invalidate(tenant=tenant)["published"] is True
    server_b.start()
    server_b.wait_ready(timeout_s=600)
    with TierCacheClient(f"127.0.0.1:{server_b.ports.grpc}", timeout_s=300) as b_again:
        after = b_again.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
    assert after.cache_status == "miss"  # generated again, not B's stored copy
    time.sleep(4 * METRICS_FLUSH_S)
    # B noted the watermarks recorded in Redis when it started (not from a message: it was down)
    noted = metric_value(server_b, "tiercache_invalidations_applied_total", kind="tenant")
    assert noted >= 1
