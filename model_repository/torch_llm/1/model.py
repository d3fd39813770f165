"""Triton model `torch_llm` (decoupled): the CPU engine. One worker thread generates for one
request at a time, streaming each chunk as a response; execute() only enqueues."""

from __future__ import annotations

import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import EngineConfig
from tiercache.engine.model_source import resolve_model
from tiercache.engine.torch_engine import TorchEngine
from tiercache.request import GenerationRequest
from tiercache.triton import boundary as tb

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_STOP = object()


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = tb.load_config(EngineConfig, args)
        self.engine = TorchEngine(resolve_model(config.model), config.models_path(), config.device)
        self.metrics = m = tb.Metrics(args["model_name"])
        self.tokens = m.counter("tiercache_engine_generated_tokens_total", "Tokens generated")
        self.prompt_tokens = m.counter("tiercache_engine_prompt_tokens_total", "Prompt tokens run")
        self.finished = {
            r: m.counter(
                "tiercache_engine_finished_total", "Generations by finish reason", reason=r
            )
            for r in ("stop", "length", "cancelled", "error")
        }
        self.queue_depth = m.gauge(
            "tiercache_engine_queue_depth", "Requests waiting for the engine"
        )
        m.start()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="torch_llm", daemon=True)
        self._worker.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            self._queue.put(request)
        self.queue_depth.set(self._queue.qsize())
        return None

    def _run(self) -> None:
        while (request := self._queue.get()) is not _STOP:
            self.queue_depth.set(self._queue.qsize())
            sender = request.get_response_sender()
            try:
                self._generate(request, sender)
            except Exception as exc:  # noqa: BLE001 - this request's error; the worker goes on
                self.finished["error"].increment(1)
                try:
                    sender.send(tb.error_response(exc), flags=FINAL)
                except Exception:  # noqa: BLE001 - e.g. the client is gone; keep serving others
                    tb.log.exception("could not send an error response")

    def _generate(self, request: object, sender: object) -> None:
        text = tb.Inputs(request).string("REQUEST")
        if text is None:
            raise ValueError("REQUEST is required")
        gen_request = GenerationRequest.from_json(text)
        for event in self.engine.generate(gen_request, sender.is_cancelled):
            outputs = [tb.bytes_tensor("TEXT", [event.text], batched=False)]
            if event.finish_reason is None:
                sender.send(pb_utils.InferenceResponse(outputs))
                continue
            outputs += [
                tb.bytes_tensor("FINISH_REASON", [event.finish_reason], batched=False),
                tb.scalar_tensor("GENERATED_TOKENS", event.generated_tokens, np.int32, False),
                tb.scalar_tensor("PROMPT_TOKENS", event.prompt_tokens, np.int32, False),
            ]
            sender.send(pb_utils.InferenceResponse(outputs), flags=FINAL)
            self.tokens.increment(event.generated_tokens)
            self.prompt_tokens.increment(event.prompt_tokens)
            self.finished[event.finish_reason].increment(1)

    def finalize(self) -> None:
        self._queue.put(_STOP)
        self._worker.join(timeout=30)
        self.metrics.close()
