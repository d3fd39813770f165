"""model_repository/lora_cache/1/model.py run in-process against the pb_utils stand-in, with a
fake engine model behind BLS that obeys LORA_OP list / load as torch_llm does."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tiercache.adapter_types import AdapterRef
from tiercache.errors import ConfigError
from tiercache.exact.request import GenerationRequest
from tiercache.lora.registry import CONFIG_FILE, WEIGHTS_FILE, AdapterRegistry
from tiercache.stages.envelope import Envelope
from tiercache.vocabulary import CacheStatus

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
NAMES = ("french", "caps", "brief")


class FakeEngine:
    """torch_llm's adapter ops: "list" answers the held versions, "load" evicts then loads."""

    def __init__(self, pb_utils: ModuleType) -> None:
        self.pb = pb_utils
        self.held: dict[str, dict[str, Any]] = {}  # digest -> AdapterRef as JSON object
        self.calls: list[dict[str, Any]] = []
        self.error = ""  # when set, every call fails with it

    def __call__(self, request: Any) -> list[Any]:
        pb = self.pb
        assert request.kwargs["model_name"] == "torch_llm"
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        assert all(a.shape == (1,) for a in inputs.values()), "torch_llm has no batch dimension"
        values = {name: a[0] for name, a in inputs.items()}
        self.calls.append(values)
        if self.error:
            return [pb.InferenceResponse([], pb.TritonError(self.error, pb.TritonError.INTERNAL))]
        op = values["LORA_OP"].decode()
        if op == "list":
            finish, text = "listed", json.dumps(list(self.held.values()))
        else:
            assert op == "load" and values["LORA_WEIGHTS"] and values["LORA_CONFIG"]
            evicted = json.loads(values.get("LORA_EVICT", b"[]"))
            for digest in evicted:
                self.held.pop(digest, None)
            ref = json.loads(values["LORA"])
            load_ms = 0.0 if ref["digest"] in self.held else 2.5
            self.held[ref["digest"]] = ref
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
def engine(pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    fake = FakeEngine(pb_utils)
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


def request_json(ref: AdapterRef | None = None, prompt: str = "Hello?") -> str:
    """The envelope prompt_cache sends for a request with adapter `ref` (None: the base)."""
    if ref is None:
        return envelope_text(GenerationRequest(prompt=prompt))
    return envelope_text(
        GenerationRequest(
            prompt=prompt, lora_name=ref.name, lora_task_id=ref.task_id, lora_digest=ref.digest
        )
    )


def envelope_text(request: GenerationRequest) -> str:
    return Envelope(request=request, status=CacheStatus.MISS).encode().decode()


def make_request(pb_utils: ModuleType, **inputs: str) -> Any:
    return pb_utils.InferenceRequest(
        [
            pb_utils.Tensor(name, np.array([[value.encode()]], dtype=np.object_))
            for name, value in inputs.items()
        ]
    )


def miss(pb_utils: ModuleType, ref: AdapterRef | None, status: str = "miss") -> Any:
    return make_request(pb_utils, ENVELOPE=request_json(ref), LOOKUP_STATUS=status)


def admin(pb_utils: ModuleType, **op: Any) -> Any:
    return make_request(pb_utils, ADMIN=json.dumps(op))


def outputs(pb_utils: ModuleType, response: Any) -> dict[str, Any]:
    assert not response.has_error(), response.error().message()
    out = {}
    for name in ("LORA", "LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT", "LORA_TIER", "ADMIN_RESULT"):
        array = pb_utils.get_output_tensor_by_name(response, name).as_numpy()
        assert array.shape == (1, 1)
        value = array[0, 0]
        out[name] = value if name == "LORA_WEIGHTS" else value.decode()
    return out


def files(adapters: Path, name: str) -> tuple[str, bytes]:
    folder = adapters / name
    return (folder / CONFIG_FILE).read_text(), (folder / WEIGHTS_FILE).read_bytes()


def flushed(model: Any) -> Any:
    model.stage.metrics.flush()
    return model.stage


def test_hits_and_base_model_requests_pass_with_empty_outputs(
    model: Any, pb_utils: ModuleType, registry: AdapterRegistry
) -> None:
    french = registry.resolve("french")
    requests = [
        miss(pb_utils, french, status="exact"),  # a hit needs no adapter
        miss(pb_utils, french, status="semantic"),
        make_request(pb_utils, ENVELOPE="", LOOKUP_STATUS="exact"),
        miss(pb_utils, None),  # the base model
        miss(pb_utils, None, status="bypass"),
        make_request(pb_utils),  # nothing at all
    ]
    empty = dict.fromkeys(("LORA", "LORA_CONFIG", "LORA_EVICT", "LORA_TIER", "ADMIN_RESULT"), "")
    for response in model.execute(requests):
        assert outputs(pb_utils, response) == {**empty, "LORA_WEIGHTS": b""}
    assert flushed(model).requests["none"].metric.value() == len(requests)


def test_first_request_loads_from_disk_then_the_engine_holds_it(
    model: Any, pb_utils: ModuleType, registry: AdapterRegistry, adapters: Path
) -> None:
    french = registry.resolve("french")
    (first,) = model.execute([miss(pb_utils, french)])
    out = outputs(pb_utils, first)
    assert AdapterRef.from_json(out["LORA"]) == french
    assert (out["LORA_CONFIG"], out["LORA_WEIGHTS"]) == files(adapters, "french")
    assert (out["LORA_EVICT"], out["LORA_TIER"], out["ADMIN_RESULT"]) == ("[]", "disk", "")
    (second,) = model.execute([miss(pb_utils, french, status="bypass")])
    out = outputs(pb_utils, second)
    assert (out["LORA_CONFIG"], out["LORA_WEIGHTS"], out["LORA_TIER"]) == ("", b"", "engine")
    assert AdapterRef.from_json(out["LORA"]) == french
    m = flushed(model)
    assert m.requests["disk"].metric.value() == 1
    assert m.requests["engine"].metric.value() == 1
    assert m.loads["engine"].metric.value() == 1
    assert m.loads["host"].metric.value() == 1
    assert m.resident["engine"].metric.value() == 1
    assert m.resident["disk"].metric.value() == 3
    assert len(m.disk_read_s.metric.observations) == 1
    assert m.requests["engine"].metric.labels == {"model": "lora_cache", "tier": "engine"}


def test_more_adapters_than_slots_evict_the_least_recently_used(
    model: Any, pb_utils: ModuleType, registry: AdapterRegistry
) -> None:
    french, caps, brief = (registry.resolve(n) for n in NAMES)
    model.execute([miss(pb_utils, french), miss(pb_utils, caps), miss(pb_utils, french)])
    (response,) = model.execute([miss(pb_utils, brief)])
    assert json.loads(outputs(pb_utils, response)["LORA_EVICT"]) == [caps.digest]
    (again,) = model.execute([miss(pb_utils, caps)])
    out = outputs(pb_utils, again)
    assert (out["LORA_TIER"], json.loads(out["LORA_EVICT"])) == ("host", [french.digest])
    assert out["LORA_WEIGHTS"]  # the engine dropped it: the weights go again, from memory
    m = flushed(model)
    assert m.evictions["engine"].metric.value() == 2
    assert m.resident["host"].metric.value() == 3


def test_a_changed_folder_is_a_new_version_and_in_flight_requests_keep_the_old_one(
    model: Any, pb_utils: ModuleType, registry: AdapterRegistry, adapters: Path
) -> None:
    old = registry.resolve("caps")
    model.execute([miss(pb_utils, old)])
    for file in (CONFIG_FILE, WEIGHTS_FILE):  # caps now holds brief's files
        tmp = adapters / "caps" / (file + ".new")
        shutil.copy2(adapters / "brief" / file, tmp)
        os.replace(tmp, adapters / "caps" / file)
    new = registry.resolve("caps")
    assert (new.task_id, new.digest != old.digest) == (old.task_id, True)
    # a request resolved before the change finishes on the old version
    (late,) = model.execute([miss(pb_utils, old)])
    assert AdapterRef.from_json(outputs(pb_utils, late)["LORA"]) == old
    assert outputs(pb_utils, late)["LORA_TIER"] == "engine"
    # new requests load the new version, and the engine drops the old one
    (fresh,) = model.execute([miss(pb_utils, new)])
    out = outputs(pb_utils, fresh)
    assert (out["LORA_TIER"], json.loads(out["LORA_EVICT"])) == ("disk", [old.digest])
    assert out["LORA_WEIGHTS"] == (adapters / "brief" / WEIGHTS_FILE).read_bytes()
    # the old version is still in host memory for stragglers, without evicting the new one
    (straggler,) = model.execute([miss(pb_utils, old)])
    out = outputs(pb_utils, straggler)
    assert (out["LORA_TIER"], out["LORA_EVICT"]) == ("host", "[]")


def test_a_version_no_tier_holds_is_unavailable(
    start: Start, pb_utils: ModuleType, registry: AdapterRegistry, adapters: Path
) -> None:
    model = start(host_max_adapters="0")
    old = registry.resolve("french")
    shutil.copy2(adapters / "brief" / WEIGHTS_FILE, adapters / "french" / WEIGHTS_FILE)
    (response,) = model.execute([miss(pb_utils, old)])
    assert response.error().code() == pb_utils.TritonError.UNAVAILABLE
    assert "changed since this request was resolved" in response.error().message()


def test_bad_requests_get_their_own_errors_and_the_batch_is_served(
    model: Any, pb_utils: ModuleType, registry: AdapterRegistry
) -> None:
    french = registry.resolve("french")
    unresolved = envelope_text(GenerationRequest(prompt="x", lora_name="french"))
    bad_digest = AdapterRef("french", french.task_id, "not-hex")
    requests = [
        miss(pb_utils, french),
        make_request(pb_utils, ENVELOPE="{not json", LOOKUP_STATUS="miss"),
        make_request(pb_utils, ENVELOPE=request_json(french), LOOKUP_STATUS="maybe"),
        make_request(pb_utils, ENVELOPE=unresolved, LOOKUP_STATUS="miss"),
        miss(pb_utils, bad_digest),
        admin(pb_utils, op="drop-everything"),
        make_request(pb_utils, ADMIN="[1, 2]"),
        admin(pb_utils, op="list", verbose=True),
        admin(pb_utils, op="warm", names=[]),
        admin(pb_utils, op="weights", lora={"name": "french"}),
        miss(pb_utils, None),
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
    model: Any, pb_utils: ModuleType, registry: AdapterRegistry, engine: FakeEngine
) -> None:
    french = registry.resolve("french")
    model.execute([miss(pb_utils, french)])
    engine.held[french.digest] = json.loads(french.to_json())  # llm passed it on
    (response,) = model.execute([admin(pb_utils, op="list")])
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
    model: Any, pb_utils: ModuleType, engine: FakeEngine, adapters: Path
) -> None:
    (adapters / "caps" / CONFIG_FILE).write_text('{"peft_type": "PREFIX_TUNING"}')
    engine.error = "engine is restarting"
    (response,) = model.execute([admin(pb_utils, op="list")])
    report = json.loads(outputs(pb_utils, response)["ADMIN_RESULT"])
    (broken,) = [row for row in report["adapters"] if row["name"] == "caps"]
    assert broken["tier"] == "" and "expected 'LORA'" in broken["problem"]
    assert report["engine_reported"] is None
    assert "engine is restarting" in report["engine_error"]


def test_warm_loads_into_the_engine_before_the_first_request(
    model: Any, pb_utils: ModuleType, registry: AdapterRegistry, engine: FakeEngine, adapters: Path
) -> None:
    (response,) = model.execute([admin(pb_utils, op="warm", names=["brief", "caps"])])
    report = json.loads(outputs(pb_utils, response)["ADMIN_RESULT"])
    assert report["op"] == "warm"
    assert report["warmed"] == {"brief": "loaded", "caps": "loaded"}
    brief, caps = registry.resolve("brief"), registry.resolve("caps")
    assert set(engine.held) == {brief.digest, caps.digest}
    load = engine.calls[0]
    assert load["LORA_OP"] == b"load" and AdapterRef.from_json(load["LORA"].decode()) == brief
    assert (load["LORA_CONFIG"].decode(), load["LORA_WEIGHTS"]) == files(adapters, "brief")
    assert {r["name"]: r["tier"] for r in report["adapters"]}["brief"] == "engine"
    assert {a["name"] for a in report["engine_reported"]} == {"brief", "caps"}
    # the first request finds it in the engine: nothing to send
    (first,) = model.execute([miss(pb_utils, brief)])
    assert outputs(pb_utils, first)["LORA_TIER"] == "engine"
    assert outputs(pb_utils, first)["LORA_WEIGHTS"] == b""
    # warming again is harmless; warming a third adapter evicts through the engine call
    (again,) = model.execute([admin(pb_utils, op="warm", names=["caps", "french"])])
    report = json.loads(outputs(pb_utils, again)["ADMIN_RESULT"])
    assert report["warmed"] == {"caps": "already loaded", "french": "loaded"}
    assert json.loads(engine.calls[-2]["LORA_EVICT"]) == [brief.digest]
    assert brief.digest not in engine.held and len(engine.held) == 2


def test_warm_of_an_unknown_adapter_is_not_found_and_loads_nothing(
    model: Any, pb_utils: ModuleType, engine: FakeEngine
) -> None:
    (response,) = model.execute([admin(pb_utils, op="warm", names=["caps", "nope"])])
    assert response.error().code() == pb_utils.TritonError.NOT_FOUND
    assert "unknown adapter 'nope'" in response.error().message()
    assert engine.calls == []


def test_warm_reports_an_engine_failure_per_name(
    model: Any, pb_utils: ModuleType, engine: FakeEngine
) -> None:
    engine.error = "out of adapter memory"
    (response,) = model.execute([admin(pb_utils, op="warm", names=["caps"])])
    report = json.loads(outputs(pb_utils, response)["ADMIN_RESULT"])
    assert report["warmed"]["caps"].startswith("error: unavailable:")
    assert "out of adapter memory" in report["warmed"]["caps"]
    # the mirror does not believe the engine holds it: the first request sends the weights
    assert {r["name"]: r["tier"] for r in report["adapters"]}["caps"] == "host"


def test_weights_op_sends_them_again_after_the_engine_lost_them(
    model: Any, pb_utils: ModuleType, registry: AdapterRegistry, adapters: Path
) -> None:
    caps = registry.resolve("caps")
    model.execute([miss(pb_utils, caps)])  # the mirror now says the engine holds it
    for lora in (json.loads(caps.to_json()), caps.to_json()):  # an object, or its JSON text
        (response,) = model.execute([admin(pb_utils, op="weights", lora=lora)])
        out = outputs(pb_utils, response)
        assert (out["LORA_CONFIG"], out["LORA_WEIGHTS"]) == files(adapters, "caps")
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
    start: Start, pb_utils: ModuleType, registry: AdapterRegistry
) -> None:
    model = start(engine_slots="2", prefetch="french", pin="french")
    french, caps, brief = (registry.resolve(n) for n in NAMES)
    (first,) = model.execute([miss(pb_utils, french)])
    assert outputs(pb_utils, first)["LORA_TIER"] == "engine"  # torch_llm loaded it at its start
    model.execute([miss(pb_utils, caps)])
    (third,) = model.execute([miss(pb_utils, brief)])
    assert json.loads(outputs(pb_utils, third)["LORA_EVICT"]) == [caps.digest]  # not french
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
    start: Start, pb_utils: ModuleType, registry: AdapterRegistry
) -> None:
    """engine_kind tensorrt_llm: TensorRT-LLM's request tensors beside the PEFT files; the
    version's lora_task_id on every miss, lora_weights / lora_config only on a load."""
    from tiercache.adapter_types import engine_task_id

    model = start(engine_slots="2", engine_kind="tensorrt_llm")
    french = registry.resolve("french")
    first, second = model.execute([miss(pb_utils, french), miss(pb_utils, french)])
    for response in (first, second):
        task = pb_utils.get_output_tensor_by_name(response, "LORA_TASK_ID").as_numpy()
        assert task.dtype == np.uint64 and task.tolist() == [[engine_task_id(french)]]
    weights = pb_utils.get_output_tensor_by_name(first, "LORA_TRT_WEIGHTS").as_numpy()
    config = pb_utils.get_output_tensor_by_name(first, "LORA_TRT_CONFIG").as_numpy()
    assert weights.dtype == np.float16 and weights.shape[:2] == (1, 60)  # q and v, 30 layers
    assert config.dtype == np.int32 and config.shape == (1, 60, 3)
    assert pb_utils.get_output_tensor_by_name(second, "LORA_TRT_WEIGHTS") is None
    (base,) = model.execute([miss(pb_utils, None)])
    assert pb_utils.get_output_tensor_by_name(base, "LORA_TASK_ID") is None


def test_unknown_engine_kind_fails_initialize(start: Start) -> None:
    with pytest.raises(ConfigError, match="engine_kind"):
        start(engine_kind="vllm")
