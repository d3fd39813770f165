"""Prefix KV reuse in torch_llm behind the real ensemble: a shared system prompt is reused within a
tenant, never across tenants, with the same greedy answer; the engine reports the counts in its
final response and in the metrics."""

from __future__ import annotations

import queue
import uuid

import pytest
import tritonclient.grpc as grpcclient

from tiercache.exact.request import GenerationRequest
from tiercache.server import TritonServer
from tiercache_client import TierCacheClient

from .conftest import settled_metric
from .sealing import engine_inputs

pytestmark = pytest.mark.integration
ANSWER = {"max_tokens": 6}  # greedy, short
BLOCK = 32  # torch_llm's default tokens_per_block
SYSTEM = (
    "You are the assistant of a small public library. Answer in one short sentence. The library "
    "opens at nine and closes at six on weekdays, opens at ten on Saturdays and is closed on "
    "Sundays. Members may borrow eight books for three weeks and renew them twice online. Late "
    "returns cost ten cents a day. Printing costs five cents a page. Rooms can be booked for two "
    "hours at a time. Children under twelve need a parent to sign up. Do not invent other rules."
)


def test_shared_prefix_is_reused_within_a_tenant_only(
    server: TritonServer, client: TierCacheClient
) -> None:
    def reused() -> float:
        return settled_metric(server, "tiercache_engine_kv_reused_tokens_total")

    def lookups(result: str) -> float:
        return settled_metric(server, "tiercache_engine_kv_lookups_total", result=result)

    tenant, other = f"kv-{uuid.uuid4().hex}", f"kv-{uuid.uuid4().hex}"
    before, hits_before, misses_before = reused(), lookups("hit"), lookups("miss")
    first = client.generate_text(f"{SYSTEM} When do you open?", tenant=tenant, **ANSWER)
    second = client.generate_text(f"{SYSTEM} Can I print?", tenant=tenant, **ANSWER)
    assert (first.cache_status, second.cache_status) == ("miss", "miss")
    after_second = reused()
    assert after_second - before >= 3 * BLOCK  # the system prompt's full blocks (~115 tokens)
    assert lookups("hit") == hits_before + 1
    assert lookups("miss") == misses_before + 1
    # The ensemble's kv_reused_tokens / kv_computed_tokens say the same per request.
    assert first.kv_reused_tokens == 0 and (first.kv_computed_tokens or 0) > 3 * BLOCK
    assert second.kv_reused_tokens == after_second - before
    assert (second.kv_computed_tokens or 0) > 0

    # Another tenant computes everything, and gets the same greedy answer.
    third = client.generate_text(f"{SYSTEM} Can I print?", tenant=other, **ANSWER)
    assert third.cache_status == "miss"
    assert third.text == second.text
    assert third.kv_reused_tokens == 0
    assert reused() == after_second
    repeat = client.generate_text(f"{SYSTEM} Can I print?", tenant=tenant, **ANSWER)
    assert repeat.cache_status == "exact"  # a hit runs no engine: no KV figures
    assert (repeat.kv_reused_tokens, repeat.kv_computed_tokens) == (None, None)
    assert lookups("miss") == misses_before + 2
    pool_bytes = settled_metric(server, "tiercache_engine_kv_pool_bytes")
    assert 0 < pool_bytes <= 256 << 20
    # every engine call's gen-stall-duration is observed (no adapter, a pool with room: ~0)
    assert settled_metric(server, "tiercache_gen_stall_seconds_count") >= 3


def engine_final(server: TritonServer, request: GenerationRequest) -> dict[str, object]:
    """One generation straight from torch_llm over the gRPC stream: the final response's
    outputs (name -> value)."""
    results: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    try:
        c.start_stream(callback=lambda result, error: results.put((result, error)))
        inputs = engine_inputs(server.state_dir, request)
        c.async_stream_infer("torch_llm", inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=300)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                return {
                    name: result.as_numpy(name)[0]
                    for name in ("PROMPT_TOKENS", "REUSED_TOKENS", "COMPUTED_TOKENS")
                }
    finally:
        c.stop_stream()
        c.close()


def test_engine_final_response_carries_reused_and_computed_tokens(server: TritonServer) -> None:
    scope = uuid.uuid4().hex
    request = GenerationRequest(f"{SYSTEM} Is it open?", max_tokens=2, tenant_scope=scope)
    cold = engine_final(server, request)
    warm = engine_final(server, request)
    assert (cold["REUSED_TOKENS"], cold["COMPUTED_TOKENS"]) == (0, cold["PROMPT_TOKENS"])
    prompt_tokens = int(warm["PROMPT_TOKENS"])
    # Every full block, leaving at least one token to compute.
    assert int(warm["REUSED_TOKENS"]) == min(prompt_tokens // BLOCK * BLOCK, prompt_tokens - 1)
    assert int(warm["REUSED_TOKENS"]) + int(warm["COMPUTED_TOKENS"]) == prompt_tokens
