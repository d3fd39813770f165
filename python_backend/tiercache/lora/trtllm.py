"""PEFT LoRA adapters in TensorRT-LLM's per-request layout: `lora_task_id`, `lora_weights`,
`lora_config`.

Pure numpy (bfloat16 output needs `ml_dtypes`, which tritonclient already requires); the
safetensors file is read here, so neither torch nor the safetensors package is needed.

Sources read (layout and ids checked against each; no code taken from them):

- NVIDIA/TensorRT-LLM `docs/source/advanced/lora.md` ("LoRA tensor format details", module id
  table, the tensor-parallel note);
- NVIDIA/TensorRT-LLM `examples/hf_lora_convert.py` (HF/PEFT adapter -> the two .npy tensors);
- NVIDIA/TensorRT-LLM `tensorrt_llm/lora_manager.py` (`LoraManager.LORA_MODULE_IDS`,
  `get_default_trtllm_modules_to_hf_modules`, `load_from_hf`: scaling, dtype, row layout);
- NVIDIA/TensorRT-LLM `cpp/include/tensorrt_llm/runtime/loraModule.h` and
  `cpp/tensorrt_llm/runtime/loraModule.cpp` (`ModuleType` ids, each module's in/out size),
  `loraUtils.cpp` (what a request is checked for), `loraCache.cpp` (`copyToPages`: how a row is
  read) and `cpp/tensorrt_llm/batch_manager/peftCacheManager.cpp` (caching by task id);
- triton-inference-server/tensorrtllm_backend `all_models/inflight_batcher_llm/tensorrt_llm/
  config.pbtxt` (the three inputs) and `docs/lora.md`.

The layout
----------
A request that brings an adapter to the backend's `tensorrt_llm` model carries:

- `lora_task_id` uint64 [1]: the id the engine caches the adapter under. Later requests send it
  alone; an id the engine does not hold fails with "LoRA task N not found in cache. Please send
  LoRA weights with request" (the retry rule in `tiercache.engine.adapter_call`).
- `lora_config` int32 [rows, 3]: one row per adapted (module, layer) pair, holding
  (module_id, layer_idx, adapter_size). Newer engines also accept a 4th column, is_dora; the
  3-column form stays valid ("pre-DoRA" rows in `loraUtils.cpp`).
- `lora_weights` [rows, row_size] in the engine's dtype: row i is, flattened row-major, the "in"
  matrix (PEFT's lora_A, adapter_size x hidden_in, D x Hi) followed by the "out" matrix (PEFT's
  lora_B, hidden_out x adapter_size, Ho x D), then zeros up to the longest row. The engine reads
  D*Hi values from the row's start as [D, Hi] and the next Ho*D as [Ho, D]; it only requires
  row_size >= D*(Hi+Ho) for each row's module. PEFT already stores A as [r, in] and B as [out, r],
  so no transpose is needed.
- The LoRA scaling is folded into the out matrix: out = scale * lora_B, with scale = lora_alpha / r,
  or lora_alpha / sqrt(r) with use_rslora, r being the module's rank (its A's row count). This is
  what both `hf_lora_convert.py` and `LoraManager.load_from_hf` do; the engine then adds
  (scale * B) @ A = PEFT's delta W. Here the product is taken in float32 before the cast to the
  engine's dtype (TensorRT-LLM multiplies in the adapter file's dtype); the difference is within
  one rounding of the output dtype.
- Over the wire each tensor gets a leading batch dimension of 1 per request ([1, rows, ...]); the
  engine checks it and drops it. Weights must be in the engine's own dtype (float16 or bfloat16,
  as built), and are always whole: the engine splits them for tensor parallelism itself.

Module ids (`LoraModule::ModuleType`) and the HF/PEFT projection each takes, as in TensorRT-LLM's
default mapping: attn_q 1 (q_proj), attn_k 2 (k_proj), attn_v 3 (v_proj), attn_dense 4 (o_proj),
mlp_h_to_4h 5 (gate_proj), mlp_4h_to_h 6 (down_proj), mlp_gate 7 (up_proj). Note gate_proj ->
mlp_h_to_4h and up_proj -> mlp_gate: TensorRT-LLM's names, not a slip. attn_qkv 0 and the fused or
MoE modules (qkv_proj, gate_up_proj, experts) are not converted. Rows come in layer order, then
module id order; the engine does not depend on the order, but a fixed order gives equal bytes for
equal adapters.

The engine must be built with LoRA: `trtllm-build --lora_plugin <dtype> --lora_target_modules`
naming every module an adapter uses (TensorRT-LLM adds the missing ones of attn_q/k/v itself) and
`--max_lora_rank` >= the adapter's rank. It rejects a row whose module it was not built with, a
layer beyond its own, or a rank above its maximum; `EngineLoraShape` lets a caller check the same
here, before a request is sent.

Task ids. TensorRT-LLM caches by `lora_task_id` alone and ignores weights sent with an id it
already holds (`LoraCache::put` returns early), so the registry's per-name task id would keep
serving the old weights after an adapter's files changed. `engine_task_id` therefore gives each
version its own id: the per-name id in the high 32 bits, the first 32 bits of the version digest
in the low 32. (Two versions of one name collide with probability 2**-32. The backend's
`lora_prefetch_dir` parses folder names as 32-bit ints, so it cannot take these ids.)

`engine_task_id` and the two payload types, `TrtllmLora` and `TrtllmRequestLora`, are in
`tiercache.adapter_types`: the engine's client (`tiercache.engine.trtllm_client`) sends what this
module converts, and the engine and lora packages do not import each other.

What the layout cannot carry is refused with InvalidRequest, naming the feature: DoRA, whole
modules (`modules_to_save`), trained biases, other LoRA variants that change the forward pass,
per-module alphas, and tensors of any module outside the table above.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.adapter_types import (
    AdapterRef,
    AdapterWeights,
    TrtllmLora,
    TrtllmRequestLora,
    engine_task_id,
)
from tiercache.errors import ConfigError, InvalidRequest

MODULE_IDS: dict[str, int] = {
    "attn_qkv": 0,
    "attn_q": 1,
    "attn_k": 2,
    "attn_v": 3,
    "attn_dense": 4,
    "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6,
    "mlp_gate": 7,
}
"""TensorRT-LLM's `LoraModule::ModuleType` values for the modules of a Llama-style decoder."""

HF_TO_TRTLLM: dict[str, str] = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "up_proj": "mlp_gate",
    "down_proj": "mlp_4h_to_h",
}
"""PEFT target module -> TensorRT-LLM LoRA module (TensorRT-LLM's default mapping)."""

_PARENT = {hf: "self_attn" if trt.startswith("attn") else "mlp" for hf, trt in HF_TO_TRTLLM.items()}

DTYPES = ("float16", "bfloat16", "float32")
"""Weight dtypes an engine can be built in (`--lora_plugin`); the weights must match it."""

CONFIG_COLUMNS = 3  # module_id, layer_idx, adapter_size

# PEFT file names: base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
TENSOR_NAME = re.compile(r"(?:.+\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")

# adapter_config.json options the layout cannot express -> why. Rejected when set (not null,
# false, empty). Options that only change training or initialisation (dropout, init_lora_weights,
# loftq/eva/corda/lora_ga, velora's backward pass) do not matter here.
UNSUPPORTED_OPTIONS: dict[str, str] = {
    "use_dora": (
        "DoRA adds a magnitude vector that must be normalised with the base weights and needs "
        "TensorRT-LLM's 4-column DoRA rows"
    ),
    "modules_to_save": (
        "whole modules saved beside the adapter (e.g. lm_head, embed_tokens) are not LoRA rows; "
        "TensorRT-LLM takes them only when the engine is built"
    ),
    "lora_bias": "a trained bias on lora_B has no place in the rows",
    "alpha_pattern": "per-module alphas are not supported; use one lora_alpha",
    "use_qalora": "QALoRA pools the input in groups before lora_A",
    "alora_invocation_tokens": "aLoRA applies the adapter only after its invocation tokens",
    "layer_replication": "replicated layers change which base layer each index names",
    "target_parameters": "LoRA on raw parameters (MoE experts) has no module row",
    "trainable_token_indices": "trainable token embeddings are not LoRA rows",
    "use_bdlora": "BD-LoRA's block-diagonal factors are not plain A and B matrices",
    "kasa_config": "KaSA changes the base weight and inserts a diagonal between A and B",
    "arrow_config": "Arrow routes among several adapters per token",
    "monteclora_config": "MonteCLoRA samples its factors",
    "fan_in_fan_out": "Conv1D (fan_in_fan_out) base layers are not the projections mapped here",
}

_SAFETENSORS_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "BF16": "<u2"}


@dataclass(frozen=True, slots=True)
class EngineLoraShape:
    """What a TensorRT-LLM engine accepts, to refuse an adapter here instead of in the engine.

    Sizes are the whole model's (before tensor parallelism), as in its HF config.json;
    `modules` and `max_lora_rank` are the engine's `--lora_target_modules` and `--max_lora_rank`.
    In/out sizes follow `LoraModule::createLoraModules`, e.g. attn_dense is hidden -> hidden.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_lora_rank: int
    modules: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")

    def __post_init__(self) -> None:
        unknown = [m for m in self.modules if m not in MODULE_IDS or m == "attn_qkv"]
        if unknown:
            raise ConfigError(f"EngineLoraShape: unknown or unsupported LoRA modules {unknown}")

    def dims(self, module: str) -> tuple[int, int]:
        """(hidden_in, hidden_out) of `module` in this engine."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        return {
            "attn_q": (self.hidden_size, q_out),
            "attn_k": (self.hidden_size, kv_out),
            "attn_v": (self.hidden_size, kv_out),
            "attn_dense": (self.hidden_size, self.hidden_size),
            "mlp_h_to_4h": (self.hidden_size, self.intermediate_size),
            "mlp_gate": (self.hidden_size, self.intermediate_size),
            "mlp_4h_to_h": (self.intermediate_size, self.hidden_size),
        }[module]


def convert_peft(
    config_json: str,
    weights: bytes,
    *,
    dtype: str = "float16",
    engine: EngineLoraShape | None = None,
    where: str = "adapter",
) -> TrtllmLora:
    """PEFT `adapter_config.json` text and `adapter_model.safetensors` bytes -> TensorRT-LLM's
    `lora_weights` and `lora_config` (layout in the module docstring).

    InvalidRequest when the adapter uses something the layout cannot carry, is malformed, or
    (with `engine`) does not fit that engine; `where` prefixes the messages (e.g. the ref).
    """
    out_dtype = _numpy_dtype(dtype)
    options = _parse_config(config_json, where)
    use_rslora = bool(options.get("use_rslora", False))
    alpha = options["lora_alpha"]
    tensors = _read_safetensors(weights, where)

    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    unknown: list[str] = []
    for name, array in tensors.items():
        match = TENSOR_NAME.fullmatch(name)
        if match is None or _PARENT.get(match[3]) != match[2]:
            unknown.append(name)
            continue
        pairs.setdefault((int(match[1]), HF_TO_TRTLLM[match[3]]), {})[match[4]] = array
    if unknown:
        shown = ", ".join(sorted(unknown)[:3]) + (" ..." if len(unknown) > 3 else "")
        raise InvalidRequest(
            f"{where}: {len(unknown)} tensor(s) are not lora_A/lora_B of a projection "
            f"TensorRT-LLM can adapt ({', '.join(HF_TO_TRTLLM)}): {shown}"
        )
    if not pairs:
        raise InvalidRequest(f"{where}: no LoRA tensors in adapter_model.safetensors")

    seen_dims: dict[str, tuple[int, int]] = {}
    rows: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # module id, layer, A, scaled B
    for (layer, module), pair in sorted(
        pairs.items(), key=lambda kv: (kv[0][0], MODULE_IDS[kv[0][1]])
    ):
        label = f"{where}: layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise InvalidRequest(f"{label}: {missing} is missing")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
            raise InvalidRequest(
                f"{label}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                "[r, hidden_in] and [hidden_out, r]"
            )
        rank, dims = int(a.shape[0]), (int(a.shape[1]), int(b.shape[0]))
        if not options.get("rank_pattern") and rank != options["r"]:
            raise InvalidRequest(f"{label}: rank {rank} differs from r={options['r']}")
        if seen_dims.setdefault(module, dims) != dims:
            raise InvalidRequest(
                f"{label}: sizes {dims} differ from {seen_dims[module]} in another layer"
            )
        if engine is not None:
            _check_fits(engine, label, module, layer, rank, dims)
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        rows.append((MODULE_IDS[module], layer, a, b * np.float32(scale)))

    row_size = max(a.size + b.size for _, _, a, b in rows)
    own = sum(a.size + b.size for _, _, a, b in rows)
    if len(rows) * row_size > MAX_PADDING * own + (1 << 20):
        # every row is padded to the longest: one wide module among hundreds of narrow ones
        # (a 116 KB file made 24 MB) would cost the process many times the adapter's size
        raise InvalidRequest(
            f"{where}: {len(rows)} rows padded to {row_size} values each are "
            f"{len(rows) * row_size / own:.0f} times the adapter's own {own} (at most "
            f"{MAX_PADDING}): its modules' sizes are too uneven for TensorRT-LLM's table"
        )
    lora_weights = np.zeros((len(rows), row_size), dtype=out_dtype)
    with np.errstate(over="ignore"):  # an overflow shows as infinity, refused just below
        for i, (_, _, a, b) in enumerate(rows):
            lora_weights[i, : a.size] = a.ravel()
            lora_weights[i, a.size : a.size + b.size] = b.ravel()
            if not np.isfinite(lora_weights[i].astype(np.float32)).all():  # a row at a time
                raise InvalidRequest(
                    f"{where}: weights are not finite in {dtype} (overflow or NaN)"
                )
    lora_config = np.array([(m, layer, a.shape[0]) for m, layer, a, _ in rows], dtype=np.int32)
    lora_weights.flags.writeable = False
    lora_config.flags.writeable = False
    return TrtllmLora(lora_weights, lora_config)


def convert_adapter(
    adapter: AdapterWeights, *, dtype: str = "float16", engine: EngineLoraShape | None = None
) -> TrtllmLora:
    """`convert_peft` of one registry version, its messages naming the version."""
    return convert_peft(
        adapter.config_json,
        adapter.weights,
        dtype=dtype,
        engine=engine,
        where=f"adapter {adapter.ref.short}",
    )


class TrtllmLoraConverter:
    """Per-request TensorRT-LLM inputs by adapter version, each version converted once.

    Keeps recent conversions up to `max_bytes` in all (LRU, keyed by AdapterRef, whose digest
    pins the content), so the one retry with weights after "not found in cache" and the next
    load of a recently evicted adapter do not convert again; a conversion larger than
    `max_bytes` is not kept, 0 keeps none. Converting is cheap next to the engine's load (about
    7 ms for a rank-8 q/v adapter of a 30-layer model), so the bound can stay small. Thread-safe.
    """

    def __init__(
        self,
        *,
        dtype: str = "float16",
        engine: EngineLoraShape | None = None,
        max_bytes: int = 64 << 20,
    ) -> None:
        _numpy_dtype(dtype)  # fail at construction, not on the first adapter
        if max_bytes < 0:
            raise ConfigError(f"TrtllmLoraConverter: max_bytes must be >= 0, got {max_bytes}")
        self.dtype = dtype
        self.engine = engine
        self.max_bytes = max_bytes
        self._done: OrderedDict[AdapterRef, TrtllmLora] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def request_lora(self, ref: AdapterRef, adapter: AdapterWeights | None) -> TrtllmRequestLora:
        """The inputs for a request on `ref`: its task id, plus the weights when `adapter` is
        given (lora_cache's plan says the engine lacks them); None sends the id alone."""
        task_id = engine_task_id(ref)
        if adapter is None:
            return TrtllmRequestLora(task_id)
        if adapter.ref != ref:
            raise InvalidRequest(f"weights of {adapter.ref.short} sent for adapter {ref.short}")
        return TrtllmRequestLora(task_id, self.convert(adapter))

    def convert(self, adapter: AdapterWeights) -> TrtllmLora:
        """`convert_adapter` with this converter's dtype and engine, kept for reuse."""
        with self._lock:
            done = self._done.get(adapter.ref)
            if done is not None:
                self._done.move_to_end(adapter.ref)
                return done
        done = convert_adapter(adapter, dtype=self.dtype, engine=self.engine)
        with self._lock:
            if adapter.ref not in self._done and done.nbytes <= self.max_bytes:
                self._done[adapter.ref] = done
                self._bytes += done.nbytes
                while self._bytes > self.max_bytes:
                    _, old = self._done.popitem(last=False)
                    self._bytes -= old.nbytes
        return done


# -- helpers ----------------------------------------------------------------------------------


def _numpy_dtype(name: str) -> np.dtype[Any]:
    if name not in DTYPES:
        raise ConfigError(f"LoRA weight dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "bfloat16":
        try:
            import ml_dtypes  # tritonclient's own BF16 type; imported only when asked for
        except ImportError as exc:
            raise ConfigError("bfloat16 LoRA weights need the ml_dtypes package") from exc
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _parse_config(config_json: str, where: str) -> dict[str, Any]:
    try:
        options = json.loads(config_json)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"{where}: adapter_config.json is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise InvalidRequest(f"{where}: adapter_config.json is not a JSON object")
    peft_type = options.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise InvalidRequest(f"{where}: peft_type is {peft_type!r}, only 'LORA' converts")
    for key, reason in UNSUPPORTED_OPTIONS.items():
        if options.get(key):
            raise InvalidRequest(f"{where}: {key}={options[key]!r} is not supported: {reason}")
    bias = options.get("bias", "none")
    if bias != "none":
        raise InvalidRequest(
            f"{where}: bias={bias!r} is not supported: TensorRT-LLM's LoRA rows have no bias"
        )
    targets = options.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(str(t) for t in targets if not isinstance(t, str) or t not in HF_TO_TRTLLM)
        if unknown:
            raise InvalidRequest(
                f"{where}: target modules {unknown} have no TensorRT-LLM LoRA module "
                f"(supported: {', '.join(HF_TO_TRTLLM)})"
            )
    for key in ("r", "lora_alpha"):
        value = options.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise InvalidRequest(f"{where}: {key} must be a positive number, got {value!r}")
    return options


def _check_fits(
    engine: EngineLoraShape, label: str, module: str, layer: int, rank: int, dims: tuple[int, int]
) -> None:
    if module not in engine.modules:
        raise InvalidRequest(
            f"{label}: the engine was not built with LoRA module {module} "
            f"(its --lora_target_modules: {' '.join(engine.modules)})"
        )
    if layer >= engine.num_layers:
        raise InvalidRequest(f"{label}: the engine has {engine.num_layers} layers")
    if rank > engine.max_lora_rank:
        raise InvalidRequest(f"{label}: rank {rank} exceeds the engine's {engine.max_lora_rank}")
    if dims != engine.dims(module):
        raise InvalidRequest(
            f"{label}: (hidden_in, hidden_out) {dims} differ from the engine's "
            f"{engine.dims(module)}; is the adapter for another base model?"
        )


# The most TensorRT-LLM's table of rows, each padded to the longest, may hold against the
# adapter's own values (a real adapter's modules differ in size by well under 2x)
MAX_PADDING = 4


def _read_safetensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    """name -> float32 array of a safetensors file: an 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets}} (offsets relative to the end of the header)."""
    bad = f"{where}: adapter_model.safetensors is malformed"
    if len(data) < 8:
        raise InvalidRequest(f"{bad}: shorter than its header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise InvalidRequest(f"{bad}: header runs past the end of the file")
    try:
        header = json.loads(data[8 : 8 + header_len].decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"{bad}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidRequest(f"{bad}: header is not a JSON object")
    body = memoryview(data)[8 + header_len :]
    _check_layout(header, len(body), bad)
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            kind = info["dtype"]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"{bad}: entry {name!r} lacks dtype, shape or offsets") from exc
        if kind not in _SAFETENSORS_DTYPES:
            raise InvalidRequest(f"{where}: tensor {name!r} has dtype {kind}, not a float type")
        if not all(0 < d < 2**31 for d in shape):
            # a negative pair multiplies to a positive count; a rank past int32 fits no config
            raise InvalidRequest(f"{bad}: tensor {name!r} has shape {shape[:8]}")
        layout = np.dtype(_SAFETENSORS_DTYPES[kind])
        count = math.prod(shape)
        if not 0 <= begin <= end <= len(body) or end - begin != count * layout.itemsize:
            raise InvalidRequest(f"{bad}: tensor {name!r} has wrong data offsets")
        raw = np.frombuffer(body[begin:end], dtype=layout)
        if kind == "BF16":  # the top half of a float32
            array = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            array = raw.astype(np.float32)
        if not np.isfinite(array).all():
            raise InvalidRequest(f"{where}: tensor {name!r} holds NaN or infinity")
        tensors[str(name)] = array.reshape(shape)
    return tensors


def _check_layout(header: dict[str, Any], body_bytes: int, bad: str) -> None:
    """The tensors' byte ranges follow one another from the body's start to its end, without
    gaps or overlaps (the format's rule, as the safetensors library holds it): tensors that
    share bytes made a 116 KB file convert to 24 MB."""
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"{bad}: entry {name!r} lacks dtype, shape or offsets") from exc
        ranges.append((begin, end))
    at = 0
    for begin, end in sorted(ranges):
        if begin != at:
            raise InvalidRequest(f"{bad}: its tensors' bytes overlap or leave a gap at {at}")
        at = end
    if at != body_bytes:
        raise InvalidRequest(f"{bad}: its tensors end at byte {at} of {body_bytes}")
