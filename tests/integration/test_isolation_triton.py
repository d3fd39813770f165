"""Tenant isolation and response-time padding through a real tritonserver.

A few hundred mixed requests (tiercache_dev.diagnostics.check_isolation's workload, without
adapters: the session server has none) from three tenants, judged by tiercache_client.isolation's
oracle; the same oracle on requests sent as one tenant (the live positive control); and a server
whose llm pads every tenant but one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import ModuleType

import pytest

from tiercache.server import TritonServer, copy_repository
from tiercache_client import TierCacheClient
from tiercache_client.isolation import IsolationOracle
from tiercache_dev.diagnostics import check_isolation

from .conftest import MODEL_REPOSITORY, start_server

pytestmark = pytest.mark.integration
FLOOR_S = 1.0  # well above a hit on a loaded 2-core machine, so the trusted side cannot reach it


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return check_isolation


@pytest.fixture(scope="module")
def oracle(check: ModuleType) -> IsolationOracle:
    return IsolationOracle(check.engine_tokenizer())


def test_mixed_requests_from_three_tenants_never_cross(
    client: TierCacheClient, check: ModuleType, oracle: IsolationOracle
) -> None:
    run = uuid.uuid4().hex[:6]
    tenants = [f"iso-{run}-{i}" for i in range(3)]
    # variety 0.15: about 90 distinct prompts (misses, ~1 s each on a CPU engine), the rest hits
    sent = check.build_workload(
        300, tenants, check.BUILTIN_PAIRS, seed=7, adapters=(), variety=0.15
    )
    outcomes = check.drive(client, sent, concurrency=4)
    report = oracle.check(outcomes)
    assert [o.error for o in outcomes if o.error] == []
    assert report.leaks == [], report.table()
    tally = report.tally()
    # The mix really exercised every kind, so "no leaks" means something.
    for kind in ("exact", "semantic", "kv"):
        assert sum(t[kind].legit for t in tally.values()) > 0, (kind, report.table())


def test_positive_control_one_wire_tenant_for_all_is_flagged(
    client: TierCacheClient, check: ModuleType, oracle: IsolationOracle
) -> None:
    """Every request goes out as one tenant while the oracle is told three: the answers one
    intended tenant generated reach the others, and the oracle must say so."""
    run = uuid.uuid4().hex[:6]
    tenants = [f"iso-{run}-{i}" for i in range(3)]
    sent = check.build_workload(120, tenants, check.BUILTIN_PAIRS, seed=8, adapters=(), variety=0.2)
    outcomes = check.drive(client, sent, concurrency=4, collapse_tenants=True)
    report = oracle.check(outcomes)
    assert {v.kind for v in report.leaks} >= {"exact", "kv"}, report.table()


@pytest.fixture(scope="module")
def padded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    root = tmp_path_factory.mktemp("padding")
    params = {"hit_padding_ms": f"{FLOOR_S * 1000:g}", "trusted_tenants": "trusted"}
    repo = copy_repository(MODEL_REPOSITORY, root / "model_repository", {"llm": params})
    server = start_server(root / "state", "triton.log", repo)
    try:
        yield server
    finally:
        server.stop()


def test_padded_tenants_wait_for_the_floor_and_trusted_ones_do_not(
    padded_server: TritonServer,
) -> None:
    prompt = f"Name one planet ({uuid.uuid4().hex[:6]})."
    with TierCacheClient(f"127.0.0.1:{padded_server.ports.grpc}", timeout_s=120) as client:
        first = client.generate_text(prompt, max_tokens=2, tenant="trusted")
        miss = client.generate_text(prompt, max_tokens=2, tenant="public")
        assert (first.cache_status, miss.cache_status) == ("miss", "masked")  # padded: masked
        trusted = client.generate_text(prompt, max_tokens=2, tenant="trusted")
        padded = client.generate_text(prompt, max_tokens=2, tenant="public")
        anonymous = client.generate_text(prompt, max_tokens=2)  # no tenant: padded too
        streamed = client.generate_text(prompt, max_tokens=2, tenant="public", stream=True)
    # A padded tenant's hit looks like its miss (status masked, no similarity, KV counts or
    # finish reason, one final response); the trusted tenant sees the real status.
    assert (trusted.cache_status, padded.cache_status) == ("exact", "masked")
    assert (padded.finish_reason, padded.kv_reused_tokens, miss.finish_reason) == (None,) * 3
    assert padded.text == miss.text and streamed.text == miss.text and streamed.chunks == 1
    assert trusted.latency_s < FLOOR_S
    assert padded.latency_s >= FLOOR_S
    assert streamed.first_chunk_s is not None and streamed.first_chunk_s >= FLOOR_S
    assert anonymous.cache_status == "masked" and anonymous.latency_s >= FLOOR_S
