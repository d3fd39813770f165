"""model_repository/embedder/1/model.py against the pb_utils stand-in, with a fake sentence
embedder: torch's threads are set from `torch_threads` before the embedder loads, each request
gets its own vectors, a request without TEXT or with a text over MAX_TEXT_BYTES gets its own
error, and a failed encode answers its batch's requests with its error."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tiercache.engine.threads import ThreadRole


class FakeEmbedder:
    """Embedder's surface: a text's vector is [its length, 1, 0, ...]."""

    def __init__(
        self, name: str, device: str, *, packed_linears: bool, events: list[object]
    ) -> None:
        events.append(("embedder", packed_linears))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        vectors = np.zeros((len(texts), 4), dtype=np.float32)
        vectors[:, 0] = [len(t) for t in texts]
        vectors[:, 1] = 1.0
        return vectors


def test_threads_first_then_one_response_per_request(
    pb_utils: ModuleType,
    load_model: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = load_model("embedder")
    stage = importlib.import_module("tiercache.stages.embedder")  # after the stand-in
    events: list[object] = []

    def set_torch_threads(setting: str, auto_divisor: int) -> int:
        events.append((setting, auto_divisor))
        return 1

    monkeypatch.setattr(stage, "Embedder", lambda *a, **k: FakeEmbedder(*a, **k, events=events))
    monkeypatch.setattr(stage, "set_torch_threads", set_torch_threads)
    instance = module.TritonPythonModel()
    params = {
        "torch_threads": {"string_value": "auto"},
        "device": {"string_value": "cpu"},
        "packed_linears": {"string_value": "false"},
    }
    instance.initialize(
        {"model_config": json.dumps({"parameters": params}), "model_name": "embedder"}
    )
    assert events == [("auto", ThreadRole.EMBEDDER), ("embedder", False)]

    def request(*texts: str) -> Any:
        array = np.array([[t.encode()] for t in texts], dtype=np.object_)
        return pb_utils.InferenceRequest([pb_utils.Tensor("TEXT", array)])

    no_text = pb_utils.InferenceRequest([])
    huge = request("x", "y" * (module.MAX_TEXT_BYTES + 1))  # a direct caller's megabytes
    responses = instance.execute([request("a", "bbb"), no_text, huge, request("cc")])
    first, missing, refused, last = responses
    assert first.output_tensors()[0].as_numpy()[:, 0].tolist() == [1.0, 3.0]
    assert missing.has_error() and "TEXT is required" in missing.error().message()
    assert refused.has_error() and "over the" in refused.error().message()  # for it alone
    assert last.output_tensors()[0].as_numpy()[:, 0].tolist() == [2.0]

    def broken(texts: Sequence[str]) -> np.ndarray:
        raise MemoryError("out of memory")

    monkeypatch.setattr(instance.stage, "embed", broken)  # the batch's requests get its error
    failed = instance.execute([request("a"), request("b")])
    assert all(r.has_error() and "out of memory" in r.error().message() for r in failed)
    instance.finalize()
