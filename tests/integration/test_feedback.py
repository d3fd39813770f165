"""Feedback through the real server (issue 19): every answer carries an answer_id, `bad` stops
the answer being served (exact and semantic), and an id is taken only from its own tenant."""

from __future__ import annotations

import uuid

import pytest

from tiercache.server import TritonServer
from tiercache_client import TierCacheClient
from tiercache_client.errors import ForbiddenError, InvalidRequestError

from .conftest import settled_metric

pytestmark = pytest.mark.integration
MAX_TOKENS = 8


def tenant() -> str:
    return f"feedback-{uuid.uuid4().hex[:8]}"


def test_bad_feedback_stops_an_exact_hit_and_good_keeps_it(
    server: TritonServer, client: TierCacheClient
) -> None:
    t = tenant()
    prompt = f"Name one planet ({uuid.uuid4().hex[:6]})."
    before = settled_metric(server, "tiercache_feedback_total", verdict="bad", served="own")
    first = client.generate_text(prompt, max_tokens=MAX_TOKENS, tenant=t)
    hit = client.generate_text(prompt, max_tokens=MAX_TOKENS, tenant=t)
    assert (first.cache_status, hit.cache_status) == ("miss", "exact")
    assert first.answer_id and hit.answer_id and first.answer_id != hit.answer_id

    endorsed = settled_metric(server, "tiercache_feedback_endorsements_total")
    good = client.feedback(hit.answer_id, "good", tenant=t)
    assert (good["verdict"], good["served"], good["invalidated"]) == ("good", "own", False)
    assert good["endorsed"] is True  # the entry's count rose in the shared tier (L2 here)
    assert settled_metric(server, "tiercache_feedback_endorsements_total") == endorsed + 1
    assert client.generate_text(prompt, max_tokens=MAX_TOKENS, tenant=t).cache_status == "exact"

    bad = client.feedback(hit.answer_id, "bad", tenant=t)
    assert (bad["verdict"], bad["served"], bad["invalidated"]) == ("bad", "own", True)
    again = client.generate_text(prompt, max_tokens=MAX_TOKENS, tenant=t)
    assert again.cache_status == "miss"  # generated again (every prompt_cache process's L1 too)
    # Stored again, and served once it is older than the watermark's skew allowance (an answer
    # stored within 50 ms of the invalidation is dropped too: tiercache.exact.watermarks).
    statuses = [
        client.generate_text(prompt, max_tokens=MAX_TOKENS, tenant=t).cache_status for _ in range(3)
    ]
    assert statuses[-1] == "exact", statuses
    # the first answer's id: that answer is gone already, so nothing more is invalidated
    replay = client.feedback(first.answer_id, "bad", tenant=t)
    assert replay["invalidated"] is False
    assert client.generate_text(prompt, max_tokens=MAX_TOKENS, tenant=t).cache_status == "exact"
    after = settled_metric(server, "tiercache_feedback_total", verdict="bad", served="own")
    assert after - before == 2


def test_bad_feedback_on_a_semantic_hit_stops_the_neighbours_answer(
    server: TritonServer, client: TierCacheClient
) -> None:
    """The served neighbour is invalidated, and once regenerated it is not served to the
    rewording judged wrong (its similarity floor), counted as embedding_cache's `penalised`."""
    t = tenant()
    stored = client.generate_text("What is the capital of France?", max_tokens=MAX_TOKENS, tenant=t)
    reworded = "What's the capital of France?"
    near = client.generate_text(reworded, max_tokens=MAX_TOKENS, tenant=t)
    assert (stored.cache_status, near.cache_status) == ("miss", "semantic")
    assert near.answer_id is not None
    report = client.feedback(near.answer_id, "bad", tenant=t)
    assert (report["served"], report["invalidated"]) == ("semantic", True)
    before = settled_metric(server, "tiercache_embedding_cache_lookups_total", outcome="penalised")
    # The neighbour's answer is gone: its own prompt generates it again ...
    own = client.generate_text("What is the capital of France?", max_tokens=MAX_TOKENS, tenant=t)
    assert own.cache_status == "miss"
    # ... and the rewording judged wrong is not served it (its similarity floor), though the
    # regenerated answer is there (no-store: the rewording's own answer is not indexed).
    again = client.generate_text(
        reworded, max_tokens=MAX_TOKENS, tenant=t, cache_control="no-store"
    )
    assert again.cache_status == "miss"
    after = settled_metric(server, "tiercache_embedding_cache_lookups_total", outcome="penalised")
    assert after - before == 1


def test_feedback_is_taken_only_from_the_tenant_served_and_only_on_answer_ids(
    server: TritonServer, client: TierCacheClient
) -> None:
    owner, other = tenant(), tenant()
    prompt = f"Name one ocean ({uuid.uuid4().hex[:6]})."
    answer = client.generate_text(prompt, max_tokens=MAX_TOKENS, tenant=owner)
    assert answer.answer_id is not None
    refused_before = settled_metric(server, "tiercache_feedback_refused_total")
    with pytest.raises(ForbiddenError):
        client.feedback(answer.answer_id, "bad", tenant=other)
    with pytest.raises(ForbiddenError):
        client.feedback(answer.answer_id, "bad")  # the default tenant is another tenant
    with pytest.raises(InvalidRequestError, match="not an answer id"):
        client.feedback("a1." + "x" * 20, "bad", tenant=owner)
    with pytest.raises(InvalidRequestError, match="verdict"):
        client.feedback(answer.answer_id, "terrible", tenant=owner)
    # nothing was invalidated
    assert client.generate_text(prompt, max_tokens=MAX_TOKENS, tenant=owner).cache_status == "exact"
    refused = settled_metric(server, "tiercache_feedback_refused_total") - refused_before
    assert refused == 4


def test_a_sampled_request_without_a_seed_has_no_answer_id(client: TierCacheClient) -> None:
    result = client.generate_text(
        f"Tell me a story ({uuid.uuid4().hex[:6]}).", max_tokens=4, temperature=0.8
    )
    assert result.answer_id is None
