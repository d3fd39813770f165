"""The gateway's edge layer looks requests up from `raw_inputs(gen)`; the ensemble's prompt_cache
from the tensors `build_inputs` sends, as Triton hands them to it (`read_raw_inputs`). For every
kind of OpenAI request both must be the same request with the same digest, or the edge would
answer something other than what the ensemble would."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from tiercache.exact.keys import EngineIdentity
from tiercache.exact.prompt_cache import PromptCache
from tiercache.exact.stores import MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.gateway import openai_api as api
from tiercache.gateway.app import ensemble_fields, raw_inputs
from tiercache.vocabulary import Tier
from tiercache_client.client import build_inputs

BODIES = [
    {"messages": [{"role": "user", "content": "What is Triton?"}]},
    {"messages": [{"role": "user", "content": "  What   is\nTriton? "}], "max_tokens": 7},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! ☃"},
            {"role": "user", "content": [{"type": "text", "text": "And now?"}]},
        ],
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 2**63 - 1,
        "stop": ["\n", "END"],
    },
    {"prompt": "<|im_start|>user\nHi<|im_end|>\n", "max_tokens": 3},
    {"prompt": "Sample me", "temperature": 1.3, "seed": 5, "stream": True},
    {
        "messages": [{"role": "user", "content": "x"}],
        "tiercache": {"cache_control": "tag=kb:v1 no-semantic"},
    },
]


def tensor(pb_utils: ModuleType, infer_input: Any) -> Any:
    """An InferInput as Triton hands it to a Python model: its bytes, deserialized."""
    raw = infer_input._get_content()
    if infer_input.datatype() == "BYTES":
        array = deserialize_bytes_tensor(raw)
    else:
        array = np.frombuffer(raw, dtype=triton_to_np_dtype(infer_input.datatype()))
    return pb_utils.Tensor(infer_input.name(), array.reshape(infer_input.shape()))


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("header", [None, "no-cache", "max-age=30"])
def test_the_edge_and_prompt_cache_read_the_same_request(
    pb_utils: ModuleType, body: dict[str, Any], header: str | None
) -> None:
    chat = "messages" in body
    gen = api.parse_request(
        {"model": "tiercache", **body},
        chat=chat,
        base_model="tiercache",
        adapters=frozenset(),
        cache_header=header,
    )
    from tiercache.triton.io import read_raw_inputs  # against the pb_utils stand-in

    inputs = build_inputs(gen.prompt, **ensemble_fields(gen))
    request = pb_utils.InferenceRequest([tensor(pb_utils, i) for i in inputs])
    lookup = PromptCache(TieredCache([(Tier.L1, MemoryStore(1 << 20))]), b"s" * 32,
                         EngineIdentity("m", "r"), embedder_key="e")  # fmt: skip
    via_triton = lookup.lookup(read_raw_inputs(request))
    at_edge = lookup.lookup(raw_inputs(gen))
    assert at_edge == via_triton
    assert at_edge.request.raw_prompt is not chat
    assert bool(at_edge.request.history) == (len(body.get("messages", [])) > 1)
