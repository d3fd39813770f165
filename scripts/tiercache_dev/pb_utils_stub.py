"""A small stand-in for Triton's `triton_python_backend_utils`, enough to run model.py files
in-process. Metrics record what they are given so tests can read them back."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor], error: TritonError | None = None) -> None:
        self._outputs = list(output_tensors)
        self._error = error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs


BLS_MODELS: dict[str, Callable[[InferenceRequest], list[InferenceResponse]]] = {}
"""The models a BLS call reaches: name -> handler returning that model's responses in order.
Tests register handlers with `monkeypatch.setitem(pb_utils.BLS_MODELS, name, handler)`."""


class InferenceRequest:
    """What `execute` receives: named input tensors; as a BLS request (`model_name=`), `exec`
    runs the handler registered in BLS_MODELS."""

    def __init__(self, inputs: list[Tensor], **kwargs: Any) -> None:
        self._inputs = list(inputs)
        self.kwargs = kwargs

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def parameters(self) -> str:
        """The request's parameters as JSON, as Triton hands them (the client's, and headers
        forwarded with --grpc-header-forward-pattern): `parameters=` of the constructor."""
        return json.dumps(self.kwargs.get("parameters") or {})

    def exec(self, decoupled: bool = False) -> Any:
        """A decoupled call yields every response, and, as python_backend's does, returns only
        once the first one came (a handler may yield them lazily); otherwise the one response."""
        name = self.kwargs.get("model_name", "")
        handler = BLS_MODELS.get(name)
        if handler is None:
            error = TritonError(f"Request for unknown model: '{name}'", TritonError.NOT_FOUND)
            responses = [InferenceResponse([], error=error)]
        else:
            responses = handler(self)
        if not decoupled:
            return responses[0]
        rest = iter(responses)
        first = next(rest, None)
        return rest if first is None else itertools.chain([first], rest)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


class Metric:
    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None):
        if family.kind == MetricFamily.HISTOGRAM and not buckets:
            raise TritonModelException("a histogram needs buckets")
        self.family = family
        self.labels = dict(labels)
        self.buckets = buckets
        self._value = 0.0
        self.observations: list[float] = []

    def increment(self, value: float) -> None:
        if self.family.kind != MetricFamily.COUNTER or value < 0:
            raise TritonModelException(f"increment({value}) on {self.family.name}")
        self._value += value

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise TritonModelException(f"set() on {self.family.name}")
        self._value = value

    def observe(self, value: float) -> None:
        if self.family.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException(f"observe() on {self.family.name}")
        self.observations.append(value)

    def value(self) -> float:
        return self._value


class MetricFamily:
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __init__(self, name: str, description: str, kind: int) -> None:
        self.name = name
        self.description = description
        self.kind = kind
        self.metrics: list[Metric] = []

    def Metric(  # noqa: N802 - Triton's spelling
        self, labels: dict[str, str] | None = None, buckets: list[float] | None = None
    ) -> Metric:
        metric = Metric(self, labels or {}, buckets)
        self.metrics.append(metric)
        return metric


class ResponseSender:
    """A decoupled request's response sender: records every response; `done` is set by the
    final flag."""

    def __init__(self) -> None:
        self.responses: list[Any] = []
        self.done = threading.Event()

    def send(self, response: Any = None, flags: int = 0) -> None:
        self.responses.append(response)
        if flags:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


def submit_decoupled(model: Any, batch: list[list[Tensor]]) -> list[ResponseSender]:
    """Requests (each its input tensors) through one execute() of a decoupled model, not
    waited for: each one's sender, whose `done` its final response sets."""
    senders, requests = [], []
    for inputs in batch:
        sender = ResponseSender()
        request = InferenceRequest(inputs)
        request.get_response_sender = lambda s=sender: s  # type: ignore[attr-defined]
        senders.append(sender)
        requests.append(request)
    model.execute(requests)
    return senders


def execute_decoupled(model: Any, batch: list[list[Tensor]], wait_s: float) -> list[list[Any]]:
    """Requests (each its input tensors) through one execute() of a decoupled model; each
    one's responses once its final one arrived."""
    senders = submit_decoupled(model, batch)
    for sender in senders:
        assert sender.done.wait(wait_s), "no final response"
    return [sender.responses for sender in senders]
