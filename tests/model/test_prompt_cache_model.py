"""model_repository/prompt_cache/1/model.py run in-process against the pb_utils stand-in."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import seals

from tiercache.budgets import LATE, SLACK
from tiercache.errors import ConfigError, Forbidden
from tiercache.exact.codec import CacheEntry
from tiercache.exact.keys import key_fields, tenant_scope
from tiercache.exact.request import GenerationRequest
from tiercache.exact.tenant_keys import add_key, hash_key, revoke_key
from tiercache.stages.envelope import Envelope, Freshness
from tiercache.stages.seal import Sealer
from tiercache.vocabulary import Tier


@pytest.fixture
def model(load_model: Callable[[str], ModuleType], tmp_path: Path) -> Iterator[Any]:
    instance = load_model("prompt_cache").TritonPythonModel()
    config = {"parameters": {"state_dir": {"string_value": str(tmp_path)}}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "prompt_cache"})
    yield instance
    instance.finalize()


def flushed(model: Any) -> Any:
    """The model's stage after its deferred metric updates were applied (a flusher tick)."""
    model.stage.metrics.flush()
    return model.stage


@pytest.fixture
def sealer(tmp_path: Path) -> Sealer:
    """The deployment's sealer (the model's state_dir is tmp_path)."""
    return seals.sealer_for(tmp_path)


def envelope(pb_utils: ModuleType, response: Any, sealer: Sealer) -> Envelope:
    """The envelope prompt_cache handed the later stages, opened: it must be sealed, over its
    JSON and the CACHED_TEXT beside it."""
    tensor = pb_utils.get_output_tensor_by_name(response, "ENVELOPE")
    assert tensor is not None, "no output ENVELOPE"
    assert tensor.as_numpy().shape == (1, 1)
    return seals.opened(sealer, tensor.as_numpy()[0, 0], output(pb_utils, response, "CACHED_TEXT"))


def make_request(pb_utils: ModuleType, text: bytes = b"What is Triton?", **inputs: Any) -> Any:
    tensors = [pb_utils.Tensor("text_input", np.array([[text]], dtype=np.object_))]
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            array = value
        elif isinstance(value, bool):
            array = np.array([[value]], dtype=np.bool_)
        elif isinstance(value, float):
            array = np.array([[value]], dtype=np.float32)
        elif isinstance(value, list):
            array = np.array([[v.encode() for v in value]], dtype=np.object_)
        elif isinstance(value, str):
            array = np.array([[value.encode()]], dtype=np.object_)
        else:
            array = np.array([[value]], dtype=np.uint64 if name == "seed" else np.int32)
        tensors.append(pb_utils.Tensor(name, array))
    return pb_utils.InferenceRequest(tensors)


def output(pb_utils: ModuleType, response: Any, name: str) -> Any:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    assert tensor is not None, f"no output {name}"
    array = tensor.as_numpy()
    assert array.shape == (1, 1)
    value = array[0, 0]
    return value.decode() if isinstance(value, bytes) else value


def test_batch_with_one_bad_request(model: Any, pb_utils: ModuleType, sealer: Sealer) -> None:
    requests = [
        make_request(pb_utils, b"first", max_tokens=16),
        make_request(pb_utils, b"second", max_tokens=0),
        make_request(pb_utils, b"third"),
    ]
    responses = model.execute(requests)
    assert len(responses) == 3
    bad = responses[1]
    assert bad.has_error()
    assert bad.error().code() == pb_utils.TritonError.INVALID_ARG
    assert bad.error().message().startswith("invalid request:")
    assert "max_tokens" in bad.error().message()
    for response, prompt, max_tokens in ((responses[0], "first", 16), (responses[2], "third", 128)):
        assert not response.has_error()
        assert envelope(pb_utils, response, sealer).status == "miss"
        request = envelope(pb_utils, response, sealer).request
        assert (request.prompt, request.max_tokens) == (prompt, max_tokens)
        assert len(envelope(pb_utils, response, sealer).digest or "") == 64
        assert output(pb_utils, response, "CACHED_TEXT") == ""
        assert envelope(pb_utils, response, sealer).write_back is True
    assert flushed(model).requests["miss"].metric.value() == 2
    assert flushed(model).requests["error"].metric.value() == 1
    assert flushed(model).requests["exact"].metric.value() == 0
    assert flushed(model).requests["miss"].metric.labels == {
        "model": "prompt_cache",
        "status": "miss",
    }
    assert flushed(model).lookup_s.metric.value() == 2  # the _count counter


def test_non_utf8_text_is_invalid(model: Any, pb_utils: ModuleType) -> None:
    (response,) = model.execute([make_request(pb_utils, b"caf\xe9")])
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert "text_input" in response.error().message()


def test_batch_dimension_two_is_invalid(model: Any, pb_utils: ModuleType) -> None:
    two = pb_utils.Tensor("text_input", np.array([[b"a"], [b"b"]], dtype=np.object_))
    (response,) = model.execute([pb_utils.InferenceRequest([two])])
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert "batch size" in response.error().message()


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ({"max_tokens": np.array([[1.0]], dtype=np.float32)}, "max_tokens"),
        ({"temperature": np.array([[1]], dtype=np.int32)}, "temperature"),
        ({"stream": np.array([[1]], dtype=np.int32)}, "stream"),
        ({"top_k": np.array([[1, 2]], dtype=np.int32)}, "top_k"),
    ],
)
def test_wrong_input_types_are_invalid(
    model: Any, pb_utils: ModuleType, inputs: dict[str, Any], fragment: str
) -> None:
    (response,) = model.execute([make_request(pb_utils, **inputs)])
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert fragment in response.error().message()


def test_stored_entry_is_an_exact_hit(model: Any, pb_utils: ModuleType, sealer: Sealer) -> None:
    (miss,) = model.execute([make_request(pb_utils)])
    digest = envelope(pb_utils, miss, sealer).digest
    model.stage.cache.cache.put(digest, "answer")
    (hit,) = model.execute([make_request(pb_utils, b"  What   is Triton?\n")])
    assert envelope(pb_utils, hit, sealer).status == "exact"
    assert output(pb_utils, hit, "CACHED_TEXT") == "answer"
    assert envelope(pb_utils, hit, sealer).digest == digest
    assert envelope(pb_utils, hit, sealer).write_back is False
    # the seal binds the envelope to the hit's answer: with another answer it does not open
    data = pb_utils.get_output_tensor_by_name(hit, "ENVELOPE").as_numpy()[0, 0]
    with pytest.raises(Forbidden, match="does not verify"):
        seals.opened(sealer, data, "another answer")
    assert flushed(model).requests["exact"].metric.value() == 1
    assert flushed(model).hits[Tier.L1].metric.value() == 1


def test_the_envelope_carries_the_oldest_answer_prompt_cache_serves(
    model: Any, pb_utils: ModuleType, sealer: Sealer
) -> None:
    """A miss's envelope (and a hit's) names prompt_cache's ttl_s under the seal: llm's own
    reads of the tiers (its re-check, another replica's answer) keep to it too."""
    model.stage.cache.cache.default_ttl_s = 120.0  # as `ttl_s` 120 configures it
    (miss,) = model.execute([make_request(pb_utils)])
    opened = envelope(pb_utils, miss, sealer)
    assert (opened.status, opened.serve_ttl_s) == ("miss", 120.0)
    model.stage.cache.cache.put(opened.digest, "answer")
    (hit,) = model.execute([make_request(pb_utils)])
    assert envelope(pb_utils, hit, sealer).serve_ttl_s == 120.0


def test_an_exact_hit_sends_its_stored_token_counts_under_the_seal(
    model: Any, pb_utils: ModuleType, sealer: Sealer
) -> None:
    (miss,) = model.execute([make_request(pb_utils)])
    assert pb_utils.get_output_tensor_by_name(miss, "CACHED_TOKENS").as_numpy().tolist() == [
        [0, 0, 0]
    ]
    digest = envelope(pb_utils, miss, sealer).digest
    model.stage.cache.cache.put(
        digest, "answer", generated_tokens=12, prompt_tokens=31, finish_reason="length"
    )
    (hit,) = model.execute([make_request(pb_utils)])
    tokens = pb_utils.get_output_tensor_by_name(hit, "CACHED_TOKENS").as_numpy()
    assert tokens.tolist() == [[31, 12, 1]]
    data = pb_utils.get_output_tensor_by_name(hit, "ENVELOPE").as_numpy()[0, 0]
    assert Envelope.open(data, sealer, Freshness(), "answer", (31, 12, 1)).status == "exact"
    with pytest.raises(Forbidden, match="does not verify"):
        Envelope.open(data, sealer, Freshness(), "answer", (31, 12, 0))


def test_a_repeated_hit_is_sealed_with_its_current_answer(
    model: Any, pb_utils: ModuleType, sealer: Sealer
) -> None:
    """The sealed envelope of an exact hit is memoized (tiercache.exact.memo): a repeated hit
    gets the same bytes; once the entry's answer changed, the envelope is sealed with the new
    answer and does not open with the old one."""
    (miss,) = model.execute([make_request(pb_utils)])
    digest = envelope(pb_utils, miss, sealer).digest
    answer = "an answer longer than the 32 bytes io shares whatever the memo does"
    model.stage.cache.cache.put(digest, answer)

    def sent(response: Any) -> bytes:
        return bytes(pb_utils.get_output_tensor_by_name(response, "ENVELOPE").as_numpy()[0, 0])

    first, again = model.execute([make_request(pb_utils), make_request(pb_utils)])
    assert sent(first) == sent(again) and output(pb_utils, again, "CACHED_TEXT") == answer

    def arrays(response: Any) -> list[Any]:
        names = ("ENVELOPE", "CACHED_TEXT", "CACHED_TOKENS")
        return [pb_utils.get_output_tensor_by_name(response, n).as_numpy() for n in names]

    # the repeat sends the arrays the first hit built, read-only (nothing can alter them)
    for built, shared in zip(arrays(first), arrays(again), strict=True):
        assert shared is built and not shared.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            shared[...] = shared
        assert shared.base is None  # not a view whose base another could still write to
    model.stage.cache.cache.put(digest, "a newer answer")
    (changed,) = model.execute([make_request(pb_utils)])
    assert output(pb_utils, changed, "CACHED_TEXT") == "a newer answer"
    assert envelope(pb_utils, changed, sealer).status == "exact"
    with pytest.raises(Forbidden, match="does not verify"):
        seals.opened(sealer, sent(changed), answer)


def test_a_repeated_request_is_prepared_once_and_read_as_the_tiers_stand(
    model: Any, pb_utils: ModuleType, sealer: Sealer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage keeps a request prepared for its lookup by its inputs as received
    (`PromptCacheStage._prepare`), but reads the tiers and checks the padded tenants on every
    request: a deleted answer is a miss at once, a tenant padded since is not looked up, and
    the same inputs with one byte more are prepared apart. The sealed hit follows the issue
    time's step."""
    stage = model.stage
    (miss,) = model.execute([make_request(pb_utils)])
    digest = envelope(pb_utils, miss, sealer).digest
    stage.cache.cache.put(digest, "answer")
    (hit,) = model.execute([make_request(pb_utils)])
    assert output(pb_utils, hit, "CACHED_TEXT") == "answer" and len(stage._prepared) == 1
    issued = [1000]
    monkeypatch.setattr("tiercache.stages.prompt_cache.issued_now", lambda: issued[0])
    (first,) = model.execute([make_request(pb_utils)])
    issued[0] = 1010
    (later,) = model.execute([make_request(pb_utils)])
    assert [envelope(pb_utils, r, sealer).issued_s for r in (first, later)] == [1000, 1010]
    assert len(stage._sealed) == 1  # the new step's envelope replaced the last one in place
    assert stage.cache.cache.delete(digest)
    (gone,) = model.execute([make_request(pb_utils)])
    assert envelope(pb_utils, gone, sealer).status == "miss"
    assert output(pb_utils, gone, "CACHED_TEXT") == ""
    stage.cache.cache.put(digest, "answer")
    stage.cache.deferred = lambda scope: True  # every tenant padded now: llm looks it up
    (deferred,) = model.execute([make_request(pb_utils)])
    assert envelope(pb_utils, deferred, sealer).status == "miss"
    # a padded tenant's request is not kept (its time here must not tell it was asked before)
    model.execute([make_request(pb_utils, b"Padded: what is Triton?")])
    assert len(stage._prepared) == 1
    stage.cache.deferred = None
    (other,) = model.execute([make_request(pb_utils, b"What is Triton? ")])
    assert envelope(pb_utils, other, sealer).status == "exact"  # the same canonical prompt
    assert len(stage._prepared) == 2
    assert flushed(model).requests["exact"].metric.value() == 4


def test_the_same_inputs_under_two_keys_are_prepared_for_each_keys_tenant(
    load_model: Callable[[str], ModuleType], pb_utils: ModuleType, tmp_path: Path, sealer: Sealer
) -> None:
    """With a key file, a request prepared for one caller's key is not served to another's:
    the grant is part of what the stage keeps it by, and a key removed from the file is
    refused on its next request, whatever was kept for it."""
    keys = tmp_path / "keys.json"
    acme_key, acme_grant = add_key(keys, "acme")
    globex_key, _ = add_key(keys, "globex")
    instance = load_model("prompt_cache").TritonPythonModel()
    parameters = {"state_dir": str(tmp_path), "api_keys_file": str(keys)}
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "prompt_cache"})

    def call(key: str) -> Any:
        request = make_request(pb_utils)
        request.kwargs["parameters"] = {"authorization": f"Bearer {key}"}
        (response,) = instance.execute([request])
        return response

    try:
        acme = envelope(pb_utils, call(acme_key), sealer)
        instance.stage.cache.cache.put(acme.digest, "for acme")
        assert output(pb_utils, call(acme_key), "CACHED_TEXT") == "for acme"
        globex = call(globex_key)
        assert envelope(pb_utils, globex, sealer).status == "miss"
        assert output(pb_utils, globex, "CACHED_TEXT") == ""
        assert envelope(pb_utils, globex, sealer).key == hash_key(globex_key)
        assert revoke_key(keys, acme_grant.key_id)
        instance.stage.keys._checked_s = float("-inf")  # the reload check due now
        refused = call(acme_key)
        assert refused.has_error() and refused.error().message().startswith("forbidden: ")
    finally:
        instance.finalize()


def test_l2_only_entry_is_a_hit_from_l2(model: Any, pb_utils: ModuleType, sealer: Sealer) -> None:
    (miss,) = model.execute([make_request(pb_utils)])
    digest = envelope(pb_utils, miss, sealer).digest
    dict(model.stage.cache.cache.stores())[Tier.L2].put(
        digest, CacheEntry("from l2", created_s=0.0)
    )
    (hit,) = model.execute([make_request(pb_utils)])
    assert output(pb_utils, hit, "CACHED_TEXT") == "from l2"
    assert flushed(model).hits[Tier.L2].metric.value() == 1


def test_tenants_do_not_share_entries(model: Any, pb_utils: ModuleType, sealer: Sealer) -> None:
    (a,) = model.execute([make_request(pb_utils, tenant="a")])
    model.stage.cache.cache.put(envelope(pb_utils, a, sealer).digest, "for a")
    (b,) = model.execute([make_request(pb_utils, tenant="b")])
    assert envelope(pb_utils, b, sealer).status == "miss"
    assert envelope(pb_utils, b, sealer).digest != envelope(pb_utils, a, sealer).digest


@pytest.mark.parametrize(
    ("inputs", "status", "has_digest", "write_back"),
    [
        ({"cache_control": "no-store"}, "miss", True, False),
        ({"cache_control": "no-cache"}, "bypass", True, True),
        ({"temperature": 0.7}, "bypass", False, False),
        ({"temperature": 0.7, "seed": 3}, "miss", True, True),
        ({"temperature": 0.7, "cache_control": "allow-sampled"}, "miss", True, True),
    ],
)
def test_cache_control_and_sampling(
    model: Any,
    pb_utils: ModuleType,
    sealer: Sealer,
    inputs: dict[str, Any],
    status: str,
    has_digest: bool,
    write_back: bool,
) -> None:
    (response,) = model.execute([make_request(pb_utils, **inputs)])
    assert envelope(pb_utils, response, sealer).status == status
    assert (envelope(pb_utils, response, sealer).digest is not None) is has_digest
    assert envelope(pb_utils, response, sealer).write_back is write_back
    assert flushed(model).requests[status].metric.value() == 1


REPO = Path(__file__).resolve().parents[2]


def test_request_json_carries_every_input(
    model: Any, pb_utils: ModuleType, sealer: Sealer, tmp_path: Path
) -> None:
    shutil.copytree(REPO / "adapters" / "brief", tmp_path / "adapters" / "adapter")
    (response,) = model.execute(
        [
            make_request(
                pb_utils,
                max_tokens=5,
                stream=True,
                temperature=0.7,
                top_p=0.9,
                top_k=4,
                seed=11,
                stop_words=["b", "a"],
                lora_name="adapter",
            )
        ]
    )
    request = envelope(pb_utils, response, sealer).request
    ref = model.stage.cache.resolve_adapter("adapter")
    assert (ref.task_id, len(ref.digest)) == (1, 64)
    assert request == GenerationRequest(
        prompt="What is Triton?",
        max_tokens=5,
        temperature=0.7,
        top_p=0.9,
        top_k=4,
        seed=11,
        stop_words=("a", "b"),
        stream=True,
        lora_name="adapter",
        lora_task_id=ref.task_id,
        lora_digest=ref.digest,
        tenant_scope=request.tenant_scope,
    )
    assert len(request.tenant_scope) == 64


@pytest.mark.parametrize(
    "inputs",
    [
        {},
        {"tenant": "a"},
        {"tenant": "b", "cache_control": "no-cache"},
        {"tenant": "a", "temperature": 0.7},  # not cacheable: bypass without a digest
    ],
)
def test_request_carries_the_tenant_scope_for_the_engine_kv(
    model: Any, pb_utils: ModuleType, sealer: Sealer, tmp_path: Path, inputs: dict[str, Any]
) -> None:
    """The engine keys prefix KV blocks by `tenant_scope`: the tenant's scope HMAC, on every status
    that reaches the engine; it is not part of the cache key."""
    (response,) = model.execute([make_request(pb_utils, **inputs)])
    request = envelope(pb_utils, response, sealer).request
    secret = (tmp_path / "secret").read_bytes()
    assert request.tenant_scope == tenant_scope(secret, inputs.get("tenant", ""))
    assert "tenant_scope" not in key_fields(request)


def test_adapters_are_resolved_and_their_digest_is_in_the_key(
    model: Any, pb_utils: ModuleType, sealer: Sealer, tmp_path: Path
) -> None:
    """An unknown adapter is NOT_FOUND; a changed adapter folder changes the digest."""
    (unknown,) = model.execute([make_request(pb_utils, lora_name="nope")])
    assert unknown.error().code() == pb_utils.TritonError.NOT_FOUND
    assert "unknown adapter 'nope'" in unknown.error().message()
    folder = tmp_path / "adapters" / "a"
    shutil.copytree(REPO / "adapters" / "brief", folder)
    base, first = model.execute([make_request(pb_utils), make_request(pb_utils, lora_name="a")])
    digests = {envelope(pb_utils, r, sealer).digest for r in (base, first)}
    assert len(digests) == 2
    shutil.copy2(REPO / "adapters" / "caps" / "adapter_model.safetensors", folder)
    (changed,) = model.execute([make_request(pb_utils, lora_name="a")])
    assert envelope(pb_utils, changed, sealer).digest not in digests


def test_store_gauges_are_published(model: Any, pb_utils: ModuleType) -> None:
    model.execute([make_request(pb_utils)])
    model.stage.metrics.flush()
    families = model.stage.metrics._families
    entries = {m.labels["tier"]: m.value() for m in families["tiercache_cache_entries"].metrics}
    assert entries == {"l1": 0, "l2": 0}


def test_unknown_parameter_fails_initialize(
    load_model: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    instance = load_model("prompt_cache").TritonPythonModel()
    parameters = {"state_dir": {"string_value": str(tmp_path)}, "bogus": {"string_value": "1"}}
    config = {"parameters": parameters}
    with pytest.raises(ConfigError, match="bogus"):
        instance.initialize({"model_config": json.dumps(config), "model_name": "prompt_cache"})


def test_with_a_key_file_the_tenant_comes_from_the_callers_key(
    load_model: Callable[[str], ModuleType], pb_utils: ModuleType, tmp_path: Path, sealer: Sealer
) -> None:
    """api_keys_file set: each request's tenant is its key's (the forwarded authorization
    header, a request parameter); no key, an unknown one, or a tenant input naming another
    tenant is refused for that request alone, counted as forbidden."""
    keys = tmp_path / "keys.json"
    acme_key, _ = add_key(keys, "acme")
    globex_key, _ = add_key(keys, "globex", adapters=[])
    instance = load_model("prompt_cache").TritonPythonModel()
    parameters = {"state_dir": str(tmp_path), "api_keys_file": str(keys)}
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "prompt_cache"})

    def call(authorization: str | None, **inputs: Any) -> Any:
        request = make_request(pb_utils, **inputs)
        if authorization is not None:
            request.kwargs["parameters"] = {"authorization": authorization}
        return request

    try:
        responses = instance.execute(
            [
                call(None),
                call("Bearer tc_not-a-key"),
                call(f"Bearer {globex_key}", tenant="acme"),  # another tenant's name
                call(f"Bearer {globex_key}", lora_name="caps"),  # an adapter it may not use
                call(f"Bearer {acme_key}"),
                call(acme_key, tenant="acme"),
            ]
        )
        errors = [r.error().message() if r.has_error() else None for r in responses]
        assert all(e is not None and e.startswith("forbidden: ") for e in errors[:4]), errors
        assert errors[4:] == [None, None]
        sent = [envelope(pb_utils, r, sealer) for r in responses[4:]]
        assert {e.request.tenant_scope for e in sent} == {
            tenant_scope(load_secret_of(tmp_path), "acme")
        }
        assert {e.key for e in sent} == {hash_key(acme_key)}  # the later stages check it again
        assert flushed(instance).requests["forbidden"].metric.value() == 4
    finally:
        instance.finalize()


def load_secret_of(state_dir: Path) -> bytes:
    return (state_dir / "secret").read_bytes()


def test_with_a_memory_headroom_l1_follows_the_host(
    load_model: Callable[[str], ModuleType], tmp_path: Path, pb_utils: ModuleType
) -> None:
    """memory_headroom_bytes larger than this machine: the host (read for real) is always short
    of it, so L1's budget goes to its floor within a tick and the metrics say so."""
    instance = load_model("prompt_cache").TritonPythonModel()
    parameters = {
        "state_dir": {"string_value": str(tmp_path)},
        "memory_headroom_bytes": {"string_value": str(1 << 60)},
        "l1_min_bytes": {"string_value": str(2 << 20)},
        "budget_interval_s": {"string_value": "0.05"},
    }
    config = {"parameters": parameters}
    instance.initialize({"model_config": json.dumps(config), "model_name": "prompt_cache"})
    try:
        l1 = instance.stage.cache.cache.store(Tier.L1)
        deadline = time.monotonic() + 10.0
        while l1.stats().max_bytes != 2 << 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert l1.stats().max_bytes == 2 << 20
        time.sleep(0.2)  # another tick: short with L1 at its floor
        instance.stage.metrics.flush()
        families = instance.stage.metrics._families
        (budget,) = families["tiercache_budget_bytes"].metrics
        assert (budget.labels["cache"], budget.value()) == ("l1", 2 << 20)
        shrinks = {
            m.labels["reason"]: m.value()
            for m in families["tiercache_budget_changes_total"].metrics
        }
        assert shrinks == {"shrink": 1, "grow": 0, "move": 0}
        (value,) = families["tiercache_budget_value_per_mib"].metrics
        assert value.value() == 0.0  # nothing evicted, nothing missed since: no gradient
        assert families["tiercache_memory_headroom_bytes"].metrics[0].value() == 1 << 60
        assert families["tiercache_cache_memory_bytes"].metrics[0].value() == 0
        assert families["tiercache_budget_short_total"].metrics[0].value() >= 1
        (available,) = families["tiercache_memory_available_bytes"].metrics
        assert 0 < available.value() < 1 << 60
    finally:
        instance.finalize()
    assert not instance.stage.budgets._thread.is_alive()  # closed with the model


def test_with_a_total_l1_takes_its_part_of_it_and_publishes_its_budget(
    load_model: Callable[[str], ModuleType], tmp_path: Path, pb_utils: ModuleType
) -> None:
    """cache_memory_bytes under L1's fixed size, no headroom: L1 shrinks to the total within a
    tick (alone on the host) and its budget is in the host's ledger for the other stages."""
    instance = load_model("prompt_cache").TritonPythonModel()
    parameters = {
        "state_dir": {"string_value": str(tmp_path)},
        "cache_memory_bytes": {"string_value": str(8 << 20)},
        "budget_interval_s": {"string_value": "0.05"},
    }
    instance.initialize(
        {"model_config": json.dumps({"parameters": parameters}), "model_name": "prompt_cache"}
    )
    try:
        l1 = instance.stage.cache.cache.store(Tier.L1)
        deadline = time.monotonic() + 10.0
        while l1.stats().max_bytes != 8 << 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert l1.stats().max_bytes == 8 << 20
        (published,) = (tmp_path / "budgets").glob("prompt_cache.*")
        while time.monotonic() < deadline:  # published at the start of the next tick
            row = json.loads(published.read_text())[0]
            if row[1] == 8 << 20:
                break
            time.sleep(0.05)
        # name, bytes, value, floor, ceiling, objective (none: SLACK), bytes past the total
        assert row == [
            "l1",
            8 << 20,
            0.0,
            1 << 20,
            64 << 20,
            0,
            0,
        ]  # joining the total: seven fields, as every version reads
    finally:
        instance.finalize()
    assert not list((tmp_path / "budgets").glob("prompt_cache.*"))  # gone with the model


def test_a_missed_hit_objective_is_published_and_counts_only_exact_hits(
    load_model: Callable[[str], ModuleType], tmp_path: Path, pb_utils: ModuleType, sealer: Sealer
) -> None:
    """hit_objective_s under any lookup's time: misses leave it unjudged (SLACK), exact hits
    make it missed (LATE) once enough are recent; the state is exported and published in the
    host's ledger (where it lets L1 grow past the total, tiercache.budgets)."""
    instance = load_model("prompt_cache").TritonPythonModel()
    parameters = {
        "state_dir": {"string_value": str(tmp_path)},
        "cache_memory_bytes": {"string_value": str(8 << 20)},
        "budget_interval_s": {"string_value": "0.05"},
        "hit_objective_s": {"string_value": "1e-9"},
    }
    instance.initialize(
        {"model_config": json.dumps({"parameters": parameters}), "model_name": "prompt_cache"}
    )
    try:
        objective = instance.stage.hit_objective
        prompts = [f"question {i}".encode() for i in range(20)]
        misses = instance.execute([make_request(pb_utils, p) for p in prompts])
        assert objective is not None and objective.state() == SLACK  # misses are not judged
        l1 = instance.stage.cache.cache.store(Tier.L1)
        for response in misses:
            l1.put(
                envelope(pb_utils, response, sealer).digest,
                CacheEntry("an answer", created_s=time.time()),
            )
        hits = instance.execute([make_request(pb_utils, p) for p in prompts])
        assert [output(pb_utils, r, "CACHED_TEXT") for r in hits] == ["an answer"] * 20
        assert objective.state() == LATE
        deadline, row = time.monotonic() + 10.0, []
        while time.monotonic() < deadline:  # published at each tick
            for published in (tmp_path / "budgets").glob("prompt_cache.*"):
                if published.suffix != ".tmp":  # written aside, then renamed
                    row = json.loads(published.read_text())[0]
            if row and row[5] == LATE:
                break
            time.sleep(0.05)
        assert row[0] == "l1" and row[5] == LATE
        instance.stage.metrics.flush()
        (state,) = instance.stage.metrics._families["tiercache_hit_objective_state"].metrics
        assert state.value() == LATE
    finally:
        instance.finalize()


def test_without_a_headroom_no_budget_thread_runs(model: Any) -> None:
    assert model.stage.budgets is None
