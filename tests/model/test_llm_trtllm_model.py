"""model_repository/llm/1/model.py with engine_kind tensorrt_llm, against the pb_utils stand-in:
a fake `tensorrt_llm` model behind BLS that answers like TensorRT-LLM's backend (token ids,
streamed; "LoRA task N not found in cache" for an adapter it does not hold) and a fake
`lora_cache` that answers the `weights` admin call with TensorRT-LLM tensors. The tokenizer is a
byte-level fake; the detokenizer is the CPU engine's real one. What llm receives is sealed as
embedding_cache and lora_cache seal it, and the fake lora_cache checks llm's admin seal
(tests/model/seals.py)."""

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

from tiercache.adapter_types import AdapterRef, engine_task_id
from tiercache.errors import ConfigError
from tiercache.exact.keys import Digest
from tiercache.exact.request import GenerationRequest
from tiercache.stages.envelope import Envelope
from tiercache.stages.seal import Sealer
from tiercache.stages.transport import AdapterCipher
from tiercache.vocabulary import CacheStatus
from tiercache_dev import pb_utils_stub

WAIT_S = 30
REF = AdapterRef("french", 3, "ab" * 32)
TASK_ID = engine_task_id(REF)
SPECIAL = 4  # ids 0-3 are special; 2 is <|im_end|>


class ByteTokenizer:
    eos_token_id = 2
    unk_token_id = 0
    pad_token_id = 2

    def convert_tokens_to_ids(self, token: str) -> int:
        return 2 if token == "<|im_end|>" else 0

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> dict[str, list[int]]:
        return {"input_ids": [1, *self.encode(messages[0]["content"]), 2]}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [SPECIAL + b for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - SPECIAL for i in ids if i >= SPECIAL).decode("utf-8", errors="replace")


class FakeTensorrtLlm:
    """The backend's side: answers `answer` in chunks of 3 tokens, then <|im_end|>; holds LoRA
    task ids it was sent weights for."""

    def __init__(self, pb_utils: ModuleType, answer: str = "Bonjour") -> None:
        self.pb = pb_utils
        self.answer = answer
        self.held: set[int] = set()
        self.calls: list[dict[str, np.ndarray]] = []

    def __call__(self, request: Any) -> list[Any]:
        pb = self.pb
        assert request.kwargs["model_name"] == "tensorrt_llm"
        assert {"output_ids", "sequence_length"} <= set(request.kwargs["requested_output_names"])
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        self.calls.append(inputs)
        assert all(a.shape[0] == 1 for a in inputs.values()), "one request, batch dimension 1"
        if "lora_task_id" in inputs:
            task = int(inputs["lora_task_id"][0, 0])
            if "lora_weights" in inputs:
                self.held.add(task)
            elif task not in self.held:
                message = (
                    f"LoRA task {task} not found in cache. Please send LoRA weights with request"
                )
                return [pb.InferenceResponse([], pb.TritonError(message))]
        tokens = ByteTokenizer().encode(self.answer) + [2]
        responses = []
        for start in range(0, len(tokens), 3):
            chunk = tokens[start : start + 3]
            outputs = [
                pb.Tensor("output_ids", np.array([[chunk]], dtype=np.int32)),
                pb.Tensor("sequence_length", np.array([[len(chunk)]], dtype=np.int32)),
            ]
            if start + 3 >= len(tokens):
                for name, value in (
                    ("kv_cache_reused_blocks", 2),
                    ("kv_cache_alloc_new_blocks", 1),
                    ("kv_cache_alloc_total_blocks", 3),
                ):
                    outputs.append(pb.Tensor(name, np.array([[value]], dtype=np.int32)))
            responses.append(pb.InferenceResponse(outputs))
        return responses


TRT_WEIGHTS = np.ones((1, 2, 8), dtype=np.float16)
TRT_CONFIG = np.array([[[1, 0, 2], [3, 0, 2]]], dtype=np.int32)


def as_tensors(values: dict[str, Any]) -> list[Any]:
    """lora_cache's TensorRT-LLM tensors as it sends them (`seals.closed_lora`'s values): the
    task id an array, the closed arrays bytes."""
    from tiercache.triton import io

    tensors = []
    for name, value in values.items():
        if isinstance(value, bytes):
            tensors.append(io.bytes_tensor(name, [value]))
        else:
            tensors.append(pb_utils_stub.Tensor(name, value))
    return tensors


class FakeLoraCache:
    """lora_cache's `weights` admin op with engine_kind tensorrt_llm; like lora_cache, it takes
    sealed admin calls only, and closes the arrays it sends for the call."""

    def __init__(self, pb_utils: ModuleType, sealer: Sealer, cipher: AdapterCipher) -> None:
        self.pb = pb_utils
        self.sealer = sealer
        self.cipher = cipher
        self.calls: list[dict[str, Any]] = []

    def __call__(self, request: Any) -> list[Any]:
        text = seals.admin_call(self.sealer, request)
        admin = json.loads(text)
        self.calls.append(admin)
        assert admin["op"] == "weights" and admin["lora"]["name"] == "french"
        task = np.array([[TASK_ID]], dtype=np.uint64)
        bound = seals.admin_seal(self.sealer, text)
        arrays = {
            "LORA_TASK_ID": task,
            "LORA_TRT_WEIGHTS": TRT_WEIGHTS,
            "LORA_TRT_CONFIG": TRT_CONFIG,
        }
        tensors = as_tensors(seals.closed_lora(self.cipher, bound, arrays))
        return [self.pb.InferenceResponse(tensors)]


Sender = pb_utils_stub.ResponseSender


def params(tmp_path: Path, **extra: str) -> dict[str, dict[str, str]]:
    values = {
        "state_dir": str(tmp_path),
        "engine_kind": "tensorrt_llm",
        "engine_model": "tensorrt_llm",
        "tokenizer_dir": str(tmp_path),
        **extra,
    }
    return {k: {"string_value": v} for k, v in values.items()}


@pytest.fixture
def llm_module(load_model: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> Any:
    module = load_model("llm")
    stage_module = importlib.import_module("tiercache.stages.llm")  # after the stand-in
    monkeypatch.setattr(stage_module, "load_tokenizer", lambda path: ByteTokenizer())
    return module


@pytest.fixture
def engine(pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch) -> FakeTensorrtLlm:
    fake = FakeTensorrtLlm(pb_utils)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "tensorrt_llm", fake)
    return fake


@pytest.fixture
def sealer(tmp_path: Path) -> Sealer:
    """The deployment's sealer (every llm here has state_dir tmp_path)."""
    return seals.sealer_for(tmp_path)


@pytest.fixture
def cipher(tmp_path: Path) -> AdapterCipher:
    """The deployment's adapter cipher (lora_cache's and llm's)."""
    return seals.cipher_for(tmp_path)


@pytest.fixture
def lora_cache(
    pb_utils: ModuleType, sealer: Sealer, cipher: AdapterCipher, monkeypatch: pytest.MonkeyPatch
) -> FakeLoraCache:
    fake = FakeLoraCache(pb_utils, sealer, cipher)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "lora_cache", fake)
    return fake


@pytest.fixture
def model(llm_module: Any, tmp_path: Path) -> Iterator[Any]:
    instance = llm_module.TritonPythonModel()
    config = json.dumps({"parameters": params(tmp_path)})
    instance.initialize({"model_config": config, "model_name": "llm"})
    yield instance
    instance.finalize()


def call(
    pb_utils: ModuleType,
    model: Any,
    sealer: Sealer,
    request: GenerationRequest,
    draft_digest: str = "",
    **extra: np.ndarray,
) -> list[Any]:
    """One miss through execute(), as the ensemble hands it on: the envelope, embedding_cache's
    answer and lora_cache's TensorRT-LLM tensors `extra` (the arrays closed for the envelope
    under the model's own deployment secret), each sealed; every response once the final one
    arrived."""
    sent_envelope = Envelope(request=request, status=CacheStatus.BYPASS, draft_digest=draft_digest)
    envelope = seals.sealed(sealer, sent_envelope)
    tensors = seals.llm_answer(sealer, envelope, "", "bypass")
    cipher = seals.cipher_for(model.stage.config.state_path())
    sent = seals.closed_lora(cipher, envelope, dict(extra))
    tensors += as_tensors(sent)
    lora_seal = seals.lora_seal(sealer, envelope, sent, trtllm=True)
    tensors.append(pb_utils.Tensor("LORA_SEAL", np.array([[lora_seal.encode()]], np.object_)))
    sender = Sender()
    infer = pb_utils.InferenceRequest(tensors)
    infer.get_response_sender = lambda: sender
    model.execute([infer])
    assert sender.done.wait(WAIT_S), "no final response"
    return sender.responses


def answer(pb_utils: ModuleType, responses: list[Any]) -> tuple[str, str]:
    """(the text of every response, the final CACHE_STATUS); fails on an error response."""
    parts, status = [], ""
    for response in responses:
        assert not response.has_error(), response.error().message()
        for tensor in response.output_tensors():
            if tensor.name() == "TEXT_OUTPUT":
                parts.append(tensor.as_numpy().reshape(-1)[0].decode())
            elif tensor.name() == "CACHE_STATUS":
                status = tensor.as_numpy().reshape(-1)[0].decode()
    return "".join(parts), status


def on_french(**kwargs: Any) -> GenerationRequest:
    return GenerationRequest(
        "Hi", lora_name=REF.name, lora_task_id=REF.task_id, lora_digest=REF.digest, **kwargs
    )


def metric(pb_utils: ModuleType, model: Any, name: str) -> float:
    model.stage.metrics.flush()
    family = model.stage.metrics._families[name]
    return sum(m.value() for m in family.metrics)


def test_base_request_generates_through_tensorrt_llm(
    pb_utils: ModuleType, sealer: Sealer, model: Any, engine: FakeTensorrtLlm
) -> None:
    responses = call(pb_utils, model, sealer, GenerationRequest("Hi", max_tokens=20, stream=True))
    assert answer(pb_utils, responses) == ("Bonjour", "bypass")
    assert len(responses) > 2, "streamed in several chunks"
    sent = engine.calls[0]
    assert sent["input_ids"].tolist() == [[1, *ByteTokenizer().encode("Hi"), 2]]
    assert int(sent["request_output_len"][0, 0]) == 20 and bool(sent["streaming"][0, 0])
    assert "lora_task_id" not in sent
    assert metric(pb_utils, model, "tiercache_trtllm_kv_cache_reused_blocks_total") == 2
    assert metric(pb_utils, model, "tiercache_trtllm_kv_cache_blocks_total") == 3


def test_held_adapter_is_sent_by_task_id_alone(
    pb_utils: ModuleType,
    sealer: Sealer,
    model: Any,
    engine: FakeTensorrtLlm,
    lora_cache: FakeLoraCache,
) -> None:
    engine.held.add(TASK_ID)
    task = np.array([[TASK_ID]], dtype=np.uint64)
    responses = call(pb_utils, model, sealer, on_french(), LORA_TASK_ID=task)
    assert answer(pb_utils, responses) == ("Bonjour", "bypass")
    assert len(engine.calls) == 1 and lora_cache.calls == []
    assert int(engine.calls[0]["lora_task_id"][0, 0]) == TASK_ID
    assert "lora_weights" not in engine.calls[0]


def test_weights_from_lora_cache_go_to_the_engine(
    pb_utils: ModuleType,
    sealer: Sealer,
    model: Any,
    engine: FakeTensorrtLlm,
    lora_cache: FakeLoraCache,
) -> None:
    responses = call(
        pb_utils,
        model,
        sealer,
        on_french(),
        LORA_TASK_ID=np.array([[TASK_ID]], dtype=np.uint64),
        LORA_TRT_WEIGHTS=TRT_WEIGHTS,
        LORA_TRT_CONFIG=TRT_CONFIG,
    )
    assert answer(pb_utils, responses)[0] == "Bonjour"
    sent = engine.calls[0]  # opened: the engine gets the arrays lora_cache made
    assert (
        np.array_equal(sent["lora_weights"], TRT_WEIGHTS)
        and sent["lora_weights"].dtype == np.float16
    )
    assert np.array_equal(sent["lora_config"], TRT_CONFIG)
    assert lora_cache.calls == []


def test_adapter_the_engine_lost_is_fetched_and_retried_once(
    pb_utils: ModuleType,
    sealer: Sealer,
    model: Any,
    engine: FakeTensorrtLlm,
    lora_cache: FakeLoraCache,
) -> None:
    """lora_cache's mirror said the engine holds it (no weights sent); TensorRT-LLM answers "not
    found in cache"; llm asks lora_cache for the weights and sends the request again."""
    responses = call(
        pb_utils, model, sealer, on_french(), LORA_TASK_ID=np.array([[TASK_ID]], np.uint64)
    )
    assert answer(pb_utils, responses) == ("Bonjour", "bypass")
    assert len(engine.calls) == 2 and len(lora_cache.calls) == 1
    assert lora_cache.calls[0]["lora"] == json.loads(REF.to_json())
    assert "lora_weights" not in engine.calls[0] and "lora_weights" in engine.calls[1]
    assert engine.held == {TASK_ID}


def test_request_without_lora_inputs_still_names_its_adapter_version(
    pb_utils: ModuleType,
    sealer: Sealer,
    model: Any,
    engine: FakeTensorrtLlm,
    lora_cache: FakeLoraCache,
) -> None:
    """The task id follows from the request itself; the engine's "not found" then brings the
    weights, as for a lost adapter."""
    responses = call(pb_utils, model, sealer, on_french())
    assert answer(pb_utils, responses)[0] == "Bonjour"
    assert int(engine.calls[0]["lora_task_id"][0, 0]) == TASK_ID
    assert len(engine.calls) == 2


def test_stop_word_cancels_the_rest_of_the_engines_stream(
    pb_utils: ModuleType,
    sealer: Sealer,
    model: Any,
    engine: FakeTensorrtLlm,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cancelled: list[bool] = []

    class Stream:
        """A response iterator with python_backend's cancel()."""

        def __init__(self, responses: list[Any]) -> None:
            self.items = iter(responses)

        def __iter__(self) -> Stream:
            return self

        def __next__(self) -> Any:
            return next(self.items)

        def cancel(self) -> None:
            cancelled.append(True)

    original = pb_utils.InferenceRequest.exec
    monkeypatch.setattr(
        pb_utils.InferenceRequest,
        "exec",
        lambda self, decoupled=False: Stream(list(original(self, decoupled=True))),
    )
    responses = call(
        pb_utils, model, sealer, GenerationRequest("Hi", max_tokens=20, stop_words=("jo",))
    )
    assert answer(pb_utils, responses) == ("Bon", "bypass")
    assert cancelled == [True]


def test_engine_error_reaches_the_client_as_its_own_error(
    pb_utils: ModuleType, sealer: Sealer, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(request: Any) -> list[Any]:
        return [pb_utils.InferenceResponse([], pb_utils.TritonError("out of KV cache"))]

    monkeypatch.setitem(pb_utils.BLS_MODELS, "tensorrt_llm", failing)
    responses = call(pb_utils, model, sealer, GenerationRequest("Hi"))
    assert len(responses) == 1 and responses[0].has_error()
    assert "out of KV cache" in responses[0].error().message()


def test_too_long_prompt_is_refused_before_the_engine(
    pb_utils: ModuleType, sealer: Sealer, llm_module: Any, engine: FakeTensorrtLlm, tmp_path: Path
) -> None:
    instance = llm_module.TritonPythonModel()
    config = {"parameters": params(tmp_path, trtllm_max_input_len="3")}
    instance.initialize({"model_config": json.dumps(config), "model_name": "llm"})
    try:
        responses = call(pb_utils, instance, sealer, GenerationRequest("Hello there"))
    finally:
        instance.finalize()
    assert responses[0].has_error()
    assert "max_input_len" in responses[0].error().message()
    assert engine.calls == []


def test_with_kv_reuse_for_one_tenant_another_tenant_is_refused_before_the_engine(
    pb_utils: ModuleType, sealer: Sealer, llm_module: Any, engine: FakeTensorrtLlm, tmp_path: Path
) -> None:
    """The engine reuses prefixes for the one tenant the key file named at assembly; a tenant
    added to the key file since (no restart) would share that tenant's cached prefixes."""
    from tiercache.exact.keys import tenant_scope

    instance = llm_module.TritonPythonModel()
    config = {"parameters": params(tmp_path, trtllm_kv_reuse_tenant="acme")}
    instance.initialize({"model_config": json.dumps(config), "model_name": "llm"})
    secret = (tmp_path / "secret").read_bytes()
    try:
        acme = GenerationRequest("Hi", max_tokens=5, tenant_scope=tenant_scope(secret, "acme"))
        assert answer(pb_utils, call(pb_utils, instance, sealer, acme))[0] == "Bonjo"  # 5 tokens
        globex = GenerationRequest("Hi", max_tokens=5, tenant_scope=tenant_scope(secret, "globex"))
        refused = call(pb_utils, instance, sealer, globex)
    finally:
        instance.finalize()
    assert refused[0].has_error()
    assert "one tenant only" in refused[0].error().message()
    assert len(engine.calls) == 1  # acme's alone reached the engine


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"engine_kind": "vllm"}, "'engine_kind' must be one of"),
        ({"tokenizer_dir": ""}, "tokenizer"),
    ],
)
def test_bad_engine_settings_fail_the_load(
    llm_module: Any, tmp_path: Path, extra: dict[str, str], message: str
) -> None:
    instance = llm_module.TritonPythonModel()
    config = {"parameters": params(tmp_path, **extra)}
    with pytest.raises(ConfigError, match=message):
        instance.initialize({"model_config": json.dumps(config), "model_name": "llm"})


class DraftTarget:
    """The backend built for external draft tokens, greedy over `answer`: one response per
    request, the answer's next tokens after the ones resent, verified against draft_input_ids
    (the accepted prefix and the token after it), at most request_output_len; the end id left
    out."""

    def __init__(self, pb_utils: ModuleType, answer: str) -> None:
        self.pb = pb_utils
        self.answer = ByteTokenizer().encode(answer)
        self.calls: list[dict[str, np.ndarray]] = []

    def __call__(self, request: Any) -> list[Any]:
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        self.calls.append(inputs)
        prompt = [1, *ByteTokenizer().encode("Hi"), 2]
        ids = inputs["input_ids"].reshape(-1).tolist()
        done = ids[len(prompt) :]
        assert ids[: len(prompt)] == prompt and done == self.answer[: len(done)]
        wanted = int(inputs["request_output_len"].reshape(-1)[0])
        draft = inputs.get("draft_input_ids")
        draft_ids = [] if draft is None else draft.reshape(-1).tolist()
        rest = self.answer[len(done) :]
        out: list[int] = []
        for i, token in enumerate(rest[:wanted]):
            out.append(token)
            if i < len(draft_ids) and draft_ids[i] != token:
                break
        pb = self.pb
        return [
            pb.InferenceResponse(
                [
                    pb.Tensor("output_ids", np.array([[out]], dtype=np.int32)),
                    pb.Tensor("sequence_length", np.array([[len(out)]], dtype=np.int32)),
                ]
            )
        ]


def test_speculative_steps_draft_from_the_kept_answer_and_give_the_plain_answer(
    pb_utils: ModuleType,
    sealer: Sealer,
    llm_module: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With trtllm_max_draft_len, a greedy miss is decoded in non-streaming steps whose
    draft_input_ids come from the answer kept under its draft digest (at most 8 per step);
    the text is the engine's own answer, and SPECULATED_TOKENS says how much was drafted."""
    text = "Bonjour, le monde. Bonjour encore, le monde."
    target = DraftTarget(pb_utils, text)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "tensorrt_llm", target)
    instance = llm_module.TritonPythonModel()
    config = json.dumps({"parameters": params(tmp_path, trtllm_max_draft_len="8")})
    instance.initialize({"model_config": config, "model_name": "llm"})
    try:
        kept = "d" * 64
        instance.stage.core.cache.put(Digest(kept), text)  # the prompt's earlier answer
        request = GenerationRequest("Hi", max_tokens=len(text) + 10)
        responses = call(pb_utils, instance, sealer, request, draft_digest=kept)
        assert answer(pb_utils, responses) == (text, "bypass")
        assert all(not bool(c["streaming"].reshape(-1)[0]) for c in target.calls)
        drafts = [c["draft_input_ids"].size for c in target.calls if "draft_input_ids" in c]
        assert drafts and max(drafts) <= 8
        assert len(target.calls) <= len(text) // 8 + 2  # not one call per token
        final = {t.name(): t.as_numpy() for t in responses[-1].output_tensors()}
        speculated = int(final["SPECULATED_TOKENS"].reshape(-1)[0])
        assert speculated >= len(text) - len(target.calls)
        instance.stage.metrics.flush()  # the same draft metrics as torch_llm's, from llm
        assert instance.stage.drafts.accepted["answer"].metric.value() == speculated
    finally:
        instance.finalize()


def test_a_lora_cache_that_stops_answering_costs_one_deadline(
    pb_utils: ModuleType,
    sealer: Sealer,
    llm_module: Any,
    tmp_path: Path,
    engine: FakeTensorrtLlm,
    lora_cache: FakeLoraCache,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine lost the adapter and lora_cache's `weights` call hangs: with lora_timeout_s
    0.5 the request fails as unavailable after it, the next one at once (not a second wait)
    while the late call is out, and they are served again once it answers."""
    release = threading.Event()

    def held(request: Any) -> list[Any]:
        assert release.wait(30), "never released"
        return lora_cache(request)

    monkeypatch.setitem(pb_utils.BLS_MODELS, "lora_cache", held)
    instance = llm_module.TritonPythonModel()
    config = json.dumps({"parameters": params(tmp_path, lora_timeout_s="0.5")})
    instance.initialize({"model_config": config, "model_name": "llm"})
    task = np.array([[TASK_ID]], np.uint64)
    try:
        started = time.monotonic()
        first = call(pb_utils, instance, sealer, on_french(), LORA_TASK_ID=task)
        waited = time.monotonic() - started
        assert first[-1].has_error() and "no answer within 0.5 s" in first[-1].error().message()
        assert 0.4 < waited < 5, waited
        started = time.monotonic()
        second = call(pb_utils, instance, sealer, on_french(), LORA_TASK_ID=task)
        assert second[-1].has_error() and "not calling again" in second[-1].error().message()
        assert time.monotonic() - started < 0.4
        release.set()
        late = instance.stage.engine.lora_client.deadline._late  # the call still out
        late.result(timeout=10)  # it answers now
        third = call(pb_utils, instance, sealer, on_french(), LORA_TASK_ID=task)
        assert answer(pb_utils, third) == ("Bonjour", "bypass")
    finally:
        release.set()
        instance.finalize()
