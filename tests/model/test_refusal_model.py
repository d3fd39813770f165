"""torch_llm's input policy through its model.py (pb_utils stand-in, the stand-in engine of
test_torch_llm_model): a matching prompt is answered with the refusal text and FINISH_REASON
content_filter without reaching the engine, counted on its own metric; a bad pattern fails
initialize."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import seals
from test_torch_llm_model import FakeEngine, call, envelope_text, text

from tiercache.errors import ConfigError
from tiercache.exact.request import GenerationRequest
from tiercache.stages.seal import Sealer

REFUSAL = "Not here."


def start(
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pattern: str,
) -> Any:
    module = load_model("torch_llm")
    torch_llm_stage = importlib.import_module("tiercache.stages.torch_llm")  # after the stand-in
    monkeypatch.setattr(torch_llm_stage, "TorchEngine", FakeEngine)
    monkeypatch.setattr(torch_llm_stage, "resolve_model", lambda name: None)
    instance = module.TritonPythonModel()
    params = {
        "state_dir": {"string_value": str(tmp_path)},
        "refuse_prompt_pattern": {"string_value": pattern},
        "refusal_text": {"string_value": REFUSAL},
    }
    instance.initialize({"model_config": json.dumps({"parameters": params}), "model_name": "e"})
    return instance


@pytest.fixture
def model(
    load_model: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    instance = start(load_model, tmp_path, monkeypatch, "(?i)secret recipe")
    yield instance
    instance.finalize()


@pytest.fixture
def sealer(tmp_path: Path) -> Sealer:
    return seals.sealer_for(tmp_path)


def test_matching_prompt_is_refused_with_content_filter(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    envelope = envelope_text(sealer, GenerationRequest("The SECRET recipe, please"))
    responses = call(pb_utils, model, sealer, ENVELOPE=envelope)
    assert len(responses) == 1  # one final response, no engine chunks
    assert text(pb_utils, responses[0]) == REFUSAL
    assert text(pb_utils, responses[0], "FINISH_REASON") == "content_filter"
    model.stage.metrics.flush()
    assert model.stage.finished["content_filter"].metric.value() == 1


def test_other_prompts_are_generated(pb_utils: ModuleType, model: Any, sealer: Sealer) -> None:
    envelope = envelope_text(sealer, GenerationRequest("A cake recipe"))
    responses = call(pb_utils, model, sealer, ENVELOPE=envelope)
    assert [text(pb_utils, r) for r in responses] == ["Hello", " there"]
    assert text(pb_utils, responses[-1], "FINISH_REASON") == "stop"


def test_bad_pattern_fails_initialize(
    load_model: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="refuse_prompt_pattern"):
        start(load_model, tmp_path, monkeypatch, "(unclosed")
