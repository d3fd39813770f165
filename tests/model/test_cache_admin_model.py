"""model_repository/cache_admin/1/model.py against the pb_utils stand-in: warm then a
prompt_cache lookup hits, error codes, adapter warm-ups forwarded to lora_cache over BLS, and the
admin token: every op refused without it or with another one (nothing done, counted), served
with it."""

from __future__ import annotations

import json
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

# One call of each op kind, each of which would change or reveal something if let through.
EVERY_OP = [
    {"op": "stats"},
    {"op": "invalidate", "tag": "news"},
    {"op": "flush", "confirm": True},
    {"op": "warm", "prompts": [{"text_input": "poison", "answer": "attacker's text"}]},
    {"op": "warm", "adapters": ["caps"]},
]


@pytest.fixture
def model(
    load_model: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    monkeypatch.delenv("TIERCACHE_ADMIN_TOKEN_FILE", raising=False)
    instance = load_model("cache_admin").TritonPythonModel()
    config = {"parameters": {"state_dir": {"string_value": str(tmp_path)}}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "cache_admin"})
    yield instance
    instance.finalize()


@pytest.fixture
def token(model: Any, tmp_path: Path) -> str:
    """The admin token the model created at initialize (the file's bytes, in hex)."""
    return (tmp_path / "admin_token").read_bytes().hex()


@pytest.fixture
def lora_cache(pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A stand-in lora_cache answering `warm` over BLS; records the names it was asked for."""
    asked: list[list[str]] = []

    def serve(request: Any) -> list[Any]:
        tensor = pb_utils.get_input_tensor_by_name(request, "ADMIN")
        names = json.loads(tensor.as_numpy().reshape(-1)[0])["names"]
        asked.append(names)
        if "nope" in names:
            error = pb_utils.TritonError("not found: unknown adapter 'nope'")
            return [pb_utils.InferenceResponse([], error)]
        answer = json.dumps({"warmed": {n: "loaded" for n in names}}).encode()
        out = pb_utils.Tensor("ADMIN_RESULT", np.array([[answer]], dtype=np.object_))
        return [pb_utils.InferenceResponse([out])]

    monkeypatch.setitem(pb_utils.BLS_MODELS, "lora_cache", serve)
    return asked


def call(pb: ModuleType, model: Any, admin: str, token: str | None) -> Any:
    tensors = [pb.Tensor("ADMIN", np.array([[admin.encode()]], dtype=np.object_))]
    if token is not None:
        tensors.append(pb.Tensor("ADMIN_TOKEN", np.array([[token.encode()]], dtype=np.object_)))
    (response,) = model.execute([pb.InferenceRequest(tensors)])
    return response


def result(response: Any) -> dict:
    assert not response.has_error(), response.error().message()
    (tensor,) = response.output_tensors()
    return dict(json.loads(tensor.as_numpy().reshape(-1)[0]))


def refused(model: Any) -> dict[str, float]:
    model.stage.metrics.flush()
    return {k: c.metric.value() for k, c in model.stage.gate_metrics.refused.items()}


def test_warm_stats_and_errors(pb_utils: ModuleType, model: Any, token: str) -> None:
    warm = {"op": "warm", "prompts": [{"text_input": "hi", "answer": "hello"}]}
    assert result(call(pb_utils, model, json.dumps(warm), token))["stored"] == 1
    stats = result(call(pb_utils, model, '{"op": "stats"}', token))
    assert stats["tiers"]["l2"]["entries"] == 1
    bad = call(pb_utils, model, "{", token)
    assert bad.has_error() and bad.error().code() == pb_utils.TritonError.INVALID_ARG


def test_adapters_forwarded_over_bls(
    pb_utils: ModuleType, model: Any, token: str, lora_cache: list[list[str]]
) -> None:
    ok = result(call(pb_utils, model, '{"op": "warm", "adapters": ["caps"]}', token))
    assert ok["adapters"] == {"warmed": {"caps": "loaded"}}
    missing = call(pb_utils, model, '{"op": "warm", "adapters": ["nope"]}', token)
    assert missing.has_error() and missing.error().code() == pb_utils.TritonError.NOT_FOUND


def test_a_warm_up_lora_cache_does_not_answer_fails_after_lora_timeout_s(
    pb_utils: ModuleType,
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    lora_cache: list[list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lora_cache holds a warm-up: the admin call fails as unavailable after lora_timeout_s,
    the next at once while the first is out, and warm-ups go through once it answered."""
    serve = pb_utils.BLS_MODELS["lora_cache"]
    release = threading.Event()

    def held(request: Any) -> list[Any]:
        assert release.wait(30), "never released"
        return serve(request)

    monkeypatch.setitem(pb_utils.BLS_MODELS, "lora_cache", held)
    monkeypatch.delenv("TIERCACHE_ADMIN_TOKEN_FILE", raising=False)
    instance = load_model("cache_admin").TritonPythonModel()
    parameters = {"state_dir": str(tmp_path), "lora_timeout_s": "0.3"}
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "cache_admin"})
    token = (tmp_path / "admin_token").read_bytes().hex()
    warm = '{"op": "warm", "adapters": ["caps"]}'
    try:
        started = time.monotonic()
        first = call(pb_utils, instance, warm, token)
        assert 0.25 < time.monotonic() - started < 5
        assert first.has_error() and first.error().code() == pb_utils.TritonError.UNAVAILABLE
        assert "no answer within 0.3 s" in first.error().message()
        started = time.monotonic()
        second = call(pb_utils, instance, warm, token)
        assert second.has_error() and "not calling again" in second.error().message()
        assert time.monotonic() - started < 0.25
        release.set()
        client = instance.stage.closing[0].__self__  # the BlsClient to lora_cache
        client.deadline._late.result(timeout=10)  # the held call answers
        assert result(call(pb_utils, instance, warm, token))["adapters"]["warmed"] == {
            "caps": "loaded"
        }
    finally:
        release.set()
        instance.finalize()


def test_token_file_is_private_and_kept(model: Any, tmp_path: Path, token: str) -> None:
    path = tmp_path / "admin_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes()) == 32 and len(token) == 64


@pytest.mark.parametrize("op", EVERY_OP, ids=lambda op: op["op"] + "-" + "-".join(sorted(op)))
@pytest.mark.parametrize(
    ("given", "reason"),
    [(None, "missing"), ("", "missing"), ("0" * 64, "wrong"), ("short", "wrong")],
    ids=["no-input", "empty", "wrong", "short"],
)
def test_every_op_refused_without_the_token(
    pb_utils: ModuleType,
    model: Any,
    token: str,
    lora_cache: list[list[str]],
    op: dict,
    given: str | None,
    reason: str,
) -> None:
    seeded = {"op": "warm", "prompts": [{"text_input": "kept", "answer": "kept answer"}]}
    assert result(call(pb_utils, model, json.dumps(seeded), token))["stored"] == 1

    response = call(pb_utils, model, json.dumps(op), given)
    assert response.has_error()
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message().startswith("forbidden: ")
    assert response.output_tensors() == []
    # Nothing was done: the seeded entry is still the only one, lora_cache was never asked.
    stats = result(call(pb_utils, model, '{"op": "stats"}', token))
    assert stats["tiers"]["l2"]["entries"] == 1
    assert lora_cache == []
    assert refused(model) == {"missing": 0, "wrong": 0, reason: 1}


def test_bad_json_with_no_token_is_forbidden_first(pb_utils: ModuleType, model: Any) -> None:
    response = call(pb_utils, model, "{", None)
    assert response.error().message().startswith("forbidden: ")


def test_an_undecodable_admin_with_no_token_is_forbidden_and_counted(
    pb_utils: ModuleType, model: Any
) -> None:
    """ADMIN is not even decoded before the token is checked: bytes that are not UTF-8, or a
    batch of two, from a caller without the token are a counted refusal, not an input error."""
    for value in (
        np.array([[b"\xff\xfe"]], dtype=np.object_),
        np.array([[b"a"], [b"b"]], dtype=np.object_),
    ):
        (response,) = model.execute([pb_utils.InferenceRequest([pb_utils.Tensor("ADMIN", value)])])
        assert response.error().message().startswith("forbidden: ")
    assert refused(model) == {"missing": 2, "wrong": 0}


@pytest.mark.parametrize("op", EVERY_OP, ids=lambda op: op["op"] + "-" + "-".join(sorted(op)))
def test_every_op_served_with_the_token(
    pb_utils: ModuleType, model: Any, token: str, lora_cache: list[list[str]], op: dict
) -> None:
    assert result(call(pb_utils, model, json.dumps(op), token))["op"] == op["op"]
    assert refused(model) == {"missing": 0, "wrong": 0}
    assert model.stage.gate.stats().allowed == 1  # one call, counted once


def test_token_file_named_by_the_environment(
    load_model: Callable[[str], ModuleType],
    pb_utils: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    named = tmp_path / "secrets" / "operator_token"
    named.parent.mkdir()
    named.write_bytes(b"x" * 40)
    named.chmod(0o600)
    monkeypatch.setenv("TIERCACHE_ADMIN_TOKEN_FILE", str(named))
    instance = load_model("cache_admin").TritonPythonModel()
    config = {"parameters": {"state_dir": {"string_value": str(tmp_path / "state")}}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "cache_admin"})
    try:
        assert not (tmp_path / "state" / "admin_token").exists()
        assert result(call(pb_utils, instance, '{"op": "stats"}', (b"x" * 40).hex()))
        wrong = call(pb_utils, instance, '{"op": "stats"}', (b"x" * 32).hex())
        assert wrong.error().message().startswith("forbidden: ")
    finally:
        instance.finalize()
