"""The CPU engine: SmolLM2 through transformers, with a token-by-token decode loop.

The loop is our own (not `model.generate`) because the stage needs per-token streaming with
incremental detokenization, stop words that never leak a partial match, cancellation between tokens,
and control over the KV cache for prefix reuse (tiercache.engine.kv_cache): a request's prompt
reuses the longest chain of cached full blocks and computes only the tokens after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tiercache.engine.adapter_call import adapter_ref
from tiercache.engine.adapters import EngineAdapters
from tiercache.engine.drafts import (
    DEFAULT_INDEX_TOKENS,
    AnswerIndex,
    Codec,
    Drafter,
    cut_at_stop,
    prefill_draft,
)
from tiercache.engine.events import StreamEvent
from tiercache.engine.kv_cache import (
    BlockHash,
    KvBlockPool,
    KvLease,
    KvStats,
    block_hashes,
    kv_salt,
)
from tiercache.engine.model_source import ModelSource
from tiercache.engine.prompt import prompt_token_ids
from tiercache.errors import InvalidRequest
from tiercache.eviction import named_policy
from tiercache.exact.request import MAX_TEMPERATURE, GenerationRequest
from tiercache.log_throttle import LogThrottle
from tiercache.packed_linear import pack_and_log

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
DEFAULT_KV_POOL_MAX_BYTES = 256 << 20


def pick_device(requested: str = "auto") -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def context_window(config: Any) -> int | None:
    """The model's context window in tokens: `max_position_embeddings` (Llama, SmolLM2), else
    `n_positions` (GPT-2 style); None when the config gives neither."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# A draft's text past this many characters a token of max_tokens can be no use (a token of the
# vocabulary spans far fewer): cut there, so a long draft costs no retokenizing per step
DRAFT_CHARS_PER_TOKEN = 32


def check_ranges(request: GenerationRequest) -> None:
    """InvalidRequest for sampling values out of their ranges. prompt_cache checks them as a
    request comes in; an engine call is sealed by llm, and this is the engine's own check of
    what it is handed (max_tokens 0 still gave a token, a negative one kept a draft whole)."""
    if request.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {request.max_tokens}")
    if not 0.0 <= request.temperature <= MAX_TEMPERATURE:
        raise InvalidRequest(
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {request.temperature}"
        )
    if not 0.0 < request.top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {request.top_p}")
    if not 0 <= request.top_k < 2**31:
        raise InvalidRequest(f"top_k must be in [0, 2**31 - 1], got {request.top_k}")
    if request.seed is not None and not 0 <= request.seed < 2**64:
        raise InvalidRequest(f"seed must fit in uint64, got {request.seed}")


def check_context(prompt_tokens: int, max_tokens: int, window: int | None) -> None:
    """InvalidRequest when the prompt and the answer it may grow to do not fit the model's
    context window: past it the positions have no trained embedding, so the answer would be
    garbage after a long, wasted generation. (The request's limits count characters; only
    the engine knows tokens.)"""
    if window is not None and prompt_tokens + max_tokens > window:
        raise InvalidRequest(
            f"the prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{prompt_tokens + max_tokens} tokens do not fit the model's context window of "
            f"{window} tokens"
        )


def converted_dir(source: ModelSource, cache_dir: Path) -> Path:
    """Where `load_model` keeps the model's de-quantised weights and its tokenizer; complete
    once it holds a COMPLETE file."""
    return cache_dir / f"{source.spec.package}-{source.identity.revision[:16]}"


def load_model(source: ModelSource, cache_dir: Path, device: str) -> tuple[Any, Any]:
    """Load weights, de-quantising the GGUF only once: the float32 result is saved as safetensors
    under `cache_dir/<revision>` (18 s -> well under 1 s on the next start)."""
    converted = converted_dir(source, cache_dir)
    if not (converted / "COMPLETE").exists():
        started = time.perf_counter()
        gguf_dir, gguf_file = str(source.gguf_path.parent), source.gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file)
        # transformers refuses to save a model loaded from GGUF; the weights are plain float32 now.
        setattr(model, "hf_quantizer", None)  # noqa: B010 - typed as a submodule by transformers
        setattr(model, "is_quantized", False)  # noqa: B010
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = converted.with_name(f"{converted.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "COMPLETE").write_text(source.identity.revision)
        try:
            tmp.rename(converted)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
        log.info("de-quantised %s in %.1f s", source.gguf_path.name, time.perf_counter() - started)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    loaded: Any = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    loaded = loaded.to(device)
    loaded.eval()
    return tokenizer, loaded


class TorchEngine:
    """Generates for one request at a time (callers serialize); safe to call from any thread.

    `adapters` holds up to `lora_slots` LoRA adapters; each request runs with the one its
    `lora_digest` names, or the base model.

    With `kv_reuse`, `kv_pool` keeps the KV of prompts' full blocks of `tokens_per_block` tokens,
    at most `kv_pool_max_bytes`, keyed by the model revision, the request's `tenant_scope` (tenant)
    and `lora_digest` (adapter), giving up blocks in the order of the policy `kv_eviction` names
    (`tiercache.eviction.NAMED_POLICIES`). Setting `kv_reuse` to False later stops lookups and
    inserts (benchmarks compare both in one process); the pool keeps what it holds."""

    def __init__(
        self,
        source: ModelSource,
        cache_dir: Path,
        device: str = "auto",
        lora_slots: int = 4,
        *,
        kv_reuse: bool = True,
        tokens_per_block: int = 32,
        kv_pool_max_bytes: int = DEFAULT_KV_POOL_MAX_BYTES,
        lora_max_bytes: int = 0,
        kv_eviction: str = "shadow",
        speculate: bool = True,
        draft_index_tokens: int = DEFAULT_INDEX_TOKENS,
        speculate_sampled: bool = False,
        pass_threads: int = 0,
        packed_linears: bool = True,
    ) -> None:
        """`speculate`: verify drafted tokens in one forward pass, drafted also from the
        engine's recent greedy answers in the request's scope (`answers`, up to
        `draft_index_tokens` tokens over all scopes; 0: none). Greedy requests only unless
        `speculate_sampled`: a sampled request's verification picks each position with its own
        seeded draw, but from logits computed several positions at a time, whose last bits
        differ from a single-token pass's; a draw that falls that close to a boundary between
        two tokens picks the other one (seen on an H200: docs/speculation.md), so a seeded
        answer would depend on what was drafted.

        `packed_linears`: on the CPU, run the model's float32 linear layers through oneDNN's
        prepacked linear instead of MKL's sgemm (`tiercache.packed_linear`; passes over several
        tokens 1.4-2.8x faster here, one-token steps 1.45x on 2 threads); `packed_layers` says
        how many were packed."""
        self.speculate = speculate
        self.speculate_sampled = speculate_sampled
        # torch threads for passes over several tokens (prefill, verification); 0: unchanged
        self.pass_threads = pass_threads
        self.answers = AnswerIndex(draft_index_tokens)
        self.last_drafter: Drafter | None = None  # the last request's drafter (its counts)
        self.source = source
        self.identity = source.identity
        self.device = pick_device(device)
        # CPU work is done when the call returns; timing a GPU's would need a synchronize
        self._timed_prefill = str(self.device).startswith("cpu")
        self._store_failures = LogThrottle()
        self.tokenizer, self.model = load_model(source, cache_dir, self.device)
        self.packed_layers = 0
        if packed_linears and not self.on_gpu:
            self.packed_layers = pack_and_log(self.model, "engine")
        self.context_tokens = context_window(self.model.config)
        self.adapters = EngineAdapters(self.model, max_slots=lora_slots, max_bytes=lora_max_bytes)
        eos = {self.tokenizer.eos_token_id}
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            eos.add(im_end)
        self.eos_token_ids = frozenset(t for t in eos if t is not None)
        self.kv_pool: KvBlockPool[torch.Tensor] = KvBlockPool(
            kv_pool_max_bytes, tokens_per_block, named_policy(kv_eviction)
        )
        self.kv_reuse = kv_reuse and _full_attention_only(self.model)
        if kv_reuse and not self.kv_reuse:
            log.warning("KV prefix reuse is off: the model has layers other than full attention")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes in every layer (keys and values)."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        element = torch.finfo(self.model.dtype).bits // 8
        return int(2 * config.num_hidden_layers * kv_heads * head_dim * element)

    @property
    def on_gpu(self) -> bool:
        return str(self.device).startswith("cuda")

    def card(self) -> tuple[int, str | None]:
        """The engine's card as this process numbers it (`cuda:<n>`; "cuda" is the current
        device) and the UUID the CUDA driver gives it (None where torch cannot say): what
        `tiercache.machine.nvml_card` matches NVML's readings with."""
        index = torch.device(self.device).index
        if index is None:
            index = torch.cuda.current_device()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
        except (AttributeError, RuntimeError, AssertionError):
            uuid = None
        return index, uuid

    def release_cached_memory(self) -> None:
        """Hand the memory torch's CUDA allocator keeps cached back to the card (after a
        budget's evictions: NVML, which the budgets read, counts cached blocks as used)."""
        if self.on_gpu:
            torch.cuda.empty_cache()

    def kv_stats(self) -> KvStats:
        return self.kv_pool.stats()

    def prompt_ids(self, request: GenerationRequest) -> torch.Tensor:
        """The model's input ids for `request` (`prompt_token_ids`), as a [1, n] tensor."""
        ids = prompt_token_ids(self.tokenizer, request)
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    def generate(
        self,
        request: GenerationRequest,
        is_cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[StreamEvent]:
        """Stream the answer. The last event has `finish_reason`; its text ends the answer, and
        every event carries how many prompt tokens were reused from the KV pool and computed.

        With `speculate` on (and, for a sampled request, `speculate_sampled`), each step drafts
        tokens from `request.drafts` (texts it may well repeat: cached answers in its scope,
        which llm sets), from its own prompt and from the scope's recent greedy answers
        (tiercache.engine.drafts), and verifies them in one forward pass: the model's own choice
        at every drafted position decides (greedy, or the sampler's draw for that answer
        position: the one plain decoding takes there), so the output is the one plain decoding
        gives, up to the pass's rounding (see `__init__`); a step yields the picked token plus
        every draft token the model agreed with.

        Raises, before any output or model work: InvalidRequest for values out of range
        (`check_ranges`) and when the prompt's tokens plus `max_tokens` exceed the model's
        context window (`check_context`); NotFound ("... not found in cache") when the
        request's adapter is not loaded."""
        check_ranges(request)
        input_ids = self.prompt_ids(request)
        prompt_tokens = int(input_ids.shape[1])
        check_context(prompt_tokens, request.max_tokens, self.context_tokens)
        self.adapters.activate(adapter_ref(request))
        sampler = _Sampler(request, self.device)
        detok = _Detokenizer(self.tokenizer, request.stop_words)
        prompt_list = input_ids[0].tolist()
        scope = kv_salt(self.identity.revision, request.tenant_scope, request.lora_digest)
        drafter = None
        if self.speculate and request.speculate and (request.greedy or self.speculate_sampled):
            most = request.max_tokens * DRAFT_CHARS_PER_TOKEN
            texts = [cut_at_stop(text[:most], request.stop_words) for _, text in request.drafts]
            answers = [
                (source, self.encode_text(text))
                for (source, _), text in zip(request.drafts, texts, strict=True)
            ]
            drafter = Drafter(
                answers,
                prompt_list,
                index=self.answers.view(scope),
                texts=texts,
                codec=Codec(detok.text_of, self.encode_text),
            )
            prefill_source, verify_ids = prefill_draft(answers, request.greedy)
            verify_ids = verify_ids[: request.max_tokens]
        else:
            prefill_source, verify_ids = "", []
        self.last_drafter = drafter
        generated: list[int] = []
        hashes: list[BlockHash] = []
        lease: KvLease[torch.Tensor] | None = None
        # a request its caller left before this point is answered cancelled below: it looks
        # nothing up (a lookup counted, blocks' reuses raised, the policy told of an access
        # for a prompt that never ran) and computes nothing
        cancelled_early = is_cancelled()
        if self.kv_reuse and not cancelled_early:
            hashes = block_hashes(prompt_list, self.kv_pool.tokens_per_block, scope)
            lease = self.kv_pool.acquire(hashes, prompt_tokens)  # released in `finally` below
        else:
            self.kv_pool.settle_budget()  # a lowered budget, taken up without a lookup
        reused = 0 if lease is None else lease.reused_tokens
        computed = 0 if cancelled_early else prompt_tokens - reused

        logprobs: list[float] = []  # each picked token's, in answer order (its end included)

        def event(text: str, finish_reason: str | None) -> StreamEvent:
            final = finish_reason is not None
            mean = sum(logprobs) / len(logprobs) if final and logprobs else None
            step = StreamEvent(
                text, finish_reason, len(generated), prompt_tokens, reused, computed,
                mean_logprob=mean, token_ids=tuple(generated) if final else (),
            )  # fmt: skip
            if not final or drafter is None:
                return step
            if finish_reason in ("stop", "length") and request.index_answer and request.greedy:
                self.answers.add(scope, generated)  # a draft source for the scope's next ones
            return dataclasses.replace(
                step,
                drafted_tokens=drafter.proposed,
                accepted_tokens=drafter.accepted_total,
                draft_steps=tuple(drafter.steps),
            )

        pending = ""  # text of the tokens taken this step, sent with the step's event

        def take(token: int, logprob: float) -> StreamEvent | None:
            """Add `token` (picked with `logprob`) to the answer: the event that ends it (eos, a
            stop word, max_tokens), else None and its new text waits in `pending`."""
            nonlocal pending
            logprobs.append(logprob)
            if token in self.eos_token_ids:
                return event(pending + detok.flush(), "stop")
            generated.append(token)
            text, stopped = detok.push(generated)
            if stopped:
                return event(pending + text, "stop")
            if len(generated) >= request.max_tokens:
                return event(pending + text + detok.flush(), "length")
            pending += text
            return None

        def take_kept(kept: list[int], kept_logprobs: list[float]) -> StreamEvent | None:
            """Take a verified draft's kept tokens: the event that ends the answer among them
            (its draft tokens past the end not counted), else None."""
            before = len(generated)
            for accepted_token, logprob in zip(kept, kept_logprobs, strict=True):
                last = take(accepted_token, logprob)
                if last is not None:
                    if drafter is not None:  # kept tokens past the answer's end
                        drafter.unused(len(kept) - (len(generated) - before))
                        last = dataclasses.replace(
                            last,
                            accepted_tokens=drafter.accepted_total,
                            draft_steps=tuple(drafter.steps),
                        )
                    return last
            return None

        def emit_kept(
            kept: list[int], kept_logprobs: list[float]
        ) -> Generator[StreamEvent, None, bool]:
            """Yield what taking a verified draft's kept tokens produced: the answer's last
            event (then True: the answer is done), or the step's pending text (False)."""
            last = take_kept(kept, kept_logprobs)
            if last is not None:
                yield last
                return True
            if pending:
                yield event(pending, None)
            return False

        try:
            if cancelled_early or is_cancelled():  # before the prefill, the longest step
                yield event("", "cancelled")
                return
            with torch.inference_mode():
                began = time.perf_counter()
                with self._many_tokens():
                    out = self._prefill(input_ids, lease, verify_ids)
                if self._timed_prefill:  # what a reused block saves (the KV pool's budget)
                    self.kv_pool.observe_prefill(
                        time.perf_counter() - began, computed + len(verify_ids)
                    )
                if lease is not None and not verify_ids:
                    # Not from a pass with an answer behind the prompt: its shapes round
                    # otherwise, and the requests reusing its blocks (even those asking for no
                    # speculation) would read what speculation computed. The next plain
                    # prefill of this prompt stores them.
                    self._store_blocks(lease, hashes, out.past_key_values)
                if verify_ids and drafter is not None:
                    # A whole answer verified in the prefill pass (`prefill_draft`): the
                    # model's own pick at each of its positions decides, as for any draft.
                    kept, kept_lp, logits, cache = self._keep_agreed(
                        out, verify_ids, out.past_key_values, sampler, 0
                    )
                    del out  # its logits (a row per answer token) are not needed any more
                    drafter.source = prefill_source
                    drafter.accepted(len(verify_ids), len(kept))
                    if (yield from emit_kept(kept, kept_lp)):
                        return
                else:
                    logits, cache = out.logits[:, -1, :], out.past_key_values
                while True:
                    if is_cancelled():
                        yield event("", "cancelled")
                        return
                    token = sampler.pick(logits, len(generated))
                    pending = ""
                    last = take(token, _logprob_of(logits[0], token))
                    if last is not None:
                        yield last
                        return
                    draft: list[int] = []
                    if drafter is not None:
                        room = request.max_tokens - len(generated)
                        draft = drafter.propose(generated, room)
                    if not draft:
                        if pending:
                            yield event(pending, None)
                        step = torch.tensor([[token]], device=self.device)
                        out = self.model(input_ids=step, past_key_values=cache, use_cache=True)
                        logits, cache = out.logits[:, -1, :], out.past_key_values
                        continue
                    kept, kept_lp, logits, cache = self._verify(
                        token, draft, cache, sampler, len(generated)
                    )
                    if drafter is not None:
                        drafter.accepted(len(draft), len(kept))
                    if (yield from emit_kept(kept, kept_lp)):
                        return
        finally:
            if lease is not None:
                self.kv_pool.release(lease)

    def encode_text(self, text: str) -> list[int]:
        """A text's token ids, as a draft's are made (no special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_ids(self, token_ids: Sequence[int]) -> str:
        """Token ids' text, as an answer's is decoded (_Detokenizer)."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _verify(
        self, token: int, draft: list[int], cache: Any, sampler: _Sampler, position: int
    ) -> tuple[list[int], list[float], Any, Any]:
        """Run `token` and the `draft` after it in one forward pass; keep the longest prefix of
        the draft the model picks itself (greedy, or `sampler`'s seeded draw for each answer
        position from `position` on), and the KV of `token` and that prefix only.
        Returns the kept draft tokens, their log-probabilities, the logits after the last kept
        token, and the cache."""
        step = torch.tensor([[token, *draft]], device=self.device)
        with self._many_tokens():
            out = self.model(input_ids=step, past_key_values=cache, use_cache=True)
        return self._keep_agreed(out, draft, out.past_key_values, sampler, position)

    @contextlib.contextmanager
    def _many_tokens(self) -> Iterator[None]:
        """A forward pass over several tokens on `pass_threads` threads (then torch's count as
        it was): on a small CPU a one-token step gains nothing from a second thread, a pass over
        many tokens does. The engine's one worker runs every pass, so the process-wide count is
        not changed under another pass."""
        wanted = self.pass_threads
        before = torch.get_num_threads()
        if wanted <= 0 or wanted == before or self.on_gpu:
            yield
            return
        torch.set_num_threads(wanted)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _keep_agreed(
        self, out: Any, draft: list[int], cache: Any, sampler: _Sampler, position: int
    ) -> tuple[list[int], list[float], Any, Any]:
        """Of a forward pass whose last len(draft) + 1 logits predict `draft` and the token
        after it: the draft's longest prefix the model picks itself (from answer position
        `position` on), the logits after it, and `cache` with the rejected tokens cropped."""
        kept = 0
        if sampler.rng is None:
            picks = out.logits[0].argmax(dim=-1).tolist()
            while kept < len(draft) and picks[kept] == draft[kept]:
                kept += 1
        else:
            while kept < len(draft) and (
                sampler.pick(out.logits[:, kept, :], position + kept) == draft[kept]
            ):
                kept += 1
        rejected = len(draft) - kept
        if rejected:
            cache.crop(-rejected)  # this transformers takes the number of tokens to drop
        kept_logprobs = []
        if kept:
            rows = torch.log_softmax(out.logits[0, :kept].float(), dim=-1)
            picked = torch.tensor(draft[:kept], device=rows.device).unsqueeze(1)
            kept_logprobs = rows.gather(1, picked).squeeze(1).tolist()
        # a copy of the one row: the pass's logits (a verify draft's: one row per answer
        # token, 0.2 MB each) are not kept alive through the rest of the answer
        return draft[:kept], kept_logprobs, out.logits[:, kept, :].clone(), cache

    def _prefill(
        self,
        input_ids: torch.Tensor,
        lease: KvLease[torch.Tensor] | None,
        verify: Sequence[int] = (),
    ) -> Any:
        """Run the prompt after the lease's reused tokens, on a cache built from its blocks,
        followed by `verify` (an answer to check in the same pass). Only the logits that pick
        the answer's tokens are computed (`logits_to_keep`: the last prompt position's, and
        `verify`'s): the LM head over a 49k vocabulary is about a fifth of SmolLM2's prefill."""
        keep = len(verify) + 1
        if verify:
            tail = torch.tensor([list(verify)], dtype=input_ids.dtype, device=input_ids.device)
            input_ids = torch.cat([input_ids, tail], dim=1)
        if lease is None or lease.reused_tokens == 0:
            return self.model(input_ids=input_ids, use_cache=True, logits_to_keep=keep)
        start = lease.reused_tokens
        # One block is [layers, 2 (keys, values), kv_heads, tokens_per_block, head_dim].
        kv = torch.cat(lease.payloads(), dim=3)[:, :, :, :start]
        cache = DynamicCache(
            ddp_cache_data=[(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in kv],
            config=self.model.config,
        )
        positions = torch.arange(start, input_ids.shape[1], device=self.device).unsqueeze(0)
        return self.model(
            input_ids=input_ids[:, start:],
            past_key_values=cache,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep,
        )

    def _store_blocks(
        self, lease: KvLease[torch.Tensor], hashes: list[BlockHash], cache: Any
    ) -> None:
        """Add the prompt's full blocks past the reused ones to the pool, right after prefill,
        so a later request can reuse them while this one is still decoding. Each block is a
        copy: a view would keep the whole, growing cache tensor alive."""
        size = self.kv_pool.tokens_per_block
        layers = cache.layers

        def block_at(index: int) -> Callable[[], torch.Tensor]:
            first, last = index * size, (index + 1) * size
            return lambda: torch.stack(
                [
                    torch.stack((layer.keys[0, :, first:last], layer.values[0, :, first:last]))
                    for layer in layers
                ]
            )

        nbytes = self.kv_bytes_per_token * size
        try:
            for index in range(len(lease.blocks), len(hashes)):
                if not self.kv_pool.insert(lease, hashes[index], nbytes, block_at(index)):
                    return
        except Exception:  # noqa: BLE001 - the prefill worked: the request goes on uncached
            # (a copy out of memory on a card the budgets keep near full, a broken policy)
            lease.broken = True
            if self._store_failures.ready():
                log.exception(
                    "storing a prompt's KV blocks failed; the request goes on without them "
                    "(%d such failures not logged)",
                    self._store_failures.suppressed,
                )


def _full_attention_only(model: Any) -> bool:
    """Blocks are stitched into a DynamicCache of plain (full-attention) layers; sliding-window
    or other layer kinds would need their own handling."""
    # here, not at the module's top: the GPU image imports this module with the transformers
    # TensorRT-LLM pins (to de-quantise the packaged weights), which may predate DynamicLayer
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _logprob_of(row: torch.Tensor, token: int) -> float:
    """The log-probability of `token` under the logits `row` (temperature 1)."""
    return float(torch.log_softmax(row.float(), dim=-1)[token])


class _Sampler:
    """Greedy argmax, or temperature / top-k / top-p sampling.

    Draws come from NumPy's PCG64 seeded with the full 64-bit seed: torch's CPU generator keeps
    only part of a uint64 seed (0 and 2**63 gave the same stream), and distinct seeds in distinct
    cache entries should mean distinct samples. The answer's token at `position` always takes
    the stream's draw number `position`, however often that position is picked: a speculative
    verification picks drafted positions ahead and picks the first refused one again after it,
    and both must give the token plain decoding gives there.
    """

    def __init__(self, request: GenerationRequest, device: str) -> None:
        self.request = request
        self.rng: np.random.Generator | None = None
        self._draws: list[float] = []  # the stream's draws so far, by answer position
        if not request.greedy:
            seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(8))
            self.rng = np.random.Generator(np.random.PCG64(seed))

    def _draw(self, position: int) -> float:
        assert self.rng is not None
        while len(self._draws) <= position:
            self._draws.append(float(self.rng.random()))
        return self._draws[position]

    def pick(self, logits: torch.Tensor, position: int) -> int:
        """The token at answer position `position` (0: the first generated) for `logits`
        (shape [1, vocab])."""
        if self.rng is None:
            return int(torch.argmax(logits, dim=-1)[0])
        raw = logits[0].float()
        # Shifted so the best score is 0 before dividing: a temperature near 0 (1e-40 passes the
        # request's checks) then gives -inf to the rest, i.e. greedy, not inf / inf = NaN
        scores = (raw - raw.max()) / self.request.temperature
        if self.request.top_k > 0:
            k = min(self.request.top_k, scores.shape[-1])
            kth = torch.topk(scores, k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.request.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs_sorted = torch.softmax(sorted_scores, dim=-1)
            drop = probs_sorted.cumsum(dim=-1) - probs_sorted > self.request.top_p
            scores = scores.masked_fill(
                torch.zeros_like(drop).scatter(0, order, drop), float("-inf")
            )
        cdf = torch.softmax(scores, dim=-1).double().cumsum(dim=-1).cpu().numpy()
        draw = self._draw(position)  # drawn whatever happens next: the stream stays aligned
        if not np.isfinite(cdf[-1]) or cdf[-1] <= 0.0:  # nothing sampleable: the best token
            return int(torch.argmax(raw))
        index = int(np.searchsorted(cdf, draw * cdf[-1], side="right"))
        return min(index, len(cdf) - 1)


class _Detokenizer:
    """Incremental detokenization that never emits broken UTF-8 or a partial stop word.

    Each step decodes all generated tokens (O(n) per token; answers are short) and emits only text
    past what was already emitted, holding back a trailing replacement character (an unfinished
    multi-byte sequence) and any suffix that could still grow into a stop word.
    """

    def __init__(self, tokenizer: Any, stop_words: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop_words = stop_words
        self.emitted = 0
        self.text = ""
        self._pushed = 0  # tokens `text` is the decoding of

    def text_of(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`: the last push's, decoded once, when they are what it
        decoded (the drafter asks for the tokens generated so far, right after they were
        pushed); decoded here otherwise."""
        if len(token_ids) == self._pushed:
            return self.text
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """New safe text, and whether a stop word ended the answer (text cut before it)."""
        self.text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self._pushed = len(token_ids)
        safe = len(self.text)
        if self.text.endswith(REPLACEMENT_CHAR):
            safe -= 1  # an unfinished character: no stop word may match it (a U+FFFD in one did)
        whole = self.text[:safe]
        cut = min((i for w in self.stop_words if (i := whole.find(w)) >= 0), default=-1)
        if cut >= 0:
            new = self.text[self.emitted : cut] if cut > self.emitted else ""
            self.emitted = max(self.emitted, cut)
            return new, True
        safe -= self._stop_prefix_len(whole)
        if safe <= self.emitted:
            return "", False
        new = self.text[self.emitted : safe]
        self.emitted = safe
        return new, False

    def flush(self) -> str:
        """At the end: the held-back text, minus an unfinished UTF-8 sequence."""
        rest = self.text[self.emitted :]
        if rest.endswith(REPLACEMENT_CHAR):
            rest = rest[:-1]
        self.emitted = len(self.text)
        return rest

    def _stop_prefix_len(self, text: str) -> int:
        longest = 0
        for word in self.stop_words:
            for n in range(min(len(word) - 1, len(text)), longest, -1):
                if text.endswith(word[:n]):
                    longest = n
                    break
        return longest
