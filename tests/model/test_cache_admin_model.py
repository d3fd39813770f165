"""model_repository/cache_admin/1/model.py against the pb_utils stand-in: warm then a
prompt_cache lookup hits, error codes, and adapter warm-ups forwarded to lora_cache over BLS."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest


@pytest.fixture
def model(load_model: Callable[[str], ModuleType], tmp_path: Path) -> Iterator[Any]:
    instance = load_model("cache_admin").TritonPythonModel()
    config = {"parameters": {"state_dir": {"string_value": str(tmp_path)}}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "cache_admin"})
    yield instance
    instance.finalize()


def call(pb: ModuleType, model: Any, admin: str) -> Any:
    tensor = pb.Tensor("ADMIN", np.array([[admin.encode()]], dtype=np.object_))
    (response,) = model.execute([pb.InferenceRequest([tensor])])
    return response


def result(response: Any) -> dict:
    (tensor,) = response.output_tensors()
    return dict(json.loads(tensor.as_numpy().reshape(-1)[0]))


def test_warm_stats_and_errors(pb_utils: ModuleType, model: Any) -> None:
    warm = {"op": "warm", "prompts": [{"text_input": "hi", "answer": "hello"}]}
    assert result(call(pb_utils, model, json.dumps(warm)))["stored"] == 1
    stats = result(call(pb_utils, model, '{"op": "stats"}'))
    assert stats["tiers"]["l2"]["entries"] == 1
    bad = call(pb_utils, model, "{")
    assert bad.has_error() and bad.error().code() == pb_utils.TritonError.INVALID_ARG


def test_adapters_forwarded_over_bls(
    pb_utils: ModuleType, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def lora_cache(request: Any) -> list[Any]:
        (tensor,) = request.inputs()
        names = json.loads(tensor.as_numpy().reshape(-1)[0])["names"]
        if "nope" in names:
            error = pb_utils.TritonError("not found: unknown adapter 'nope'")
            return [pb_utils.InferenceResponse([], error)]
        answer = json.dumps({"warmed": {n: "loaded" for n in names}}).encode()
        out = pb_utils.Tensor("ADMIN_RESULT", np.array([[answer]], dtype=np.object_))
        return [pb_utils.InferenceResponse([out])]

    monkeypatch.setitem(pb_utils.BLS_MODELS, "lora_cache", lora_cache)
    ok = result(call(pb_utils, model, '{"op": "warm", "adapters": ["caps"]}'))
    assert ok["adapters"] == {"warmed": {"caps": "loaded"}}
    missing = call(pb_utils, model, '{"op": "warm", "adapters": ["nope"]}')
    assert missing.has_error() and missing.error().code() == pb_utils.TritonError.NOT_FOUND
