"""model_repository/embedder/1/model.py against the pb_utils stand-in, with a fake sentence
embedder: torch's threads are set from `torch_threads` before the embedder loads, each request
gets its own vectors, a request without TEXT or with a text over MAX_TEXT_BYTES gets its own
error, a text without its seal (or with another's) is refused for its request alone, and a
failed encode answers its batch's requests with its error."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tiercache.engine.threads import ThreadRole
from tiercache.stages.parts import open_sealer
from tiercache.stages.seal import EMBED_LABEL


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
    tmp_path: Path,
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
        "state_dir": {"string_value": str(tmp_path)},
    }
    instance.initialize(
        {"model_config": json.dumps({"parameters": params}), "model_name": "embedder"}
    )
    assert events == [("auto", ThreadRole.EMBEDDER), ("embedder", False)]

    sealer = open_sealer(tmp_path)  # the deployment's, as embedding_cache's

    def request(*texts: str, sealed: bool = True) -> Any:
        array = np.array([[t.encode()] for t in texts], dtype=np.object_)
        tensors = [pb_utils.Tensor("TEXT", array)]
        if sealed:
            seals = [[sealer.seal(EMBED_LABEL, t.encode()).encode()] for t in texts]
            tensors.append(pb_utils.Tensor("TEXT_SEAL", np.array(seals, dtype=np.object_)))
        return pb_utils.InferenceRequest(tensors)

    no_text = pb_utils.InferenceRequest([])
    huge = request("x", "y" * (module.MAX_TEXT_BYTES + 1))  # a direct caller's megabytes
    responses = instance.execute([request("a", "bbb"), no_text, huge, request("cc")])
    first, missing, refused, last = responses
    assert first.output_tensors()[0].as_numpy()[:, 0].tolist() == [1.0, 3.0]
    assert missing.has_error() and "TEXT is required" in missing.error().message()
    assert refused.has_error() and "over the" in refused.error().message()  # for it alone
    assert last.output_tensors()[0].as_numpy()[:, 0].tolist() == [2.0]

    # A direct caller without seals (or with another text's) is refused before the embedder
    # runs, for its request alone: the one instance every lookup waits on stays free.
    unsealed = request("a direct caller's batch", sealed=False)
    texts = np.array([[b"mine"], [b"yours"]], dtype=np.object_)
    seals = np.array(
        [
            [sealer.seal(EMBED_LABEL, b"yours").encode()],
            [sealer.seal(EMBED_LABEL, b"mine").encode()],
        ],
        dtype=np.object_,
    )
    swapped = pb_utils.InferenceRequest(
        [pb_utils.Tensor("TEXT", texts), pb_utils.Tensor("TEXT_SEAL", seals)]
    )
    refused_unsealed, refused_swapped, served = instance.execute([unsealed, swapped, request("ok")])
    assert refused_unsealed.has_error() and "not sealed" in refused_unsealed.error().message()
    assert refused_swapped.has_error() and "does not verify" in refused_swapped.error().message()
    assert served.output_tensors()[0].as_numpy()[:, 0].tolist() == [2.0]

    def broken(texts: Sequence[str]) -> np.ndarray:
        raise MemoryError("out of memory")

    monkeypatch.setattr(instance.stage, "embed", broken)  # the batch's requests get its error
    failed = instance.execute([request("a"), request("b")])
    assert all(r.has_error() and "MemoryError" in r.error().message() for r in failed)
    instance.finalize()
