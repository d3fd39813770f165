"""Triton boundary, I/O: reading a request's inputs, building outputs, parsing stage parameters,
and the one mapping between the core's typed errors and Triton errors, both ways.

Only the `tiercache.triton` package imports `triton_python_backend_utils`; the core stays
importable without Triton. Encoding (`to_triton_error`) and decoding (`from_triton_error`) are
inverses: a typed error raised in one model reaches a BLS caller as the same type with the same
message (`tiercache.triton.bls`), because over Triton's gRPC stream the status code is lost and
only the message (which starts with the error's `kind`) arrives.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import parse_config
from tiercache.errors import (
    CapacityError,
    ConfigError,
    Forbidden,
    InvalidRequest,
    NotFound,
    TierCacheError,
    Unavailable,
)
from tiercache.exact.memo import MEMO_MAX_CHARS, Memo
from tiercache.exact.request import RawInputs
from tiercache.log_throttle import LogThrottle

log = logging.getLogger("tiercache")
_UNEXPECTED_LOG = LogThrottle()  # unexpected errors: their tracebacks, once a minute

# A stage process that crashes (SIGSEGV, or SIGABRT from a corrupted heap) prints every thread's
# Python stack to stderr, which is tritonserver's log; Triton itself only reports the stub as
# "not healthy" afterwards (docs/faults.md). Imported only by model.py files, i.e. in stubs.
if not faulthandler.is_enabled():
    faulthandler.enable(all_threads=True)
T = TypeVar("T")


def freeze_startup_objects() -> None:
    """The end of a stage's `initialize`: what it made while starting (modules, its stores and
    indexes, an engine's model) is collected once and then kept out of the cyclic garbage
    collector's sight (`gc.freeze`). Those objects live as long as the stub, and a full
    collection, which the requests' own objects set off every few thousand hits, otherwise walks
    all of them each time: in process (tiercache_dev.bench.hit_path, 3,000 distinct exact hits
    a round), full collections took 494 ms over the run unfrozen and 141 ms frozen."""
    gc.collect()
    gc.freeze()


def load_config(cls: type[T], args: dict[str, str]) -> tuple[T, dict[str, Any]]:
    """Parse `args["model_config"]`'s parameters into `cls`; returns it and the raw model config."""
    model_config = json.loads(args["model_config"])
    raw = model_config.get("parameters", {}) or {}
    values = {key: str(value.get("string_value", "")) for key, value in raw.items()}
    return parse_config(cls, values), model_config


# ---- errors -----------------------------------------------------------------------------------

# Each typed error and its Triton code. Two kinds share UNAVAILABLE and two INTERNAL: the
# message's `kind` prefix tells them apart when decoding.
_CODES: tuple[tuple[type[TierCacheError], str], ...] = (
    (Forbidden, "INVALID_ARG"),
    (InvalidRequest, "INVALID_ARG"),
    (NotFound, "NOT_FOUND"),
    (Unavailable, "UNAVAILABLE"),
    (CapacityError, "UNAVAILABLE"),
    (ConfigError, "INTERNAL"),
    (TierCacheError, "INTERNAL"),
)
_BY_KIND: dict[str, type[TierCacheError]] = {cls.kind: cls for cls, _ in reversed(_CODES)}


def to_triton_error(exc: BaseException) -> pb_utils.TritonError:
    """The core's error as a Triton error; unexpected errors are logged with their traceback and
    reach the client as a one-line INTERNAL message naming their type only (their text can
    hold file paths, addresses or another request's data: the server's log keeps it)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return pb_utils.TritonError(exc.client_message(), getattr(pb_utils.TritonError, code))
    if _UNEXPECTED_LOG.ready():  # a caller can repeat what reaches a bug: once a minute
        log.error(
            "unexpected error (%d such errors not logged)",
            _UNEXPECTED_LOG.suppressed,
            exc_info=exc,
        )
    return pb_utils.TritonError(
        f"internal: {type(exc).__name__} (details in the server's log)",
        pb_utils.TritonError.INTERNAL,
    )


def from_triton_error(message: str, code: int | None = None) -> TierCacheError:
    """The typed error behind a Triton error's message (and code, when the transport kept it):
    the class its `kind` prefix names, with the message after the prefix. A message without a
    known prefix (another backend's error) is typed by its code: INVALID_ARG and NOT_FOUND as
    the caller's fault, anything else as Unavailable (the dependency failed; a retry may work)."""
    kind, sep, rest = message.partition(": ")
    if sep and kind in _BY_KIND:
        return _BY_KIND[kind](rest)
    if code == pb_utils.TritonError.INVALID_ARG:
        return InvalidRequest(message)
    if code == pb_utils.TritonError.NOT_FOUND:
        return NotFound(message)
    return Unavailable(message)


def error_response(exc: BaseException) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(output_tensors=[], error=to_triton_error(exc))


_NAME = operator.methodcaller("name")


class Inputs:
    """One request's input tensors, looked up by name.

    Built once per request: `pb_utils.get_input_tensor_by_name` rebuilds the list of the
    request's tensors on every call, which on the 11-input hit path cost more than the lookup.
    Every reader returns None for an omitted input and raises InvalidRequest naming the input
    for a wrong batch size, shape, dtype or encoding.
    """

    __slots__ = ("_tensors",)

    def __init__(self, request: Any) -> None:
        tensors = request.inputs()  # a list (zip below reads it twice)
        if not isinstance(tensors, list):
            tensors = list(tensors)
        # by name without a Python loop (llm has 16 inputs)
        self._tensors = dict(zip(map(_NAME, tensors), tensors, strict=True))

    def names(self) -> list[str]:
        """The names of the inputs the request carries."""
        return list(self._tensors)

    def _array(self, name: str) -> np.ndarray | None:
        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        array = tensor.as_numpy()
        if array.ndim >= 2 and array.shape[0] != 1:
            raise InvalidRequest(f"{name}: batch size must be 1, got shape {list(array.shape)}")
        return array

    def raw_key(self, names: Sequence[str], max_bytes: int) -> tuple[object, ...] | None:
        """The inputs `names` exactly as received (each one's dtype, shape and values; None
        for an omitted one), as a hashable key: two requests with equal keys carry the same
        tensors byte for byte. None when their values hold more than `max_bytes` (checked
        before anything is copied), or a BYTES tensor holds more than one value or anything but
        bytes or text (a key is for memoizing small repeated requests)."""
        parts: list[object] = []
        size = 0
        tensors = self._tensors
        for name in names:
            tensor = tensors.get(name)
            if tensor is None:
                parts.append(None)
                continue
            array = tensor.as_numpy()
            if array.dtype.kind != "O":
                size += array.nbytes
                if size > max_bytes:
                    return None
                parts.append((array.dtype.str, array.shape, array.tobytes()))
                continue
            if array.size != 1:
                return None
            value = array.item()
            if not isinstance(value, (bytes, str)):
                return None
            size += len(value)
            if size > max_bytes:
                return None
            parts.append((array.shape, value))
        return tuple(parts)

    def key(self, max_bytes: int) -> tuple[tuple[str, ...], tuple[object, ...]] | None:
        """Every input the request carries, exactly as received, as a hashable key: their
        names, in the order they came, and `raw_key` of them. Two requests with equal keys carry
        the same tensors byte for byte (in the same order: another order is another key).
        None as `raw_key`."""
        names = tuple(self._tensors)
        parts = self.raw_key(names, max_bytes)
        return None if parts is None else (names, parts)

    def batch_strings(self, name: str, max_bytes: int | None = None) -> list[str] | None:
        """All texts of a BYTES input whose batch dimension may exceed 1 (one per row);
        InvalidRequest for a value over `max_bytes` (checked before anything is decoded)."""
        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        values = tensor.as_numpy().reshape(-1)
        if max_bytes is not None:
            for value in values:
                if isinstance(value, (bytes, str)) and len(value) > max_bytes:
                    raise InvalidRequest(
                        f"{name}: a value of {len(value)} bytes, over the {max_bytes} allowed"
                    )
        return [_decode(name, value) for value in values]

    def vector(self, name: str) -> np.ndarray | None:
        """A numeric tensor as it came (e.g. an embedding), batch dimension included."""
        return self._array(name)

    def string(self, name: str, max_bytes: int | None = None) -> str | None:
        """One BYTES value as text; InvalidRequest when it is over `max_bytes` (checked before
        it is decoded)."""
        array = self._array(name)
        if array is None:
            return None
        value = _one(name, array)
        if max_bytes is not None and isinstance(value, (bytes, str)) and len(value) > max_bytes:
            raise InvalidRequest(f"{name}: {len(value)} bytes, over the {max_bytes} allowed")
        return _decode(name, value)

    def blob(self, name: str) -> bytes | None:
        """One BYTES value as raw bytes (binary payloads such as adapter weights)."""
        array = self._array(name)
        if array is None:
            return None
        value = _one(name, array)
        if isinstance(value, str):
            return value.encode("utf-8")
        if not isinstance(value, (bytes, np.bytes_)):
            raise InvalidRequest(f"{name} must be BYTES, got {type(value).__name__}")
        return bytes(value)

    def blobs(self, name: str) -> list[bytes] | None:
        """Every BYTES value of a tensor as raw bytes, undecoded (the core bounds their size and
        number before it decodes them)."""
        array = self._array(name)
        if array is None:
            return None
        values = []
        for value in array.reshape(-1):
            if isinstance(value, str):
                value = value.encode("utf-8")
            elif not isinstance(value, (bytes, np.bytes_)):
                raise InvalidRequest(f"{name} must be BYTES, got {type(value).__name__}")
            values.append(bytes(value))
        return values

    def strings(self, name: str) -> list[str] | None:
        array = self._array(name)
        if array is None:
            return None
        return [_decode(name, value) for value in array.reshape(-1)]

    def integer(self, name: str) -> int | None:
        array = self._array(name)
        if array is None:
            return None
        if array.dtype.kind not in "iu":
            raise InvalidRequest(f"{name} must be an integer tensor, got {array.dtype}")
        return int(_one(name, array))

    def number(self, name: str) -> float | None:
        array = self._array(name)
        if array is None:
            return None
        if array.dtype.kind != "f":
            raise InvalidRequest(f"{name} must be a float tensor, got {array.dtype}")
        return float(_one(name, array))

    def boolean(self, name: str) -> bool | None:
        array = self._array(name)
        if array is None:
            return None
        if array.dtype.kind != "b":
            raise InvalidRequest(f"{name} must be a BOOL tensor, got {array.dtype}")
        return bool(_one(name, array))


def _one(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    return array.item()  # the one value, without a view of the array


def _decode(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise InvalidRequest(f"{name} must be BYTES (UTF-8 text), got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid UTF-8 (byte {exc.start})") from exc


# The public ensemble inputs (TensorRT-LLM's names plus ours) and how each is read.
RAW_INPUT_READERS: dict[str, Callable[[Inputs, str], object]] = {
    "text_input": Inputs.blob,
    "max_tokens": Inputs.integer,
    "stream": Inputs.boolean,
    "temperature": Inputs.number,
    "top_p": Inputs.number,
    "top_k": Inputs.integer,
    "seed": Inputs.integer,
    "stop_words": Inputs.blobs,
    "tenant": Inputs.blob,
    "cache_control": Inputs.blob,
    "lora_name": Inputs.blob,
    "history": Inputs.blob,
    "raw_prompt": Inputs.boolean,
}


def key_chars(key: tuple[tuple[str, ...], tuple[object, ...]]) -> int:
    """The bytes (or characters) of the values an `Inputs.key` holds: what a memo keyed by it
    counts (tiercache.exact.memo). Each `raw_key` part ends with its values."""
    return sum(len(part[-1]) for part in key[1])  # type: ignore[misc, index, arg-type]


def read_raw_inputs(request: Any) -> RawInputs:
    """The public ensemble inputs of one request; text as the raw bytes, which `canonicalize`
    bounds in size before it decodes and normalizes them. Only the inputs the request carries
    are read (a request usually sends two or three of the thirteen); the rest stay None."""
    return raw_inputs(Inputs(request))


def raw_inputs(inputs: Inputs) -> RawInputs:
    """`read_raw_inputs` of a request's inputs already looked up by name."""
    values = {
        name: read(inputs, name)
        for name in inputs.names()
        if (read := RAW_INPUT_READERS.get(name)) is not None
    }
    return RawInputs(text_input=values.pop("text_input", None), **values)  # type: ignore[arg-type]


def request_parameter(request: Any, name: str) -> object | None:
    """One of the request's parameters (the client's, and the headers Triton forwards into them
    with --grpc-header-forward-pattern / --http-header-forward-pattern); None when absent."""
    text = request.parameters()
    if not text or text == "{}":
        return None
    try:
        parameters = json.loads(text)
    except ValueError:
        return None
    return parameters.get(name) if isinstance(parameters, dict) else None


_SHORT_BYTES = 32  # one-value arrays of values up to this long are built once (`_one_value`;
# 64-character seals and the answer ids, which never repeat, stay out)
_ONE_VALUE: dict[tuple[str | bytes, bool], np.ndarray] = {}
_ONE_VALUE_MAX = 1024  # cleared when full: statuses, finish reasons, "" recur; ids do not


def _one_value(value: str | bytes, batched: bool) -> np.ndarray:
    """The BYTES array of one value, shape [1, 1] (batched) or [1]. A short value's array is
    built once and shared by every response that sends it (the hit path sends the same
    statuses and empty strings on every request): nothing writes an output array after it is
    built, and pb_utils.Tensor serializes it into its own buffer."""
    short = len(value) <= _SHORT_BYTES
    if short:
        array = _ONE_VALUE.get((value, batched))
        if array is not None:
            return array
    array = np.empty((1, 1) if batched else (1,), dtype=np.object_)
    array.flat[0] = value.encode("utf-8") if isinstance(value, str) else value
    if short:
        array.setflags(write=False)  # shared by every response that sends it
        if len(_ONE_VALUE) >= _ONE_VALUE_MAX:
            _ONE_VALUE.clear()
        _ONE_VALUE[(value, batched)] = array
    return array


def read_only(array: np.ndarray) -> np.ndarray:
    """`array`, made read-only (its own copy when it is a view), for a module's output arrays
    shared by every response that sends them."""
    if array.base is not None:
        array = array.copy()
    array.setflags(write=False)
    return array


def bytes_array(value: str | bytes, batched: bool = True) -> np.ndarray:
    """The BYTES array of one value, shape [1, 1] (batched) or [1]; a short value's is shared
    and read-only (`_one_value`)."""
    return _one_value(value, batched)


# a hit's answer, sent again on every repeat of its prompt: its [1, 1] array by the answer
_SHARED_TEXTS: Memo[np.ndarray] = Memo()
_SMALL_INTS = 1 << 14  # token counts under this: their INT32 [1, 1] arrays built once
_INT32: dict[int, np.ndarray] = {}


def shared_bytes_array(value: str) -> np.ndarray:
    """`bytes_array(value)` (batched) built once while the value is among those kept (a
    hit's answer, sent on every repeat: up to MEMO_MAX_CHARS characters, a Memo's worth),
    shared and read-only like a short value's."""
    array = _SHARED_TEXTS.get(value)
    if array is None:
        array = _one_value(value, True)
        if len(value) <= MEMO_MAX_CHARS:
            array.setflags(write=False)  # shared by every response that sends it
            _SHARED_TEXTS.put(value, array, 2 * len(value))  # the text and its bytes
    return array


def int32_array(value: int) -> np.ndarray:
    """The INT32 [1, 1] array of `value` (a token count); shared and read-only for small
    non-negative values, built once each."""
    array = _INT32.get(value)
    if array is None:
        array = np.array([[value]], dtype=np.int32)
        if 0 <= value < _SMALL_INTS:
            array.setflags(write=False)
            _INT32[value] = array
    return array


def bytes_tensor(name: str, values: Sequence[str | bytes], batched: bool = True) -> Any:
    if len(values) == 1:
        return pb_utils.Tensor(name, _one_value(values[0], batched))
    encoded = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    array = np.array(encoded, dtype=np.object_)
    return pb_utils.Tensor(name, array.reshape(1, -1) if batched else array)


def scalar_tensor(name: str, value: Any, dtype: Any, batched: bool = True) -> Any:
    array = np.array([value], dtype=dtype)
    return pb_utils.Tensor(name, array.reshape(1, 1) if batched else array)


def output_string(response: Any, name: str) -> str | None:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    if tensor is None:
        return None
    return _decode(name, tensor.as_numpy().reshape(-1)[0])


def output_blob(response: Any, name: str) -> bytes | None:
    """One BYTES output as raw bytes."""
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    if tensor is None:
        return None
    return bytes(tensor.as_numpy().reshape(-1)[0])


def output_int(response: Any, name: str) -> int | None:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return None if tensor is None else int(tensor.as_numpy().reshape(-1)[0])


def output_float(response: Any, name: str) -> float | None:
    """One numeric output as a float; None when absent or NaN (a value the sender did not
    have)."""
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    if tensor is None:
        return None
    value = float(tensor.as_numpy().reshape(-1)[0])
    return None if math.isnan(value) else value
