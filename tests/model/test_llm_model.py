"""model_repository/llm/1/model.py with its default engine (torch_llm over BLS) against the pb_utils
stand-in. llm is internal: it acts only on what the ensemble's earlier stages sealed (the
envelope, embedding_cache's answer, lora_cache's adapter files); an unsealed or altered request
is refused alone, nothing generated or stored for it, and the rest of its batch is served. Its
engine calls carry ENGINE_SEAL, which the fake torch_llm checks as torch_llm does."""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import seals

from tiercache.adapter_types import AdapterRef, adapter_digest, not_in_engine_message
from tiercache.engine.adapter_call import adapter_ref
from tiercache.errors import Forbidden
from tiercache.exact.answer_ids import AnswerRef, ServedAs
from tiercache.exact.keys import Digest
from tiercache.exact.request import GenerationRequest
from tiercache.exact.tenant_keys import RELOAD_CHECK_S, add_key, revoke_key
from tiercache.lora.registry import CONFIG_FILE, WEIGHTS_FILE
from tiercache.semantic.entry_trust import read_trust, verification_stamp
from tiercache.stages.envelope import Envelope, issued_now
from tiercache.stages.seal import Sealer
from tiercache.stages.transport import AdapterCipher
from tiercache.vocabulary import CacheStatus
from tiercache_dev import pb_utils_stub

WAIT_S = 30
ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
TENANT, OTHER_TENANT = "a" * 64, "b" * 64


def adapter(name: str, task_id: int) -> tuple[AdapterRef, dict[str, str | bytes]]:
    """A packaged adapter's version and the tensors lora_cache sends llm for a load."""
    config, weights = (ADAPTERS / name / CONFIG_FILE), (ADAPTERS / name / WEIGHTS_FILE)
    ref = AdapterRef(name, task_id, adapter_digest(config.read_bytes(), weights.read_bytes()))
    files: dict[str, str | bytes] = {
        "LORA_CONFIG": config.read_text(),
        "LORA_WEIGHTS": weights.read_bytes(),
        "LORA_EVICT": "[]",
    }
    return ref, files


class FakeTorchLlm:
    """torch_llm behind BLS: checks each call as torch_llm does (ENGINE_SEAL, the envelope's seal,
    the adapter files against their digest), records it, answers "Hello there"."""

    def __init__(self, pb_utils: ModuleType, sealer: Sealer) -> None:
        self.pb = pb_utils
        self.sealer = sealer
        self.calls: list[tuple[Any, GenerationRequest | None]] = []
        self.finish_reason = "stop"  # what its final response says (content_filter: a refusal)

    def __call__(self, request: Any) -> list[Any]:
        assert request.kwargs["model_name"] == "torch_llm"
        self.calls.append(seals.engine_call(self.sealer, request))
        pb = self.pb

        def out(name: str, value: str | int) -> Any:
            if isinstance(value, str):
                return pb.Tensor(name, np.array([value.encode()], dtype=np.object_))
            return pb.Tensor(name, np.array([value], dtype=np.int32))

        final = [out("TEXT", " there"), out("FINISH_REASON", self.finish_reason)]
        final.append(out("GENERATED_TOKENS", 2))
        final += [out("PROMPT_TOKENS", 3), out("REUSED_TOKENS", 0), out("COMPUTED_TOKENS", 3)]
        final.append(out("SPECULATED_TOKENS", 1))
        final.append(pb.Tensor("MEAN_LOGPROB", np.array([-0.25], dtype=np.float32)))
        final.append(pb.Tensor("ENGINE_S", np.array([2.0**-20], dtype=np.float32)))
        return [pb.InferenceResponse([out("TEXT", "Hello")]), pb.InferenceResponse(final)]


Sender = pb_utils_stub.ResponseSender


@pytest.fixture
def sealer(tmp_path: Path) -> Sealer:
    """The deployment's sealer (llm's state_dir is tmp_path)."""
    return seals.sealer_for(tmp_path)


@pytest.fixture
def cipher(tmp_path: Path) -> AdapterCipher:
    """The deployment's adapter cipher (lora_cache's and llm's)."""
    return seals.cipher_for(tmp_path)


@pytest.fixture
def engine(pb_utils: ModuleType, sealer: Sealer, monkeypatch: pytest.MonkeyPatch) -> FakeTorchLlm:
    # the fake's check imports torch_llm (peft, transformers: seconds), done here, before any
    # test's clock starts (a test run alone took them inside its first engine call)
    importlib.import_module("tiercache.stages.torch_llm")
    fake = FakeTorchLlm(pb_utils, sealer)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "torch_llm", fake)
    return fake


@pytest.fixture
def model(
    load_model: Callable[[str], ModuleType], tmp_path: Path, engine: FakeTorchLlm
) -> Iterator[Any]:
    instance = start_llm(load_model, tmp_path)
    yield instance
    instance.finalize()


def start_llm(load_model: Callable[[str], ModuleType], state: Path, **params: str) -> Any:
    """The llm model initialized on the state folder `state` with `params`."""
    instance = load_model("llm").TritonPythonModel()
    values = {"state_dir": str(state), **params}
    config = {"parameters": {k: {"string_value": v} for k, v in values.items()}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "llm"})
    return instance


def run(pb_utils: ModuleType, model: Any, batch: list[list[Any]]) -> list[list[Any]]:
    return pb_utils_stub.execute_decoupled(model, batch, WAIT_S)


def text_tensor(pb_utils: ModuleType, name: str, value: str | bytes) -> Any:
    data = value.encode() if isinstance(value, str) else value
    return pb_utils.Tensor(name, np.array([[data]], dtype=np.object_))


def to_llm(
    pb_utils: ModuleType,
    sealer: Sealer,
    envelope: bytes,
    text: str = "",
    status: str = "miss",
    similarity: float = 0.0,
    lora: dict[str, str | bytes] | None = None,
    answer_seal: str | None = None,
    lora_seal: str | None = None,
    cipher: AdapterCipher | None = None,
    tokens: tuple[int, int, int] = (0, 0, 0),
    neighbours: tuple[str, ...] = (),
    trust: tuple[float, bool] = (0.0, False),
) -> list[Any]:
    """llm's inputs as the ensemble hands them on: the envelope, embedding_cache's answer with
    its ANSWER_SEAL and, past a hit, lora_cache's adapter tensors `lora` (in clear; closed with
    `cipher` as lora_cache closes them) with their LORA_SEAL (`answer_seal` / `lora_seal`:
    another seal, "" for none)."""
    tensors = seals.llm_answer(
        sealer,
        envelope,
        text,
        status,
        similarity,
        seal=answer_seal,
        tokens=tokens,
        neighbours=neighbours,
        trust=trust,
    )
    if status in (CacheStatus.EXACT, CacheStatus.SEMANTIC):
        return tensors
    lora = lora or {"LORA_CONFIG": "", "LORA_WEIGHTS": b"", "LORA_EVICT": ""}
    if cipher is not None:
        lora = seals.closed_lora(cipher, envelope, lora)  # type: ignore[assignment]
    tensors += [text_tensor(pb_utils, name, value) for name, value in lora.items()]
    if lora_seal is None:
        lora_seal = seals.lora_seal(sealer, envelope, lora)
    if lora_seal:
        tensors.append(text_tensor(pb_utils, "LORA_SEAL", lora_seal))
    return tensors


def with_input(inputs: list[Any], name: str, value: Any) -> list[Any]:
    """`inputs` with `name`'s value replaced, every seal kept as it was."""
    (old,) = [t for t in inputs if t.name() == name]
    dtype = old.as_numpy().dtype
    if dtype == np.object_ and isinstance(value, str):
        value = value.encode()
    new = type(old)(name, np.array([[value]], dtype=dtype))
    return [new if t is old else t for t in inputs]


def final(pb_utils: ModuleType, responses: list[Any]) -> tuple[str, str]:
    """(the answer's text, its CACHE_STATUS); fails on an error response."""
    (response,) = responses
    assert not response.has_error(), response.error().message()
    names = {t.name(): t.as_numpy().reshape(-1)[0] for t in response.output_tensors()}
    return names["TEXT_OUTPUT"].decode(), names["CACHE_STATUS"].decode()


def assert_forbidden(pb_utils: ModuleType, responses: list[Any], fragment: str) -> None:
    (response,) = responses
    assert response.has_error(), "served"
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message().startswith("forbidden: ")
    assert fragment in response.error().message()


def counted(model: Any) -> dict[str, float]:
    model.stage.metrics.flush()
    return {k: c.metric.value() for k, c in model.stage.requests.items() if c.metric.value()}


def envelope(
    sealer: Sealer,
    status: CacheStatus,
    digest: str,
    cached_text: str = "",
    request: GenerationRequest | None = None,
    tokens: tuple[int, int, int] = (0, 0, 0),
    **fields: Any,
) -> bytes:
    """prompt_cache's sealed envelope for a request of TENANT (`cached_text`: an exact hit's,
    `tokens` its stored token counts)."""
    request = request or GenerationRequest("What is Triton?", tenant_scope=TENANT)
    sent = Envelope(request=request, status=status, digest=Digest(digest), **fields)
    return seals.sealed(sealer, sent, cached_text, tokens)


def test_a_hit_is_served_only_with_embedding_cache_s_seal(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """A hit called directly (no ANSWER_SEAL), a miss turned into an exact hit with planted
    text, a semantic hit's sealed answer moved onto another tenant's envelope, a semantic hit
    whose similarity was raised, and an exact hit's text in embedding_cache's answer, sealed
    (no stage sends one that way: it comes from prompt_cache): each refused alone; the good
    hit, handed on as the ensemble does (`seals.llm_exact`), is served."""
    exact = CacheStatus.EXACT
    hit = envelope(sealer, exact, "1" * 64, "the answer")
    good = seals.llm_exact(hit, "the answer")
    other = envelope(
        sealer,
        CacheStatus.MISS,
        "2" * 64,
        semantic_scope="s" * 64,
        request=GenerationRequest("What is Triton?", tenant_scope=OTHER_TENANT),
    )
    miss = envelope(sealer, CacheStatus.MISS, "3" * 64, write_back=True)
    planted = with_input(to_llm(pb_utils, sealer, miss), "LOOKUP_STATUS", "exact")
    semantic = envelope(sealer, CacheStatus.MISS, "4" * 64, semantic_scope="s" * 64)
    near = to_llm(pb_utils, sealer, semantic, "close enough", "semantic", similarity=0.7)
    batch = [
        to_llm(pb_utils, sealer, hit, "the answer", exact, answer_seal=""),
        with_input(planted, "CACHED_TEXT", "planted"),
        with_input(near, "ENVELOPE", other),
        with_input(near, "SIMILARITY", np.float32(0.99)),
        to_llm(pb_utils, sealer, hit, "the answer", exact),
        good,
    ]
    unsealed, *forged, text_in_answer, served = run(pb_utils, model, batch)
    assert_forbidden(pb_utils, unsealed, "embedding_cache's answer is not sealed")
    for responses in forged:
        assert_forbidden(pb_utils, responses, "embedding_cache's answer's seal does not verify")
    assert_forbidden(pb_utils, text_in_answer, "comes from prompt_cache (EXACT_TEXT)")
    assert final(pb_utils, served) == ("the answer", "exact")
    assert engine.calls == []
    assert counted(model) == {"exact": 1, "error": 2 + len(forged)}


def test_an_exact_hit_is_served_from_prompt_cache_s_text_only_as_its_envelope_sealed_it(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """The ensemble hands llm an exact hit's text and token counts from prompt_cache (EXACT_TEXT,
    EXACT_TOKENS) beside embedding_cache's empty, unsealed pass-through: served with its
    counts when the envelope's seal verifies over them; another text, other counts, a text on
    a miss's envelope, an envelope sealed with a text that is not an exact hit's: each
    refused alone. Decoded once for inputs equal byte for byte (`LlmStage.known_hit`), the
    forgeries after that still refused; and the pass-through without the text is no answer."""
    exact = CacheStatus.EXACT
    hit = envelope(sealer, exact, "1" * 64, "the answer", tokens=(7, 3, 1))
    good = seals.llm_exact(hit, "the answer", (7, 3, 1))
    miss = envelope(sealer, CacheStatus.MISS, "3" * 64, write_back=True)
    # an envelope sealed with a text but saying miss (no stage makes one; refused all the same)
    odd = envelope(sealer, CacheStatus.MISS, "4" * 64, "the answer", tokens=(7, 3, 1))

    def counts(values: list[int]) -> list[Any]:
        tokens = type(good[0])("EXACT_TOKENS", np.array([values], dtype=np.int32))
        return [tokens if t.name() == "EXACT_TOKENS" else t for t in good]

    (first,) = run(pb_utils, model, [good])
    names = {t.name(): t.as_numpy().reshape(-1)[0] for t in first[0].output_tensors()}
    assert final(pb_utils, first) == ("the answer", "exact")
    assert (int(names["PROMPT_TOKENS"]), int(names["COMPLETION_TOKENS"])) == (7, 3)
    assert names["FINISH_REASON"].decode() == "length"
    checked = []
    received = model.stage.received_exact
    model.stage.received_exact = lambda *args: checked.append(args) or received(*args)
    batch = [
        good,
        with_input(good, "EXACT_TEXT", "the attacker's answer"),
        counts([7, 3, 0]),
        with_input(good, "ENVELOPE", miss),
        with_input(good, "ENVELOPE", odd),
        [t for t in good if t.name() != "EXACT_TEXT"],
        good,
    ]
    again, *refused, odd_one, bare, third = run(pb_utils, model, batch)
    assert final(pb_utils, again) == final(pb_utils, third) == ("the answer", "exact")
    for responses in refused:
        assert_forbidden(pb_utils, responses, "ENVELOPE's seal does not verify")
    assert_forbidden(pb_utils, odd_one, "not an exact hit's")
    assert_forbidden(pb_utils, bare, "embedding_cache's answer is not sealed")
    assert len(checked) == len(refused) + 1  # the good hit's repeats: taken as decoded before
    assert len(model.stage._hits) == 1  # the good hit only
    assert engine.calls == []
    assert counted(model) == {"exact": 3, "error": len(refused) + 2}


def test_a_repeated_exact_hit_skips_its_seal_check_and_a_forgery_is_still_refused(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """An exact hit that comes through embedding_cache (its stored answer is empty: the engine
    stopped at once) is decoded once for all inputs equal to its own byte for byte
    (`LlmStage.known_hit`): the good hit served again without decoding or checking it again,
    then the same envelope and ANSWER_SEAL with a text, other token counts, another
    similarity, neighbours or a vector added: each decoded and refused as before."""
    exact = CacheStatus.EXACT
    hit = envelope(sealer, exact, "1" * 64, "", tokens=(7, 0, 0))
    good = to_llm(pb_utils, sealer, hit, "", exact, tokens=(7, 0, 0))
    assert final(pb_utils, run(pb_utils, model, [good])[0]) == ("", "exact")
    checked = []
    received = model.stage.received
    model.stage.received = lambda *args: checked.append(args) or received(*args)
    vector = type(good[0])("EMBEDDING", np.ones((1, 4), dtype=np.float32))
    batch = [
        good,
        with_input(good, "CACHED_TEXT", "the attacker's answer"),
        [
            type(t)("ANSWER_TOKENS", np.array([[7, 0, 1]], dtype=np.int32))
            if t.name() == "ANSWER_TOKENS"
            else t
            for t in good
        ],
        with_input(good, "SIMILARITY", np.float32(0.5)),
        with_input(good, "NEIGHBOURS", "a" * 64),
        [vector if t.name() == "EMBEDDING" else t for t in good],
        good,
    ]
    again, *refused, third = run(pb_utils, model, batch)
    assert final(pb_utils, again) == final(pb_utils, third) == ("", "exact")
    for responses in refused:
        assert_forbidden(pb_utils, responses, "embedding_cache's answer's seal does not verify")
    assert len(checked) == len(refused)  # the good hit's repeats: taken as decoded before
    assert engine.calls == []
    assert counted(model) == {"exact": 3, "error": len(refused)}


def test_a_forged_envelope_behind_a_replayed_answer_seal_is_refused_every_time(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """embedding_cache's answer seal binds the envelope's seal, not its body: an envelope (of
    an exact hit with an empty stored answer) whose body was altered after its seal passes that
    check, fails its own, and is never taken as a decoded hit (`LlmStage.remember_hit` opens
    the envelope first), so each replay is refused."""
    exact = CacheStatus.EXACT
    hit = envelope(sealer, exact, "1" * 64, "", tokens=(7, 0, 0))
    forged = hit[:-1] + (b"}" if hit[-1:] != b"}" else b" ")
    good = to_llm(pb_utils, sealer, hit, "", exact, tokens=(7, 0, 0))
    bad = with_input(good, "ENVELOPE", forged)
    first, second, served = run(pb_utils, model, [bad, bad, good])
    for responses in (first, second):
        assert_forbidden(pb_utils, responses, "ENVELOPE's seal does not verify")
    assert final(pb_utils, served) == ("", "exact")
    assert len(model.stage._hits) == 1  # the good hit only
    assert engine.calls == []
    # an envelope of megabytes (a direct call) is refused before any seal's HMAC reads it
    (huge,) = run(pb_utils, model, [with_input(good, "ENVELOPE", b"{" + b" " * (1 << 20))])
    (response,) = huge
    assert response.has_error() and "over 1048576" in response.error().message()


def test_a_miss_is_generated_only_with_its_envelope_and_adapter_sealed(
    pb_utils: ModuleType, model: Any, sealer: Sealer, cipher: AdapterCipher, engine: FakeTorchLlm
) -> None:
    """A miss called directly, a no-store miss turned write_back, a miss moved to another
    tenant's scope, a miss whose LORA_WEIGHTS were swapped, one without LORA_SEAL, one whose
    adapter files came in clear, and one whose files were closed for another request: each
    refused alone, nothing generated or stored for it; the good miss is generated (its engine
    call sealed, its adapter files the version it names, opened) and stored."""
    french, files = adapter("french", 1)
    _, caps_files = adapter("caps", 2)
    on_french = GenerationRequest(
        "Bonjour?",
        lora_name="french",
        lora_task_id=french.task_id,
        lora_digest=french.digest,
        tenant_scope=TENANT,
    )
    miss = CacheStatus.MISS

    def sent(digest: str, write_back: bool = True) -> bytes:
        return envelope(sealer, miss, digest, request=on_french, write_back=write_back)

    def sealed_as_sent(data: bytes, lora: dict[str, Any]) -> list[Any]:
        """`lora` as it is, with a LORA_SEAL over it that verifies (a stage's bug, or a key
        leak of the seal alone): only the files' own encryption stands in the way."""
        return to_llm(
            pb_utils, sealer, data, lora=lora, lora_seal=seals.lora_seal(sealer, data, lora)
        )

    digests = [c * 64 for c in "12345678"]
    d_direct, d_store, d_tenant, d_weights, d_lora, d_clear, d_moved, d_good = digests
    closed = {"cipher": cipher}
    direct = to_llm(
        pb_utils, sealer, sent(d_direct), lora=files, answer_seal="", lora_seal="", **closed
    )
    no_store = sent(d_store, write_back=False)
    flipped = seals.altered(no_store, b'"write_back":false', b'"write_back":true')
    moved = seals.altered(sent(d_tenant), TENANT.encode(), OTHER_TENANT.encode())
    swapped = to_llm(pb_utils, sealer, sent(d_weights), lora=files, **closed)
    other_request = seals.closed_lora(cipher, sent(d_good), files)
    batch = [
        direct,
        to_llm(pb_utils, sealer, flipped, lora=files, **closed),
        to_llm(pb_utils, sealer, moved, lora=files, **closed),
        with_input(swapped, "LORA_WEIGHTS", caps_files["LORA_WEIGHTS"]),
        to_llm(pb_utils, sealer, sent(d_lora), lora=files, lora_seal="", **closed),
        sealed_as_sent(sent(d_clear), files),
        sealed_as_sent(sent(d_moved), other_request),
        to_llm(pb_utils, sealer, sent(d_good), lora=files, **closed),
    ]
    *refused, served = run(pb_utils, model, batch)
    fragments = [
        "embedding_cache's answer is not sealed",
        "ENVELOPE's seal does not verify",
        "ENVELOPE's seal does not verify",
        "lora_cache's adapter tensors's seal does not verify",
        "lora_cache's adapter tensors is not sealed",
        "LORA_CONFIG is not an adapter box of this deployment",
        "LORA_CONFIG does not open",
    ]
    for responses, fragment in zip(refused, fragments, strict=True):
        assert_forbidden(pb_utils, responses, fragment)
    assert final(pb_utils, served) == ("Hello there", "miss")
    model.stage.core.drain()  # the good answer is stored
    ((order, request),) = engine.calls  # the good miss's call alone reached the engine
    assert request == on_french and order.weights.ref == french
    cache = model.stage.core.cache
    assert cache.get(d_good).entry.text == "Hello there"
    assert [d for d in digests if cache.get(d) is not None] == [d_good]
    assert counted(model) == {"miss": 1, "error": len(refused)}


class AdapterEngine(FakeTorchLlm):
    """torch_llm holding adapters: a call with an adapter's files loads it, a call without them
    for one it does not hold is refused as torch_llm refuses it. The first call that carries
    files is taken only after another call came (or WAIT_S): the request that carried them
    reaching the engine after one lora_cache planned after it, without files."""

    def __init__(self, pb_utils: ModuleType, sealer: Sealer) -> None:
        super().__init__(pb_utils, sealer)
        self.held: set[AdapterRef] = set()
        self.refused: list[AdapterRef] = []
        self._lock = threading.Lock()
        self._holding_back = False
        self._other_came = threading.Event()

    def __call__(self, request: Any) -> list[Any]:
        order, call = seals.engine_call(self.sealer, request)
        with self._lock:
            first = order.weights is not None and not self._holding_back
            self._holding_back = self._holding_back or first
        if first:
            self._other_came.wait(WAIT_S)
        else:
            self._other_came.set()
        ref = adapter_ref(call) if call is not None else None
        with self._lock:
            if order.weights is not None:
                self.held.add(order.weights.ref)
            elif ref is not None and ref not in self.held:
                self.refused.append(ref)
                error = self.pb.TritonError(not_in_engine_message(ref))
                return [self.pb.InferenceResponse([], error=error)]
        return super().__call__(request)


def test_an_adapter_s_files_go_with_a_later_request_that_reaches_the_engine_first(
    pb_utils: ModuleType,
    model: Any,
    sealer: Sealer,
    cipher: AdapterCipher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lora_cache sends an adapter's files with the first request it plans for it and none
    with the next; when the next one's engine call comes first, it carries the files the first
    one brought (docs/lora.md "Where the weights can fall behind"): the engine refuses
    nothing, no files are fetched again, and llm keeps no files once the engine took them."""
    engine = AdapterEngine(pb_utils, sealer)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "torch_llm", engine)
    french, files = adapter("french", 1)

    def sent(prompt: str, digest: str) -> bytes:
        request = GenerationRequest(
            prompt,
            lora_name="french",
            lora_task_id=french.task_id,
            lora_digest=french.digest,
            tenant_scope=TENANT,
        )
        return envelope(sealer, CacheStatus.MISS, digest, request=request, write_back=True)

    first = to_llm(pb_utils, sealer, sent("Bonjour?", "1" * 64), lora=files, cipher=cipher)
    after = to_llm(pb_utils, sealer, sent("Salut?", "2" * 64))  # planned as loaded: no files
    served = run(pb_utils, model, [first, after])
    assert [final(pb_utils, r) for r in served] == [("Hello there", "miss")] * 2
    assert engine.refused == []
    assert [order.weights.ref for order, _ in engine.calls] == [french, french]
    assert model.stage.engine.unconfirmed() == 0


def test_llm_keeps_few_adapters_files_for_the_engine(model: Any) -> None:
    """What `expect` keeps is bounded: the newest MAX_UNCONFIRMED_ADAPTERS adapters, within
    MAX_UNCONFIRMED_BYTES, none larger than that alone, and nothing for the base model."""
    from tiercache.engine.adapter_call import EngineLora
    from tiercache.stages import llm

    engine = model.stage.engine

    def on(task_id: int) -> GenerationRequest:
        return GenerationRequest("q", lora_name="a", lora_task_id=task_id, lora_digest="d" * 64)

    files = EngineLora("{}", b"w" * 10)
    engine.expect(GenerationRequest("q"), files)
    assert engine.unconfirmed() == 0
    for task_id in range(1, llm.MAX_UNCONFIRMED_ADAPTERS + 3):
        engine.expect(on(task_id), files)
    assert engine.unconfirmed() == llm.MAX_UNCONFIRMED_ADAPTERS
    huge = EngineLora("{}", b"w" * llm.MAX_UNCONFIRMED_BYTES)
    engine.expect(on(99), huge)
    assert engine.unconfirmed() == llm.MAX_UNCONFIRMED_ADAPTERS
    half = EngineLora("{}", b"w" * (llm.MAX_UNCONFIRMED_BYTES // 2))
    engine.expect(on(100), half)
    engine.expect(on(101), half)  # two halves and their configs pass the bound: the newest stays
    assert engine.unconfirmed() == 1


def finish(responses: list[Any]) -> str:
    (response,) = responses
    tensor = pb_utils_stub.get_output_tensor_by_name(response, "FINISH_REASON")
    return str(tensor.as_numpy().reshape(-1)[0].decode())


def counts(responses: list[Any]) -> tuple[int, int] | None:
    """The final response's (PROMPT_TOKENS, COMPLETION_TOKENS); None when it has none."""
    (response,) = responses
    assert not response.has_error(), response.error().message()
    names = {t.name(): int(t.as_numpy().reshape(-1)[0]) for t in response.output_tensors()
             if t.name() in ("PROMPT_TOKENS", "COMPLETION_TOKENS")}  # fmt: skip
    return None if not names else (names["PROMPT_TOKENS"], names["COMPLETION_TOKENS"])


def test_token_counts_a_miss_reports_and_stores_and_a_hit_reports_as_sealed(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """A miss reports the engine's counts (prompt 3, completion 2) and stores them (and its
    mean log-probability) with its answer; an exact hit reports the counts (and the finish
    reason: `length` when its generation stopped at max_tokens) prompt_cache sealed into its
    envelope, a semantic hit those embedding_cache sealed; counts altered on the way are
    refused."""
    miss = envelope(sealer, CacheStatus.MISS, "a" * 64, write_back=True)
    (generated,) = run(pb_utils, model, [to_llm(pb_utils, sealer, miss)])
    assert counts(generated) == (3, 2)
    model.stage.core.drain()
    stored = model.stage.core.cache.get("a" * 64).entry
    assert (stored.prompt_tokens, stored.generated_tokens) == (3, 2)
    assert stored.mean_logprob == -0.25  # the engine's MEAN_LOGPROB, stored with the answer
    assert stored.generation_s == 2.0**-20  # its ENGINE_S (under the call): not its queueing

    exact = CacheStatus.EXACT
    hit = envelope(sealer, exact, "b" * 64, "the answer", tokens=(31, 12, 1))
    good = seals.llm_exact(hit, "the answer", (31, 12, 1))
    semantic = envelope(sealer, CacheStatus.MISS, "c" * 64, semantic_scope="s" * 64)
    near = to_llm(pb_utils, sealer, semantic, "close", "semantic", 0.9, tokens=(40, 7, 0))
    forged = [t for t in good if t.name() != "EXACT_TOKENS"]
    forged.append(pb_utils.Tensor("EXACT_TOKENS", np.array([[31, 12, 0]], dtype=np.int32)))
    forged_near = [t for t in near if t.name() != "ANSWER_TOKENS"]
    forged_near.append(pb_utils.Tensor("ANSWER_TOKENS", np.array([[40, 9, 0]], dtype=np.int32)))
    served, near_served, refused, refused_near = run(
        pb_utils, model, [good, near, forged, forged_near]
    )
    assert counts(served) == (31, 12) and counts(near_served) == (40, 7)
    assert finish(served) == "length" and finish(near_served) == "stop"  # as they were stored
    assert_forbidden(pb_utils, refused, "ENVELOPE's seal does not verify")
    assert_forbidden(pb_utils, refused_near, "embedding_cache's answer's seal does not verify")


def test_a_miss_drafts_from_the_neighbours_embedding_cache_sealed(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """The answers under the NEIGHBOURS embedding_cache sealed reach the engine as drafts
    (source `neighbour`; another tenant's answer among them is not passed on), and the final
    response reports the engine's SPECULATED_TOKENS; a NEIGHBOURS list altered on the way (one
    more digest: another tenant's answer) is refused."""
    cache = model.stage.core.cache
    cache.put(Digest("1" * 64), "a neighbour's answer", tenant_scope=TENANT)
    cache.put(Digest("2" * 64), "another tenant's answer", tenant_scope=OTHER_TENANT)
    miss = envelope(sealer, CacheStatus.MISS, "c" * 64, semantic_scope="s" * 64)
    sealed = to_llm(pb_utils, sealer, miss, neighbours=("2" * 64, "1" * 64))
    (answered,) = run(pb_utils, model, [sealed])
    ((_, request),) = engine.calls
    assert request is not None and request.drafts == (("neighbour", "a neighbour's answer"),)
    (final,) = answered
    speculated = pb_utils_stub.get_output_tensor_by_name(final, "SPECULATED_TOKENS")
    assert int(speculated.as_numpy().reshape(-1)[0]) == 1
    forged = [t for t in sealed if t.name() != "NEIGHBOURS"]
    forged.append(text_tensor(pb_utils, "NEIGHBOURS", "2" * 64))
    (refused,) = run(pb_utils, model, [forged])
    assert_forbidden(pb_utils, refused, "embedding_cache's answer's seal does not verify")
    assert len(engine.calls) == 1


def test_a_semantic_hit_with_verify_semantic_is_served_only_as_the_engines_own_answer(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """With cache_control `verify-semantic` (in prompt_cache's sealed envelope) a semantic
    hit goes to the engine as a `verify` draft: served as `verified` when the engine's answer
    is exactly the cached one, else the engine's answer is a miss (and stored); without the
    word the hit is served at once, no engine call."""
    asks = envelope(
        sealer, CacheStatus.MISS, "c" * 64, semantic_scope="s" * 64, verify_semantic=True
    )
    (same,) = run(pb_utils, model, [to_llm(pb_utils, sealer, asks, "Hello there", "semantic")])
    assert final(pb_utils, same) == ("Hello there", "verified")
    ((_, request),) = engine.calls
    assert request is not None and request.drafts[0] == ("verify", "Hello there")
    other = envelope(
        sealer, CacheStatus.MISS, "d" * 64, semantic_scope="s" * 64, verify_semantic=True,
        write_back=True,
    )  # fmt: skip
    (wrong,) = run(pb_utils, model, [to_llm(pb_utils, sealer, other, "Goodbye", "semantic")])
    assert final(pb_utils, wrong) == ("Hello there", "miss")
    stored = model.stage.core.cache.get(Digest("d" * 64))
    assert stored is not None and stored.entry.text == "Hello there"
    plain = envelope(sealer, CacheStatus.MISS, "e" * 64, semantic_scope="s" * 64)
    (served,) = run(pb_utils, model, [to_llm(pb_utils, sealer, plain, "Goodbye", "semantic")])
    assert final(pb_utils, served) == ("Goodbye", "semantic")
    assert len(engine.calls) == 2
    assert counted(model) == {"verified": 1, "miss": 1, "semantic": 1}
    model.stage.metrics.flush()
    outcomes = {k: c.metric.value() for k, c in model.stage.verifications.items()}
    assert outcomes == {"verified": 1, "refuted": 1, "unchecked": 0}


def test_a_hit_the_trust_gate_sends_to_verify_is_checked_and_its_outcome_recorded(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """embedding_cache's trust gate (HIT_TRUST, under its seal) sends a semantic hit to the
    engine to verify without the request's word; the outcome is recorded against the entry
    whose answer was checked, at the gate's score (tiercache.semantic.entry_trust), where the
    gate reads it next. A hit the gate serves goes out at once, its id carrying the score; a
    HIT_TRUST altered in transit is refused."""
    cache = model.stage.core.cache
    right, wrong, served = "5" * 64, "6" * 64, "7" * 64
    asks = envelope(sealer, CacheStatus.MISS, "c" * 64, semantic_scope="s" * 64)
    same = to_llm(
        pb_utils, sealer, asks, "Hello there", "semantic", 0.9, neighbours=(right,),
        trust=(0.75, True),
    )  # fmt: skip
    (verified,) = run(pb_utils, model, [same])
    assert final(pb_utils, verified) == ("Hello there", "verified")
    ((_, request),) = engine.calls
    assert request is not None and request.drafts[0] == ("verify", "Hello there")
    other = envelope(sealer, CacheStatus.MISS, "d" * 64, semantic_scope="s" * 64)
    differs = to_llm(
        pb_utils, sealer, other, "Goodbye", "semantic", 0.9, neighbours=(wrong,),
        trust=(0.625, True),
    )  # fmt: skip
    (refuted,) = run(pb_utils, model, [differs])
    assert final(pb_utils, refuted) == ("Hello there", "miss")

    def recorded(digest: str) -> list[tuple[float, bool, float]]:
        """The entry's outcomes once there (recorded just after the final response)."""
        deadline = time.monotonic() + WAIT_S
        while not (found := read_trust(cache, digest, TENANT).observations):
            assert time.monotonic() < deadline, f"no outcome recorded for {digest[:8]}"
            time.sleep(0.01)
        return found

    assert recorded(right) == [(0.75, True, verification_stamp("c" * 64, right, "Hello there"))]
    assert recorded(wrong) == [(0.625, False, verification_stamp("d" * 64, wrong, "Goodbye"))]
    assert read_trust(cache, right, OTHER_TENANT).observations == []  # the tenant's record
    third = envelope(sealer, CacheStatus.MISS, "e" * 64, semantic_scope="s" * 64)
    trusted = to_llm(
        pb_utils, sealer, third, "Goodbye", "semantic", 0.9, neighbours=(served,),
        trust=(0.875, False),
    )  # fmt: skip
    (at_once,) = run(pb_utils, model, [trusted])
    assert final(pb_utils, at_once) == ("Goodbye", "semantic")
    ref = answer_ref(model, at_once)
    assert ref is not None and (ref.digest, ref.score) == (served, 0.875)
    assert len(engine.calls) == 2 and read_trust(cache, served, TENANT).observations == []
    sampled_request = GenerationRequest(
        "What is Triton?", tenant_scope=TENANT, temperature=0.7, seed=3
    )
    sampled = envelope(
        sealer, CacheStatus.MISS, "f" * 64, request=sampled_request, semantic_scope="s" * 64,
        verify_semantic=True,
    )  # fmt: skip
    drawn = "8" * 64
    checked = to_llm(
        pb_utils, sealer, sampled, "Goodbye", "semantic", 0.9, neighbours=(drawn,),
        trust=(0.75, False),
    )  # fmt: skip
    (refuted_draw,) = run(pb_utils, model, [checked])
    assert final(pb_utils, refuted_draw) == ("Hello there", "miss")  # a draw, not the answer
    assert len(engine.calls) == 3
    time.sleep(0.2)  # an outcome is recorded just after the final response, if at all
    assert read_trust(cache, drawn, TENANT).observations == []  # a draw teaches nothing
    forged = [t for t in same if t.name() != "HIT_TRUST"]
    forged.append(pb_utils.Tensor("HIT_TRUST", np.array([[0.75, 0.0]], dtype=np.float32)))
    (refused,) = run(pb_utils, model, [forged])
    assert_forbidden(pb_utils, refused, "embedding_cache's answer's seal does not verify")
    assert len(engine.calls) == 3


def test_a_failure_to_record_an_outcome_never_fails_the_request(
    pb_utils: ModuleType,
    model: Any,
    sealer: Sealer,
    engine: FakeTorchLlm,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Recording a verification's outcome is extra: when it raises, the verified answer is
    still served and counted, and the failure is logged."""
    import tiercache.stages.llm as llm_stage

    def broken(*args: Any, **kwargs: Any) -> bool:
        raise OSError("the shared tier's disk is full")

    monkeypatch.setattr(llm_stage, "record_outcome", broken)
    asks = envelope(sealer, CacheStatus.MISS, "c" * 64, semantic_scope="s" * 64)
    same = to_llm(
        pb_utils, sealer, asks, "Hello there", "semantic", 0.9, neighbours=("5" * 64,),
        trust=(0.75, True),
    )  # fmt: skip
    (verified,) = run(pb_utils, model, [same])
    assert final(pb_utils, verified) == ("Hello there", "verified")
    model.stage.metrics.flush()
    assert model.stage.verifications["verified"].metric.value() == 1
    deadline = time.monotonic() + WAIT_S  # recorded (and failed) just after the response
    while "recording a verification against" not in caplog.text:
        assert time.monotonic() < deadline, "the failure to record was not logged"
        time.sleep(0.01)


def answer_ref(model: Any, responses: list[Any], tenant: str = TENANT) -> AnswerRef | None:
    """What the final response's ANSWER_ID names, opened as the feedback model opens it (None
    when the response carries no id)."""
    (response,) = responses
    assert not response.has_error(), response.error().message()
    tensor = pb_utils_stub.get_output_tensor_by_name(response, "ANSWER_ID")
    if tensor is None:
        return None
    answer_id = tensor.as_numpy().reshape(-1)[0].decode()
    ref: AnswerRef = model.stage.answer_ids.open(answer_id, tenant)
    return ref


def test_every_answer_is_named_for_feedback_by_the_entry_it_serves(
    pb_utils: ModuleType, model: Any, sealer: Sealer, engine: FakeTorchLlm
) -> None:
    """An exact hit's and a miss's ANSWER_ID name the request's own digest; a semantic hit's
    names the neighbour whose answer it serves (from embedding_cache's sealed NEIGHBOURS) and
    its similarity; each opens only for the tenant it was served to; a request without a digest
    gets none, nor does a generation that is not stored; a repeated exact hit gets a fresh id
    for the same entry. A generation's id is issued once its answer is made (stamped at or
    after the stored entry's time, and sealed as naming an answer made before it), so a
    verdict sent after that answer was generated again does not act on the new one."""
    exact = envelope(sealer, CacheStatus.EXACT, "1" * 64, "the answer")
    hit = seals.llm_exact(exact, "the answer")
    asks = envelope(sealer, CacheStatus.MISS, "2" * 64, semantic_scope="s" * 64)
    near = to_llm(
        pb_utils, sealer, asks, "close enough", "semantic", 0.8125, neighbours=("5" * 64,)
    )
    miss = envelope(sealer, CacheStatus.MISS, "3" * 64, write_back=True)
    unkeyed = Envelope(
        request=GenerationRequest("Hi", tenant_scope=TENANT), status=CacheStatus.MISS
    )
    no_digest = seals.sealed(sealer, unkeyed, "", (0, 0, 0))
    not_stored = envelope(sealer, CacheStatus.MISS, "4" * 64, write_back=False)  # no-store
    batch = [
        hit,
        hit,
        near,
        to_llm(pb_utils, sealer, miss),
        to_llm(pb_utils, sealer, no_digest),
        to_llm(pb_utils, sealer, not_stored),
    ]
    first, again, semantic, generated, anonymous, unstored = run(pb_utils, model, batch)
    # a generation not stored gets none: its digest names whatever else is cached under it
    assert answer_ref(model, unstored) is None
    assert answer_ref(model, first) is not None
    ids = [pb_utils_stub.get_output_tensor_by_name(r[0], "ANSWER_ID") for r in (first, again)]
    assert ids[0].as_numpy()[0] != ids[1].as_numpy()[0]
    hits_and_miss = (
        (first, "1" * 64, ServedAs.CACHED),  # exact hits: made before their ids
        (again, "1" * 64, ServedAs.CACHED),
        (generated, "3" * 64, ServedAs.CACHED),  # a generation's: issued once it is made
    )
    for responses, digest, served in hits_and_miss:
        ref = answer_ref(model, responses)
        assert ref is not None and (ref.digest, ref.served) == (digest, served)
    made = model.stage.core.cache.get(Digest("3" * 64))
    ref = answer_ref(model, generated)
    assert made is not None and ref is not None and made.entry.created_s <= ref.issued_s
    ref = answer_ref(model, semantic)
    assert ref is not None and (ref.digest, ref.served) == ("5" * 64, ServedAs.SEMANTIC)
    assert ref.similarity == pytest.approx(0.8125)
    assert answer_ref(model, anonymous) is None
    with pytest.raises(Forbidden):
        answer_ref(model, first, OTHER_TENANT)


def test_a_generations_id_is_issued_before_padding_holds_it_and_a_refusal_gets_none(
    pb_utils: ModuleType,
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    sealer: Sealer,
    engine: FakeTorchLlm,
) -> None:
    """A padded tenant's generation: its id is issued when the final response is handed in,
    well before the padding floor releases it (so the release does for a held miss what it
    does for a held hit: no id issued there), and sent with it; an answer the engine refused
    (`content_filter`: served, not cached) gets no id, whose digest would name another
    answer."""
    instance = start_llm(load_model, tmp_path, hit_padding_ms="400")
    try:
        start = time.time()
        miss = envelope(sealer, CacheStatus.MISS, "3" * 64, write_back=True)
        (generated,) = run(pb_utils, instance, [to_llm(pb_utils, sealer, miss)])
        assert time.time() - start >= 0.4  # held to the floor
        ref = answer_ref(instance, generated)
        assert ref is not None and ref.digest == "3" * 64
        assert ref.issued_s < start + 0.3  # issued as the worker handed it in, not at release
        engine.finish_reason = "content_filter"
        refused = envelope(sealer, CacheStatus.MISS, "4" * 64, write_back=True)
        (response,) = run(pb_utils, instance, [to_llm(pb_utils, sealer, refused)])
        assert final(pb_utils, response)[0] == "Hello there"
        assert answer_ref(instance, response) is None
    finally:
        instance.finalize()


def test_kept_envelopes_are_refused_once_their_key_is_revoked_or_they_are_old(
    pb_utils: ModuleType,
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    sealer: Sealer,
    engine: FakeTorchLlm,
) -> None:
    """With the deployment's key file, llm acts on an envelope only while the API key that
    sent it is in the file: a caller's kept sealed tensors (a miss, an exact hit llm keeps
    decoded) replayed after its key is revoked are refused, and nothing is generated; an
    envelope older than envelope_max_age_s is refused with or without a key file."""
    keys_file = tmp_path / "api_keys.json"
    _, grant = add_key(keys_file, "acme")
    instance = start_llm(load_model, tmp_path, api_keys_file=str(keys_file))
    try:
        exact, miss = CacheStatus.EXACT, CacheStatus.MISS
        hit = seals.llm_exact(
            envelope(sealer, exact, "1" * 64, "the answer", key=grant.key_hash), "the answer"
        )
        asked = to_llm(pb_utils, sealer, envelope(sealer, miss, "2" * 64, key=grant.key_hash))
        keyless = to_llm(pb_utils, sealer, envelope(sealer, miss, "3" * 64))
        old = envelope(sealer, miss, "4" * 64, key=grant.key_hash, issued_s=issued_now() - 400)
        served, generated, *refused = run(
            pb_utils, instance, [hit, asked, keyless, to_llm(pb_utils, sealer, old)]
        )
        assert final(pb_utils, served) == ("the answer", "exact")
        assert final(pb_utils, generated) == ("Hello there", "miss")
        assert_forbidden(pb_utils, refused[0], "names no API key, and this server requires one")
        assert_forbidden(pb_utils, refused[1], "over the 300 s a request may take")
        assert len(engine.calls) == 1
        assert revoke_key(keys_file, grant.key_id)
        time.sleep(RELOAD_CHECK_S + 0.1)  # the key file is looked at at most once a second
        for responses in run(pb_utils, instance, [hit, asked]):
            assert_forbidden(pb_utils, responses, "the API key that sent this request has been")
        assert len(engine.calls) == 1
    finally:
        instance.finalize()


def test_an_engine_that_stops_answering_fails_the_miss_after_engine_timeout_s(
    pb_utils: ModuleType,
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    sealer: Sealer,
    engine: FakeTorchLlm,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch_llm takes a generation and sends nothing: with engine_timeout_s 0.5 the miss fails
    as unavailable after it, alone, and nothing is stored; once the engine answers again the
    next miss is generated."""
    importlib.import_module("tiercache.stages.torch_llm")  # the fake engine's decoder: torch,
    # imported now, not inside the first call's 0.5 s
    release = threading.Event()

    def held(request: Any) -> Iterator[Any]:
        responses = engine(request)
        assert release.wait(WAIT_S), "never released"
        yield from responses

    monkeypatch.setitem(pb_utils.BLS_MODELS, "torch_llm", held)
    instance = start_llm(load_model, tmp_path, engine_timeout_s="0.5")
    try:
        stalled, later = "1" * 64, "2" * 64
        started = time.monotonic()
        (responses,) = run(
            pb_utils,
            instance,
            [
                to_llm(
                    pb_utils, sealer, envelope(sealer, CacheStatus.MISS, stalled, write_back=True)
                )
            ],
        )
        waited = time.monotonic() - started
        (response,) = responses
        assert response.has_error() and response.error().code() == pb_utils.TritonError.UNAVAILABLE
        assert "engine torch_llm: no response within 0.5 s" in response.error().message()
        assert 0.4 < waited < 10, waited
        instance.stage.metrics.flush()
        late = {e: c.metric.value() for e, c in instance.stage.engine_late.items()}
        assert late == {"timed_out": 1, "refused": 0}  # tiercache_llm_engine_late_total
        release.set()
        (served,) = run(
            pb_utils,
            instance,
            [to_llm(pb_utils, sealer, envelope(sealer, CacheStatus.MISS, later, write_back=True))],
        )
        assert final(pb_utils, served) == ("Hello there", "miss")
        instance.stage.core.drain()
        cache = instance.stage.core.cache
        assert cache.get(stalled) is None and cache.get(later).entry.text == "Hello there"
    finally:
        release.set()
        instance.finalize()


def test_a_padded_tenant_is_refused_alike_while_the_engine_refuses_calls(
    pb_utils: ModuleType,
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    sealer: Sealer,
    engine: FakeTorchLlm,
) -> None:
    """An engine whose stream watch refuses new calls fails a miss and not a hit: a padded
    tenant's caller could tell which prompts were cached by the error. Its requests are refused
    alike before any lookup then (a tenant that is not padded is not checked)."""
    instance = start_llm(load_model, tmp_path, hit_padding_ms="50", engine_timeout_s="30")
    try:
        watch = instance.stage.engine.client.stream_deadline
        watch._stalled = watch.max_stalled  # noqa: SLF001 - four engine streams out, unanswered
        exact = CacheStatus.EXACT
        hit = envelope(sealer, exact, "1" * 64, "the answer")
        miss = envelope(sealer, CacheStatus.MISS, "2" * 64, write_back=True)
        refused = run(
            pb_utils,
            instance,
            [
                seals.llm_exact(hit, "the answer"),
                to_llm(pb_utils, sealer, miss),
            ],
        )
        messages = [r[-1].error().message() for r in refused if r[-1].has_error()]
        assert len(messages) == 2 and messages[0] == messages[1]
        assert "no response" in messages[0]
        watch._stalled = 0  # noqa: SLF001 - the engine answers again
        (served,) = run(pb_utils, instance, [seals.llm_exact(hit, "the answer")])
        assert final(pb_utils, served)[0] == "the answer"
    finally:
        instance.finalize()
