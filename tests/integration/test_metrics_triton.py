"""The Grafana dashboard's metrics on a real tritonserver with Redis (issue 7).

One server for the module, on a copy of model_repository whose Redis-aware stages share a
redis-server of the module's own. It serves a miss, an exact hit, a tenant invalidation through
cache_admin and a miss after it; then every metric name a dashboard panel reads must be in the
/metrics scrape, and the Redis, invalidation and lease families must show what that traffic
implies. Last, Redis is killed and restarted: the outage and the recovery show in them too.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest
from dashboard_queries import load_dashboard, metric_names, missing_from_scrape, targets
from redis_server import RedisServer

from tiercache.server import REDIS_STAGES, TritonServer, copy_repository
from tiercache_client import TierCacheClient, read_admin_token

from .conftest import METRICS_FLUSH_S, MODEL_REPOSITORY, settled_metric, start_server

pytestmark = pytest.mark.integration
MAX_TOKENS = 8
PROPAGATION_TIMEOUT_S = 10.0
OUTAGE_TIMEOUT_S = 120.0  # each poke is a generation on a shared CPU


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The module's own redis-server: the last test kills and restarts it."""
    server = RedisServer(tmp_path_factory.mktemp("redis-metrics")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[TritonServer]:
    state = tmp_path_factory.mktemp("metrics")
    shared = {"redis_url": redis.url, "redis_prefix": f"m{uuid.uuid4().hex[:12]}:"}
    repository = copy_repository(
        MODEL_REPOSITORY, state / "model_repository", dict.fromkeys(REDIS_STAGES, shared)
    )
    srv = start_server(state, "triton-metrics.log", repository)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def traffic(server: TritonServer) -> str:
    """Miss, exact hit, tenant invalidation, miss again; returns the scrape once prompt_cache
    has applied the invalidation and the counters have settled."""
    tenant = f"metrics-{uuid.uuid4().hex[:8]}"
    prompt = f"Name one river ({uuid.uuid4().hex[:6]})."
    token = read_admin_token(server.admin_token_file)
    with TierCacheClient(server.grpc_url, timeout_s=300, admin_token=token) as client:
        first = client.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
        again = client.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
        assert (first.cache_status, again.cache_status) == ("miss", "exact")
        assert client.invalidate(tenant=tenant)["published"] is True
        deadline = time.monotonic() + PROPAGATION_TIMEOUT_S
        while settled_metric(server, "tiercache_invalidations_applied_total", model="llm") < 1:
            assert time.monotonic() < deadline, "llm's listener never applied the invalidation"
        after = client.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
        assert after.cache_status == "miss"
    settled_metric(server, "tiercache_lease_acquisitions_total")
    return scrape(server)


def scrape(server: TritonServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics") as response:
        return str(response.read().decode())


def samples(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each sample of `name` whose labels include `labels`."""
    found = []
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match:
            have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                found.append((have, float(match.group(2))))
    return found


def total(text: str, name: str, **labels: str) -> float:
    return sum(value for _, value in samples(text, name, **labels))


def test_every_dashboard_metric_is_scraped(traffic: str) -> None:
    names = set().union(*(metric_names(t["expr"]) for _, t in targets(load_dashboard())))
    assert len(names) >= 30
    assert missing_from_scrape(names, traffic) == []


def test_l1_and_l2_report_the_value_of_their_entries(traffic: str) -> None:
    """Issue 19: prompt_cache's L1 and L2 (L2 by its shared values, l2_eviction gdsf) export
    what their evictions gave up, what they refused and removed, and their hit skew; the tenant
    invalidation removed the copy the exact hit had put in L1."""
    for name in (
        "tiercache_cache_evicted_hits_total",
        "tiercache_cache_rejected_total",
        "tiercache_cache_removed_total",
    ):
        for tier in ("l1", "l2"):
            assert samples(traffic, name, model="prompt_cache", tier=tier), (name, tier)
    assert total(traffic, "tiercache_cache_removed_total", model="prompt_cache", tier="l1") >= 1
    for tier in ("l1", "l2"):
        (skew,) = samples(
            traffic, "tiercache_cache_hit_skew_ratio", model="prompt_cache", tier=tier
        )
        assert 0.0 <= skew[1] <= 1.0


def test_redis_is_up_in_every_stage_that_uses_it(traffic: str) -> None:
    up = samples(traffic, "tiercache_redis_up")
    assert {labels["model"] for labels, _ in up} == set(REDIS_STAGES)
    assert all(value == 1.0 for _, value in up)
    assert total(traffic, "tiercache_redis_errors_total") == 0
    assert total(traffic, "tiercache_redis_breaker_opens_total") == 0
    listeners = samples(traffic, "tiercache_invalidation_listener_connected")
    # one per process with Redis: prompt_cache, llm, cache_admin, feedback, 2 embedding_cache
    assert len(listeners) == 6 and all(value == 1.0 for _, value in listeners)


def test_the_invalidation_is_counted_where_it_was_issued_and_applied(traffic: str) -> None:
    issued = {"model": "cache_admin", "kind": "tenant"}
    assert total(traffic, "tiercache_invalidations_issued_total", **issued) == 1
    assert total(traffic, "tiercache_invalidations_issued_total", model="cache_admin") == 1
    assert total(traffic, "tiercache_invalidations_published_total", model="cache_admin") == 1
    # The issuer swept the host's L2 and L3, which held the answer llm stored.
    dropped = "tiercache_invalidation_dropped_entries_total"
    assert total(traffic, dropped, source="issued", kind="tenant") >= 2
    # Every other process with a listener got the message once and applied it.
    for model, listeners in (("prompt_cache", 1), ("llm", 1), ("embedding_cache", 2)):
        for family in ("received", "applied"):
            name = f"tiercache_invalidations_{family}_total"
            assert total(traffic, name, model=model, kind="tenant") == listeners, (model, name)
            assert total(traffic, name, model=model) == listeners, (model, name)
        lag = samples(traffic, "tiercache_invalidation_lag_seconds_count", model=model)
        assert sum(value for _, value in lag) == listeners
        lag_sum = total(traffic, "tiercache_invalidation_lag_seconds_sum", model=model)
        assert 0 <= lag_sum < PROPAGATION_TIMEOUT_S * listeners
    assert total(traffic, "tiercache_invalidations_received_total", model="cache_admin") == 0
    assert total(traffic, "tiercache_invalidations_replayed_total") == 0  # no reconnect


def test_each_miss_took_a_lease_and_none_waited(traffic: str) -> None:
    acquisitions = "tiercache_lease_acquisitions_total"
    assert total(traffic, acquisitions, model="llm", result="acquired") == 2
    assert total(traffic, acquisitions, result="held_elsewhere") == 0
    assert total(traffic, acquisitions, result="unavailable") == 0
    assert total(traffic, "tiercache_lease_waits_total") == 0
    assert total(traffic, "tiercache_lease_remote_hits_total") == 0
    assert total(traffic, "tiercache_lease_takeovers_total") == 0
    assert total(traffic, "tiercache_leases_active") == 0


def test_cache_families_agree_with_the_traffic(traffic: str) -> None:
    hits = samples(traffic, "tiercache_prompt_cache_hits_total")
    assert {labels["tier"] for labels, _ in hits} == {"l1", "l2", "l3"}
    assert sum(value for _, value in hits) == 1
    assert total(traffic, "tiercache_llm_requests_total", status="miss") == 2
    assert total(traffic, "tiercache_llm_requests_total", status="exact") == 1
    assert total(traffic, "nv_inference_request_success", model="ensemble") == 3


def wait_for_scrape(
    server: TritonServer, done: Callable[[str], bool], poke: Callable[[], None], what: str
) -> str:
    """Scrape (after `poke`, e.g. one request) until `done` holds, up to OUTAGE_TIMEOUT_S."""
    deadline = time.monotonic() + OUTAGE_TIMEOUT_S
    while True:
        poke()
        time.sleep(2 * METRICS_FLUSH_S)
        text = scrape(server)
        if done(text):
            return text
        assert time.monotonic() < deadline, f"not within {OUTAGE_TIMEOUT_S} s: {what}"


def test_a_redis_outage_and_its_end_show_in_the_redis_families(
    server: TritonServer, redis: RedisServer, traffic: str
) -> None:
    stage = {"model": "prompt_cache"}
    opens_before = total(traffic, "tiercache_redis_breaker_opens_total", **stage)
    with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=300) as client:

        def ask() -> None:  # a fresh prompt: prompt_cache and llm both call Redis
            prompt = f"Name one mountain ({uuid.uuid4().hex[:6]})."
            result = client.generate_text(prompt, max_tokens=MAX_TOKENS)
            assert result.cache_status == "miss"  # served from local tiers, no error

        redis.kill()
        down = wait_for_scrape(
            server,
            lambda t: (
                total(t, "tiercache_redis_up", **stage) == 0
                and total(t, "tiercache_lease_acquisitions_total", result="unavailable") >= 1
                and min(v for _, v in samples(t, "tiercache_invalidation_listener_connected")) == 0
            ),
            ask,
            "Redis down in prompt_cache's link, llm's leases and a listener",
        )
        assert total(down, "tiercache_redis_errors_total", **stage) >= 1
        assert total(down, "tiercache_redis_breaker_opens_total", **stage) == opens_before + 1

        redis.start()  # the same port, empty (no persistence)
        up = wait_for_scrape(
            server,
            lambda t: (
                all(v == 1.0 for _, v in samples(t, "tiercache_redis_up", **stage))
                and all(
                    v == 1.0 for _, v in samples(t, "tiercache_invalidation_listener_connected")
                )
            ),
            ask,
            "Redis back in prompt_cache's link and every listener",
        )
    assert total(up, "tiercache_invalidation_reconnects_total") >= 1
    assert total(up, "tiercache_redis_breaker_opens_total", **stage) == opens_before + 1
