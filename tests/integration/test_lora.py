"""LoRA adapters through the real ensemble: resolved by name and digest, swapped in and out of
two engine slots without a failed request, reloaded under the same name without stale hits.

A server of its own: a copy of model_repository whose lora_cache and torch_llm hold 2 adapters
(the committed three do not fit), serving a temporary copy of adapters/ that the tests change.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from tiercache.config import ADAPTERS_DIR_ENV
from tiercache.server import Ports, TritonServer, copy_repository
from tiercache_client import NotFoundError, TierCacheClient, read_admin_token

from .conftest import MODEL_REPOSITORY, REPO, settled_metric
from .sealing import engine_call

pytestmark = pytest.mark.integration
MAX_TOKENS = 12
SLOTS = 2
ADAPTERS = ("french", "caps", "brief")
PROMPT = "How do I boil an egg?"


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for name in ADAPTERS:
        shutil.copytree(REPO / "adapters" / name, root / name)
    return root


@pytest.fixture(scope="module")
def lora_server(
    tmp_path_factory: pytest.TempPathFactory, adapters_dir: Path
) -> Iterator[TritonServer]:
    state = tmp_path_factory.mktemp("lora-state")
    repository = copy_repository(
        MODEL_REPOSITORY,
        state / "model_repository",
        {"lora_cache": {"engine_slots": str(SLOTS)}, "torch_llm": {"lora_slots": str(SLOTS)}},
    )
    server = TritonServer(
        model_repository=repository,
        state_dir=state,
        ports=Ports.free(),
        exit_timeout_s=5,
        log_path=state / "triton-lora.log",
        env_overrides={ADAPTERS_DIR_ENV: str(adapters_dir)},
    )
    server.start()
    try:
        server.wait_ready(timeout_s=600)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lora_client(lora_server: TritonServer) -> Iterator[TierCacheClient]:
    """A client with the server's admin token (adapter listing and warming go through
    cache_admin)."""
    token = read_admin_token(lora_server.admin_token_file)
    with TierCacheClient(lora_server.grpc_url, timeout_s=300, admin_token=token) as c:
        yield c


def fresh(prompt: str = PROMPT) -> str:
    """A prompt no other test has cached (the exact cache would answer it otherwise)."""
    return f"{prompt} ({uuid.uuid4().hex[:6]})"


def test_each_adapter_answers_differently_and_caches_under_its_own_key(
    lora_client: TierCacheClient,
) -> None:
    prompt = fresh()
    base = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS)
    caps = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="caps")
    assert (base.cache_status, caps.cache_status) == ("miss", "miss")
    assert caps.text != base.text
    again = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="caps")
    assert (again.cache_status, again.text) == ("exact", caps.text)
    french = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="french")
    assert french.cache_status == "miss" and french.text != caps.text


def test_unknown_adapter_is_not_found_and_the_server_stays_up(
    lora_client: TierCacheClient,
) -> None:
    with pytest.raises(NotFoundError, match="unknown adapter 'nope'"):
        lora_client.generate_text("Hello?", max_tokens=4, lora_name="nope")
    assert lora_client.generate_text(fresh("Hello?"), max_tokens=4).cache_status == "miss"


def test_round_robin_over_more_adapters_than_slots_swaps_without_failures(
    lora_client: TierCacheClient, lora_server: TritonServer
) -> None:
    """Three adapters through two slots, four at a time: every request succeeds and each
    adapter's greedy answer stays the same however often it was evicted and loaded again."""
    prompt = "What is 7 plus 5?"
    evictions_before = settled_metric(lora_server, "tiercache_engine_adapter_evictions_total")
    names = [ADAPTERS[i % len(ADAPTERS)] for i in range(12)]

    def run(i: int) -> tuple[str, str]:
        result = lora_client.generate_text(
            prompt,
            max_tokens=MAX_TOKENS,
            lora_name=names[i],
            cache_control="no-cache, no-store",
            stop_words=[f"never-seen-{i}"],  # a digest of its own: no coalescing
        )
        return names[i], result.text

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, range(len(names))))
    answers: dict[str, set[str]] = {}
    for name, text in results:
        answers.setdefault(name, set()).add(text)
    assert {name: len(texts) for name, texts in answers.items()} == dict.fromkeys(ADAPTERS, 1)
    assert len({next(iter(t)) for t in answers.values()}) == len(ADAPTERS)
    evictions = settled_metric(lora_server, "tiercache_engine_adapter_evictions_total")
    assert evictions - evictions_before >= len(names) // 2


def test_a_changed_adapter_folder_is_a_new_version_with_no_stale_hits(
    lora_client: TierCacheClient, adapters_dir: Path
) -> None:
    prompt = fresh("Name a large animal.")
    caps = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="caps")
    brief = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="brief")
    assert caps.text != brief.text
    for file in ("adapter_config.json", "adapter_model.safetensors"):  # caps now holds brief
        shutil.copy2(adapters_dir / "brief" / file, adapters_dir / "caps" / file)
    try:
        changed = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="caps")
        assert (changed.cache_status, changed.text) == ("miss", brief.text)
    finally:
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy2(REPO / "adapters" / "caps" / file, adapters_dir / "caps" / file)
    restored = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="caps")
    assert (restored.cache_status, restored.text) == ("exact", caps.text)


def engine_op(server: TritonServer, op: str, evict: list[str] | None = None) -> str:
    """One admin call to torch_llm itself, sealed as lora_cache and llm seal theirs (the test
    reads the server's secret from its state folder: an outside caller cannot, and is refused,
    tests/security)."""
    inputs = engine_call(server.state_dir, {"LORA_OP": op, "LORA_EVICT": json.dumps(evict or [])})
    import queue

    results: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    try:
        c.start_stream(callback=lambda result, error: results.put((result, error)))
        c.async_stream_infer("torch_llm", inputs)
        result, error = results.get(timeout=60)
        assert error is None, error
        return str(result.as_numpy("TEXT").reshape(-1)[0].decode())
    finally:
        c.stop_stream()
        c.close()


def test_adapter_the_engine_lost_is_sent_again_and_the_request_succeeds(
    lora_client: TierCacheClient, lora_server: TritonServer
) -> None:
    """lora_cache believes the engine holds `french`; the engine dropped it behind its back: the
    engine answers "not found in cache", llm fetches the weights once more and retries."""
    prompt = fresh("Say hello.")
    first = lora_client.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="french")
    report = lora_client.adapters()
    french = [a["digest"] for a in report["adapters"] if a["name"] == "french"]
    engine_op(lora_server, "evict", french)
    assert all(a["digest"] not in french for a in json.loads(engine_op(lora_server, "list")))
    again = lora_client.generate_text(
        prompt, max_tokens=MAX_TOKENS, lora_name="french", cache_control="no-cache"
    )
    assert (again.cache_status, again.text) == ("bypass", first.text)


def test_adapters_lists_tiers_and_warm_loads_into_the_engine(
    lora_client: TierCacheClient,
) -> None:
    report = lora_client.adapters(warm=["brief"])
    tiers = {a["name"]: a["tier"] for a in report["adapters"]}
    assert tiers["brief"] == "engine"
    engine = {a["name"] for a in report["engine_reported"]}
    assert "brief" in engine and len(engine) <= SLOTS
    with pytest.raises(NotFoundError):
        lora_client.adapters(warm=["nope"])


def test_an_adapter_is_a_model_through_the_gateway(lora_server: TritonServer) -> None:
    """`tiercache gateway` (issue 16): each adapter is a `model` id; the same prompt on the base
    model and on an adapter are two keys, each cached."""
    import openai

    from .test_gateway import BASE, running_gateway

    prompt = fresh()
    with running_gateway(lora_server, frozenset(ADAPTERS)) as url:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            assert [m.id for m in oai.models.list()] == [BASE, "brief", "caps", "french"]
            statuses = []
            for model in (BASE, "caps", "caps"):
                raw = oai.chat.completions.with_raw_response.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=8,
                )
                assert raw.parse().model == model and raw.parse().choices[0].message.content
                statuses.append(raw.headers["x-tiercache-cache-status"])
        finally:
            oai.close()
    assert statuses == ["miss", "miss", "exact"]
