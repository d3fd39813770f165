"""cache_admin through a real tritonserver: warm pre-loads an answer under the digest
prompt_cache computes, invalidate by tenant stops it being served, stats counts L2; and without
the operator's admin token (none, or another one) every op is refused over gRPC, nothing is done
and the refusals are counted.

The session server runs without Redis: the invalidation reaches prompt_cache's processes through
the host's invalidation log, so an answer already served (an L1 copy there) is not served again
either."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tiercache.server import TritonServer
from tiercache_client import (
    ForbiddenError,
    InvalidRequestError,
    TierCacheClient,
    read_admin_token,
)

from .conftest import settled_metric

pytestmark = pytest.mark.integration
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def admin(server: TritonServer) -> Iterator[TierCacheClient]:
    """A client with the operator's token, read from the file the server's cache_admin made."""
    token = read_admin_token(server.admin_token_file)
    with TierCacheClient(server.grpc_url, timeout_s=300, admin_token=token) as c:
        yield c


def test_warm_invalidate_and_stats(client: TierCacheClient, admin: TierCacheClient) -> None:
    tenant = f"admin-{uuid.uuid4().hex[:8]}"
    first = {
        "text_input": "What colour is a ripe banana?",
        "answer": "Yellow (warmed).",
        "tenant": tenant,
        "max_tokens": MAX_TOKENS,
    }
    second = {**first, "text_input": "What colour is a clear sky?", "answer": "Blue (warmed)."}
    report = admin.warm(prompts=[first, second])
    assert (report["stored"], report["failed"]) == (2, 0)

    hit = client.generate_text(first["text_input"], tenant=tenant, max_tokens=MAX_TOKENS)
    assert (hit.cache_status, hit.text) == ("exact", "Yellow (warmed).")

    again = client.generate_text(first["text_input"], tenant=tenant, max_tokens=MAX_TOKENS)
    assert again.cache_status == "exact"  # now also in a prompt_cache process's L1

    admin.invalidate(tenant=tenant)
    after = client.generate_text(second["text_input"], tenant=tenant, max_tokens=MAX_TOKENS)
    assert after.cache_status == "miss" and after.text != "Blue (warmed)."
    served = client.generate_text(first["text_input"], tenant=tenant, max_tokens=MAX_TOKENS)
    assert served.cache_status == "miss" and served.text != "Yellow (warmed)."

    stats = admin.stats()
    assert stats["tiers"]["l2"]["entries"] >= 1
    with pytest.raises(InvalidRequestError):
        admin.admin({"op": "flush"})  # no confirm


def _every_op(tenant: str, prompt: str) -> list[Callable[[TierCacheClient], Any]]:
    """One call of each op kind an attacker would make: poison, wipe, evict, read."""
    poison = {"text_input": prompt, "answer": "attacker's text", "tenant": tenant}
    return [
        lambda c: c.warm(prompts=[{**poison, "max_tokens": MAX_TOKENS}]),
        lambda c: c.flush(),
        lambda c: c.invalidate(tenant=tenant),
        lambda c: c.stats(),
    ]


@pytest.mark.parametrize("token", [None, "wrong", "empty"])
def test_every_op_refused_without_the_admin_token(
    server: TritonServer, client: TierCacheClient, admin: TierCacheClient, token: str | None
) -> None:
    tenant = f"victim-{uuid.uuid4().hex[:8]}"
    prompt = f"What is the boiling point of water ({uuid.uuid4().hex[:6]})?"
    genuine = {"text_input": prompt, "answer": "100 degrees C.", "tenant": tenant}
    assert admin.warm(prompts=[{**genuine, "max_tokens": MAX_TOKENS}])["stored"] == 1
    entries = admin.stats()["tiers"]["l2"]["entries"]
    reason = "missing" if token in (None, "empty") else "wrong"
    before = settled_metric(server, "tiercache_admin_refused_total", reason=reason)

    given = {None: None, "wrong": "00" * 32, "empty": ""}[token]
    with TierCacheClient(server.grpc_url, timeout_s=300, admin_token=given) as attacker:
        for op in _every_op(tenant, prompt):
            with pytest.raises(ForbiddenError, match="admin token|ADMIN_TOKEN"):
                op(attacker)

    # Nothing was done: the genuine answer is still served, nothing was flushed.
    served = client.generate_text(prompt, tenant=tenant, max_tokens=MAX_TOKENS)
    assert (served.cache_status, served.text) == ("exact", "100 degrees C.")
    assert admin.stats()["tiers"]["l2"]["entries"] >= entries
    counted = settled_metric(server, "tiercache_admin_refused_total", reason=reason) - before
    assert counted == 4


def test_every_op_served_with_the_admin_token(
    client: TierCacheClient, admin: TierCacheClient
) -> None:
    tenant = f"owner-{uuid.uuid4().hex[:8]}"
    prompt = f"Name a prime number ({uuid.uuid4().hex[:6]})."
    assert (
        admin.warm(prompts=[{"text_input": prompt, "answer": "7.", "tenant": tenant}])["stored"]
        == 1
    )
    assert client.generate_text(prompt, tenant=tenant).text == "7."
    assert admin.stats()["op"] == "stats"
    assert admin.invalidate(tenant=tenant)["op"] == "invalidate"
    flushed = admin.flush()
    assert flushed["op"] == "flush" and flushed["flushed"]["l2"] >= 1
    assert admin.stats()["tiers"]["l2"]["entries"] == 0
