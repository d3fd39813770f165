"""Requests to TensorRT-LLM's `tensorrt_llm` model, and its streamed answers as StreamEvents.

Transport-free: model_repository/llm/1/model.py sends `TrtllmCall.tensors` to the model over BLS
and hands each response back as a dict of its output arrays; a unit test passes fakes. No torch,
no Triton: the tokenizer is injected (`load_tokenizer` reads one with transformers, without a
model), and the incremental detokenizer is the CPU engine's own (`_Detokenizer`, imported when
first used), so both engines cut text and stop words the same way.

The request (names and shapes as in the backend's `tensorrt_llm` config.pbtxt, each with the
leading batch dimension of 1 that a `max_batch_size > 0` model takes):

- `input_ids` int32 [1, n]: the prompt as `tiercache.engine.prompt.prompt_token_ids` renders it;
  `input_lengths` int32 [1, 1]; `request_output_len` int32 [1, 1] = max_tokens.
- `end_id`, `pad_id` int32 [1, 1]: `<|im_end|>` when the tokenizer has it, else its eos token;
  other eos ids go into `stop_words_list` as one-token words.
- `streaming` bool [1, 1] always true (the llm stage streams to every flight member, whatever the
  request's own `stream`), `exclude_input_in_output` bool [1, 1] true.
- Sampling: greedy is `runtime_top_k` 1 (TensorRT-LLM's greedy; temperature is not sent);
  otherwise `temperature`, `runtime_top_k` (0: off), `runtime_top_p` and `seed` uint64. A
  sampled request without a seed gets a fresh random one: the engine's default seed is fixed,
  which would make every unseeded sample the same draw.
- `stop_words_list` int32 [1, 2, m]: each stop word's token ids, concatenated, over their end
  offsets padded with -1. Best effort: the engine stops early only when the word is tokenized
  the same way in context; the detokenizer's text match is what decides (and cuts) either way.
- LoRA: `lora_task_id` uint64 [1, 1] for a request on an adapter version (the version-unique id
  of `tiercache.adapter_types.engine_task_id`, computed from the request itself), plus
  `lora_weights` / `lora_config` when lora_cache sent them.
- `return_perf_metrics` bool [1, 1] true: the final response then carries
  `kv_cache_reused_blocks`, `kv_cache_alloc_new_blocks` and `kv_cache_alloc_total_blocks`.

The answer: in streaming mode each response's `output_ids` [1, beams, k] holds only the new
tokens (padded with -1 across beams; `sequence_length` [1, beams] says how many are real). An eos
token ends the answer ("stop"; whether the engine includes it or not), as does a stop word;
`max_tokens` tokens end it with "length"; a stream that ends otherwise ended at the engine's end
id or a token-level stop word, which is "stop" too. Prompts the engine was not built for
(`max_input_len`, `max_seq_len`) are refused before sending, so an answer the engine would have
cut short is never stored as complete.

Speculative decoding (`max_draft_len` > 0, greedy requests with `speculate`): the engine is built
for external draft tokens (`trtllm-build --speculative_decoding_mode draft_tokens_external
--max_draft_len N`) and `speculative_events` drives it in steps, as TensorRT-LLM's own
draft-target BLS does: each step is one non-streaming request of the prompt plus the tokens
accepted so far (prefix KV reuse makes the resent part cheap), `draft_input_ids` the next draft
(tiercache.engine.drafts.Drafter over the request's cached answers and its context) and
`request_output_len` the draft's length plus one; the engine verifies the draft against its own
greedy choices and returns the accepted prefix and the token after it. Without a draft a step
asks for `PLAIN_CHUNK` tokens. The answer is the one plain decoding gives; only the number of
engine calls changes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tiercache.adapter_types import TrtllmLora, TrtllmRequestLora, engine_task_id
from tiercache.engine.adapter_call import adapter_ref, is_not_in_engine
from tiercache.engine.drafts import MAX_DRAFT_TOKENS, Drafter
from tiercache.engine.events import StreamEvent
from tiercache.engine.prompt import prompt_token_ids
from tiercache.errors import ConfigError, InvalidRequest, TierCacheError, Unavailable
from tiercache.exact.request import GenerationRequest

IM_END = "<|im_end|>"

REQUESTED_OUTPUTS = (
    "output_ids",
    "sequence_length",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_new_blocks",
    "kv_cache_alloc_total_blocks",
)
"""What llm asks the `tensorrt_llm` model for (the backend requires the first two)."""
# A speculative step without a draft asks for this many tokens (no draft: plain decoding, in
# chunks, until a source has a draft again).
PLAIN_CHUNK = 16
# The adapter's weights: sent with a request's first engine call; the engine keeps them by
# lora_task_id for the next ones.
LORA_WEIGHT_INPUTS = ("lora_weights", "lora_config")


class Detokenizer(Protocol):
    """tiercache.engine.torch_engine._Detokenizer's surface."""

    def push(self, token_ids: list[int]) -> tuple[str, bool]: ...

    def flush(self) -> str: ...


DetokenizerFactory = Callable[[Any, tuple[str, ...]], Detokenizer]


def torch_engine_detokenizer(tokenizer: Any, stop_words: tuple[str, ...]) -> Detokenizer:
    """The CPU engine's incremental detokenizer (imported here so this module loads without
    torch; the import costs torch's, once)."""
    from tiercache.engine.torch_engine import _Detokenizer

    detokenizer: Detokenizer = _Detokenizer(tokenizer, stop_words)
    return detokenizer


def load_tokenizer(path: str | Path) -> Any:
    """The engine's tokenizer (a Hugging Face tokenizer folder, chat template included), read
    with transformers without loading any model. ConfigError when the folder is missing."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"tokenizer_dir {str(folder)!r} is not a folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the engine was built for (`trtllm-build --max_input_len / --max_seq_len`); 0 means
    unknown, not checked. `draft_len`: its `--max_draft_len`, which TensorRT-LLM takes off
    every request's room in max_seq_len (it shortens the output silently otherwise)."""

    max_input_len: int = 0
    max_seq_len: int = 0
    draft_len: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class TrtllmCall:
    """One request's input tensors for the `tensorrt_llm` model, by name."""

    tensors: dict[str, np.ndarray]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class KvCacheReuse:
    """The engine's KV-cache block counts for one request (its final response)."""

    reused_blocks: int
    new_blocks: int
    total_blocks: int


def stop_words_list(words: Sequence[Sequence[int]]) -> np.ndarray:
    """TensorRT-LLM's word list, [1, 2, m] int32: row 0 the token ids of every word, one after
    the other; row 1 each word's end offset into row 0, padded with -1 (row 0 with 0)."""
    flat = [token for word in words for token in word]
    ends = np.cumsum([len(word) for word in words]).tolist()
    width = max(len(flat), len(ends), 1)
    out = np.zeros((1, 2, width), dtype=np.int32)
    out[0, 1, :] = -1
    out[0, 0, : len(flat)] = flat
    out[0, 1, : len(ends)] = ends
    return out


def request_lora_from_arrays(
    task_id: np.ndarray | None, weights: np.ndarray | None, config: np.ndarray | None
) -> TrtllmRequestLora | None:
    """lora_cache's LORA_TASK_ID [1, 1], LORA_TRT_WEIGHTS [1, rows, size] and LORA_TRT_CONFIG
    [1, rows, 3] (each absent when not sent) as one request's LoRA inputs; None without a task
    id. InvalidRequest when weights and config do not come together or do not match."""
    if task_id is None or task_id.size == 0:
        if weights is not None and weights.size:
            raise InvalidRequest("LORA_TRT_WEIGHTS came without LORA_TASK_ID")
        return None
    if task_id.size != 1:
        raise InvalidRequest(f"LORA_TASK_ID must hold one id, got shape {list(task_id.shape)}")
    ident = int(task_id.reshape(-1)[0])
    has_weights = weights is not None and weights.size > 0
    has_config = config is not None and config.size > 0
    if has_weights != has_config:
        raise InvalidRequest("LORA_TRT_WEIGHTS and LORA_TRT_CONFIG must come together")
    if weights is None or config is None or not has_weights:
        return TrtllmRequestLora(ident)
    rows_w, rows_c = _rows(weights, "LORA_TRT_WEIGHTS"), _rows(config, "LORA_TRT_CONFIG")
    if rows_c.ndim != 2 or rows_c.shape[1] != 3 or rows_w.shape[0] != rows_c.shape[0]:
        raise InvalidRequest(
            f"LORA_TRT_WEIGHTS {list(weights.shape)} and LORA_TRT_CONFIG {list(config.shape)} "
            "are not [1, rows, size] and [1, rows, 3]"
        )
    return TrtllmRequestLora(ident, TrtllmLora(rows_w, rows_c.astype(np.int32, copy=False)))


def _rows(array: np.ndarray, name: str) -> np.ndarray:
    if array.ndim != 3 or array.shape[0] != 1:
        raise InvalidRequest(f"{name} must be [1, rows, n], got {list(array.shape)}")
    return array[0]


class TrtllmClient:
    """Builds `tensorrt_llm` requests and reads their streamed answers. Thread-safe: no state
    between requests, and encoding is serialized (a Hugging Face fast tokenizer may reset its
    truncation settings while encoding, which fails with "Already borrowed" when two threads do
    it at once; encoding a prompt takes well under a millisecond). Decoding needs no lock."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        limits: EngineLimits = EngineLimits(),
        seed_source: Callable[[], int] = random_seed,
        detokenizer: DetokenizerFactory = torch_engine_detokenizer,
        max_draft_len: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        if not 0 <= max_draft_len <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"trtllm_max_draft_len must be 0 to {MAX_DRAFT_TOKENS}")
        self.max_draft_len = max_draft_len
        self._seed_source = seed_source
        self._detokenizer = detokenizer
        self._encode_lock = threading.Lock()
        eos = tokenizer.eos_token_id
        im_end = tokenizer.convert_tokens_to_ids(IM_END)
        has_im_end = isinstance(im_end, int) and im_end != getattr(tokenizer, "unk_token_id", None)
        end_id = im_end if has_im_end else eos
        if not isinstance(end_id, int):
            raise ConfigError("the tokenizer has neither <|im_end|> nor an eos token")
        self.end_id: int = end_id
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id: int = pad if isinstance(pad, int) else end_id
        self.eos_ids = frozenset(t for t in (eos, end_id) if isinstance(t, int))

    # -- the request -------------------------------------------------------------------------

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt as the CPU engine feeds it (`tiercache.engine.prompt.prompt_token_ids`)."""
        with self._encode_lock:
            return prompt_token_ids(self.tokenizer, request)

    def request(
        self, request: GenerationRequest, lora: TrtllmRequestLora | None = None
    ) -> TrtllmCall:
        """The tensors for `request`; `lora` is what lora_cache sent (None: nothing, the id
        alone is then derived from the request). InvalidRequest for a prompt the engine was
        not built for; Unavailable when lora_cache's id is not the request's version."""
        ids = self.prompt_ids(request)
        self._check_fits(len(ids), request.max_tokens)
        tensors: dict[str, np.ndarray] = {
            "input_ids": np.array([ids], dtype=np.int32),
            "input_lengths": _one(len(ids), np.int32),
            "request_output_len": _one(request.max_tokens, np.int32),
            "end_id": _one(self.end_id, np.int32),
            "pad_id": _one(self.pad_id, np.int32),
            "streaming": _one(True, np.bool_),
            "exclude_input_in_output": _one(True, np.bool_),
            "return_perf_metrics": _one(True, np.bool_),
        }
        if request.greedy:
            tensors["runtime_top_k"] = _one(1, np.int32)
        else:
            seed = request.seed if request.seed is not None else self._seed_source()
            tensors["temperature"] = _one(request.temperature, np.float32)
            tensors["runtime_top_k"] = _one(request.top_k, np.int32)
            tensors["runtime_top_p"] = _one(request.top_p, np.float32)
            tensors["seed"] = _one(seed, np.uint64)
        words = [self._word_ids(w) for w in request.stop_words]
        words += [[t] for t in sorted(self.eos_ids - {self.end_id})]
        words = [w for w in words if w]
        if words:
            tensors["stop_words_list"] = stop_words_list(words)
        tensors.update(self._lora_tensors(request, lora))
        return TrtllmCall(tensors, len(ids))

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        limits = self.limits
        if limits.max_input_len and prompt_tokens > limits.max_input_len:
            raise InvalidRequest(
                f"the prompt is {prompt_tokens} tokens with its chat template, over the "
                f"engine's max_input_len of {limits.max_input_len}"
            )
        if (
            limits.max_seq_len
            and prompt_tokens + max_tokens + limits.draft_len > limits.max_seq_len
        ):
            drafts = f" and its draft room ({limits.draft_len})" if limits.draft_len else ""
            raise InvalidRequest(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}){drafts} "
                f"exceeds the engine's max_seq_len of {limits.max_seq_len}"
            )

    def _word_ids(self, word: str) -> list[int]:
        with self._encode_lock:
            ids = self.tokenizer.encode(word, add_special_tokens=False)
        return [int(t) for t in ids]

    @staticmethod
    def _lora_tensors(
        request: GenerationRequest, lora: TrtllmRequestLora | None
    ) -> dict[str, np.ndarray]:
        ref = adapter_ref(request)
        if ref is None:
            if lora is not None:
                raise Unavailable("lora_cache sent TensorRT-LLM LoRA inputs for a base request")
            return {}
        task_id = engine_task_id(ref)
        if lora is None:
            return TrtllmRequestLora(task_id).tensors()
        if lora.task_id != task_id:
            raise Unavailable(
                f"lora_cache's lora_task_id {lora.task_id} is not {task_id}, the id of "
                f"adapter {ref.short}"
            )
        return lora.tensors()

    # -- the answer --------------------------------------------------------------------------

    def events(
        self,
        request: GenerationRequest,
        call: TrtllmCall,
        outputs: Iterable[Mapping[str, np.ndarray]],
        on_kv_cache: Callable[[KvCacheReuse], None] | None = None,
    ) -> Iterator[StreamEvent]:
        """The engine's streamed responses (each as {output name: array}) as StreamEvents, in
        the CPU engine's contract: text chunks, then one last event with the finish reason.
        Returns as soon as the answer is complete; the caller cancels the rest of the stream."""
        reuse_seen: list[KvCacheReuse] = []
        try:
            yield from self._events(request, call, outputs, reuse_seen)
        finally:
            # The engine writes the request's KV block counts (totals) into every streamed
            # response: reported once, the last seen, whatever ended the stream.
            reuse = reuse_seen[-1] if reuse_seen else None
            if reuse is not None and on_kv_cache is not None:
                on_kv_cache(reuse)

    def _events(
        self,
        request: GenerationRequest,
        call: TrtllmCall,
        outputs: Iterable[Mapping[str, np.ndarray]],
        reuse_seen: list[KvCacheReuse],
    ) -> Iterator[StreamEvent]:
        detok = self._detokenizer(self.tokenizer, request.stop_words)
        generated: list[int] = []
        prompt = call.prompt_tokens
        for output in outputs:
            reuse = kv_cache_reuse(output)
            if reuse is not None:
                reuse_seen[:] = [reuse]
            for token in new_tokens(output):
                if token in self.eos_ids:
                    yield StreamEvent(detok.flush(), "stop", len(generated), prompt)
                    return
                generated.append(token)
                text, stopped = detok.push(generated)
                if stopped:
                    yield StreamEvent(text, "stop", len(generated), prompt)
                    return
                if len(generated) >= request.max_tokens:
                    yield StreamEvent(text + detok.flush(), "length", len(generated), prompt)
                    return
                if text:
                    yield StreamEvent(text, None, len(generated), prompt)
        yield StreamEvent(detok.flush(), "stop", len(generated), prompt)

    # -- speculative decoding ------------------------------------------------------------------

    def speculates(self, request: GenerationRequest, call: TrtllmCall) -> bool:
        """Whether `request` (its tensors `call`) is decoded in speculative steps
        (`speculative_events`): greedy, not opted out, and every step's input (the prompt plus
        up to max_tokens - 1 accepted tokens) within the engine's max_input_len."""
        if not (self.max_draft_len > 0 and request.speculate and request.greedy):
            return False
        longest = call.prompt_tokens + request.max_tokens - 1
        return not self.limits.max_input_len or longest <= self.limits.max_input_len

    def speculative_events(
        self,
        request: GenerationRequest,
        call: TrtllmCall,
        run: Callable[[dict[str, np.ndarray]], Iterable[Mapping[str, np.ndarray]]],
        on_kv_cache: Callable[[KvCacheReuse], None] | None = None,
    ) -> Iterator[StreamEvent]:
        """The answer to `request` (its tensors `call`) in speculative steps, each one engine
        request sent through `run` (its responses as {output name: array}), as StreamEvents in
        the CPU engine's contract; the last one carries the drafted and accepted counts. The
        adapter's weights (if `call` has them) go with the first step, and again with a later
        step the engine answers that it lost the adapter; the KV reuse reported is the first
        step's (later steps reuse the request's own blocks)."""
        prompt = [int(t) for t in call.tensors["input_ids"].reshape(-1)]
        with self._encode_lock:
            answers = [
                (source, self.tokenizer.encode(text, add_special_tokens=False))
                for source, text in request.drafts
            ]
        drafter = Drafter(answers, prompt)
        detok = self._detokenizer(self.tokenizer, request.stop_words)
        generated: list[int] = []
        with_weights = call.tensors
        without = {k: v for k, v in with_weights.items() if k not in LORA_WEIGHT_INPUTS}
        has_weights = len(without) < len(with_weights)

        def event(text: str, finish: str | None) -> StreamEvent:
            if finish is None:
                return StreamEvent(text, None, len(generated), len(prompt))
            return StreamEvent(
                text,
                finish,
                len(generated),
                len(prompt),
                drafted_tokens=drafter.proposed,
                accepted_tokens=drafter.accepted_total,
                draft_steps=tuple(drafter.steps),
            )

        def step(base: dict[str, np.ndarray], first: bool, extra: dict) -> list[int]:
            got: list[int] = []
            for output in run({**base, **extra}):
                reuse = kv_cache_reuse(output)
                if first and reuse is not None and on_kv_cache is not None:
                    on_kv_cache(reuse)
                got += new_tokens(output)
            return got

        first = True
        while True:
            room = request.max_tokens - len(generated)
            draft = drafter.propose(generated, min(self.max_draft_len, room - 1))
            wanted = len(draft) + 1 if draft else min(PLAIN_CHUNK, room)
            ids = prompt + generated
            extra = {
                "input_ids": np.array([ids], dtype=np.int32),
                "input_lengths": _one(len(ids), np.int32),
                "request_output_len": _one(wanted, np.int32),
                "streaming": _one(False, np.bool_),
            }
            if draft:
                extra["draft_input_ids"] = np.array([draft], dtype=np.int32)
            try:
                got = step(with_weights if first else without, first, extra)
            except TierCacheError as exc:
                if first or not has_weights or not is_not_in_engine(exc):
                    raise
                got = step(with_weights, False, extra)  # the engine dropped the adapter
            first = False
            expected = wanted  # what a step that did not reach the end returns
            kept = 0
            if draft:
                while kept < min(len(draft), len(got)) and got[kept] == draft[kept]:
                    kept += 1
                drafter.accepted(len(draft), kept)
                expected = kept + 1  # the accepted prefix, then the target's own token
            before = len(generated)

            def final(
                text: str, finish: str, kept: int = kept, before: int = before
            ) -> StreamEvent:
                # draft tokens the model agreed with past the answer's end are not in it
                drafter.unused(max(0, kept - (len(generated) - before)))
                return event(text, finish)

            pending = ""
            for token in got[:wanted]:
                if token in self.eos_ids:
                    yield final(pending + detok.flush(), "stop")
                    return
                generated.append(token)
                text, stopped = detok.push(generated)
                if stopped:
                    yield final(pending + text, "stop")
                    return
                if len(generated) >= request.max_tokens:
                    yield final(pending + text + detok.flush(), "length")
                    return
                pending += text
            if len(got) < expected:  # the engine stopped early: at its end id, or a stop word
                yield final(pending + detok.flush(), "stop")
                return
            if pending:
                yield event(pending, None)


def new_tokens(output: Mapping[str, np.ndarray]) -> list[int]:
    """The first beam's tokens in one streamed response (none in a flags-only final one)."""
    ids = output.get("output_ids")
    if ids is None or ids.size == 0:
        return []
    beams = ids.reshape(-1, ids.shape[-1]) if ids.ndim >= 2 else ids.reshape(1, -1)
    row = beams[0]
    lengths = output.get("sequence_length")
    count = int(lengths.reshape(-1)[0]) if lengths is not None and lengths.size else row.size
    return [int(t) for t in row[:count] if t >= 0]


def kv_cache_reuse(output: Mapping[str, np.ndarray]) -> KvCacheReuse | None:
    """The response's KV-cache block counts, when it carries them (the final one does when
    `return_perf_metrics` was set)."""
    reused = output.get("kv_cache_reused_blocks")
    if reused is None or reused.size == 0:
        return None

    def first(name: str) -> int:
        value = output.get(name)
        return int(value.reshape(-1)[0]) if value is not None and value.size else 0

    return KvCacheReuse(
        reused_blocks=first("kv_cache_reused_blocks"),
        new_blocks=first("kv_cache_alloc_new_blocks"),
        total_blocks=first("kv_cache_alloc_total_blocks"),
    )


def _one(value: Any, dtype: Any) -> np.ndarray:
    return np.array([[value]], dtype=dtype)
