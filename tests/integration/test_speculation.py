"""Speculative decoding through a real tritonserver (issue 17): a greedy miss drafts from the
answer cached for the same prompt under another max_tokens, and from the answer of a neighbour
the guard refused to serve; its answer is the one plain decoding (cache_control
`no-speculate`) gives, and the ensemble reports its speculated tokens; a seeded sampled miss
is decoded plainly (torch_llm's speculate_sampled is off by default) and keeps its seed's
answer."""

from __future__ import annotations

import uuid

import pytest

from tiercache.server import TritonServer
from tiercache_client import TierCacheClient

from .conftest import settled_metric

pytestmark = pytest.mark.integration
ACCEPTED = "tiercache_engine_draft_accepted_tokens_total"
DRAFTED = "tiercache_engine_draft_tokens_total"


def test_a_longer_ask_of_a_cached_prompt_is_drafted_from_its_answer(
    server: TritonServer, client: TierCacheClient
) -> None:
    prompt = f"Explain what a hash table is. ({uuid.uuid4().hex[:8]})"
    short = client.generate_text(prompt, max_tokens=12)
    assert short.cache_status == "miss" and short.text
    accepted = settled_metric(server, ACCEPTED, source="answer")
    longer = client.generate_text(prompt, max_tokens=24)
    assert longer.cache_status == "miss"
    # the short answer was its draft
    assert settled_metric(server, ACCEPTED, source="answer") > accepted
    assert (longer.speculated_tokens or 0) > 0
    plain = client.generate_text(
        prompt, max_tokens=24, cache_control="no-cache, no-store, no-speculate"
    )
    assert plain.cache_status == "bypass" and plain.speculated_tokens == 0
    assert (plain.text, plain.finish_reason) == (longer.text, longer.finish_reason)
    assert longer.text.startswith(short.text.rstrip())


def test_a_miss_the_guard_refused_is_drafted_from_its_neighbours_answer(
    server: TritonServer, client: TierCacheClient
) -> None:
    """embedding_cache names the neighbour the guard refused (another country's capital), llm
    reads its answer and the engine verifies drafts from it (source `neighbour`); the answer
    is plain decoding's."""
    tenant = f"spec-{uuid.uuid4().hex[:8]}"  # a scope of its own: its only neighbour is France
    first = client.generate_text("What is the capital of France?", max_tokens=16, tenant=tenant)
    assert first.cache_status == "miss"
    drafted = settled_metric(server, DRAFTED, source="neighbour")
    question = "What is the capital of Germany?"
    second = client.generate_text(question, max_tokens=16, tenant=tenant)
    assert second.cache_status == "miss"  # refused: France's answer does not answer it
    assert settled_metric(server, DRAFTED, source="neighbour") > drafted
    plain = client.generate_text(
        question, max_tokens=16, tenant=tenant, cache_control="no-cache, no-store, no-speculate"
    )
    assert (plain.text, plain.finish_reason) == (second.text, second.finish_reason)


def test_a_seeded_sampled_ask_of_a_cached_prompt_is_decoded_plainly_by_default(
    server: TritonServer, client: TierCacheClient
) -> None:
    """torch_llm's speculate_sampled is off by default: a sampled miss of a prompt whose greedy
    answer is cached is decoded plainly (no token speculated, the draft source's accepted
    count unchanged), so its answer is the one plain decoding gives for its seed whatever
    was drafted (the engine's opt-in is tested in tests/unit/test_engine_speculation.py)."""
    prompt = f"Explain what a linked list is. ({uuid.uuid4().hex[:8]})"
    greedy = client.generate_text(prompt, max_tokens=24)
    assert greedy.cache_status == "miss" and greedy.text
    accepted = settled_metric(server, ACCEPTED, source="answer")
    sampled = client.generate_text(prompt, max_tokens=24, temperature=0.2, seed=7)
    assert sampled.cache_status == "miss"
    assert sampled.speculated_tokens == 0
    assert settled_metric(server, ACCEPTED, source="answer") == accepted
    plain = client.generate_text(
        prompt, max_tokens=24, temperature=0.2, seed=7,
        cache_control="no-cache, no-store, no-speculate",
    )  # fmt: skip
    assert plain.cache_status == "bypass" and plain.speculated_tokens == 0
    assert (plain.text, plain.finish_reason) == (sampled.text, sampled.finish_reason)
