"""Speculative decoding through a real tritonserver (issue 17): a greedy miss drafts from the
answer cached for the same prompt under another max_tokens, and its answer is the one plain
decoding (cache_control `no-speculate`) gives."""

from __future__ import annotations

import uuid

import pytest

from tiercache.server import TritonServer
from tiercache_client import TierCacheClient

from .conftest import settled_metric

pytestmark = pytest.mark.integration
ACCEPTED = "tiercache_engine_draft_accepted_tokens_total"


def test_a_longer_ask_of_a_cached_prompt_is_drafted_from_its_answer(
    server: TritonServer, client: TierCacheClient
) -> None:
    prompt = f"Explain what a hash table is. ({uuid.uuid4().hex[:8]})"
    short = client.generate_text(prompt, max_tokens=12)
    assert short.cache_status == "miss" and short.text
    accepted = settled_metric(server, ACCEPTED)
    longer = client.generate_text(prompt, max_tokens=24)
    assert longer.cache_status == "miss"
    assert settled_metric(server, ACCEPTED) > accepted  # the short answer was its draft
    plain = client.generate_text(
        prompt, max_tokens=24, cache_control="no-cache, no-store, no-speculate"
    )
    assert plain.cache_status == "bypass"
    assert (plain.text, plain.finish_reason) == (longer.text, longer.finish_reason)
    assert longer.text.startswith(short.text.rstrip())
