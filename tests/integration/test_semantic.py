"""The embedding cache through the real ensemble: reworded prompts hit, wrong answers do not."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiercache.server import TritonServer, copy_repository
from tiercache_client import TierCacheClient

from .conftest import MODEL_REPOSITORY, settled_metric, start_server

pytestmark = pytest.mark.integration
MAX_TOKENS = 8


def tenant() -> str:
    """A tenant of its own: its scope holds only what the test puts there."""
    return f"semantic-{uuid.uuid4().hex[:8]}"


def test_reworded_prompt_is_a_semantic_hit_with_the_same_text(client: TierCacheClient) -> None:
    t = tenant()
    first = client.generate_text("What is the capital of France?", max_tokens=MAX_TOKENS, tenant=t)
    assert first.cache_status == "miss"
    again = client.generate_text("What's the capital of France?", max_tokens=MAX_TOKENS, tenant=t)
    assert (again.cache_status, again.text) == ("semantic", first.text)
    assert again.similarity is not None and 0.8 < again.similarity <= 1.0


@pytest.mark.parametrize(
    ("stored", "changed"),
    [
        ("How do I cancel my order?", "How do I not cancel my order?"),
        ("Give me 3 tips for sleeping better.", "Give me 7 tips for sleeping better."),
        ("What is the capital of France?", "What is the capital of Germany?"),
    ],
)
def test_negated_number_or_entity_change_misses(
    client: TierCacheClient, stored: str, changed: str
) -> None:
    t = tenant()
    assert client.generate_text(stored, max_tokens=MAX_TOKENS, tenant=t).cache_status == "miss"
    assert client.generate_text(changed, max_tokens=MAX_TOKENS, tenant=t).cache_status == "miss"


def test_another_tenants_reworded_prompt_misses(client: TierCacheClient) -> None:
    owner, other = tenant(), tenant()
    client.generate_text("How tall is Mount Everest?", max_tokens=MAX_TOKENS, tenant=owner)
    result = client.generate_text("How high is Mount Everest?", max_tokens=MAX_TOKENS, tenant=other)
    assert result.cache_status == "miss"


def test_opt_outs_and_sampled_requests_skip_the_semantic_cache(client: TierCacheClient) -> None:
    t = tenant()
    client.generate_text("Name the largest ocean on Earth.", max_tokens=MAX_TOKENS, tenant=t)
    reworded = "Which is the largest ocean on Earth?"
    skipped = client.generate_text(
        reworded, max_tokens=MAX_TOKENS, tenant=t, cache_control="no-semantic"
    )
    assert skipped.cache_status == "miss"
    other_params = client.generate_text(reworded, max_tokens=MAX_TOKENS + 1, tenant=t)
    assert other_params.cache_status == "miss"  # max_tokens is part of the scope


def test_both_embedding_cache_instances_serve_each_others_writes(
    server: TritonServer, client: TierCacheClient
) -> None:
    """Answers are written by the llm process; both embedding_cache processes find them."""
    t = tenant()
    client.generate_text("How do I boil an egg?", max_tokens=MAX_TOKENS, tenant=t)
    labels = [f"embedding_cache_0_{i}" for i in range(2)]
    before = [
        settled_metric(
            server, "tiercache_embedding_cache_lookups_total", outcome="semantic", instance=name
        )
        for name in labels
    ]
    prompts = ["How do I boil an egg ?", "How do I boil an egg??", "how do I boil an egg"] * 4
    with ThreadPoolExecutor(6) as pool:
        results = list(
            pool.map(
                lambda p: client.generate_text(
                    p, max_tokens=MAX_TOKENS, tenant=t, cache_control="semantic-only"
                ),
                prompts,
            )
        )
    assert {r.cache_status for r in results} == {"semantic"}
    after = [
        settled_metric(
            server, "tiercache_embedding_cache_lookups_total", outcome="semantic", instance=name
        )
        for name in labels
    ]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_semantic_hit_survives_a_restart(state_dir: Path, server: TritonServer) -> None:
    t = tenant()
    first = start_server(state_dir, "triton-semantic-1.log")
    try:
        with TierCacheClient(f"127.0.0.1:{first.ports.grpc}") as c:
            miss = c.generate_text(
                "What is the boiling point of water?", max_tokens=MAX_TOKENS, tenant=t
            )
            assert miss.cache_status == "miss"
    finally:
        first.stop()
    second = start_server(state_dir, "triton-semantic-2.log")
    try:
        with TierCacheClient(f"127.0.0.1:{second.ports.grpc}") as c:
            hit = c.generate_text(
                "What's the boiling point of water?", max_tokens=MAX_TOKENS, tenant=t
            )
    finally:
        second.stop()
    assert (hit.cache_status, hit.text) == ("semantic", miss.text)


def test_long_prompts_that_differ_past_the_embedders_window_never_share_an_answer(
    client: TierCacheClient,
) -> None:
    """MiniLM reads 256 tokens; two prompts equal up to there would get one vector."""
    t = tenant()
    shared = "Follow the support policy below carefully and answer briefly. " * 30
    first = client.generate_text(
        shared + "How do I cancel my hotel booking?", max_tokens=4, tenant=t
    )
    second = client.generate_text(
        shared + "How do I change the name on my flight ticket?", max_tokens=4, tenant=t
    )
    assert (first.cache_status, second.cache_status) == ("miss", "miss")


@pytest.mark.parametrize(
    "reworded", ["what is the capital of France?", "Tell me the capital city of France."]
)
def test_a_hit_the_engine_verifies_is_served_only_as_its_own_answer(
    server: TritonServer, client: TierCacheClient, reworded: str
) -> None:
    """With `verify-semantic` a semantic hit's answer is served as `verified` only when it is
    exactly what the engine generates for the reworded prompt (compared with a generation that
    skips the cache), else the engine's own answer is served as a miss: precision 1.0 against
    the engine's output by construction. Either way one verification is counted."""
    t = tenant()
    first = client.generate_text("What is the capital of France?", max_tokens=16, tenant=t)
    assert first.cache_status == "miss"
    outcomes = {
        o: settled_metric(server, "tiercache_llm_semantic_verifications_total", outcome=o)
        for o in ("verified", "refuted")
    }
    checked = client.generate_text(
        reworded, max_tokens=16, tenant=t, cache_control="verify-semantic, no-store"
    )
    own = client.generate_text(
        reworded, max_tokens=16, tenant=t, cache_control="no-cache, no-store"
    )
    assert own.cache_status == "bypass" and checked.text == own.text
    expected = "verified" if own.text == first.text else "miss"
    assert checked.cache_status == expected
    outcome = "verified" if expected == "verified" else "refuted"
    assert (
        settled_metric(server, "tiercache_llm_semantic_verifications_total", outcome=outcome)
        == outcomes[outcome] + 1
    )


def test_with_a_max_error_a_new_tenants_hits_go_to_the_engine_and_it_learns(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`semantic_max_error` through the ensemble (issue 18 item 4): a tenant with no outcomes
    yet does not get its semantic hits served at the guard's word; a greedy rewording goes to
    the engine to verify (HIT_TRUST under embedding_cache's seal), served only as the engine's
    own answer (`verified` when it is the cached one, else a miss); the outcome is recorded;
    a seeded sampled rewording, which the engine cannot verify, misses (outcome untrusted)."""
    state = tmp_path_factory.mktemp("trust-gate")
    gate = {"semantic_max_error": "0.05", "semantic_audit_rate": "0"}
    repository = copy_repository(
        MODEL_REPOSITORY, state / "model_repository", {"embedding_cache": gate}
    )
    server = start_server(state, "triton-trust-gate.log", repository)
    try:
        with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=300) as c:
            t = tenant()
            first = c.generate_text("What is the capital of France?", max_tokens=16, tenant=t)
            assert first.cache_status == "miss"
            reworded = "what is the capital of France?"
            checked = c.generate_text(reworded, max_tokens=16, tenant=t, cache_control="no-store")
            own = c.generate_text(
                reworded, max_tokens=16, tenant=t, cache_control="no-cache, no-store"
            )
            assert checked.text == own.text
            assert checked.cache_status == ("verified" if own.text == first.text else "miss")
            sampled = {"max_tokens": 8, "tenant": t, "temperature": 0.7, "seed": 3}
            stored = c.generate_text("Name the largest ocean on Earth.", **sampled)
            assert stored.cache_status == "miss"
            untrusted = c.generate_text("Which is the largest ocean on Earth?", **sampled)
            assert untrusted.cache_status == "miss"

        def metric(name: str, **labels: str) -> float:
            return settled_metric(server, name, **labels)

        assert metric("tiercache_embedding_cache_trust_decisions_total", decision="verify") == 1
        assert metric("tiercache_embedding_cache_trust_decisions_total", decision="serve") == 0
        verifications = [
            metric("tiercache_llm_semantic_verifications_total", outcome=o)
            for o in ("verified", "refuted")
        ]
        assert sum(verifications) == 1
        assert metric("tiercache_embedding_cache_lookups_total", outcome="untrusted") == 1
    finally:
        server.stop()
