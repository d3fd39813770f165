"""Triton model `llm` (decoupled): check and decode the envelope, embedding_cache's answer and
lora_cache's adapter files (each sealed; the files encrypted), or an exact hit's text as
prompt_cache sealed it with the envelope, hand them to the stage (tiercache.stages.llm), and
encode its responses."""

from __future__ import annotations

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.config import LlmConfig
from tiercache.engine.adapter_call import NO_LORA
from tiercache.exact.flights import EngineUsage
from tiercache.stages.envelope import check_envelope_size
from tiercache.stages.llm import (
    EXACT_INPUTS,
    HIT_INPUTS,
    HIT_KEY_MAX_BYTES,
    LlmInput,
    LlmStage,
    open_llm,
)
from tiercache.stages.seal import (
    Part,
    answer_tensors,
    lora_inputs,
    neighbours_of,
    tokens_of,
    trust_of,
)
from tiercache.triton import io
from tiercache.vocabulary import CacheStatus, is_hit

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Responder:
    """One request's response sender, in the shape tiercache.generation.Responder asks for."""

    def __init__(self, sender: object) -> None:
        self.sender = sender
        self.answer_id: str | None = None

    def identify(self, answer_id: str) -> None:
        self.answer_id = answer_id

    def is_cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())

    def send_chunk(self, text: str) -> None:
        self.sender.send(pb_utils.InferenceResponse([io.bytes_tensor("TEXT_OUTPUT", [text])]))

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        usage: EngineUsage | None = None,
        finish_reason: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        tensor = pb_utils.Tensor
        outputs = [tensor("CACHE_STATUS", io.bytes_array(status))]
        if self.answer_id is not None:
            outputs.append(tensor("ANSWER_ID", io.bytes_array(self.answer_id)))
        if tokens is not None:
            outputs.append(tensor("PROMPT_TOKENS", io.int32_array(tokens[0])))
            outputs.append(tensor("COMPLETION_TOKENS", io.int32_array(tokens[1])))
        if finish_reason is not None:
            outputs.append(tensor("FINISH_REASON", io.bytes_array(finish_reason)))
        if similarity is not None:
            outputs.append(tensor("CACHE_SIMILARITY", np.array([[similarity]], dtype=np.float32)))
        if usage is not None:
            outputs.append(io.scalar_tensor("KV_REUSED_TOKENS", usage.reused_tokens, np.int32))
            outputs.append(io.scalar_tensor("KV_COMPUTED_TOKENS", usage.computed_tokens, np.int32))
            outputs.append(io.scalar_tensor("SPECULATED_TOKENS", usage.speculated_tokens, np.int32))
        if text is not None:  # a hit's answer comes again: its array is kept
            array = io.shared_bytes_array(text) if is_hit(status) else io.bytes_array(text)
            outputs.insert(0, tensor("TEXT_OUTPUT", array))
        self.sender.send(pb_utils.InferenceResponse(outputs), flags=FINAL)

    def send_cancelled(self) -> None:
        self.sender.send(flags=FINAL)

    def send_error(self, exc: BaseException) -> None:
        self.sender.send(io.error_response(exc), flags=FINAL)


def decode(inputs: io.Inputs, stage: LlmStage) -> LlmInput:
    """One request's inputs, their seals checked (Forbidden when unsealed or altered); an
    exact hit decoded before from the same inputs is taken as it was (`LlmStage.known_hit`)."""
    exact = inputs.raw_key(EXACT_INPUTS, HIT_KEY_MAX_BYTES)
    if exact is not None and exact[1] is not None and exact[1][1]:  # an EXACT_TEXT: kept?
        known = stage.known_hit(("exact", *exact))
        if known is not None:
            return known
    if inputs.blob("EXACT_TEXT"):
        return decode_exact(inputs, stage, exact)
    key = inputs.raw_key(HIT_INPUTS, HIT_KEY_MAX_BYTES)
    known = stage.known_hit(key)
    if known is not None:
        return known
    status = inputs.string("LOOKUP_STATUS") or ""
    data = inputs.blob("ENVELOPE")
    check_envelope_size(data)
    cached_text = inputs.string("CACHED_TEXT") or ""
    similarity = inputs.number("SIMILARITY")
    vector = inputs.vector("EMBEDDING")
    tokens = inputs.vector("ANSWER_TOKENS")
    neighbours = inputs.string("NEIGHBOURS")
    trust = inputs.vector("HIT_TRUST")
    answer = answer_tensors(cached_text, status, similarity, vector, tokens, neighbours, trust)
    envelope = stage.received(data, inputs.string("ANSWER_SEAL"), answer)
    if is_hit(status):  # a hit needs neither the prompt's vector nor the adapter's files
        counts = tokens_of(tokens)
        served = neighbours_of(neighbours)  # a semantic hit's: the entry it serves
        score, verify = trust_of(trust)  # and its trust decision, if a gate made one
        item = LlmInput(
            envelope, status, cached_text, similarity, None, NO_LORA, counts, served, score, verify
        )
        stage.remember_hit(key, item)
        return item
    tensors: dict[str, Part] = {
        name: inputs.vector(name) if name == "LORA_TASK_ID" else inputs.blob(name)
        for name in lora_inputs(stage.engine.trtllm is not None)
    }
    lora = stage.received_lora(envelope, inputs.string("LORA_SEAL"), tensors)
    return LlmInput(
        envelope=envelope,
        status=status,
        cached_text=cached_text,
        similarity=similarity,
        vector=None if vector is None else vector.astype(np.float32),
        lora=lora,
        neighbours=neighbours_of(neighbours),
    )


def decode_exact(inputs: io.Inputs, stage: LlmStage, raw: tuple[object, ...] | None) -> LlmInput:
    """An exact hit with an answer, as prompt_cache handed it on (EXACT_TEXT, EXACT_TOKENS,
    under the envelope's seal); embedding_cache's pass-through is not read. Kept like any
    decoded hit (`LlmStage.known_hit`, keyed by `raw`, the inputs EXACT_INPUTS as received,
    tagged apart from the other hits')."""
    key = None if raw is None else ("exact", *raw)
    data = inputs.blob("ENVELOPE")
    check_envelope_size(data)
    text = inputs.string("EXACT_TEXT") or ""
    counts = tokens_of(inputs.vector("EXACT_TOKENS"))
    envelope = stage.received_exact(data, text, counts)
    item = LlmInput(envelope, CacheStatus.EXACT.value, text, None, None, NO_LORA, counts)
    stage.remember_hit(key, item)
    return item


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config, _ = io.load_config(LlmConfig, args)
        self.stage = open_llm(config, args["model_name"])
        io.freeze_startup_objects()

    def execute(self, requests: list) -> None:
        for request in requests:
            arrival_s = time.monotonic()  # padding counts from here (ResponseTimer's clock)
            responder = Responder(request.get_response_sender())
            try:
                item = decode(io.Inputs(request), self.stage)
            except Exception as exc:  # noqa: BLE001 - mapped to this request's error response
                self.stage.count_error(responder, exc)
                continue
            self.stage.serve(item, responder, arrival_s)
        return None

    def finalize(self) -> None:
        self.stage.close()
