"""cache_admin through a real tritonserver: warm pre-loads an answer under the digest
prompt_cache computes, invalidate by tenant stops it being served, stats counts L2.

The session server runs without Redis: the invalidation reaches prompt_cache's processes through
the host's invalidation log, so an answer already served (an L1 copy there) is not served again
either."""

from __future__ import annotations

import uuid

import pytest

from tiercache_client import InvalidRequestError, TierCacheClient

pytestmark = pytest.mark.integration
MAX_TOKENS = 8


def test_warm_invalidate_and_stats(client: TierCacheClient) -> None:
    tenant = f"admin-{uuid.uuid4().hex[:8]}"
    first = {
        "text_input": "What colour is a ripe banana?",
        "answer": "Yellow (warmed).",
        "tenant": tenant,
        "max_tokens": MAX_TOKENS,
    }
    second = {**first, "text_input": "What colour is a clear sky?", "answer": "Blue (warmed)."}
    report = client.warm(prompts=[first, second])
    assert (report["stored"], report["failed"]) == (2, 0)

    hit = client.generate_text(first["text_input"], tenant=tenant, max_tokens=MAX_TOKENS)
    assert (hit.cache_status, hit.text) == ("exact", "Yellow (warmed).")

    again = client.generate_text(first["text_input"], tenant=tenant, max_tokens=MAX_TOKENS)
    assert again.cache_status == "exact"  # now also in a prompt_cache process's L1

    client.invalidate(tenant=tenant)
    after = client.generate_text(second["text_input"], tenant=tenant, max_tokens=MAX_TOKENS)
    assert after.cache_status == "miss" and after.text != "Blue (warmed)."
    served = client.generate_text(first["text_input"], tenant=tenant, max_tokens=MAX_TOKENS)
    assert served.cache_status == "miss" and served.text != "Yellow (warmed)."

    stats = client.stats()
    assert stats["tiers"]["l2"]["entries"] >= 1
    with pytest.raises(InvalidRequestError):
        client.admin({"op": "flush"})  # no confirm
