"""model_repository/torch_llm/1/model.py run in-process against the pb_utils stand-in.

The engine is a stand-in whose adapters are the real EngineAdapters on a tiny random Llama (one
layer, hidden size 16) with tiny LoRA adapters made by peft: the adapter protocol (evict, load,
op) is exercised end to end without loading SmolLM2. Calls are sealed as llm and lora_cache seal
them (tests/model/seals.py); the last tests show unsealed and altered calls refused.
"""

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

from tiercache.adapter_types import AdapterRef, adapter_digest, held_key
from tiercache.engine.adapter_call import adapter_ref
from tiercache.engine.adapters import EngineAdapters
from tiercache.engine.events import StreamEvent
from tiercache.engine.kv_cache import BlockHash, KvBlockPool, KvStats, block_hashes, kv_salt
from tiercache.engine.threads import ThreadRole
from tiercache.eviction import named_policy
from tiercache.exact.request import GenerationRequest
from tiercache.stages.envelope import MAX_ENVELOPE_BYTES, Envelope
from tiercache.stages.seal import Sealer
from tiercache_dev import pb_utils_stub

# peft still asks transformers for the deprecated name.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

WAIT_S = 30


def tiny_model(seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def tiny_adapter(seed: int) -> tuple[str, bytes]:
    """adapter_config.json text and adapter_model.safetensors bytes, as peft saves them."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save

    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(tiny_model(seed), config)
    state_dict = {k: v.contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
    config = peft_model.peft_config["default"].to_dict()
    config_json = json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    return config_json, save(state_dict)


def tiny_version(name: str, task_id: int, seed: int) -> tuple[AdapterRef, str, bytes]:
    """A tiny adapter's version (its digest over its files, as the registry names it) and files."""
    config_json, weights = tiny_adapter(seed)
    return (
        AdapterRef(name, task_id, adapter_digest(config_json.encode(), weights)),
        config_json,
        weights,
    )


class FakeEngine:
    """TorchEngine's surface: real adapters, a real KV block pool over the prompt's bytes as
    tokens (4 per block, 10 bytes a block), canned answers."""

    def __init__(
        self,
        source: object,
        cache_dir: Path,
        device: str,
        lora_slots: int,
        *,
        kv_reuse: bool,
        tokens_per_block: int,
        kv_pool_max_bytes: int,
        lora_max_bytes: int,
        kv_eviction: str,
        speculate: bool,
        draft_index_tokens: int,
        speculate_sampled: bool,
        pass_threads: int,
        packed_linears: bool,
    ) -> None:
        self.speculate = speculate  # the stage passes its parameters on
        self.packed_linears = packed_linears
        self.speculate_sampled = speculate_sampled
        self.pass_threads = pass_threads
        self.device = "cpu" if device == "auto" else device  # as resolved (no GPU here)
        self.kv_eviction = kv_eviction
        self.draft_index_tokens = draft_index_tokens
        self.adapters = EngineAdapters(tiny_model(), max_slots=lora_slots, max_bytes=lora_max_bytes)
        self.kv_pool: KvBlockPool[str] = KvBlockPool(
            kv_pool_max_bytes, tokens_per_block, named_policy(kv_eviction)
        )

    def kv_stats(self) -> KvStats:
        return self.kv_pool.stats()

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def card(self) -> tuple[int, str | None]:
        return 0, "8932f937-d72c-4106-c12f-20bd9faed9f6"  # as torch 2.13 writes it

    def release_cached_memory(self) -> None:
        self.released = getattr(self, "released", 0) + 1

    def generate(
        self, request: GenerationRequest, is_cancelled: Callable[[], bool]
    ) -> Iterator[StreamEvent]:
        self.adapters.activate(adapter_ref(request))
        tokens = list(request.prompt.encode())
        salt = kv_salt("rev", request.tenant_scope, request.lora_digest)
        hashes = block_hashes(tokens, self.kv_pool.tokens_per_block, salt)
        lease = self.kv_pool.acquire(hashes, len(tokens))
        for key in hashes[len(lease.blocks) :]:
            self.kv_pool.insert(lease, key, 10, lambda: "kv")
        self.kv_pool.release(lease)
        counts = (len(tokens), lease.reused_tokens, lease.computed_tokens)
        yield StreamEvent("Hello", None, 1, *counts)
        # Speculation: each draft it was handed "verified" once, 4 tokens proposed, 3 kept.
        steps = tuple((source, 4, 3) for source, _ in request.drafts)
        accepted = sum(step[2] for step in steps)
        yield StreamEvent(
            " there", "stop", 2, *counts, 4 * len(steps), accepted, steps, mean_logprob=-0.5
        )


Sender = pb_utils_stub.ResponseSender


@pytest.fixture
def model(
    load_model: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    module = load_model("torch_llm")
    torch_llm_stage = importlib.import_module("tiercache.stages.torch_llm")  # after the stand-in
    monkeypatch.setattr(torch_llm_stage, "TorchEngine", FakeEngine)
    monkeypatch.setattr(torch_llm_stage, "resolve_model", lambda name: None)
    # This process's torch thread count stays as it is (test_torch_threads_come_first).
    monkeypatch.setattr(torch_llm_stage, "set_torch_threads", lambda setting, divisor: 1)
    instance = module.TritonPythonModel()
    params = {
        "state_dir": {"string_value": str(tmp_path)},
        "lora_slots": {"string_value": "2"},
        "tokens_per_block": {"string_value": "4"},
        "kv_pool_max_bytes": {"string_value": "30"},
    }
    instance.initialize({"model_config": json.dumps({"parameters": params}), "model_name": "e"})
    yield instance
    instance.finalize()


def test_torch_threads_come_first(
    load_model: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torch_threads` reaches set_torch_threads with the engine's auto divisor, before the
    engine (its weights) is built."""
    module = load_model("torch_llm")
    torch_llm_stage = importlib.import_module("tiercache.stages.torch_llm")
    events: list[object] = []

    class RecordingEngine(FakeEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            events.append("engine")
            super().__init__(*args, **kwargs)

    def set_torch_threads(setting: str, auto_divisor: int) -> int:
        events.append((setting, auto_divisor))
        return 3

    monkeypatch.setattr(torch_llm_stage, "TorchEngine", RecordingEngine)
    monkeypatch.setattr(torch_llm_stage, "resolve_model", lambda name: None)
    monkeypatch.setattr(torch_llm_stage, "set_torch_threads", set_torch_threads)
    instance = module.TritonPythonModel()
    params = {"state_dir": {"string_value": str(tmp_path)}, "torch_threads": {"string_value": "3"}}
    instance.initialize({"model_config": json.dumps({"parameters": params}), "model_name": "e"})
    instance.finalize()
    assert events == [("3", ThreadRole.ENGINE), "engine"]


@pytest.mark.parametrize(("setting", "expected"), [("auto", 5), ("0", 0), ("2", 2)])
def test_pass_threads_reach_the_engine_as_a_count(
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    expected: int,
) -> None:
    """`pass_threads` reaches the engine as a thread count: auto is every usable CPU."""
    torch_llm_stage = importlib.import_module("tiercache.stages.torch_llm")
    monkeypatch.setattr(torch_llm_stage, "set_torch_threads", lambda setting, role: 1)
    monkeypatch.setattr(torch_llm_stage, "usable_cpus", lambda: 5)
    params = {"pass_threads": {"string_value": setting}}
    built = engines_built(load_model, tmp_path, monkeypatch, params)
    assert [engine.pass_threads for engine in built] == [expected]
    assert [engine.packed_linears for engine in built] == [True]  # the default


def engines_built(
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    params: dict[str, dict[str, str]],
) -> list[FakeEngine]:
    """The engines torch_llm's model.py builds from `params` (over a scratch state_dir)."""
    module = load_model("torch_llm")
    torch_llm_stage = importlib.import_module("tiercache.stages.torch_llm")
    built: list[FakeEngine] = []

    class RecordingEngine(FakeEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(torch_llm_stage, "TorchEngine", RecordingEngine)
    monkeypatch.setattr(torch_llm_stage, "resolve_model", lambda name: None)
    instance = module.TritonPythonModel()
    params = {"state_dir": {"string_value": str(tmp_path)}, **params}
    instance.initialize({"model_config": json.dumps({"parameters": params}), "model_name": "e"})
    instance.finalize()
    return built


def test_packed_linears_can_be_turned_off(
    load_model: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = {"packed_linears": {"string_value": "false"}}
    built = engines_built(load_model, tmp_path, monkeypatch, params)
    assert [engine.packed_linears for engine in built] == [False]


@pytest.fixture
def sealer(tmp_path: Path) -> Sealer:
    """The deployment's sealer (the model's state_dir is tmp_path)."""
    return seals.sealer_for(tmp_path)


def tensors(pb_utils: ModuleType, **inputs: str | bytes) -> list[Any]:
    """Engine inputs as they are, sealed or not (no batch dimension)."""
    return [
        pb_utils.Tensor(name, np.array([v.encode() if isinstance(v, str) else v], np.object_))
        for name, v in inputs.items()
    ]


def call_batch(pb_utils: ModuleType, model: Any, batch: list[list[Any]]) -> list[list[Any]]:
    return pb_utils_stub.execute_decoupled(model, batch, WAIT_S)


def call(pb_utils: ModuleType, model: Any, sealer: Sealer, **inputs: str | bytes) -> list[Any]:
    """One engine call, sealed as llm and lora_cache seal theirs, through execute(); the
    responses once the final one arrived."""
    (responses,) = call_batch(pb_utils, model, [seals.engine_inputs(sealer, **inputs)])
    return responses


def text(pb_utils: ModuleType, response: Any, name: str = "TEXT") -> str:
    assert not response.has_error(), response.error().message()
    return str(pb_utils.get_output_tensor_by_name(response, name).as_numpy()[0].decode())


def envelope_text(sealer: Sealer, request: GenerationRequest) -> bytes:
    """The envelope llm hands the engine: the request alone, sealed."""
    return seals.sealed(sealer, Envelope(request=request))


def on_adapter(ref: AdapterRef | None = None, **fields: Any) -> GenerationRequest:
    if ref is None:
        return GenerationRequest("Hi", **fields)
    return GenerationRequest(
        "Hi", lora_name=ref.name, lora_task_id=ref.task_id, lora_digest=ref.digest, **fields
    )


def request_json(sealer: Sealer, ref: AdapterRef | None = None) -> bytes:
    return envelope_text(sealer, on_adapter(ref))


def load(
    pb_utils: ModuleType, model: Any, sealer: Sealer, version: tuple[AdapterRef, str, bytes]
) -> Any:
    """LORA_OP load of one `tiny_version`; its one response, checked to say "loaded"."""
    ref, config_json, weights = version
    (loaded,) = call(
        pb_utils,
        model,
        sealer,
        LORA_OP="load",
        LORA=ref.to_json(),
        LORA_CONFIG=config_json,
        LORA_WEIGHTS=weights,
    )
    assert text(pb_utils, loaded, "FINISH_REASON") == "loaded"
    return loaded


def test_load_list_generate_evict(pb_utils: ModuleType, model: Any, sealer: Sealer) -> None:
    version = tiny_version("one", 1, seed=1)
    ref = version[0]
    loaded = load(pb_utils, model, sealer, version)
    assert json.loads(text(pb_utils, loaded))["load_ms"] > 0
    (listed,) = call(pb_utils, model, sealer, LORA_OP="list")
    assert text(pb_utils, listed, "FINISH_REASON") == "listed"
    listing = [(a["name"], a["digest"]) for a in json.loads(text(pb_utils, listed))]
    assert listing == [("one", ref.digest)]

    chunk, final = call(pb_utils, model, sealer, ENVELOPE=request_json(sealer, ref))
    assert (text(pb_utils, chunk), text(pb_utils, final)) == ("Hello", " there")
    assert text(pb_utils, final, "FINISH_REASON") == "stop"

    evict = json.dumps([held_key(ref), "zz"])
    (evicted,) = call(pb_utils, model, sealer, LORA_OP="evict", LORA_EVICT=evict)
    assert json.loads(text(pb_utils, evicted)) == {"evicted": [held_key(ref)]}
    (missing,) = call(pb_utils, model, sealer, ENVELOPE=request_json(sealer, ref))
    assert missing.error().code() == pb_utils.TritonError.NOT_FOUND
    assert "not found in cache" in missing.error().message()

    model.stage.metrics.flush()
    # the adapter protocol's expected turn (the caller retries with the weights), not an error
    assert model.stage.finished["adapter_missing"].metric.value() == 1
    assert model.stage.finished["error"].metric.value() == 0
    assert model.stage.adapter_loads.metric.value() == 1
    assert model.stage.adapter_evictions.metric.value() == 1
    assert model.stage.adapter_load_s.metric.value() == 1
    assert model.stage.adapter_swap_s.metric.value() == 1  # base -> one
    assert model.stage.adapters_resident.metric.value() == 0


def test_generate_request_evicts_then_loads_its_adapter(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    """The llm stage's call: REQUEST names the adapter, the weights come along, and LORA_EVICT
    lists digests to drop first, never the one this request needs."""
    (ref1, *files1), (ref2, *files2), (ref3, *files3) = (
        tiny_version("one", 1, seed=1),
        tiny_version("two", 2, seed=2),
        tiny_version("x", 3, seed=3),
    )
    for ref, (config_json, weights) in ((ref1, files1), (ref2, files2)):
        call(
            pb_utils,
            model,
            sealer,
            ENVELOPE=request_json(sealer, ref),
            LORA_CONFIG=config_json,
            LORA_WEIGHTS=weights,
        )
    config_json, weights = files3
    responses = call(
        pb_utils,
        model,
        sealer,
        ENVELOPE=request_json(sealer, ref3),
        LORA_CONFIG=config_json,
        LORA_WEIGHTS=weights,
        LORA_EVICT=json.dumps([ref1.digest, ref3.digest]),
    )
    assert text(pb_utils, responses[-1], "FINISH_REASON") == "stop"
    resident = [a["digest"] for a in model.stage.engine.adapters.resident()]
    assert resident == [ref2.digest, ref3.digest]
    (base,) = call(pb_utils, model, sealer, ENVELOPE=request_json(sealer), LORA_OP="")[-1:]
    assert text(pb_utils, base, "FINISH_REASON") == "stop"
    assert model.stage.engine.adapters.stats().active is None


def test_bad_inputs_get_their_own_error_and_the_worker_goes_on(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    (bad,) = call(pb_utils, model, sealer, LORA_OP="train")
    assert bad.error().code() == pb_utils.TritonError.INVALID_ARG
    assert "LORA_OP must be one of" in bad.error().message()
    config_json, weights = tiny_adapter(1)
    ia3 = config_json.replace('"LORA"', '"IA3"')  # a version of its own: its digest matches
    (rejected,) = call(
        pb_utils,
        model,
        sealer,
        LORA_OP="load",
        LORA=AdapterRef("one", 1, adapter_digest(ia3.encode(), weights)).to_json(),
        LORA_CONFIG=ia3,
        LORA_WEIGHTS=weights,
    )
    assert rejected.error().code() == pb_utils.TritonError.INVALID_ARG
    assert "peft_type must be LORA" in rejected.error().message()
    (listed,) = call(pb_utils, model, sealer, LORA_OP="list")
    assert json.loads(text(pb_utils, listed)) == []


def int_output(pb_utils: ModuleType, response: Any, name: str) -> int:
    return int(pb_utils.get_output_tensor_by_name(response, name).as_numpy()[0])


def test_final_response_and_metrics_report_kv_reuse(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    """REUSED_TOKENS + COMPUTED_TOKENS = PROMPT_TOKENS on the final response; the pool's
    lookups, evictions (and the reuses they gave up), skew and bytes reach the metrics."""

    def counts(prompt: str) -> tuple[int, int, int]:
        envelope = envelope_text(sealer, GenerationRequest(prompt))
        final = call(pb_utils, model, sealer, ENVELOPE=envelope)[-1]
        assert text(pb_utils, final, "FINISH_REASON") == "stop"
        names = ("PROMPT_TOKENS", "REUSED_TOKENS", "COMPUTED_TOKENS")
        prompt_tokens, reused, computed = (int_output(pb_utils, final, n) for n in names)
        assert reused + computed == prompt_tokens
        return prompt_tokens, reused, computed

    assert counts("abcdefghij") == (10, 0, 10)  # two blocks cached, 20 bytes
    assert counts("abcdefghXYZ") == (11, 8, 3)  # reuses both; XYZ is no full block
    assert counts("zzzzyyyy") == (8, 0, 8)  # two new blocks: the LRU leaf (efgh) evicted
    model.stage.metrics.flush()
    assert model.stage.kv_lookups["hit"].metric.value() == 1
    assert model.stage.kv_lookups["miss"].metric.value() == 2
    assert model.stage.kv_reused.metric.value() == 8
    assert model.stage.kv_computed.metric.value() == 21
    assert model.stage.kv_evictions.metric.value() == 1
    assert model.stage.kv_evicted_reuses.metric.value() == 1  # efgh had been reused once
    assert model.stage.kv_rejected.metric.value() == 0
    assert model.stage.kv_hit_skew.metric.value() == 1.0  # abcd holds the one reuse left
    assert model.stage.kv_pool_bytes.metric.value() == 30
    (listed,) = call(pb_utils, model, sealer, LORA_OP="list")  # admin ops report zeros
    assert (
        int_output(pb_utils, listed, "REUSED_TOKENS"),
        int_output(pb_utils, listed, "COMPUTED_TOKENS"),
    ) == (0, 0)


def test_final_response_and_metrics_report_speculation_by_draft_source(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    """SPECULATED_TOKENS on the final response is the draft tokens kept; the draft counters
    and the accepted-per-step histogram are labelled by source; no drafts: 0."""
    drafts = (("answer", "a cached answer"), ("neighbour", "a neighbour's"))
    envelope = envelope_text(sealer, GenerationRequest("Hi", drafts=drafts))
    final = call(pb_utils, model, sealer, ENVELOPE=envelope)[-1]
    assert int_output(pb_utils, final, "SPECULATED_TOKENS") == 6
    logprob = pb_utils.get_output_tensor_by_name(final, "MEAN_LOGPROB").as_numpy()[0]
    assert logprob == -0.5  # the answer's confidence goes to llm with it
    spent = float(pb_utils.get_output_tensor_by_name(final, "ENGINE_S").as_numpy()[0])
    assert 0.0 <= spent < 60.0  # the engine's own seconds: an answer's cost, its queue left out
    plain = call(pb_utils, model, sealer, ENVELOPE=envelope_text(sealer, GenerationRequest("Hi")))
    assert int_output(pb_utils, plain[-1], "SPECULATED_TOKENS") == 0
    model.stage.metrics.flush()
    drafts = model.stage.drafts
    assert (drafts.drafted["answer"].metric.value(), drafts.accepted["answer"].metric.value()) == (
        4,
        3,
    )
    assert drafts.accepted["neighbour"].metric.value() == 3
    assert drafts.drafted["context"].metric.value() == 0
    assert drafts.per_step["answer"].metric.value() == 1  # one step observed


# ---- the engine is internal: unsealed and altered calls are refused ----------------------------


def with_input(inputs: list[Any], name: str, value: str | bytes) -> list[Any]:
    """`inputs` with `name`'s value replaced (every other tensor, ENGINE_SEAL included, kept)."""
    array = np.array([value.encode() if isinstance(value, str) else value], np.object_)
    return [type(t)(name, array) if t.name() == name else t for t in inputs]


def assert_forbidden(pb_utils: ModuleType, responses: list[Any], fragment: str) -> None:
    (response,) = responses  # the error alone, no chunk before it
    assert response.has_error()
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message().startswith("forbidden: ")
    assert fragment in response.error().message()


def test_unsealed_or_altered_generations_are_forbidden_alone(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    """A generation called directly (no ENGINE_SEAL), one whose envelope is not sealed, one moved
    to another tenant's scope (its prefix KV), one sealed by another deployment: each refused
    with nothing loaded or run; the good request of the same batch is served."""
    ref, config_json, weights = tiny_version("one", 1, seed=1)
    files = {"LORA_CONFIG": config_json, "LORA_WEIGHTS": weights}
    mine = on_adapter(ref, tenant_scope="a" * 64)
    good = seals.engine_inputs(sealer, ENVELOPE=envelope_text(sealer, mine), **files)
    bare = Envelope(request=mine).encode()
    stranger = Sealer.from_secret(b"another deployment's secret....")
    batch = [
        tensors(pb_utils, ENVELOPE=bare, **files),  # a direct call
        seals.engine_inputs(sealer, ENVELOPE=bare, **files),  # the envelope is not sealed
        with_input(
            good, "ENVELOPE", seals.altered(envelope_text(sealer, mine), b"a" * 64, b"b" * 64)
        ),
        seals.engine_inputs(stranger, ENVELOPE=envelope_text(stranger, mine), **files),
        good,
    ]
    *refused, served = call_batch(pb_utils, model, batch)
    fragments = [
        "the engine call is not sealed",
        "ENVELOPE's seal does not verify",
        "the engine call's seal does not verify",
        "the engine call's seal does not verify",
    ]
    for responses, fragment in zip(refused, fragments, strict=True):
        assert_forbidden(pb_utils, responses, fragment)
    assert [text(pb_utils, r) for r in served] == ["Hello", " there"]
    # only the good request loaded its adapter and reached the engine (one KV lookup)
    assert [a["digest"] for a in model.stage.engine.adapters.resident()] == [ref.digest]
    assert model.stage.engine.adapters.stats().loads == 1
    assert model.stage.engine.kv_stats().lookups == 1
    model.stage.metrics.flush()
    assert model.stage.finished["error"].metric.value() == len(refused)
    assert model.stage.finished["stop"].metric.value() == 1


def test_an_oversized_envelope_or_a_full_queue_is_refused_before_the_worker(
    pb_utils: ModuleType, model: Any, sealer: Sealer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked in execute, not on the one worker: an ENVELOPE over MAX_ENVELOPE_BYTES is
    refused unread, and past MAX_QUEUED waiting requests a call is refused at once (llm treats
    it as any engine failure); the good request is served either way."""
    torch_llm_stage = importlib.import_module("tiercache.stages.torch_llm")  # after the stand-in
    good = seals.engine_inputs(sealer, ENVELOPE=envelope_text(sealer, on_adapter()))
    huge = tensors(pb_utils, ENVELOPE=b"x" * (MAX_ENVELOPE_BYTES + 1))
    refused, served = call_batch(pb_utils, model, [huge, good])
    (response,) = refused
    assert response.has_error() and "over" in response.error().message()
    assert [text(pb_utils, r) for r in served] == ["Hello", " there"]
    monkeypatch.setattr(torch_llm_stage, "MAX_QUEUED", 0)
    (full,) = call_batch(pb_utils, model, [good])
    (response,) = full
    assert response.has_error() and "requests waiting" in response.error().message()
    model.stage.metrics.flush()
    assert model.stage.finished["error"].metric.value() == 2


def test_adapter_files_waiting_for_the_engine_are_bounded_by_bytes(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    """queue_max_adapter_bytes: while a load's files wait behind a generation, a second load
    that would take the waiting files past the bound is refused at once (unavailable), and the
    waiting one is served; once the worker took it, the same load queues and loads; an adapter
    larger than the bound still loads when none waits."""
    (ref1, config1, weights1), (ref2, config2, weights2) = (
        tiny_version("one", 1, seed=1),
        tiny_version("two", 2, seed=2),
    )

    stage = model.stage
    stage.max_queued_adapter_bytes = len(weights1) + len(config1)  # room for the first only
    entered, release = threading.Event(), threading.Event()
    generate = stage.engine.generate

    def held(request: GenerationRequest, is_cancelled: Callable[[], bool]) -> Iterator[Any]:
        entered.set()
        assert release.wait(WAIT_S)
        yield from generate(request, is_cancelled)

    stage.engine.generate = held
    (blocker,) = pb_utils_stub.submit_decoupled(
        model, [seals.engine_inputs(sealer, ENVELOPE=envelope_text(sealer, on_adapter()))]
    )
    assert entered.wait(WAIT_S)  # the worker is inside the generation: what follows waits
    first, second = pb_utils_stub.submit_decoupled(
        model,
        [
            seals.engine_inputs(sealer, **load_inputs(ref1, config1, weights1)),
            seals.engine_inputs(sealer, **load_inputs(ref2, config2, weights2)),
        ],
    )
    assert second.done.is_set() and not first.done.is_set()
    (refused,) = second.responses
    assert refused.has_error() and "queue_max_adapter_bytes" in refused.error().message()
    release.set()
    for sender in (blocker, first):
        assert sender.done.wait(WAIT_S)
    assert text(pb_utils, first.responses[-1], "FINISH_REASON") == "loaded"
    again = call(pb_utils, model, sealer, **load_inputs(ref2, config2, weights2))
    assert text(pb_utils, again[-1], "FINISH_REASON") == "loaded"
    assert stage._queued_adapter_bytes == 0
    stage.max_queued_adapter_bytes = 1  # smaller than any adapter: one alone still loads
    evict = call(pb_utils, model, sealer, LORA_OP="evict", LORA_EVICT=json.dumps([ref1.digest]))
    assert not evict[-1].has_error()
    reload = call(pb_utils, model, sealer, **load_inputs(ref1, config1, weights1))
    assert text(pb_utils, reload[-1], "FINISH_REASON") == "loaded"
    assert stage._queued_adapter_bytes == 0
    assert [a["digest"] for a in stage.engine.adapters.resident()] == [ref2.digest, ref1.digest]


def load_inputs(ref: AdapterRef, config: str, weights: bytes) -> dict[str, str | bytes]:
    return {
        "LORA_OP": "load",
        "LORA": ref.to_json(),
        "LORA_CONFIG": config,
        "LORA_WEIGHTS": weights,
    }


def test_unsealed_forged_or_mismatched_loads_are_forbidden_alone(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    """An adapter load called directly, one whose LORA_WEIGHTS were swapped after sealing, and a
    sealed one whose files are not the version its digest names: each refused, nothing loaded;
    the good load of the same batch is served."""
    (ref1, config1, weights1), (ref2, config2, weights2) = (
        tiny_version("one", 1, seed=1),
        tiny_version("two", 2, seed=2),
    )
    load1 = {"LORA_OP": "load", "LORA": ref1.to_json(), "LORA_CONFIG": config1}
    batch = [
        tensors(pb_utils, **load1, LORA_WEIGHTS=weights1),  # a direct call
        with_input(
            seals.engine_inputs(sealer, **load1, LORA_WEIGHTS=weights1), "LORA_WEIGHTS", weights2
        ),
        seals.engine_inputs(sealer, **{**load1, "LORA_CONFIG": config2}, LORA_WEIGHTS=weights2),
        tensors(pb_utils, LORA_OP="list"),  # nor may a caller read what the engine holds
        seals.engine_inputs(
            sealer, LORA_OP="load", LORA=ref2.to_json(), LORA_CONFIG=config2, LORA_WEIGHTS=weights2
        ),
    ]
    *refused, served = call_batch(pb_utils, model, batch)
    fragments = [
        "the engine call is not sealed",
        "the engine call's seal does not verify",
        f"adapter {ref1.short}: its files do not match its digest; not loaded",
        "the engine call is not sealed",
    ]
    for responses, fragment in zip(refused, fragments, strict=True):
        assert_forbidden(pb_utils, responses, fragment)
    assert text(pb_utils, served[-1], "FINISH_REASON") == "loaded"
    assert [a["digest"] for a in model.stage.engine.adapters.resident()] == [ref2.digest]
    stats = model.stage.engine.adapters.stats()
    assert (stats.loads, stats.load_failures) == (1, 0)


def start_stage(
    load_model: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    params: dict[str, dict[str, str]],
    engine: type = FakeEngine,
) -> Any:
    """torch_llm's model over `engine` (a stand-in for TorchEngine), initialized with `params`
    (the caller finalizes it)."""
    module = load_model("torch_llm")
    torch_llm_stage = importlib.import_module("tiercache.stages.torch_llm")
    monkeypatch.setattr(torch_llm_stage, "TorchEngine", engine)
    monkeypatch.setattr(torch_llm_stage, "resolve_model", lambda name: None)
    monkeypatch.setattr(torch_llm_stage, "set_torch_threads", lambda setting, divisor: 1)
    instance = module.TritonPythonModel()
    instance.initialize({"model_config": json.dumps({"parameters": params}), "model_name": "e"})
    return instance


@pytest.mark.parametrize(("given", "expected"), [(None, False), ("true", True)])
def test_sampled_requests_speculate_only_where_the_deployment_opts_in(
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    given: str | None,
    expected: bool,
) -> None:
    """speculate_sampled (default false) reaches the engine as given; speculate stays on."""
    params = {"state_dir": {"string_value": str(tmp_path)}}
    if given is not None:
        params["speculate_sampled"] = {"string_value": given}
    instance = start_stage(load_model, monkeypatch, params, FakeEngine)
    try:
        engine = instance.stage.engine
        assert (engine.speculate, engine.speculate_sampled) == (True, expected)
    finally:
        instance.finalize()


def test_with_a_memory_headroom_the_kv_pool_follows_the_host(
    load_model: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memory_headroom_bytes larger than this machine (read for real): the KV pool's budget
    goes to kv_pool_min_bytes, and the engine thread's next request evicts down to it; what
    the pool holds is exported beside its budget."""
    params = {
        "state_dir": {"string_value": str(tmp_path)},
        "tokens_per_block": {"string_value": "4"},
        "kv_pool_max_bytes": {"string_value": "1000"},
        "kv_pool_min_bytes": {"string_value": "20"},
        "memory_headroom_bytes": {"string_value": str(1 << 60)},
        # the first resize comes one interval after the start: long enough for the insert
        # below to come first on a loaded machine (at 0.05 s it did not always)
        "budget_interval_s": {"string_value": "1.0"},
    }
    instance = start_stage(load_model, monkeypatch, params, FakeEngine)
    try:
        pool = instance.stage.engine.kv_pool
        lease = pool.acquire([], 1)  # a block the pool holds until its next request
        assert pool.insert(lease, BlockHash(b"k" * 32), 300, lambda: "block")
        families = instance.stage.metrics._families
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # the gauges follow the resize within the tick
            instance.stage.metrics.flush()
            (budget,) = families["tiercache_budget_bytes"].metrics
            (held,) = families["tiercache_budget_held_bytes"].metrics
            if pool.budget_bytes == 20 and budget.value() == 20 and held.value() == 300:
                break
            time.sleep(0.05)
        assert pool.budget_bytes == 20  # in force from the next request (engine thread)
        assert (budget.labels["cache"], budget.value()) == ("kv_pool", 20)
        assert (held.labels["cache"], held.value()) == ("kv_pool", 300)  # held until then
    finally:
        instance.finalize()


def test_with_a_memory_headroom_the_adapter_slots_follow_the_host(
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sealer: Sealer,
    pb_utils: ModuleType,
) -> None:
    """lora_max_bytes gives the adapter slots a budget of their own: with a headroom larger than
    this machine it goes to lora_min_bytes (1: one adapter), and the next request drops the
    others (never the one it runs with); a request for a dropped one gets the engine's "not
    held" error (llm's answer to it, sending the weights again, is generate_with_adapter's)."""
    params = {
        "state_dir": {"string_value": str(tmp_path)},
        "lora_max_bytes": {"string_value": str(1 << 20)},
        "lora_min_bytes": {"string_value": "1"},
        "memory_headroom_bytes": {"string_value": str(1 << 60)},
        "budget_interval_s": {"string_value": "0.05"},
    }
    instance = start_stage(load_model, monkeypatch, params, FakeEngine)
    try:
        versions = [tiny_version(n, i + 1, seed=i + 1) for i, n in enumerate(("one", "two"))]
        for version in versions:
            load(pb_utils, instance, sealer, version)
        adapters = instance.stage.engine.adapters  # both held unless the budget came first
        families = instance.stage.metrics._families
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            instance.stage.metrics.flush()
            sizes = {
                m.labels["cache"]: m.value() for m in families["tiercache_budget_bytes"].metrics
            }
            if sizes.get("adapter_slots") == 1:
                break
            time.sleep(0.05)
        assert sizes == {"kv_pool": 16 << 20, "adapter_slots": 1}
        one, two = (ref for ref, *_ in versions)
        final = call(pb_utils, instance, sealer, ENVELOPE=request_json(sealer, two))[-1]
        assert text(pb_utils, final, "FINISH_REASON") == "stop"
        stats = adapters.stats()
        assert (stats.resident, stats.budget_evictions, stats.injected_slots) == (1, 1, 1)
        assert [a["digest"] for a in adapters.resident()] == [two.digest]
        instance.stage.metrics.flush()
        (held,) = families["tiercache_engine_adapter_slot_bytes"].metrics
        assert held.value() == stats.slot_bytes > 1  # the one it runs with, alone over it
        (missing,) = call(pb_utils, instance, sealer, ENVELOPE=request_json(sealer, one))
        assert missing.error().code() == pb_utils.TritonError.NOT_FOUND
    finally:
        instance.finalize()


def test_a_kv_pool_on_a_gpu_keeps_its_fixed_budget(
    load_model: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine resolved `device` to a GPU (as "auto" does on a GPU host): its pool frees no
    host memory and its prefill is not timed, so no budget follows the host for it."""

    class GpuEngine(FakeEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.device = "cuda:0"

    params = {
        "state_dir": {"string_value": str(tmp_path)},
        "cache_memory_bytes": {"string_value": str(1 << 30)},
        "memory_headroom_bytes": {"string_value": str(1 << 60)},
    }
    instance = start_stage(load_model, monkeypatch, params, GpuEngine)
    try:
        assert instance.stage.budgets is None
        assert instance.stage.engine.kv_pool.budget_bytes == 256 << 20  # its fixed size
    finally:
        instance.finalize()


class CardNvml:
    """pynvml's call surface, as the probe uses it: one card whose free memory a test sets."""

    class NVMLError(Exception):
        pass

    def __init__(self, free: int) -> None:
        self.free = free

    def nvmlInit(self) -> None:  # noqa: N802 - NVML's names
        pass

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        from types import SimpleNamespace

        total = 141 << 30
        return SimpleNamespace(total=total, free=self.free, used=total - self.free)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:  # noqa: N802
        raise self.NVMLError("Insufficient Permissions")


def test_on_a_gpu_the_kv_pool_follows_the_cards_free_memory_through_nvml(
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sealer: Sealer,
    pb_utils: ModuleType,
) -> None:
    """gpu_memory_headroom_bytes: the card's free memory as NVML reads it (a stand-in with
    NVML's calls) drives the KV pool's budget: down to its floor while short of the headroom,
    back to its fixed size when the memory returns; after the evictions a request makes, the
    engine hands torch's cached blocks back to the card (where NVML sees them)."""
    from tiercache.machine import GpuMemoryProbe

    class GpuEngine(FakeEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.device = "cuda:0"

    nvml = CardNvml(free=100 << 30)
    torch_llm_stage = importlib.import_module("tiercache.stages.torch_llm")
    monkeypatch.setattr(torch_llm_stage, "GpuMemoryProbe", lambda: GpuMemoryProbe(nvml))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    params = {
        "state_dir": {"string_value": str(tmp_path)},
        "tokens_per_block": {"string_value": "4"},
        "kv_pool_max_bytes": {"string_value": "1000"},
        "kv_pool_min_bytes": {"string_value": "20"},
        "gpu_memory_headroom_bytes": {"string_value": str(40 << 30)},
        "memory_headroom_bytes": {"string_value": str(1 << 60)},  # host memory: not the GPU's
        "budget_interval_s": {"string_value": "0.05"},
    }
    instance = start_stage(load_model, monkeypatch, params, GpuEngine)
    try:
        engine = instance.stage.engine
        pool = engine.kv_pool
        families = instance.stage.metrics._families

        def ask(prompt: str) -> int:
            """One generation; how often the engine released cached memory so far."""
            envelope = envelope_text(sealer, GenerationRequest(prompt))
            final = call(pb_utils, instance, sealer, ENVELOPE=envelope)[-1]
            assert text(pb_utils, final, "FINISH_REASON") == "stop"
            return int(getattr(engine, "released", 0))

        def wait_for(size: int) -> None:
            deadline = time.monotonic() + 10.0
            while pool.budget_bytes != size and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.budget_bytes == size

        assert ask("a prompt long enough to fill more than twenty bytes of KV") == 0
        assert pool.stats().bytes > 20 and pool.stats().evictions == 0
        nvml.free = 10 << 30  # another process took the card: 10 GiB free, 40 asked for
        wait_for(20)  # the floor, applied at the next request
        # the tick resizes first and sets the gauges after (its on_tick): wait for that too
        deadline = time.monotonic() + 10.0
        while True:
            instance.stage.metrics.flush()
            (available,) = families["tiercache_memory_available_bytes"].metrics
            if available.value() == 10 << 30 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (available.labels["memory"], available.value()) == ("gpu", 10 << 30)
        (headroom,) = families["tiercache_memory_headroom_bytes"].metrics
        assert headroom.value() == 40 << 30
        assert (tmp_path / "budgets-gpu-8932f937-d72c-4106-c12f-20bd9faed9f6").is_dir()
        # "hi" fills no block: the first evicts down to the budget and releases, the next not
        assert [ask("hi"), ask("hi")] == [1, 1]
        assert pool.stats().bytes <= 20 and pool.stats().evictions > 0
        evictions = pool.stats().evictions
        assert ask("another prompt, long enough to make the full pool evict") == 1
        assert pool.stats().evictions > evictions  # ordinary evictions: nothing released
        nvml.free = 100 << 30  # the memory came back
        wait_for(1000)
    finally:
        instance.finalize()


def test_with_a_ttft_objective_each_generation_is_timed_and_its_state_published(
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pb_utils: ModuleType,
    sealer: Sealer,
) -> None:
    """ttft_objective_s: each generation's time from leaving the queue to its first event is
    observed; 16 of them over a microsecond objective make it LATE, which the budgets see and
    export (2)."""
    params = {
        "state_dir": {"string_value": str(tmp_path)},
        "tokens_per_block": {"string_value": "4"},
        "kv_pool_max_bytes": {"string_value": "1000"},
        "cache_memory_bytes": {"string_value": "1000"},
        "ttft_objective_s": {"string_value": "0.000001"},
        "budget_interval_s": {"string_value": "0.05"},
    }
    instance = start_stage(load_model, monkeypatch, params, FakeEngine)
    try:
        for i in range(16):
            envelope = envelope_text(sealer, GenerationRequest(f"prompt number {i}"))
            final = call(pb_utils, instance, sealer, ENVELOPE=envelope)[-1]
            assert text(pb_utils, final, "FINISH_REASON") == "stop"
        objective = instance.stage.objective
        assert objective is not None and len(objective._recent) == 16
        assert all(0.0 < seconds < 10.0 for _, seconds in objective._recent)
        deadline = time.monotonic() + 10.0
        state = -1.0
        while state != 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # a tick, then the deferred metrics
            instance.stage.metrics.flush()
            (gauge,) = instance.stage.metrics._families["tiercache_ttft_objective_state"].metrics
            state = gauge.value()
        assert state == 2  # LATE
    finally:
        instance.finalize()


def test_a_request_its_caller_gave_up_while_queued_is_not_run(
    pb_utils: ModuleType, model: Any, sealer: Sealer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llm gave up on it (its deadline, a flight nobody waits for) while it waited: the worker
    answered it only after the tokenization and the whole prefill. Now it is answered as
    cancelled once the adapter work it carried is done (lora_cache's mirror counts on it)."""
    lookups = model.stage.engine.kv_stats().lookups
    gone = [True]
    monkeypatch.setattr(pb_utils_stub.ResponseSender, "is_cancelled", lambda self: gone[0])
    ref, config_json, weights = tiny_version("carried", 7, seed=7)
    (final,) = call(
        pb_utils,
        model,
        sealer,
        ENVELOPE=request_json(sealer, ref),
        LORA_CONFIG=config_json,
        LORA_WEIGHTS=weights,
    )[-1:]
    assert text(pb_utils, final, "FINISH_REASON") == "cancelled"
    assert model.stage.engine.kv_stats().lookups == lookups  # no prompt reached the engine
    held = [a["digest"] for a in model.stage.engine.adapters.resident()]
    assert ref.digest in held  # the weights it carried were loaded: lora_cache counts on it
    gone[0] = False
    (served,) = call(pb_utils, model, sealer, ENVELOPE=request_json(sealer), LORA_OP="")[-1:]
    assert text(pb_utils, served, "FINISH_REASON") == "stop"  # the worker goes on


def test_refused_engine_requests_are_logged_once_a_minute(
    pb_utils: ModuleType, model: Any, sealer: Sealer, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller can repeat a request the engine refuses (past the context window, a control
    token) at will: each was a warning line."""
    huge = tensors(pb_utils, ENVELOPE=b"x" * (MAX_ENVELOPE_BYTES + 1))
    with caplog.at_level("WARNING", logger="tiercache"):
        for _ in range(20):
            (refused,) = call_batch(pb_utils, model, [huge])
            assert refused[0].has_error()
    assert len([r for r in caplog.records if "engine request refused" in r.getMessage()]) <= 1
