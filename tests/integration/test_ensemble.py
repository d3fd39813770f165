"""End to end through the real ensemble: prompt_cache -> llm -> torch_llm on tritonserver."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiercache.server import TritonServer
from tiercache_client import TierCacheClient
from tiercache_client.errors import InvalidRequestError

from .conftest import raw_stream_infer, settled_metric, start_server, tensor

pytestmark = pytest.mark.integration
MAX_TOKENS = 12


def unique(prompt: str) -> str:
    """A prompt no other test sends, so every test starts from a miss."""
    return f"{prompt} (ref {uuid.uuid4().hex[:8]})"


def test_miss_generates_then_repeat_is_exact_hit(client: TierCacheClient) -> None:
    prompt = unique("What is the capital of France?")
    first = client.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert first.cache_status == "miss"
    assert first.finish_reason in ("stop", "length")
    assert len(first.text.strip()) > 0
    second = client.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert second.cache_status == "exact"
    assert second.text == first.text
    assert second.finish_reason == first.finish_reason  # a hit carries its generation's


def test_spacing_unicode_and_parameter_variants_hit(client: TierCacheClient) -> None:
    tag = uuid.uuid4().hex[:8]
    base = client.generate_text(f"Name a primary color. {tag}", max_tokens=MAX_TOKENS)
    assert base.cache_status == "miss"
    variants = [
        dict(prompt=f"  Name   a primary\tcolor.\n {tag} "),
        dict(prompt=f"Ｎａｍｅ a primary color. {tag}"),  # fullwidth letters: NFKC
        dict(prompt=f"Name a primary color. {tag}", temperature=0.0, top_p=0.3, top_k=7, seed=5),
        dict(prompt=f"Name a primary color. {tag}", stop_words=[]),
    ]
    for variant in variants:
        prompt = variant.pop("prompt")
        result = client.generate_text(prompt, max_tokens=MAX_TOKENS, **variant)
        assert (result.cache_status, result.text) == ("exact", base.text), variant


def test_other_tenant_misses(client: TierCacheClient) -> None:
    prompt = unique("Say hello.")
    assert client.generate_text(prompt, max_tokens=4, tenant="alpha").cache_status == "miss"
    assert client.generate_text(prompt, max_tokens=4, tenant="alpha").cache_status == "exact"
    assert client.generate_text(prompt, max_tokens=4, tenant="beta").cache_status == "miss"


def test_sampled_request_is_not_cached_but_seeded_is(client: TierCacheClient) -> None:
    prompt = unique("Pick a random fruit.")
    for _ in range(2):
        result = client.generate_text(prompt, max_tokens=4, temperature=0.9)
        assert result.cache_status == "bypass"
    seeded = [client.generate_text(prompt, max_tokens=4, temperature=0.9, seed=11) for _ in "ab"]
    assert [r.cache_status for r in seeded] == ["miss", "exact"]
    assert seeded[0].text == seeded[1].text


def test_cache_control_no_cache_and_no_store(client: TierCacheClient) -> None:
    prompt = unique("Count to three.")
    stored = client.generate_text(prompt, max_tokens=6, cache_control="no-store")
    assert stored.cache_status == "miss"
    assert client.generate_text(prompt, max_tokens=6).cache_status == "miss"
    assert client.generate_text(prompt, max_tokens=6).cache_status == "exact"
    assert client.generate_text(prompt, max_tokens=6, cache_control="no-cache").cache_status == (
        "bypass"
    )


def test_streaming_delivers_several_chunks_then_final(client: TierCacheClient) -> None:
    events = list(client.generate(unique("Describe the sea in one sentence."), max_tokens=24))
    chunks = [e for e in events if isinstance(e, str)]
    result = events[-1]
    assert not isinstance(result, str)
    assert len(chunks) >= 3
    assert "".join(chunks) == result.text
    assert result.cache_status == "miss"


def test_concurrent_identical_misses_generate_once(
    server: TritonServer, client: TierCacheClient
) -> None:
    prompt = unique("Write one sentence about trains.")
    generations = settled_metric(server, "tiercache_llm_generations_total")
    coalesced = settled_metric(server, "tiercache_llm_coalesced_total")
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: client.generate_text(prompt, max_tokens=24), range(16)))
    assert {r.text for r in results} == {results[0].text}
    assert settled_metric(server, "tiercache_llm_generations_total") - generations == 1
    assert settled_metric(server, "tiercache_llm_coalesced_total") - coalesced == 15
    assert client.generate_text(prompt, max_tokens=24).cache_status == "exact"


def test_metrics_count_requests_by_status(server: TritonServer, client: TierCacheClient) -> None:
    before = settled_metric(server, "tiercache_prompt_cache_requests_total", status="exact")
    prompt = unique("Name a planet.")
    client.generate_text(prompt, max_tokens=4)
    client.generate_text(prompt, max_tokens=4)
    assert settled_metric(server, "tiercache_prompt_cache_requests_total", status="exact") == (
        before + 1
    )
    assert settled_metric(server, "tiercache_cache_entries", tier="l2") >= 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=""), "text_input is empty"),
        (dict(prompt="   \n "), "text_input is empty"),
        (dict(prompt="x" * 20_000), "over the limit"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", max_tokens=100_000), "max_tokens"),
        (dict(prompt="hi", temperature=float("nan")), "temperature"),
        (dict(prompt="hi", temperature=-1.0), "temperature"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(prompt="hi", top_p=float("nan")), "top_p"),
        (dict(prompt="hi", cache_control="no-cache, sometimes"), "cache_control"),
    ],
)
def test_bad_input_is_invalid_argument_and_server_stays_ready(
    client: TierCacheClient, kwargs: dict, message: str
) -> None:
    prompt = kwargs.pop("prompt")
    with pytest.raises(InvalidRequestError, match=message):
        client.generate_text(prompt, **kwargs)
    assert client.health()["ready"] is True


def test_malformed_tensors_fail_only_that_request(
    server: TritonServer, client: TierCacheClient
) -> None:
    cases = [
        ([tensor("text_input", [b"\xff\xfe bad"], "BYTES")], "not valid UTF-8"),
        ([tensor("max_tokens", [4], "INT32")], "text_input"),  # required input missing
        (
            [tensor("text_input", [b"hi"], "BYTES"), tensor("max_tokens", [4, 5], "INT32")],
            "max_tokens",
        ),  # wrong shape
        (
            [tensor("text_input", [b"hi"], "BYTES"), tensor("max_tokens", [4], "INT64")],
            "max_tokens",
        ),  # wrong dtype, rejected by Triton itself
    ]
    for inputs, message in cases:
        outcome = raw_stream_infer(server, inputs)
        assert outcome.error is not None and message in outcome.error, outcome.error
    assert client.generate_text(unique("Still there?"), max_tokens=2).cache_status == "miss"


def test_entry_survives_server_restart(state_dir: Path, server: TritonServer) -> None:
    """L2 is on disk: a new tritonserver process on the same state dir hits at once."""
    prompt = unique("What colour is the sky?")
    first = start_server(state_dir, "triton-restart-1.log")
    try:
        with TierCacheClient(f"127.0.0.1:{first.ports.grpc}") as c:
            miss = c.generate_text(prompt, max_tokens=8)
            assert miss.cache_status == "miss"
    finally:
        assert first.stop() == 0
    second = start_server(state_dir, "triton-restart-2.log")
    try:
        with TierCacheClient(f"127.0.0.1:{second.ports.grpc}") as c:
            hit = c.generate_text(prompt, max_tokens=8)
    finally:
        second.stop()
    assert (hit.cache_status, hit.text) == ("exact", miss.text)


def test_cancelled_stream_never_leaves_a_partial_entry(
    server: TritonServer, client: TierCacheClient
) -> None:
    """A client that cancels mid-stream: the server stays up and no partial text is ever stored.

    Triton 2.51 does not pass an ensemble request's cancellation on to the composing `llm`
    request (its `is_cancelled()` stays False), so the generation runs to its clean end and may
    be stored whole; what must never happen is a stored prefix. Cancellation inside the stage
    (a subscriber that leaves, all subscribers gone) is covered by tests/unit/test_generation.py.
    """
    import queue
    import time

    import tritonclient.grpc as grpcclient

    from tiercache_client.client import build_inputs

    prompt = unique("Tell a long story about a lighthouse keeper.")
    generations = settled_metric(server, "tiercache_llm_generations_total")
    chunks: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    c.start_stream(callback=lambda result, error: chunks.put((result, error)))
    c.async_stream_infer(
        "ensemble",
        build_inputs(prompt, max_tokens=48, stream=True),
        enable_empty_final_response=True,
    )
    result, error = chunks.get(timeout=120)
    assert error is None and result.as_numpy("text_output") is not None
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.monotonic() + 120
    while settled_metric(server, "tiercache_llm_generations_total") == generations:
        assert time.monotonic() < deadline, "the abandoned generation never finished"
        time.sleep(0.2)
    served = client.generate_text(prompt, max_tokens=48)
    fresh = client.generate_text(prompt, max_tokens=48, cache_control="no-cache, no-store")
    assert served.cache_status in ("exact", "miss")
    assert served.text == fresh.text  # greedy: a whole answer, never a prefix


def test_engine_stops_generating_when_its_request_is_cancelled(
    server: TritonServer, client: TierCacheClient
) -> None:
    """torch_llm checks cancellation between tokens: a cancelled direct request ends early."""
    import queue
    import time

    import tritonclient.grpc as grpcclient

    from tiercache.exact.request import GenerationRequest

    from .sealing import engine_inputs

    request = GenerationRequest(unique("Tell a very long story about a river."), max_tokens=200)
    before = settled_metric(server, "tiercache_engine_finished_total", reason="cancelled")
    responses: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    c.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = engine_inputs(server.state_dir, request)
    c.async_stream_infer("torch_llm", inputs, enable_empty_final_response=True)
    result, error = responses.get(timeout=120)
    assert error is None and result.as_numpy("TEXT") is not None
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.monotonic() + 60
    while settled_metric(server, "tiercache_engine_finished_total", reason="cancelled") == before:
        assert time.monotonic() < deadline, "the engine never reported the cancellation"
    assert settled_metric(server, "tiercache_engine_finished_total", reason="error") == 0
    assert client.generate_text(unique("Still generating?"), max_tokens=2).cache_status == "miss"
