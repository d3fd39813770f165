"""Issue 14's attacks against a hardened `tiercache serve` (conftest.py), each shown refused,
with nothing served afterwards that the attacker wrote.

An attacker here can reach the gRPC port (call any model, with any inputs, headers and
parameters), holds an API key of its own (a tenant), can read and write the deployment's Redis,
and may know a victim's digest. It does not have the server's state folder (the secret, the
admin token). Two tests act as a compromised stage would (they seal with the server's secret,
read from its state folder) to show what the engine checks even then. docs/security.md has the
table of these attacks and their outcome.
"""

from __future__ import annotations

import json
import queue
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
from integration.conftest import REPO, metric_value
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tiercache.adapter_types import AdapterRef, adapter_digest
from tiercache.config import CacheConfig
from tiercache.errors import ConfigError
from tiercache.exact.codec import CacheEntry, encode_entry
from tiercache.exact.request import GenerationRequest
from tiercache.exact.tenant_keys import add_key, revoke_key
from tiercache.exact.watermarks import Invalidation
from tiercache.stages.envelope import Envelope
from tiercache.stages.parts import open_exact_cache, open_sealer
from tiercache.stages.seal import ENGINE_INPUTS, ENGINE_LABEL, SEAL_CHARS, seal_tensors
from tiercache.stages.transport import OVERHEAD
from tiercache.vocabulary import CacheStatus, InvalidationKind
from tiercache_client import (
    ForbiddenError,
    InvalidRequestError,
    TierCacheClient,
)

from .conftest import PADDING_MS, REDIS_PREFIX, Served

pytestmark = pytest.mark.integration
MAX_TOKENS = 6
DIMENSIONS = 384


def unique(text: str) -> str:
    return f"{text} ({uuid.uuid4().hex[:8]})"


def client(served: Served, tenant: str | None = "acme") -> TierCacheClient:
    key = served.keys[tenant] if tenant else None
    return TierCacheClient(served.grpc_url, timeout_s=300, api_key=key)


@pytest.fixture(scope="module")
def raw(served: Served) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(served.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def store(served: Served) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(served.redis_url)
    yield r
    r.close()


def tensor(name: str, value: Any, batched: bool = True) -> grpcclient.InferInput:
    """One input as a client sends it (BYTES for str/bytes, INT32 for int, else FP32), batch
    of one."""
    if isinstance(value, int):
        array, datatype = np.array([[value]], dtype=np.int32), "INT32"
    elif isinstance(value, np.ndarray):
        array = value.astype(np.float32).reshape(1, -1) if batched else value
        datatype = "FP32"
    elif isinstance(value, float):
        array, datatype = np.array([[value]], dtype=np.float32), "FP32"
    else:
        data = value.encode() if isinstance(value, str) else value
        array = np.array([[data]] if batched else [data], dtype=np.object_)
        datatype = "BYTES"
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def unary_error(
    raw: grpcclient.InferenceServerClient,
    model: str,
    inputs: list[grpcclient.InferInput],
    headers: dict[str, str] | None = None,
) -> str:
    """The error message of one unary call that must fail."""
    with pytest.raises(InferenceServerException) as failed:
        raw.infer(model, inputs, headers=headers)
    return str(failed.value.message())


def stream_outcome(
    served: Served, model: str, inputs: list[grpcclient.InferInput]
) -> tuple[list[grpcclient.InferResult], str | None]:
    """One call of a decoupled model over the gRPC stream: its responses and its error."""
    results: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        c.start_stream(callback=lambda result, error: results.put((result, error)))
        c.async_stream_infer(model, inputs, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                return responses, str(error.message())
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses, None
    finally:
        c.stop_stream()
        c.close()


def sealed_envelope_of(
    raw: grpcclient.InferenceServerClient, served: Served, prompt: str
) -> tuple[bytes, Envelope]:
    """What an attacker gets by calling the edge (prompt_cache) directly with its own key: its
    own request's sealed envelope, and the JSON inside (readable, never alterable)."""
    result = raw.infer(
        "prompt_cache",
        [tensor("text_input", prompt), tensor("max_tokens", MAX_TOKENS)],  # as the client sends
        headers={"authorization": f"Bearer {served.keys['acme']}"},
    )
    data = result.as_numpy("ENVELOPE").reshape(-1)[0]
    return data, Envelope.decode(data[SEAL_CHARS:])


def forbidden(message: str | None) -> bool:
    return message is not None and message.startswith("forbidden: ")


# -- authenticated tenants --------------------------------------------------------------------


def test_requests_without_a_valid_key_for_their_tenant_are_refused(served: Served) -> None:
    prompt = unique("What is the boiling point of water?")
    with client(served, None) as anonymous, pytest.raises(ForbiddenError, match="API key"):
        anonymous.generate_text(prompt, max_tokens=MAX_TOKENS)
    with (
        TierCacheClient(served.grpc_url, timeout_s=300, api_key="tc_" + "A" * 43) as guessing,
        pytest.raises(ForbiddenError, match="unknown API key"),
    ):
        guessing.generate_text(prompt, max_tokens=MAX_TOKENS)
    with client(served, "globex") as globex:
        with pytest.raises(ForbiddenError, match="tenant"):
            globex.generate_text(prompt, max_tokens=MAX_TOKENS, tenant="acme")
        with pytest.raises(ForbiddenError, match="adapter 'caps'"):
            globex.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="caps")
        assert globex.generate_text(prompt, max_tokens=MAX_TOKENS).cache_status == "miss"


def test_the_openai_endpoint_takes_the_tenant_from_the_key(served: Served) -> None:
    """`tiercache serve`'s OpenAI endpoint (docs/gateway.md) with the API key file: no key and an
    unknown key are 401 with OpenAI's error JSON; acme's key is served, and a second call of
    acme's is an exact hit while globex's same request is not (another tenant's scope); globex
    asking an adapter its key may not use is a 403. An unknown key is refused before its body
    is read, on the feedback route too."""
    import httpx2 as httpx
    import openai

    url = f"http://127.0.0.1:{served.gateway_port}/v1"
    prompt = unique("What is a gateway?")
    body = {"model": "tiercache", "prompt": prompt, "max_tokens": MAX_TOKENS}
    anonymous = httpx.post(f"{url}/completions", json=body, timeout=300)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    oai = openai.OpenAI(base_url=url, api_key="tc_" + "A" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="unknown API key"):
        oai.completions.create(model="tiercache", prompt=prompt, max_tokens=MAX_TOKENS)
    oai.close()
    # the key is checked first, by the edge's copy of the key file: an unknown key's body is
    # neither parsed nor sent to Triton (its 400 would come after a 401)
    junk = httpx.post(
        f"{url}/completions",
        content=b"{not json",
        headers={"content-type": "application/json", "authorization": "Bearer tc_" + "B" * 43},
        timeout=60,
    )
    assert junk.status_code == 401 and "unknown API key" in junk.text
    junk_feedback = httpx.post(  # and so on the feedback route
        f"{url}/feedback",
        content=b"{not json",
        headers={"content-type": "application/json", "authorization": "Bearer tc_" + "B" * 43},
        timeout=60,
    )
    assert junk_feedback.status_code == 401 and "unknown API key" in junk_feedback.text
    statuses = []
    for tenant in ("acme", "acme", "globex"):
        oai = openai.OpenAI(base_url=url, api_key=served.keys[tenant], max_retries=0)
        raw = oai.completions.with_raw_response.create(
            model="tiercache", prompt=prompt, max_tokens=MAX_TOKENS
        )
        statuses.append(raw.headers["x-tiercache-cache-status"])
        oai.close()
    assert statuses == ["miss", "exact", "miss"]
    # a valid key asking for what it may not use is a 403, not a 401
    oai = openai.OpenAI(base_url=url, api_key=served.keys["globex"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="may not use adapter 'caps'"):
        oai.completions.create(model="caps", prompt=prompt, max_tokens=MAX_TOKENS)
    oai.close()


def test_another_tenants_answers_stay_out_of_reach(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    prompt = unique("Name a prime number.")
    with client(served, "acme") as acme, client(served, "globex") as globex:
        first = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
        assert acme.generate_text(prompt, max_tokens=MAX_TOKENS).cache_status == "exact"
        assert globex.generate_text(prompt, max_tokens=MAX_TOKENS).cache_status == "miss"
    # The edge called directly, naming acme with globex's key: refused, no cached text.
    message = unary_error(
        raw,
        "prompt_cache",
        [tensor("text_input", prompt), tensor("tenant", "acme")],
        headers={"authorization": f"Bearer {served.keys['globex']}"},
    )
    assert forbidden(message) and first.text not in message


def test_feedback_is_taken_only_from_the_tenant_that_was_served(served: Served) -> None:
    """Issue 19: an attacker with a key of its own cannot make a victim's answer be dropped:
    the victim's answer id sent with the attacker's key (naming the victim or not), without a
    key, or altered, is refused and nothing is invalidated; the victim's own bad verdict is
    taken."""
    prompt = unique("Name a noble gas.")
    with client(served, "acme") as acme, client(served, "globex") as globex:
        answer = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
        assert answer.answer_id is not None
        with client(served, None) as anonymous:
            with pytest.raises(ForbiddenError):
                anonymous.feedback(answer.answer_id, "bad", tenant="acme")
        with pytest.raises(ForbiddenError):
            globex.feedback(answer.answer_id, "bad")
        with pytest.raises(ForbiddenError):  # naming the victim: refused by the key check
            globex.feedback(answer.answer_id, "bad", tenant="acme")
        altered = answer.answer_id[:-2] + ("AA" if answer.answer_id[-2:] != "AA" else "BB")
        with pytest.raises((ForbiddenError, InvalidRequestError)):
            acme.feedback(altered, "bad")
        assert acme.generate_text(prompt, max_tokens=MAX_TOKENS).cache_status == "exact"
        # This deployment pads a tenant: the answer says no more than that it was taken.
        assert acme.feedback(answer.answer_id, "bad") == {"verdict": "bad", "accepted": True}
        assert acme.generate_text(prompt, max_tokens=MAX_TOKENS).cache_status != "exact"


def test_a_key_limited_to_some_adapters_judges_only_their_answers(served: Served) -> None:
    """An acme key that may use `french` only, holding the answer id of an acme answer made with
    `caps` (another acme key's), can neither drop that answer (`bad`) nor endorse it (`good`):
    the id names its adapter. Its own adapter's answers and the base model's it judges. (Not
    `brief`: the replay test below needs it not yet loaded in the engine.)"""
    keys_file = served.state_dir.parent / "api_keys.json"
    limited, _ = add_key(keys_file, "acme", adapters=["french"])
    time.sleep(2.0)  # each stage looks at the key file at most once a second
    caps_prompt = unique("Name a colour of the sea.")
    with (
        client(served, "acme") as acme,
        TierCacheClient(served.grpc_url, timeout_s=300, api_key=limited) as french_only,
    ):
        caps = acme.generate_text(caps_prompt, max_tokens=MAX_TOKENS, lora_name="caps")
        assert caps.answer_id is not None
        for verdict in ("bad", "good"):
            with pytest.raises(ForbiddenError, match="may not use the adapter"):
                french_only.feedback(caps.answer_id, verdict)
        again = acme.generate_text(caps_prompt, max_tokens=MAX_TOKENS, lora_name="caps")
        assert again.cache_status == "exact"
        own = french_only.generate_text(
            unique("Name a colour of the sky."), max_tokens=MAX_TOKENS, lora_name="french"
        )
        base = french_only.generate_text(unique("Name a colour of grass."), max_tokens=MAX_TOKENS)
        for answer in (own, base):
            assert answer.answer_id is not None
            assert french_only.feedback(answer.answer_id, "good")["accepted"] is True


# -- closed internal stages -------------------------------------------------------------------


def test_direct_calls_of_the_internal_stages_are_refused(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    request = GenerationRequest(unique("Say hi."), max_tokens=MAX_TOKENS)
    bare = Envelope(request=request, status=CacheStatus.MISS, write_back=True).encode()
    caps = AdapterRef("caps", 1, "0" * 64).to_json()
    unary = {
        "embedding_cache": [tensor("ENVELOPE", bare), tensor("CACHED_TEXT", "")],
        "lora_cache weights": [tensor("ADMIN", json.dumps({"op": "weights", "lora": caps}))],
        "lora_cache list": [tensor("ADMIN", '{"op": "list"}')],
        "lora_cache warm": [tensor("ADMIN", '{"op": "warm", "names": ["caps"]}')],
        "lora_cache plan": [tensor("ENVELOPE", bare), tensor("LOOKUP_STATUS", "miss")],
        # its texts unsealed, or sealed with a guess: refused before the tokenizer
        "embedder": [tensor("TEXT", "a direct caller's text")],
        "embedder guessed": [tensor("TEXT", "x"), tensor("TEXT_SEAL", "0" * SEAL_CHARS)],
    }
    for name, inputs in unary.items():
        model = name.split()[0]
        if name == "lora_cache plan":  # a base-model request needs no plan: with an adapter
            adapter = GenerationRequest("x", lora_name="caps", lora_task_id=1, lora_digest="0" * 64)
            inputs = [tensor("ENVELOPE", Envelope(request=adapter).encode()), inputs[1]]
        assert forbidden(unary_error(raw, model, inputs)), name
    vector = np.zeros(DIMENSIONS, dtype=np.float32)
    llm = [
        tensor("ENVELOPE", bare),
        tensor("CACHED_TEXT", "attacker's text"),
        tensor("LOOKUP_STATUS", "exact"),
        tensor("SIMILARITY", 1.0),
        tensor("EMBEDDING", vector),
        tensor("ANSWER_SEAL", "0" * SEAL_CHARS),
    ]
    assert forbidden(stream_outcome(served, "llm", llm)[1])
    engine = [tensor("ENVELOPE", bare, batched=False)]
    assert forbidden(stream_outcome(served, "torch_llm", engine)[1])
    config, weights = adapter_files("french")
    load = [
        tensor("LORA_OP", "load", batched=False),
        tensor("LORA", caps, batched=False),
        tensor("LORA_CONFIG", config, batched=False),
        tensor("LORA_WEIGHTS", weights, batched=False),
    ]
    assert forbidden(stream_outcome(served, "torch_llm", load)[1])


def test_a_replayed_envelope_cannot_carry_a_forged_answer(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    """The attacker's own sealed envelope (from the edge) with a planted answer (as
    embedding_cache's or as prompt_cache's exact hit), status or vector: refused by llm; the
    ensemble then generates and keeps the real answer."""
    prompt = unique("What colour is the sky?")
    data, envelope = sealed_envelope_of(raw, served, prompt)
    assert envelope.status is CacheStatus.MISS and envelope.write_back
    vector = np.ones(DIMENSIONS, dtype=np.float32) / np.sqrt(DIMENSIONS)
    for status, text in (("semantic", "attacker's text"), ("exact", "attacker's text")):
        forged = [
            tensor("ENVELOPE", data),
            tensor("CACHED_TEXT", text),
            tensor("LOOKUP_STATUS", status),
            tensor("SIMILARITY", 0.99),
            tensor("EMBEDDING", vector),
            tensor("ANSWER_SEAL", "0" * SEAL_CHARS),
        ]
        assert forbidden(stream_outcome(served, "llm", forged)[1]), status
    # the exact hit's own way in: a text beside the attacker's miss envelope (whose seal binds
    # no text), with embedding_cache's empty pass-through
    exact = [
        tensor("ENVELOPE", data),
        tensor("EXACT_TEXT", "attacker's text"),
        tensor("CACHED_TEXT", ""),
        tensor("LOOKUP_STATUS", "exact"),
        tensor("SIMILARITY", 0.0),
        tensor("EMBEDDING", np.zeros(0, dtype=np.float32)),
    ]
    assert forbidden(stream_outcome(served, "llm", exact)[1])
    planted = [
        tensor("ENVELOPE", data),
        tensor("CACHED_TEXT", ""),
        tensor("LOOKUP_STATUS", "miss"),
        tensor("SIMILARITY", 0.0),
        tensor("EMBEDDING", vector),  # another prompt's vector, to poison the semantic index
        tensor("ANSWER_SEAL", "f" * SEAL_CHARS),
    ]
    assert forbidden(stream_outcome(served, "llm", planted)[1])
    with client(served) as acme:
        first = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
        again = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert first.cache_status == "miss" and "attacker" not in first.text
    assert (again.cache_status, again.text) == ("exact", first.text)


def test_an_attacker_who_knows_a_digest_cannot_overwrite_its_answer(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    """The issue's overwrite: llm called with the victim's digest, bypass and write-back. The
    envelope names the digest (read from the victim's own envelope), but cannot be sealed."""
    prompt = unique("Which planet is closest to the sun?")
    with client(served) as acme:
        original = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
    _, victim = sealed_envelope_of(raw, served, prompt)
    assert victim.status is CacheStatus.EXACT and victim.digest
    forged = Envelope(
        request=GenerationRequest("Say: attacker", max_tokens=MAX_TOKENS),
        status=CacheStatus.BYPASS,
        digest=victim.digest,
        write_back=True,
    ).encode()
    for seal in ("", "0" * SEAL_CHARS):
        inputs = [
            tensor("ENVELOPE", seal.encode() + forged),
            tensor("CACHED_TEXT", ""),
            tensor("LOOKUP_STATUS", "bypass"),
            tensor("SIMILARITY", 0.0),
            tensor("EMBEDDING", np.zeros(0, dtype=np.float32)),
            tensor("ANSWER_SEAL", "0" * SEAL_CHARS),
        ]
        assert forbidden(stream_outcome(served, "llm", inputs)[1])
    with client(served) as acme:
        after = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert (after.cache_status, after.text) == ("exact", original.text)


def adapter_files(name: str) -> tuple[str, bytes]:
    folder = REPO / "adapters" / name
    return (folder / "adapter_config.json").read_text(), (
        folder / "adapter_model.safetensors"
    ).read_bytes()


def test_a_replayed_envelope_gets_only_ciphertext_of_an_adapter(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    """Adapter export by replay: the attacker's own sealed envelope for an adapter its key may
    use, replayed into lora_cache, gets a plan whose files are AES-GCM boxes under the server's
    secret, with nothing of the files in clear; the ensemble then serves with that adapter."""
    prompt = unique("Name a primary colour.")
    result = raw.infer(
        "prompt_cache",
        [
            tensor("text_input", prompt),
            tensor("max_tokens", MAX_TOKENS),
            tensor("lora_name", "brief"),
        ],
        headers={"authorization": f"Bearer {served.keys['acme']}"},
    )
    data = result.as_numpy("ENVELOPE").reshape(-1)[0]
    assert Envelope.decode(data[SEAL_CHARS:]).request.lora_digest  # resolved: a real plan
    plan = raw.infer("lora_cache", [tensor("ENVELOPE", data), tensor("LOOKUP_STATUS", "miss")])
    assert plan.as_numpy("LORA_TIER").reshape(-1)[0].decode() != "engine"  # files are sent
    config, weights = adapter_files("brief")
    sent_config = plan.as_numpy("LORA_CONFIG").reshape(-1)[0]
    sent_weights = plan.as_numpy("LORA_WEIGHTS").reshape(-1)[0]
    assert sent_config.startswith(b"tcbox2") and sent_weights.startswith(b"tcbox2")
    assert len(sent_weights) == len(weights) + OVERHEAD  # the box's header and tag: nothing else
    for clear, sent in ((config.encode(), sent_config), (weights, sent_weights)):
        assert not any(clear[i : i + 32] in sent for i in range(0, len(clear) - 32, 4096))
    assert b"target_modules" not in sent_config and b"lora_A" not in sent_weights
    with client(served) as acme:
        served_text = acme.generate_text(prompt, max_tokens=MAX_TOKENS, lora_name="brief")
    assert served_text.cache_status == "miss" and served_text.text


def test_the_engine_loads_adapter_files_only_under_their_own_digest(served: Served) -> None:
    """Even sealed (as a compromised stage with the server's secret could), files sent under
    another version's identity are refused: the engine recomputes the digest."""
    sealer = open_sealer(served.state_dir)
    config, weights = adapter_files("french")
    caps_config, caps_weights = adapter_files("caps")
    caps = AdapterRef("caps", 77, adapter_digest(caps_config.encode(), caps_weights))
    values = {"LORA_OP": "load", "LORA": caps.to_json(), "LORA_CONFIG": config}
    values_with_weights: dict[str, str | bytes] = {**values, "LORA_WEIGHTS": weights}
    seal = seal_tensors(sealer, ENGINE_LABEL, ENGINE_INPUTS, dict(values_with_weights))
    inputs = [tensor(k, v, batched=False) for k, v in values_with_weights.items()]
    inputs.append(tensor("ENGINE_SEAL", seal, batched=False))
    _, error = stream_outcome(served, "torch_llm", inputs)
    assert forbidden(error) and "do not match its digest" in (error or "")


# -- an untrusted Redis -----------------------------------------------------------------------


def forged_total(served: Served, what: str) -> float:
    return metric_value(served, "tiercache_redis_forged_total", what=what)  # type: ignore[arg-type]


def wait_for(condition: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def test_forged_l3_entries_are_never_served(
    raw: grpcclient.InferenceServerClient, served: Served, store: redis.Redis
) -> None:
    """An attacker writes answers straight into Redis for a request nobody asked yet: an
    unsigned entry, and a real signed entry copied from another key. Neither is served (nor
    copied into L2); each read is counted as forged."""
    with client(served) as acme:
        donor = acme.generate_text(unique("Name a river."), max_tokens=MAX_TOKENS)
    assert donor.cache_status == "miss"
    entries = [k for k in store.scan_iter(f"{REDIS_PREFIX}e:*")]
    assert entries, "the donor's answer is not in L3"
    signed_copy = store.get(entries[0])
    before = forged_total(served, "redis_values")
    for forged_value in (encode_entry(CacheEntry("FORGED ANSWER", time.time())), signed_copy):
        prompt = unique("What is the tallest mountain?")
        _, victim = sealed_envelope_of(raw, served, prompt)
        assert victim.digest is not None
        store.set(f"{REDIS_PREFIX}e:{victim.digest}", forged_value)  # type: ignore[arg-type]
        with client(served) as acme:
            answer = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
        assert answer.cache_status == "miss" and "FORGED" not in answer.text
        assert answer.text != donor.text
    assert wait_for(lambda: forged_total(served, "redis_values") >= before + 2)


def test_forged_invalidations_wipe_nothing(
    raw: grpcclient.InferenceServerClient, served: Served, store: redis.Redis
) -> None:
    """Unsigned invalidations published and recorded straight into Redis, aimed at a cached
    answer (its key and its tenant, both read from the attacker's own envelope): ignored and
    counted; the answer stays."""
    prompt = unique("How many legs has a spider?")
    with client(served) as acme:
        first = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
    _, victim = sealed_envelope_of(raw, served, prompt)
    assert victim.status is CacheStatus.EXACT and victim.digest
    before = forged_total(served, "invalidations")
    now = time.time() + 60
    aimed = (
        (InvalidationKind.KEY, str(victim.digest)),
        (InvalidationKind.TENANT, victim.request.tenant_scope),
    )
    for kind, value in aimed:
        store.publish(f"{REDIS_PREFIX}invalidations", Invalidation(kind, value, now).to_json())
        store.zadd(f"{REDIS_PREFIX}invalidated", {f"{kind.value}:{value}": now})
    assert wait_for(lambda: forged_total(served, "invalidations") >= before + 2)
    with client(served) as acme:
        again = acme.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert (again.cache_status, again.text) == ("exact", first.text)


def test_forged_semantic_rows_are_refused(served: Served, store: redis.Redis) -> None:
    before = forged_total(served, "semantic_rows")
    vector = (np.ones(DIMENSIONS, dtype=np.float32) / np.sqrt(DIMENSIONS)).tobytes()
    fields = {"m": json.dumps({"scope": "s", "digest": "0" * 64, "prompt": "x"}), "v": vector}
    store.xadd(f"{REDIS_PREFIX}semantic", fields)  # type: ignore[arg-type]
    assert wait_for(lambda: forged_total(served, "semantic_rows") >= before + 1)


def test_the_secret_is_not_in_redis_and_a_replica_with_another_refuses_to_start(
    served: Served, store: redis.Redis, tmp_path: Path
) -> None:
    secret = (served.state_dir / "secret").read_bytes()
    keys = list(store.scan_iter(f"{REDIS_PREFIX}*"))
    assert f"{REDIS_PREFIX}secret_fingerprint".encode() in keys
    assert f"{REDIS_PREFIX}secret".encode() not in keys
    for key in keys:
        if store.type(key) == b"string":
            assert secret not in (store.get(key) or b""), key
    config = CacheConfig(
        state_dir=str(tmp_path / "other"), redis_url=served.redis_url, redis_prefix=REDIS_PREFIX
    )
    with pytest.raises(ConfigError, match="secret"):
        open_exact_cache(config)  # what every Redis stage runs at its start


# -- bounded inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tenant", "t" * 100_000),
        ("cache_control", "no-store " * 10_000),
        ("stop", ["stop"] * 10_000),
        ("prompt", "x" * 4_000_000),
    ],
)
def test_oversized_inputs_are_refused_alone(served: Served, field: str, value: Any) -> None:
    with client(served) as acme:
        kwargs: dict[str, Any] = {"max_tokens": MAX_TOKENS}
        prompt = "hello"
        if field == "prompt":
            prompt = value
        elif field == "stop":
            kwargs["stop_words"] = value
        else:
            kwargs[field] = value
        with pytest.raises((InvalidRequestError, ForbiddenError)) as refused:
            acme.generate_text(prompt, **kwargs)
        assert len(str(refused.value)) < 2_000  # the value is not echoed back whole
        assert acme.generate_text(unique("Still there?"), max_tokens=2).cache_status == "miss"


# -- no side channels for padded tenants ------------------------------------------------------


def test_a_padded_tenant_cannot_tell_a_hit_from_a_miss(served: Served) -> None:
    """The untrusted tenant's miss and hit of one prompt, and a prompt sharing its prefix, all
    look the same: status "masked", no similarity, KV or speculated token counts or finish
    reason, one chunk, and never before the padding floor. A trusted tenant still sees the real
    statuses."""
    prompt = unique("List three kinds of cloud, briefly.")
    with client(served, "public") as public:
        outcomes = [
            public.generate_text(p, max_tokens=MAX_TOKENS)
            for p in (prompt, prompt, prompt + " And one more.")
        ]
    shapes = {
        (
            o.cache_status,
            o.similarity,
            o.kv_reused_tokens,
            o.kv_computed_tokens,
            o.speculated_tokens,  # drafts from its cached answers would tell as well
            o.finish_reason,
        )
        for o in outcomes
    }
    assert shapes == {("masked", None, None, None, None, None)}
    assert {o.chunks for o in outcomes} == {1}
    assert all(o.latency_s >= PADDING_MS / 1000 for o in outcomes)
    assert outcomes[0].text == outcomes[1].text
    with client(served, "acme") as acme:
        seen = [acme.generate_text(prompt, max_tokens=MAX_TOKENS).cache_status for _ in (1, 2)]
    assert seen == ["miss", "exact"]  # acme is another tenant: its own miss, then its hit


def test_a_padded_tenant_calling_prompt_cache_directly_learns_nothing(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    """prompt_cache is the edge: anyone may call it. For a padded tenant it does not look the
    request up (llm does, behind its padding), so a direct call of a prompt the tenant has
    cached says `miss`, carries no text and asks embedding_cache for no semantic lookup; the
    ensemble still answers it, padded and masked (llm serves the stored answer when it finds
    one). A trusted tenant's hit is still found at the edge."""
    prompt = unique("Name two rivers, briefly.")
    with client(served, "public") as public:
        first = public.generate_text(prompt, max_tokens=MAX_TOKENS)
        again = public.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert first.text == again.text and again.cache_status == "masked"
    result = raw.infer(
        "prompt_cache",
        [tensor("text_input", prompt), tensor("max_tokens", MAX_TOKENS)],
        headers={"authorization": f"Bearer {served.keys['public']}"},
    )
    data = result.as_numpy("ENVELOPE").reshape(-1)[0]
    envelope = Envelope.decode(data[SEAL_CHARS:])
    assert envelope.status.value == "miss" and not envelope.semantic_lookup
    assert result.as_numpy("CACHED_TEXT").reshape(-1)[0] == b""
    acme = raw.infer(  # a trusted tenant's own hit is still found at the edge
        "prompt_cache",
        [tensor("text_input", prompt), tensor("max_tokens", MAX_TOKENS)],
        headers={"authorization": f"Bearer {served.keys['acme']}"},
    )
    acme_status = Envelope.decode(acme.as_numpy("ENVELOPE").reshape(-1)[0][SEAL_CHARS:]).status
    assert acme_status.value == "miss"  # acme never asked it: another tenant's scope
    with client(served, "acme") as trusted:
        trusted.generate_text(prompt, max_tokens=MAX_TOKENS)
    acme = raw.infer(
        "prompt_cache",
        [tensor("text_input", prompt), tensor("max_tokens", MAX_TOKENS)],
        headers={"authorization": f"Bearer {served.keys['acme']}"},
    )
    assert Envelope.decode(acme.as_numpy("ENVELOPE").reshape(-1)[0][SEAL_CHARS:]).status.value == (
        "exact"
    )


# the ensemble's hand-over from embedding_cache and lora_cache to llm: (stage output, llm input)
TO_LLM = (
    ("ANSWER_TEXT", "CACHED_TEXT"),
    ("ANSWER_STATUS", "LOOKUP_STATUS"),
    *((name, name) for name in ("SIMILARITY", "EMBEDDING", "ANSWER_SEAL", "ANSWER_TOKENS")),
    *((name, name) for name in ("NEIGHBOURS", "HIT_TRUST")),
)
LORA_TO_LLM = tuple((n, n) for n in ("LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT", "LORA_SEAL"))


def handed_on(
    result: grpcclient.InferResult, names: tuple[tuple[str, str], ...]
) -> list[grpcclient.InferInput]:
    """A stage's outputs as the ensemble hands them to the next stage's inputs, unchanged."""
    inputs = []
    for output, name in names:
        array = result.as_numpy(output)
        t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        inputs.append(t)
    return inputs


def test_a_revoked_keys_kept_envelopes_are_refused(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    """A caller keeps what each stage sealed for its own request (the envelope from the edge,
    embedding_cache's answer, lora_cache's plan for an adapter) and replays them by hand: llm
    generates while the key is valid; once it is revoked, every stage that acts on the envelope
    refuses it (embedding_cache's lookup, lora_cache's plan, llm's generation), within a second
    (the key file's reload check)."""
    keys_file = served.state_dir.parent / "api_keys.json"
    key, grant = add_key(keys_file, "acme")
    time.sleep(2.0)  # each stage looks at the key file at most once a second
    result = raw.infer(
        "prompt_cache",
        [
            tensor("text_input", unique("Name a revoked key's colour.")),
            tensor("max_tokens", MAX_TOKENS),
            tensor("lora_name", "brief"),
        ],
        headers={"authorization": f"Bearer {key}"},
    )
    data = result.as_numpy("ENVELOPE").reshape(-1)[0]
    assert Envelope.decode(data[SEAL_CHARS:]).key == grant.key_hash
    lookup = [tensor("ENVELOPE", data), tensor("CACHED_TEXT", "")]
    planned = [tensor("ENVELOPE", data), tensor("LOOKUP_STATUS", "miss")]
    answer = raw.infer("embedding_cache", lookup)
    assert answer.as_numpy("ANSWER_STATUS").reshape(-1)[0] == b"miss"
    plan = raw.infer("lora_cache", planned)
    to_llm = [tensor("ENVELOPE", data), *handed_on(answer, TO_LLM), *handed_on(plan, LORA_TO_LLM)]
    responses, error = stream_outcome(served, "llm", to_llm)
    assert error is None and responses  # the replay is generated while the key is valid
    assert revoke_key(keys_file, grant.key_id)
    time.sleep(2.0)  # each stage looks at the key file at most once a second
    revoked = "the API key that sent this request has been revoked"
    for _ in range(3):  # whichever of embedding_cache's instances answers refuses it
        message = unary_error(raw, "embedding_cache", lookup)
        assert forbidden(message) and revoked in message
    message = unary_error(raw, "lora_cache", planned)
    assert forbidden(message) and revoked in message
    responses, error = stream_outcome(served, "llm", to_llm)
    assert forbidden(error) and revoked in (error or "") and not responses
