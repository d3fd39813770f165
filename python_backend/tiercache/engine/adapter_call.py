"""One engine call with an adapter, retried once with the weights when the engine lost them.

lora_cache keeps a mirror of what the engine holds and sends weights only when the mirror says the
engine lacks them. The mirror can be wrong (the engine restarted, another instance evicted): the
engine then answers "LoRA task N ... not found in cache" before it generates anything, and the
call is repeated once with the weights fetched again from lora_cache. This is TensorRT-LLM's
backend protocol, so the same rule serves `torch_llm` and `tensorrt_llm`.

It is the engine's calling convention, so it lives in the engine package; lora_cache only
answers `fetch` (through its Triton model), and neither package imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tiercache.adapter_types import NOT_IN_ENGINE_MARK, AdapterRef, TrtllmRequestLora
from tiercache.engine.events import StreamEvent
from tiercache.errors import TierCacheError
from tiercache.exact.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class EngineLora:
    """What goes to the engine with one request besides the request itself: PEFT files for
    torch_llm, TensorRT-LLM's tensors for tensorrt_llm (which evicts by itself)."""

    config_json: str = ""  # adapter_config.json, only when the engine must load the adapter
    weights: bytes = b""  # adapter_model.safetensors, idem
    evict: tuple[str, ...] = ()  # digests the engine drops first, to make room
    trtllm: TrtllmRequestLora | None = None  # lora_task_id, and lora_weights/lora_config to load

    @property
    def loads(self) -> bool:
        """Whether the adapter's weights travel with this call (then there is no retry)."""
        return bool(self.weights) or (self.trtllm is not None and self.trtllm.lora is not None)


NO_LORA = EngineLora()

EngineCall = Callable[[GenerationRequest, EngineLora], Iterator[StreamEvent]]
FetchWeights = Callable[[AdapterRef], EngineLora]


def adapter_ref(request: GenerationRequest) -> AdapterRef | None:
    """The adapter version a request was resolved to, or None for the base model."""
    if not request.lora_digest:
        return None
    return AdapterRef(request.lora_name, request.lora_task_id, request.lora_digest)


def is_not_in_engine(exc: BaseException) -> bool:
    return isinstance(exc, TierCacheError) and NOT_IN_ENGINE_MARK in exc.message


def generate_with_adapter(
    call: EngineCall, fetch: FetchWeights, request: GenerationRequest, lora: EngineLora
) -> Iterator[StreamEvent]:
    """Stream `call(request, lora)`; if the engine says it does not hold the request's adapter
    (before any output, and only when no weights were sent), fetch them and call once more.
    Events with neither text nor a finish (the call's turn on the engine, `EngineBls`) pass
    through as they come: they are not output."""
    ref = adapter_ref(request)
    events = call(request, lora)
    try:
        try:
            first = next(events, None)
            while first is not None and not first.text and first.finish_reason is None:
                yield first
                first = next(events, None)
        except TierCacheError as exc:
            if ref is None or lora.loads or not is_not_in_engine(exc):
                raise
            events = call(request, fetch(ref))
            first = next(events, None)
        if first is None:
            return
        yield first
        yield from events
    finally:  # closed here too when the caller closes this one (its engine stream released)
        close = getattr(events, "close", None)
        if close is not None:
            close()
