"""PEFT adapters -> TensorRT-LLM's lora_weights / lora_config, checked on the committed adapters
(rank 8, alpha 16, q_proj and v_proj on SmolLM2-135M: 30 layers, hidden 576, v_proj out 192)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from tiercache.adapter_types import AdapterRef, AdapterWeights, engine_task_id
from tiercache.errors import ConfigError, InvalidRequest
from tiercache.lora.registry import adapter_digest
from tiercache.lora.trtllm import (
    MODULE_IDS,
    EngineLoraShape,
    TrtllmLoraConverter,
    convert_adapter,
    convert_peft,
)

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
NAMES = ("french", "caps", "brief")
LAYERS, HIDDEN, KV_OUT, RANK, SCALE = 30, 576, 192, 8, 16 / 8
Q, V = MODULE_IDS["attn_q"], MODULE_IDS["attn_v"]
PREFIX = "base_model.model.model.layers"
SMOLLM2 = EngineLoraShape(
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_lora_rank=8,
)


def committed(name: str) -> AdapterWeights:
    config = (ADAPTERS / name / "adapter_config.json").read_bytes()
    weights = (ADAPTERS / name / "adapter_model.safetensors").read_bytes()
    ref = AdapterRef(name, NAMES.index(name) + 1, adapter_digest(config, weights))
    return AdapterWeights(ref, config.decode(), weights)


@pytest.fixture(scope="module")
def french() -> AdapterWeights:
    return committed("french")


def split_row(row: np.ndarray, rank: int, hidden_in: int, hidden_out: int) -> tuple[Any, Any]:
    """(in [D, Hi], out [Ho, D]) of one lora_weights row, as the engine reads it."""
    a = row[: rank * hidden_in].reshape(rank, hidden_in)
    b = row[rank * hidden_in : rank * (hidden_in + hidden_out)].reshape(hidden_out, rank)
    return a, b


def peft_config(**changes: Any) -> str:
    options: dict[str, Any] = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "o_proj", "down_proj"],
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    options.update(changes)
    return json.dumps(options)


def synthetic(ranks: dict[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Two layers of q_proj (8 -> 8), o_proj (8 -> 8) and down_proj (12 -> 8)."""
    rng = np.random.default_rng(seed)
    dims = {"self_attn.q_proj": (8, 8), "self_attn.o_proj": (8, 8), "mlp.down_proj": (12, 8)}
    ranks = ranks or {}
    tensors = {}
    for layer in (0, 1):
        for module, (hidden_in, hidden_out) in dims.items():
            rank = ranks.get(module.split(".")[1], 4)
            key = f"{PREFIX}.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, hidden_in), np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((hidden_out, rank), np.float32)
    return tensors


# -- the committed adapters -------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_shapes_module_ids_and_layer_order(name: str) -> None:
    lora = convert_adapter(committed(name))
    assert lora.weights.shape == (2 * LAYERS, RANK * (HIDDEN + HIDDEN))  # q rows are the longest
    assert lora.weights.dtype == np.float16
    assert lora.config.dtype == np.int32 and lora.config.shape == (2 * LAYERS, 3)
    expected = [(module, layer, RANK) for layer in range(LAYERS) for module in (Q, V)]
    assert [tuple(row) for row in lora.config.tolist()] == expected
    assert (Q, V) == (1, 3)


@pytest.mark.parametrize("layer", [0, 13, 29])
def test_row_matrices_reproduce_the_peft_delta(french: AdapterWeights, layer: int) -> None:
    peft = load_safetensors(french.weights)
    lora = convert_adapter(french)
    for module, hf, hidden_out in ((Q, "q_proj", HIDDEN), (V, "v_proj", KV_OUT)):
        row = lora.weights[2 * layer + (module == V)]
        assert tuple(lora.config[2 * layer + (module == V)]) == (module, layer, RANK)
        a_in, b_out = split_row(row.astype(np.float32), RANK, HIDDEN, hidden_out)
        key = f"{PREFIX}.{layer}.self_attn.{hf}"
        a, b = peft[f"{key}.lora_A.weight"], peft[f"{key}.lora_B.weight"]
        delta = SCALE * b @ a  # PEFT: W + (alpha / r) * B @ A
        np.testing.assert_allclose(b_out @ a_in, delta, rtol=0, atol=2e-3 * np.abs(delta).max())
        # the scale sits on the out side only, and float16 rounding is all that changed
        np.testing.assert_array_equal(a_in, a.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(b_out, (SCALE * b).astype(np.float16).astype(np.float32))


def test_float32_rows_are_exact(french: AdapterWeights) -> None:
    peft = load_safetensors(french.weights)
    lora = convert_adapter(french, dtype="float32")
    a_in, b_out = split_row(lora.weights[2 * 7 + 1], RANK, HIDDEN, KV_OUT)
    key = f"{PREFIX}.7.self_attn.v_proj"
    np.testing.assert_array_equal(a_in, peft[f"{key}.lora_A.weight"])
    np.testing.assert_array_equal(b_out, np.float32(SCALE) * peft[f"{key}.lora_B.weight"])


def test_short_rows_are_zero_padded(french: AdapterWeights) -> None:
    lora = convert_adapter(french)
    v_used = RANK * (HIDDEN + KV_OUT)
    for i, (module, _, _) in enumerate(lora.config.tolist()):
        row = lora.weights[i]
        if module == V:
            assert not row[v_used:].any() and row[v_used:].size == RANK * (HIDDEN - KV_OUT)
            assert row[:v_used].any()
        else:
            assert np.count_nonzero(row) > 0.99 * row.size  # a q row fills the width


def test_bfloat16_rounds_like_ml_dtypes(french: AdapterWeights) -> None:
    as_f32 = convert_adapter(french, dtype="float32")
    as_bf16 = convert_adapter(french, dtype="bfloat16")
    assert as_bf16.weights.dtype == np.dtype(ml_dtypes.bfloat16)
    expected = as_f32.weights.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(as_bf16.weights.view(np.uint16), expected.view(np.uint16))


def test_arrays_are_read_only(french: AdapterWeights) -> None:
    lora = convert_adapter(french)
    with pytest.raises(ValueError):
        lora.weights[0, 0] = 1
    with pytest.raises(ValueError):
        lora.config[0, 0] = 1


def test_fits_the_smollm2_engine_and_not_others(french: AdapterWeights) -> None:
    assert convert_adapter(french, engine=SMOLLM2).rows == 2 * LAYERS
    cases = {
        "not built with LoRA module attn_v": dict(modules=("attn_q", "attn_k")),
        "exceeds the engine's 4": dict(max_lora_rank=4),
        "has 24 layers": dict(num_layers=24),
        "another base model": dict(num_kv_heads=9),
    }
    for message, change in cases.items():
        engine = EngineLoraShape(**{**_fields(SMOLLM2), **change})
        with pytest.raises(InvalidRequest, match=message):
            convert_adapter(french, engine=engine)


def _fields(shape: EngineLoraShape) -> dict[str, Any]:
    return {name: getattr(shape, name) for name in shape.__slots__}


# -- scaling, ranks, file formats -------------------------------------------------------------


def test_rslora_scale_is_alpha_over_sqrt_rank() -> None:
    tensors = synthetic()
    lora = convert_peft(peft_config(use_rslora=True), save_safetensors(tensors), dtype="float32")
    a_in, b_out = split_row(lora.weights[0], 4, 8, 8)
    np.testing.assert_array_equal(a_in, tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"])
    np.testing.assert_allclose(b_out, 4.0 * tensors[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"])


def test_rank_pattern_gives_each_module_its_rank_and_scale() -> None:
    tensors = synthetic({"o_proj": 2, "down_proj": 6})
    config = peft_config(rank_pattern={"o_proj": 2, "down_proj": 6})
    lora = convert_peft(config, save_safetensors(tensors), dtype="float32")
    rows = [tuple(row) for row in lora.config.tolist()]
    attn_q, attn_dense, down = (
        MODULE_IDS["attn_q"],
        MODULE_IDS["attn_dense"],
        MODULE_IDS["mlp_4h_to_h"],
    )
    assert rows == [(attn_q, 0, 4), (attn_dense, 0, 2), (down, 0, 6)] + [
        (attn_q, 1, 4),
        (attn_dense, 1, 2),
        (down, 1, 6),
    ]
    assert lora.weights.shape[1] == 6 * (12 + 8)
    a_in, b_out = split_row(lora.weights[2], 6, 12, 8)
    key = f"{PREFIX}.0.mlp.down_proj"
    expected = (8 / 6) * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
    np.testing.assert_allclose(b_out @ a_in, expected, rtol=1e-5, atol=1e-6)


def test_all_seven_projections_map_to_their_modules() -> None:
    rng = np.random.default_rng(1)
    parents = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
    parents |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    tensors = {}
    for hf, parent in parents.items():
        key = f"{PREFIX}.3.{parent}.{hf}"
        tensors[f"{key}.lora_A.weight"] = rng.standard_normal((4, 8), np.float32)
        tensors[f"{key}.lora_B.weight"] = rng.standard_normal((8, 4), np.float32)
    config = peft_config(target_modules=list(parents))
    lora = convert_peft(config, save_safetensors(tensors))
    assert [tuple(row) for row in lora.config.tolist()] == [(m, 3, 4) for m in range(1, 8)]


def test_bfloat16_tensors_in_the_file_are_read() -> None:
    a = np.array([[1.0, -2.5], [0.15625, 3.0]], np.float32)  # exact in bfloat16
    b = np.array([[0.5, 0.25], [-1.0, 2.0]], np.float32)
    key = f"{PREFIX}.0.self_attn.q_proj"
    data = _safetensors_bf16({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b})
    lora = convert_peft(peft_config(r=2, lora_alpha=2), data, dtype="float32")
    a_in, b_out = split_row(lora.weights[0], 2, 2, 2)
    np.testing.assert_array_equal(a_in, a)
    np.testing.assert_array_equal(b_out, b)


def _safetensors_bf16(tensors: dict[str, np.ndarray]) -> bytes:
    header, body = {}, b""
    for name, array in tensors.items():
        raw = (array.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape)}
        header[name]["data_offsets"] = [len(body), len(body) + len(raw)]
        body += raw
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


# -- what the layout cannot carry -------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(use_dora=True), "use_dora=True is not supported: DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save=.* not LoRA rows"),
        (dict(bias="lora_only"), "bias='lora_only' is not supported"),
        (dict(lora_bias=True), "lora_bias=True"),
        (dict(alpha_pattern={"q_proj": 32}), "per-module alphas"),
        (dict(target_modules=["q_proj", "fc1"]), r"target modules \['fc1'\] have no TensorRT-LLM"),
        (dict(peft_type="IA3"), "peft_type is 'IA3'"),
        (dict(r=8), "rank 4 differs from r=8"),
        (dict(lora_alpha=None), "lora_alpha must be a positive number"),
        (dict(layer_replication=[[0, 2]]), "layer_replication"),
    ],
)
def test_unsupported_options_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        convert_peft(peft_config(**change), save_safetensors(synthetic()), where="adapter x")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", "not lora_A/lora_B"),
        ("base_model.model.lm_head.lora_A.weight", "lm_head.lora_A.weight"),
        (f"{PREFIX}.0.self_attn.qkv_proj.lora_A.weight", "qkv_proj"),
        (f"{PREFIX}.0.mlp.q_proj.lora_A.weight", "mlp.q_proj"),  # wrong parent
        (f"{PREFIX}.0.self_attn.q_proj.lora_A.bias", "lora_A.bias"),
    ],
)
def test_foreign_tensors_are_refused(extra: str, message: str) -> None:
    tensors = synthetic()
    tensors[extra] = np.ones((4, 8), np.float32)
    with pytest.raises(InvalidRequest, match=message):
        convert_peft(peft_config(), save_safetensors(tensors))


def test_broken_pairs_and_files_are_refused() -> None:
    tensors = synthetic()
    del tensors[f"{PREFIX}.1.mlp.down_proj.lora_B.weight"]
    with pytest.raises(InvalidRequest, match="layer 1 mlp_4h_to_h: lora_B is missing"):
        convert_peft(peft_config(), save_safetensors(tensors))
    tensors = synthetic()
    tensors[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"] = np.ones((8, 3), np.float32)
    with pytest.raises(InvalidRequest, match=r"are not \[r, hidden_in\] and \[hidden_out, r\]"):
        convert_peft(peft_config(), save_safetensors(tensors))
    tensors = synthetic()
    tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"][0, 0] = np.nan
    with pytest.raises(InvalidRequest, match="NaN or infinity"):
        convert_peft(peft_config(), save_safetensors(tensors))
    tensors = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": np.ones((4, 8), np.int32)}
    with pytest.raises(InvalidRequest, match="dtype I32, not a float type"):
        convert_peft(peft_config(), save_safetensors(tensors))
    for data in (b"", b"\xff" * 16, save_safetensors(synthetic())[:-5]):
        with pytest.raises(InvalidRequest, match="malformed"):
            convert_peft(peft_config(), data)
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        convert_peft("{", save_safetensors(synthetic()))
    with pytest.raises(InvalidRequest, match="no LoRA tensors"):
        convert_peft(peft_config(), save_safetensors({}))


def test_tensors_sharing_bytes_or_padded_far_past_the_file_are_refused() -> None:
    """One wide A/B pair whose bytes every other tensor shares, or one wide module among
    hundreds of narrow ones: a 116 KB file made a 24 MB table (rows padded to the longest),
    and a few MB would have made tens of GB. The format's rule (byte ranges back to back) and
    a bound on the padding refuse both."""
    tensors = synthetic()
    data = bytearray(save_safetensors(tensors))
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    first, second = sorted(
        (n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0]
    )[:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]  # the same bytes twice
    text = json.dumps(header).encode()
    shared = struct.pack("<Q", len(text)) + text + bytes(data[8 + header_len :])
    with pytest.raises(InvalidRequest, match="overlap or leave a gap"):
        convert_peft(peft_config(), shared)
    uneven = {  # q_proj 8 -> 8 in 300 layers, and one down_proj of 12 -> 4,096
        f"{PREFIX}.{layer}.self_attn.q_proj.lora_{part}.weight": np.ones(shape, np.float32)
        for layer in range(300)
        for part, shape in (("A", (4, 8)), ("B", (8, 4)))
    }
    uneven[f"{PREFIX}.0.mlp.down_proj.lora_A.weight"] = np.ones((4, 12), np.float32)
    uneven[f"{PREFIX}.0.mlp.down_proj.lora_B.weight"] = np.ones((40_000, 4), np.float32)
    with pytest.raises(InvalidRequest, match="too uneven"):
        convert_peft(peft_config(), save_safetensors(uneven))
    assert convert_peft(peft_config(), save_safetensors(synthetic())).rows == 6  # as before


def test_float16_overflow_is_refused() -> None:
    tensors = synthetic()
    tensors[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"][0, 0] = 40000.0  # x2 > float16 max
    with pytest.raises(InvalidRequest, match="not finite in float16"):
        convert_peft(peft_config(), save_safetensors(tensors))
    assert convert_peft(peft_config(), save_safetensors(tensors), dtype="float32").rows == 6


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="float16, bfloat16, float32"):
        convert_peft(peft_config(), save_safetensors(synthetic()), dtype="fp8")
    with pytest.raises(ConfigError):
        TrtllmLoraConverter(dtype="int8")


# -- task ids and the per-request helper ------------------------------------------------------


def test_engine_task_id_is_unique_per_version() -> None:
    ref = AdapterRef("french", 3, "0123abcd" + "0" * 56)
    assert engine_task_id(ref) == (3 << 32) | 0x0123ABCD
    other_version = AdapterRef("french", 3, "0123abce" + "0" * 56)
    assert engine_task_id(other_version) != engine_task_id(ref)
    assert engine_task_id(AdapterRef("french", 2**32 - 1, "f" * 64)) == 2**64 - 1
    for bad in (AdapterRef("x", 0, "0" * 64), AdapterRef("x", 2**32, "0" * 64)):
        with pytest.raises(InvalidRequest, match="outside"):
            engine_task_id(bad)
    with pytest.raises(InvalidRequest, match="not hex"):
        engine_task_id(AdapterRef("x", 1, "zz" * 32))


def test_request_lora_sends_the_id_alone_or_with_weights(french: AdapterWeights) -> None:
    converter = TrtllmLoraConverter()
    held = converter.request_lora(french.ref, None).tensors()
    assert list(held) == ["lora_task_id"]
    assert held["lora_task_id"].dtype == np.uint64 and held["lora_task_id"].shape == (1, 1)
    assert int(held["lora_task_id"][0, 0]) == engine_task_id(french.ref)

    sent = converter.request_lora(french.ref, french).tensors()
    assert sent["lora_task_id"].tolist() == held["lora_task_id"].tolist()
    assert sent["lora_weights"].shape == (1, 2 * LAYERS, 2 * RANK * HIDDEN)
    assert sent["lora_weights"].dtype == np.float16
    assert sent["lora_config"].shape == (1, 2 * LAYERS, 3)
    assert sent["lora_config"].dtype == np.int32

    caps = committed("caps")
    with pytest.raises(InvalidRequest, match="sent for adapter french"):
        converter.request_lora(french.ref, caps)


def test_converter_keeps_recent_conversions_within_max_bytes(french: AdapterWeights) -> None:
    converter = TrtllmLoraConverter()
    first = converter.convert(french)
    assert converter.convert(french) is first
    assert converter.held_bytes == first.nbytes

    small = TrtllmLoraConverter(max_bytes=first.nbytes)  # room for one
    caps, brief = committed("caps"), committed("brief")
    kept = small.convert(caps)
    small.convert(brief)
    assert small.convert(caps) is not kept  # evicted by brief, converted again
    assert small.held_bytes == first.nbytes

    none = TrtllmLoraConverter(max_bytes=0)
    assert none.convert(french) is not none.convert(french)
    assert none.held_bytes == 0


@pytest.mark.parametrize("shape", [[-1, -4], [-2, -2], [2**40, 0], [0, 4], [4, 2**31]])
def test_shapes_no_tensor_can_have_are_refused_as_the_callers_error(shape: list[int]) -> None:
    """A negative pair multiplies to a positive element count and passed the offsets check; a
    dimension of 2**40 overflowed the int32 config: each was an internal error."""
    name = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    count = max(1, math.prod(shape))
    body = np.zeros(count if count < 1024 else 0, "<f4").tobytes()
    header = {name: {"dtype": "F32", "shape": shape, "data_offsets": [0, len(body)]}}
    text = json.dumps(header).encode()
    with pytest.raises(InvalidRequest, match="has shape"):
        convert_peft(peft_config(), struct.pack("<Q", len(text)) + text + body)
