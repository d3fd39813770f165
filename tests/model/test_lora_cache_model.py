"""model_repository/lora_cache/1/model.py run in-process against the pb_utils stand-in, with a
fake engine model behind BLS that obeys LORA_OP list / load as torch_llm does and, like it, takes
sealed calls only. Envelopes and admin calls are sealed as the pipeline seals them
(tests/model/seals.py); the last tests show unsealed and altered ones refused."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import seals

from tiercache.adapter_types import AdapterRef, held_key
from tiercache.errors import ConfigError, Forbidden
from tiercache.exact.request import GenerationRequest
from tiercache.lora.registry import CONFIG_FILE, WEIGHTS_FILE, AdapterRegistry
from tiercache.stages.seal import ENGINE_LABEL, Sealer
from tiercache.stages.transport import HEADER_BYTES, AdapterCipher

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
NAMES = ("french", "caps", "brief")


class FakeEngine:
    """torch_llm's adapter ops: "list" answers the held versions, "load" evicts then loads."""

    def __init__(self, pb_utils: ModuleType, sealer: Sealer) -> None:
        self.pb = pb_utils
        self.sealer = sealer
        self.held: dict[str, dict[str, Any]] = {}  # held key -> AdapterRef as JSON object
        self.calls: list[dict[str, Any]] = []
        self.error = ""  # when set, every call fails with it

    def __call__(self, request: Any) -> list[Any]:
        pb = self.pb
        assert request.kwargs["model_name"] == "torch_llm"
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        assert all(a.shape == (1,) for a in inputs.values()), "torch_llm has no batch dimension"
        seals.engine_call(self.sealer, request)  # Forbidden unless sealed, as torch_llm checks
        values = {name: a[0] for name, a in inputs.items() if name != "ENGINE_SEAL"}
        self.calls.append(values)
        if self.error:
            return [pb.InferenceResponse([], pb.TritonError(self.error, pb.TritonError.INTERNAL))]
        op = values["LORA_OP"].decode()
        if op == "list":
            finish, text = "listed", json.dumps(list(self.held.values()))
        else:
            assert op == "load" and values["LORA_WEIGHTS"] and values["LORA_CONFIG"]
            evicted = json.loads(values.get("LORA_EVICT", b"[]"))  # held keys (task id:digest)
            for key in evicted:
                self.held.pop(key, None)
            ref = json.loads(values["LORA"])
            key = f"{ref['task_id']}:{ref['digest']}"
            load_ms = 0.0 if key in self.held else 2.5
            self.held[key] = ref
            finish, text = "loaded", json.dumps({"load_ms": load_ms, "evicted": evicted})

        def tensor(name: str, value: str) -> Any:
            return pb.Tensor(name, np.array([value.encode()], dtype=np.object_))

        # the final response of a decoupled model carries no outputs, only the final flag
        answer = pb.InferenceResponse([tensor("TEXT", text), tensor("FINISH_REASON", finish)])
        return [answer, pb.InferenceResponse([])]


@pytest.fixture
def adapters(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    for name in NAMES:
        shutil.copytree(ADAPTERS / name, root / name)
    return root


@pytest.fixture
def sealer(tmp_path: Path) -> Sealer:
    """The deployment's sealer (the stage's state_dir is tmp_path / "state")."""
    return seals.sealer_for(tmp_path / "state")


@pytest.fixture
def cipher(tmp_path: Path) -> AdapterCipher:
    """The deployment's adapter cipher (lora_cache closes the files it sends with it)."""
    return seals.cipher_for(tmp_path / "state")


@pytest.fixture
def engine(pb_utils: ModuleType, sealer: Sealer, monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    fake = FakeEngine(pb_utils, sealer)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "torch_llm", fake)
    return fake


Start = Callable[..., Any]


@pytest.fixture
def start(
    load_model: Callable[[str], ModuleType], tmp_path: Path, adapters: Path, engine: FakeEngine
) -> Iterator[Start]:
    started: list[Any] = []

    def start(**parameters: str) -> Any:
        values = {"state_dir": str(tmp_path / "state"), "adapters_dir": str(adapters)}
        values.update(parameters)
        config = {"parameters": {k: {"string_value": v} for k, v in values.items()}}
        instance = load_model("lora_cache").TritonPythonModel()
        instance.initialize({"model_config": json.dumps(config), "model_name": "lora_cache"})
        started.append(instance)
        return instance

    yield start
    for instance in started:
        instance.finalize()


@pytest.fixture
def model(start: Start) -> Any:
    return start(engine_slots="2")


@pytest.fixture
def registry(adapters: Path, tmp_path: Path) -> AdapterRegistry:
    """prompt_cache's view of the adapters (same folder, same task ids)."""
    return AdapterRegistry(adapters, tmp_path / "state", rescan_interval_s=0.0)


def on_adapter(ref: AdapterRef | None = None, prompt: str = "Hello?", **fields: Any) -> Any:
    """A request with adapter `ref` (None: the base model), as prompt_cache resolved it."""
    if ref is None:
        return GenerationRequest(prompt=prompt, **fields)
    return GenerationRequest(
        prompt=prompt,
        lora_name=ref.name,
        lora_task_id=ref.task_id,
        lora_digest=ref.digest,
        **fields,
    )


def request_json(sealer: Sealer, ref: AdapterRef | None = None, prompt: str = "Hello?") -> bytes:
    """The sealed envelope prompt_cache sends for a request with adapter `ref` (None: the base)."""
    return envelope_text(sealer, on_adapter(ref, prompt))


def envelope_text(sealer: Sealer, request: GenerationRequest) -> bytes:
    return seals.sealed_miss(sealer, request)


def make_request(pb_utils: ModuleType, **inputs: str | bytes) -> Any:
    return pb_utils.InferenceRequest(
        [
            pb_utils.Tensor(
                name,
                np.array([[value.encode() if isinstance(value, str) else value]], np.object_),
            )
            for name, value in inputs.items()
        ]
    )


def miss(pb_utils: ModuleType, sealer: Sealer, ref: AdapterRef | None, status: str = "miss") -> Any:
    return make_request(pb_utils, ENVELOPE=request_json(sealer, ref), LOOKUP_STATUS=status)


def admin_text(pb_utils: ModuleType, sealer: Sealer, text: str) -> Any:
    """An admin call, sealed as llm and cache_admin seal theirs."""
    return pb_utils.InferenceRequest(seals.admin_inputs(sealer, text))


def admin(pb_utils: ModuleType, sealer: Sealer, **op: Any) -> Any:
    return admin_text(pb_utils, sealer, json.dumps(op))


def outputs(pb_utils: ModuleType, response: Any) -> dict[str, Any]:
    """The response's outputs by name: text, and the adapter files as sent (bytes: encrypted,
    b"" when not sent; `opened` opens them)."""
    assert not response.has_error(), response.error().message()
    out = {}
    for name in ("LORA", "LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT", "LORA_TIER", "ADMIN_RESULT"):
        array = pb_utils.get_output_tensor_by_name(response, name).as_numpy()
        assert array.shape == (1, 1)
        value = array[0, 0]
        out[name] = value if name in seals.CLOSED_FILES else value.decode()
    return out


def opened(
    pb_utils: ModuleType, cipher: AdapterCipher, request: Any, response: Any
) -> tuple[str, bytes]:
    """The adapter files (config text, weights) lora_cache sent in `response` to `request`,
    opened as llm opens them: closed for the request's envelope, or its ADMIN_SEAL."""
    names = ("ENVELOPE", "ADMIN_SEAL")
    sent = {n: pb_utils.get_input_tensor_by_name(request, n) for n in names}
    envelope, admin_seal = (
        None if t is None else t.as_numpy().reshape(-1)[0] for t in sent.values()
    )
    bound = envelope if envelope is not None else admin_seal.decode()
    files = seals.opened_lora(cipher, bound, outputs(pb_utils, response))
    return files["LORA_CONFIG"].decode(), files["LORA_WEIGHTS"]


def files(adapters: Path, name: str) -> tuple[str, bytes]:
    folder = adapters / name
    return (folder / CONFIG_FILE).read_text(), (folder / WEIGHTS_FILE).read_bytes()


def lora_seal(pb_utils: ModuleType, response: Any) -> str:
    return str(pb_utils.get_output_tensor_by_name(response, "LORA_SEAL").as_numpy()[0, 0].decode())


def check_lora_seal(
    pb_utils: ModuleType, sealer: Sealer, envelope: bytes, response: Any, trtllm: bool = False
) -> None:
    """The response's LORA_SEAL verifies over its adapter tensors, as llm checks it."""
    values = {}
    for tensor in response.output_tensors():
        value = tensor.as_numpy()
        values[tensor.name()] = value[0, 0] if value.dtype == np.object_ else value
    seals.check_lora(sealer, envelope, values, lora_seal(pb_utils, response), trtllm)


def flushed(model: Any) -> Any:
    model.stage.metrics.flush()
    return model.stage


def test_hits_and_base_model_requests_pass_with_empty_outputs(
    model: Any, pb_utils: ModuleType, sealer: Sealer, registry: AdapterRegistry
) -> None:
    french = registry.resolve("french")
    requests = [
        miss(pb_utils, sealer, french, status="exact"),  # a hit needs no adapter
        miss(pb_utils, sealer, french, status="semantic"),
        make_request(pb_utils, ENVELOPE="", LOOKUP_STATUS="exact"),
        miss(pb_utils, sealer, None),  # the base model
        miss(pb_utils, sealer, None, status="bypass"),
        make_request(pb_utils),  # nothing at all
    ]
    empty = dict.fromkeys(("LORA", "LORA_EVICT", "LORA_TIER", "ADMIN_RESULT"), "")
    for response in model.execute(requests):
        assert outputs(pb_utils, response) == {**empty, "LORA_CONFIG": b"", "LORA_WEIGHTS": b""}
    assert flushed(model).requests["none"].metric.value() == len(requests)


def test_first_request_loads_from_disk_then_the_engine_holds_it(
    model: Any,
    pb_utils: ModuleType,
    sealer: Sealer,
    cipher: AdapterCipher,
    registry: AdapterRegistry,
    adapters: Path,
) -> None:
    french = registry.resolve("french")
    request = miss(pb_utils, sealer, french)
    (first,) = model.execute([request])
    out = outputs(pb_utils, first)
    assert AdapterRef.from_json(out["LORA"]) == french
    # the files go out encrypted for llm: nothing of them in clear
    config, weights = files(adapters, "french")
    assert out["LORA_CONFIG"].startswith(b"tcbox2") and out["LORA_WEIGHTS"].startswith(b"tcbox2")
    assert (
        config.encode()[:64] not in out["LORA_CONFIG"] and weights[:64] not in out["LORA_WEIGHTS"]
    )
    assert opened(pb_utils, cipher, request, first) == (config, weights)
    # sealed for llm over the files, bound to this request's envelope
    envelope = pb_utils.get_input_tensor_by_name(request, "ENVELOPE").as_numpy()[0, 0]
    check_lora_seal(pb_utils, sealer, envelope, first)
    assert (out["LORA_EVICT"], out["LORA_TIER"], out["ADMIN_RESULT"]) == ("[]", "disk", "")
    (second,) = model.execute([miss(pb_utils, sealer, french, status="bypass")])
    out = outputs(pb_utils, second)
    assert (out["LORA_CONFIG"], out["LORA_WEIGHTS"], out["LORA_TIER"]) == (b"", b"", "engine")
    assert AdapterRef.from_json(out["LORA"]) == french
    m = flushed(model)
    assert m.requests["disk"].metric.value() == 1
    assert m.requests["engine"].metric.value() == 1
    assert m.loads["engine"].metric.value() == 1
    assert m.loads["host"].metric.value() == 1
    assert m.resident["engine"].metric.value() == 1
    assert m.resident["disk"].metric.value() == 3
    assert m.disk_read_s.metric.value() == 1
    assert m.requests["engine"].metric.labels == {"model": "lora_cache", "tier": "engine"}


def test_more_adapters_than_slots_evict_the_least_recently_used(
    model: Any,
    pb_utils: ModuleType,
    sealer: Sealer,
    cipher: AdapterCipher,
    registry: AdapterRegistry,
    adapters: Path,
) -> None:
    french, caps, brief = (registry.resolve(n) for n in NAMES)
    first = model.execute(
        [
            miss(pb_utils, sealer, french),
            miss(pb_utils, sealer, caps),
            miss(pb_utils, sealer, french),
        ]
    )
    (response,) = model.execute([miss(pb_utils, sealer, brief)])
    assert json.loads(outputs(pb_utils, response)["LORA_EVICT"]) == [held_key(caps)]
    request = miss(pb_utils, sealer, caps)
    (again,) = model.execute([request])
    out = outputs(pb_utils, again)
    assert (out["LORA_TIER"], json.loads(out["LORA_EVICT"])) == ("host", [held_key(french)])
    assert out["LORA_WEIGHTS"]  # the engine dropped it: the weights go again, from memory
    # ... encrypted once (transport_cache_bytes): the same body, its key wrapped for this request
    sent_before = outputs(pb_utils, first[1])["LORA_WEIGHTS"]
    assert out["LORA_WEIGHTS"][HEADER_BYTES:] == sent_before[HEADER_BYTES:]
    assert out["LORA_WEIGHTS"][:HEADER_BYTES] != sent_before[:HEADER_BYTES]
    assert opened(pb_utils, cipher, request, again)[1] == files(adapters, "caps")[1]
    envelope = pb_utils.get_input_tensor_by_name(request, "ENVELOPE").as_numpy()[0, 0]
    check_lora_seal(pb_utils, sealer, envelope, again)
    kept = flushed(model).transport_bytes.metric.value()
    assert kept == model.stage.cipher.body_bytes > len(files(adapters, "caps")[1])
    m = flushed(model)
    assert m.evictions["engine"].metric.value() == 2
    assert m.resident["host"].metric.value() == 3


def test_a_changed_folder_is_a_new_version_and_in_flight_requests_keep_the_old_one(
    model: Any,
    pb_utils: ModuleType,
    sealer: Sealer,
    cipher: AdapterCipher,
    registry: AdapterRegistry,
    adapters: Path,
) -> None:
    old = registry.resolve("caps")
    model.execute([miss(pb_utils, sealer, old)])
    for file in (CONFIG_FILE, WEIGHTS_FILE):  # caps now holds brief's files
        tmp = adapters / "caps" / (file + ".new")
        shutil.copy2(adapters / "brief" / file, tmp)
        os.replace(tmp, adapters / "caps" / file)
    new = registry.resolve("caps")
    assert (new.task_id, new.digest != old.digest) == (old.task_id, True)
    # a request resolved before the change finishes on the old version
    (late,) = model.execute([miss(pb_utils, sealer, old)])
    assert AdapterRef.from_json(outputs(pb_utils, late)["LORA"]) == old
    assert outputs(pb_utils, late)["LORA_TIER"] == "engine"
    # new requests load the new version, and the engine drops the old one
    request = miss(pb_utils, sealer, new)
    (fresh,) = model.execute([request])
    out = outputs(pb_utils, fresh)
    assert (out["LORA_TIER"], json.loads(out["LORA_EVICT"])) == ("disk", [held_key(old)])
    assert opened(pb_utils, cipher, request, fresh) == files(adapters, "brief")
    # the old version is still in host memory for stragglers, without evicting the new one
    (straggler,) = model.execute([miss(pb_utils, sealer, old)])
    out = outputs(pb_utils, straggler)
    assert (out["LORA_TIER"], out["LORA_EVICT"]) == ("host", "[]")


def test_a_version_no_tier_holds_is_unavailable(
    start: Start, pb_utils: ModuleType, sealer: Sealer, registry: AdapterRegistry, adapters: Path
) -> None:
    model = start(host_max_adapters="0")
    old = registry.resolve("french")
    shutil.copy2(adapters / "brief" / WEIGHTS_FILE, adapters / "french" / WEIGHTS_FILE)
    (response,) = model.execute([miss(pb_utils, sealer, old)])
    assert response.error().code() == pb_utils.TritonError.UNAVAILABLE
    assert "changed since this request was resolved" in response.error().message()


def test_bad_requests_get_their_own_errors_and_the_batch_is_served(
    model: Any, pb_utils: ModuleType, sealer: Sealer, registry: AdapterRegistry
) -> None:
    french = registry.resolve("french")
    unresolved = envelope_text(sealer, GenerationRequest(prompt="x", lora_name="french"))
    bad_digest = AdapterRef("french", french.task_id, "not-hex")
    requests = [
        miss(pb_utils, sealer, french),
        make_request(
            pb_utils, ENVELOPE=seals.sealed_payload(sealer, b"{not json"), LOOKUP_STATUS="miss"
        ),
        make_request(pb_utils, ENVELOPE=request_json(sealer, french), LOOKUP_STATUS="maybe"),
        make_request(pb_utils, ENVELOPE=unresolved, LOOKUP_STATUS="miss"),
        miss(pb_utils, sealer, bad_digest),
        admin(pb_utils, sealer, op="drop-everything"),
        admin_text(pb_utils, sealer, "[1, 2]"),
        admin(pb_utils, sealer, op="list", verbose=True),
        admin(pb_utils, sealer, op="warm", names=[]),
        admin(pb_utils, sealer, op="weights", lora={"name": "french"}),
        miss(pb_utils, sealer, None),
    ]
    responses = model.execute(requests)
    assert len(responses) == len(requests)
    assert outputs(pb_utils, responses[0])["LORA_TIER"] == "disk"
    assert outputs(pb_utils, responses[-1])["LORA"] == ""
    fragments = [
        "ENVELOPE is not JSON",
        "LOOKUP_STATUS must be one of",
        "without its version",
        "digest must be 64",
        "ADMIN must be a JSON object",
        "ADMIN must be a JSON object",
        "unknown keys ['verbose']",
        "non-empty list",
        "must be an AdapterRef",
    ]
    for response, fragment in zip(responses[1:-1], fragments, strict=True):
        assert response.error().code() == pb_utils.TritonError.INVALID_ARG
        assert response.error().message().startswith("invalid request:")
        assert fragment in response.error().message()
    assert flushed(model).requests["error"].metric.value() == len(fragments)


def test_list_reports_each_version_in_its_tier_and_the_engines_own_list(
    model: Any, pb_utils: ModuleType, sealer: Sealer, registry: AdapterRegistry, engine: FakeEngine
) -> None:
    french = registry.resolve("french")
    model.execute([miss(pb_utils, sealer, french)])
    engine.held[held_key(french)] = json.loads(french.to_json())  # llm passed it on
    (response,) = model.execute([admin(pb_utils, sealer, op="list")])
    out = outputs(pb_utils, response)
    assert (out["LORA"], out["LORA_WEIGHTS"]) == ("", b"")
    report = json.loads(out["ADMIN_RESULT"])
    assert report["op"] == "list" and report["engine_model"] == "torch_llm"
    rows = {row["name"]: row for row in report["adapters"]}
    assert {name: row["tier"] for name, row in rows.items()} == {
        "brief": "disk",
        "caps": "disk",
        "french": "engine",
    }
    assert rows["french"]["digest"] == french.digest
    assert rows["french"]["bytes"] == sum(
        len(x) for x in files(model.stage.core.registry.root, "french")
    )
    assert rows["french"]["current"] is True and rows["french"]["pinned"] is False
    assert report["engine_reported"] == [json.loads(french.to_json())]
    assert report["stats"]["hits"] == {"engine": 0, "host": 0, "disk": 1}
    assert engine.calls[-1] == {"LORA_OP": b"list"}


def test_list_reports_a_broken_folder_and_an_engine_that_cannot_answer(
    model: Any, pb_utils: ModuleType, sealer: Sealer, engine: FakeEngine, adapters: Path
) -> None:
    (adapters / "caps" / CONFIG_FILE).write_text('{"peft_type": "PREFIX_TUNING"}')
    engine.error = "engine is restarting"
    (response,) = model.execute([admin(pb_utils, sealer, op="list")])
    report = json.loads(outputs(pb_utils, response)["ADMIN_RESULT"])
    (broken,) = [row for row in report["adapters"] if row["name"] == "caps"]
    assert broken["tier"] == "" and "expected 'LORA'" in broken["problem"]
    assert report["engine_reported"] is None
    assert "engine is restarting" in report["engine_error"]


def test_warm_loads_into_the_engine_before_the_first_request(
    model: Any,
    pb_utils: ModuleType,
    sealer: Sealer,
    registry: AdapterRegistry,
    engine: FakeEngine,
    adapters: Path,
) -> None:
    (response,) = model.execute([admin(pb_utils, sealer, op="warm", names=["brief", "caps"])])
    report = json.loads(outputs(pb_utils, response)["ADMIN_RESULT"])
    assert report["op"] == "warm"
    assert report["warmed"] == {"brief": "loaded", "caps": "loaded"}
    brief, caps = registry.resolve("brief"), registry.resolve("caps")
    assert set(engine.held) == {held_key(brief), held_key(caps)}
    load = engine.calls[0]
    assert load["LORA_OP"] == b"load" and AdapterRef.from_json(load["LORA"].decode()) == brief
    assert (load["LORA_CONFIG"].decode(), load["LORA_WEIGHTS"]) == files(adapters, "brief")
    assert {r["name"]: r["tier"] for r in report["adapters"]}["brief"] == "engine"
    assert {a["name"] for a in report["engine_reported"]} == {"brief", "caps"}
    # the first request finds it in the engine: nothing to send
    (first,) = model.execute([miss(pb_utils, sealer, brief)])
    assert outputs(pb_utils, first)["LORA_TIER"] == "engine"
    assert outputs(pb_utils, first)["LORA_WEIGHTS"] == b""
    # warming again is harmless; warming a third adapter evicts through the engine call
    (again,) = model.execute([admin(pb_utils, sealer, op="warm", names=["caps", "french"])])
    report = json.loads(outputs(pb_utils, again)["ADMIN_RESULT"])
    assert report["warmed"] == {"caps": "already loaded", "french": "loaded"}
    assert json.loads(engine.calls[-2]["LORA_EVICT"]) == [held_key(brief)]
    assert held_key(brief) not in engine.held and len(engine.held) == 2


def test_warm_of_an_unknown_adapter_is_not_found_and_loads_nothing(
    model: Any, pb_utils: ModuleType, sealer: Sealer, engine: FakeEngine
) -> None:
    (response,) = model.execute([admin(pb_utils, sealer, op="warm", names=["caps", "nope"])])
    assert response.error().code() == pb_utils.TritonError.NOT_FOUND
    assert "unknown adapter 'nope'" in response.error().message()
    assert engine.calls == []


def test_warm_reports_a_broken_folder_per_name_and_warms_the_rest(
    model: Any, pb_utils: ModuleType, sealer: Sealer, engine: FakeEngine, adapters: Path
) -> None:
    """One adapter folder that cannot be read (its weights gone) failed the whole warm call,
    and the fleet's warm-up, which retries the list, warmed nothing for two minutes."""
    (adapters / "brief" / "adapter_model.safetensors").unlink()
    (response,) = model.execute([admin(pb_utils, sealer, op="warm", names=["brief", "caps"])])
    report = json.loads(outputs(pb_utils, response)["ADMIN_RESULT"])
    assert report["warmed"]["caps"] == "loaded"
    assert report["warmed"]["brief"].startswith("error: ")
    assert [c["LORA_OP"] for c in engine.calls].count(b"load") == 1  # caps alone


def test_warm_reports_an_engine_failure_per_name(
    model: Any, pb_utils: ModuleType, sealer: Sealer, engine: FakeEngine
) -> None:
    engine.error = "out of adapter memory"
    (response,) = model.execute([admin(pb_utils, sealer, op="warm", names=["caps"])])
    report = json.loads(outputs(pb_utils, response)["ADMIN_RESULT"])
    assert report["warmed"]["caps"].startswith("error: unavailable:")
    assert "out of adapter memory" in report["warmed"]["caps"]
    # the mirror does not believe the engine holds it: the first request sends the weights
    assert {r["name"]: r["tier"] for r in report["adapters"]}["caps"] == "host"


def test_a_load_the_engine_never_answers_fails_after_engine_timeout_s(
    start: Start,
    pb_utils: ModuleType,
    sealer: Sealer,
    engine: FakeEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine takes a warm-up's load and answers nothing: with engine_timeout_s 0.5 the
    warm-up reports the name unavailable after it, and the mirror does not count the adapter
    loaded; once the engine answers (the late load went through), warming again finds it
    there."""
    importlib.import_module("tiercache.stages.torch_llm")  # the fake engine's decoder (torch)
    release = threading.Event()

    def held(request: Any) -> Iterator[Any]:
        answers = engine(request)
        assert release.wait(30), "never released"
        yield from answers

    monkeypatch.setitem(pb_utils.BLS_MODELS, "torch_llm", held)
    model = start(engine_slots="2", engine_timeout_s="0.5")
    try:
        started = time.monotonic()
        (response,) = model.execute([admin(pb_utils, sealer, op="warm", names=["caps"])])
        assert 0.4 < time.monotonic() - started < 10
        report = json.loads(outputs(pb_utils, response)["ADMIN_RESULT"])
        assert report["warmed"]["caps"].startswith("error: unavailable:")
        assert "engine torch_llm: no response within 0.5 s" in report["warmed"]["caps"]
        assert {r["name"]: r["tier"] for r in report["adapters"]}["caps"] == "host"
        # the report's listing of the engine waited too: two streams given up on
        assert report["engine_reported"] is None and "no response" in report["engine_error"]
        model.stage.metrics.flush()  # tiercache_lora_engine_late_total
        assert {e: c.metric.value() for e, c in model.stage.engine_late.items()} == {
            "timed_out": 2,
            "refused": 0,
        }
        release.set()
        (again,) = model.execute([admin(pb_utils, sealer, op="warm", names=["caps"])])
        report = json.loads(outputs(pb_utils, again)["ADMIN_RESULT"])
        assert report["warmed"] == {"caps": "already loaded"}
        assert {r["name"]: r["tier"] for r in report["adapters"]}["caps"] == "engine"
    finally:
        release.set()


def test_weights_op_sends_them_again_after_the_engine_lost_them(
    model: Any,
    pb_utils: ModuleType,
    sealer: Sealer,
    cipher: AdapterCipher,
    registry: AdapterRegistry,
    adapters: Path,
) -> None:
    """The files go out encrypted for the admin call that asked (bound to its ADMIN_SEAL)."""
    caps = registry.resolve("caps")
    model.execute([miss(pb_utils, sealer, caps)])  # the mirror now says the engine holds it
    for lora in (json.loads(caps.to_json()), caps.to_json()):  # an object, or its JSON text
        request = admin(pb_utils, sealer, op="weights", lora=lora)
        (response,) = model.execute([request])
        out = outputs(pb_utils, response)
        assert opened(pb_utils, cipher, request, response) == files(adapters, "caps")
        other_call = seals.admin_seal(sealer, json.dumps({"op": "list"}))
        with pytest.raises(Forbidden, match="LORA_CONFIG does not open"):
            seals.opened_lora(cipher, other_call, out)
        assert (out["LORA_TIER"], out["LORA_EVICT"]) == ("host", "[]")
        assert AdapterRef.from_json(out["LORA"]) == caps
        result = json.loads(out["ADMIN_RESULT"])
        assert result == {
            "op": "weights",
            "lora": json.loads(caps.to_json()),
            "tier": "host",
            "evict": [],
        }


def test_prefetch_marks_resident_and_pins_stay(
    start: Start, pb_utils: ModuleType, sealer: Sealer, registry: AdapterRegistry
) -> None:
    model = start(engine_slots="2", prefetch="french", pin="french")
    french, caps, brief = (registry.resolve(n) for n in NAMES)
    (first,) = model.execute([miss(pb_utils, sealer, french)])
    assert outputs(pb_utils, first)["LORA_TIER"] == "engine"  # torch_llm loaded it at its start
    model.execute([miss(pb_utils, sealer, caps)])
    (third,) = model.execute([miss(pb_utils, sealer, brief)])
    assert json.loads(outputs(pb_utils, third)["LORA_EVICT"]) == [held_key(caps)]  # not french
    report = model.stage.core.list_report()
    assert [r["pinned"] for r in report["adapters"] if r["name"] == "french"] == [True]


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({"pin": "nope"}, "pin/prefetch adapter 'nope'"),
        ({"prefetch": "french,caps,brief", "engine_slots": "2"}, "prefetch names 3 adapters"),
        ({"pin": "french,caps", "engine_slots": "2"}, "engine_slots >= 3"),
        ({"engine_slot": "2"}, "unknown parameter 'engine_slot'"),
    ],
)
def test_bad_configuration_fails_initialize(
    start: Start, parameters: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        start(**parameters)


def test_tensorrt_llm_kind_sends_task_id_always_and_weights_only_when_missing(
    start: Start,
    pb_utils: ModuleType,
    sealer: Sealer,
    cipher: AdapterCipher,
    registry: AdapterRegistry,
) -> None:
    """engine_kind tensorrt_llm: TensorRT-LLM's request tensors beside the PEFT files; the
    version's lora_task_id on every miss, lora_weights / lora_config (encrypted like the PEFT
    files) only on a load."""
    from tiercache.adapter_types import engine_task_id

    model = start(engine_slots="2", engine_kind="tensorrt_llm")
    french = registry.resolve("french")
    requests = [miss(pb_utils, sealer, french), miss(pb_utils, sealer, french)]
    first, second = model.execute(requests)
    for request, response in zip(requests, (first, second), strict=True):  # as llm checks it
        envelope = pb_utils.get_input_tensor_by_name(request, "ENVELOPE").as_numpy()[0, 0]
        check_lora_seal(pb_utils, sealer, envelope, response, trtllm=True)
    for response in (first, second):
        task = pb_utils.get_output_tensor_by_name(response, "LORA_TASK_ID").as_numpy()
        assert task.dtype == np.uint64 and task.tolist() == [[engine_task_id(french)]]

    def sent(response: Any, name: str) -> Any:
        return pb_utils.get_output_tensor_by_name(response, name).as_numpy()[0, 0]

    bound = pb_utils.get_input_tensor_by_name(requests[0], "ENVELOPE").as_numpy()[0, 0]
    opened_arrays = seals.opened_lora(
        cipher, bound, {n: sent(first, n) for n in ("LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG")}
    )
    weights, config = opened_arrays["LORA_TRT_WEIGHTS"], opened_arrays["LORA_TRT_CONFIG"]
    assert weights.dtype == np.float16 and weights.shape[:2] == (1, 60)  # q and v, 30 layers
    assert config.dtype == np.int32 and config.shape == (1, 60, 3)
    assert (sent(second, "LORA_TRT_WEIGHTS"), sent(second, "LORA_TRT_CONFIG")) == (b"", b"")
    (base,) = model.execute([miss(pb_utils, sealer, None)])
    assert pb_utils.get_output_tensor_by_name(base, "LORA_TASK_ID") is None


def test_unknown_engine_kind_fails_initialize(start: Start) -> None:
    with pytest.raises(ConfigError, match="engine_kind"):
        start(engine_kind="vllm")


# ---- lora_cache is internal: unsealed and altered calls are refused -----------------------------


def assert_forbidden(pb_utils: ModuleType, response: Any, fragment: str) -> None:
    assert response.has_error()
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message().startswith("forbidden: ")
    assert fragment in response.error().message()
    assert response.output_tensors() == []  # no adapter files, no LORA_SEAL


def test_unsealed_or_altered_envelopes_get_no_adapter_plan(
    model: Any, pb_utils: ModuleType, sealer: Sealer, registry: AdapterRegistry, engine: FakeEngine
) -> None:
    """An envelope sent without its seal, one moved to another tenant's scope, one switched to
    another adapter, one sealed by another deployment: each refused alone, no adapter read or
    planned for it (so no adapter files handed out); the good request of the batch is served."""
    french, caps = registry.resolve("french"), registry.resolve("caps")
    mine = envelope_text(sealer, on_adapter(french, tenant_scope="a" * 64))
    stranger = Sealer.from_secret(b"another deployment's secret....")
    good = miss(pb_utils, sealer, caps)
    requests = [
        make_request(pb_utils, ENVELOPE=mine[64:], LOOKUP_STATUS="miss"),  # a direct call
        make_request(
            pb_utils, ENVELOPE=seals.altered(mine, b"a" * 64, b"b" * 64), LOOKUP_STATUS="miss"
        ),
        make_request(
            pb_utils,
            ENVELOPE=seals.altered(
                seals.altered(mine, french.digest.encode(), caps.digest.encode()),
                b'"lora_name":"french"',
                b'"lora_name":"caps"',
            ),
            LOOKUP_STATUS="miss",
        ),
        make_request(pb_utils, ENVELOPE=request_json(stranger, french), LOOKUP_STATUS="miss"),
        good,
    ]
    *refused, served = model.execute(requests)
    for response in refused:
        assert_forbidden(pb_utils, response, "ENVELOPE's seal does not verify")
    out = outputs(pb_utils, served)
    assert (AdapterRef.from_json(out["LORA"]), out["LORA_TIER"]) == (caps, "disk")
    envelope = pb_utils.get_input_tensor_by_name(good, "ENVELOPE").as_numpy()[0, 0]
    check_lora_seal(pb_utils, sealer, envelope, served)
    m = flushed(model)
    assert m.requests["error"].metric.value() == len(refused)
    assert m.requests["disk"].metric.value() == 1  # the good request's plan alone
    assert m.loads["host"].metric.value() == 1 and m.resident["host"].metric.value() == 1
    assert engine.calls == []


def test_unsealed_or_altered_admin_calls_are_refused(
    model: Any, pb_utils: ModuleType, sealer: Sealer, registry: AdapterRegistry, engine: FakeEngine
) -> None:
    """lora_cache's admin ops are internal (llm, cache_admin): a warm without ADMIN_SEAL, one
    whose names were changed after sealing, one carrying a seal made for another hop, and a
    `weights` call (the adapter's files) without a seal are refused with nothing loaded; the
    good call of the batch is served."""
    warm_caps = json.dumps({"op": "warm", "names": ["caps"]})
    warm_french = json.dumps({"op": "warm", "names": ["french"]})
    other_hop = sealer.seal(ENGINE_LABEL, warm_french.encode())  # valid, for another hop
    weights = json.dumps(
        {"op": "weights", "lora": json.loads(registry.resolve("french").to_json())}
    )
    requests = [
        make_request(pb_utils, ADMIN=warm_french),  # a direct call
        make_request(pb_utils, ADMIN=warm_french, ADMIN_SEAL=seals.admin_seal(sealer, warm_caps)),
        make_request(pb_utils, ADMIN=warm_french, ADMIN_SEAL=other_hop),
        make_request(pb_utils, ADMIN=weights),
        admin(pb_utils, sealer, op="warm", names=["brief"]),
    ]
    *refused, served = model.execute(requests)
    fragments = [
        "ADMIN is not sealed",
        "ADMIN's seal does not verify",
        "ADMIN's seal does not verify",
        "ADMIN is not sealed",
    ]
    for response, fragment in zip(refused, fragments, strict=True):
        assert_forbidden(pb_utils, response, fragment)
    report = json.loads(outputs(pb_utils, served)["ADMIN_RESULT"])
    assert report["warmed"] == {"brief": "loaded"}
    brief = registry.resolve("brief")
    assert set(engine.held) == {held_key(brief)}  # nothing of the refused calls was loaded
    loads = [c for c in engine.calls if c["LORA_OP"] == b"load"]
    assert [AdapterRef.from_json(c["LORA"].decode()) for c in loads] == [brief]
    assert flushed(model).requests["error"].metric.value() == len(refused)


def test_with_a_total_the_host_tier_follows_the_budgets(start: Start, tmp_path: Path) -> None:
    """cache_memory_bytes under the host tier's and the transport cache's fixed sizes: their
    budgets come down to the total within a tick, each at or above its floor, published in
    the host's ledger beside the other stages' budgets."""
    instance = start(
        engine_slots="2",
        cache_memory_bytes=str(32 << 20),
        host_min_bytes=str(1 << 20),
        transport_cache_min_bytes=str(2 << 20),
        budget_interval_s="0.05",
    )
    residency = instance.stage.core.residency
    cipher = instance.stage.cipher

    def total() -> int:
        return residency._host.max_bytes + cipher.max_body_bytes

    deadline = time.monotonic() + 10.0
    while total() > 32 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert total() <= 32 << 20
    assert residency._host.max_bytes >= 1 << 20 and cipher.max_body_bytes >= 2 << 20
    names = {budget.name for budget in instance.stage.budgets.controller.budgets}
    assert names == {"adapters_host", "adapters_transport"}
    (published,) = (tmp_path / "state" / "budgets").glob("lora_cache.*")
    assert instance.stage.budgets is not None
    instance.finalize()
    assert not published.exists() and not instance.stage.budgets._thread.is_alive()
