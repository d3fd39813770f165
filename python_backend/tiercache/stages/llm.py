"""The `llm` stage (decoupled): hits stream at once; misses go to `tiercache.generation`, which
calls the engine model through BLS: `torch_llm` (engine_kind torch_llm, the default) or Triton's
TensorRT-LLM backend model (engine_kind tensorrt_llm, tiercache.engine.trtllm_client). Response
padding for untrusted tenants, cross-replica leases and shared semantic rows are wired here."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.adapter_types import AdapterRef
from tiercache.config import LlmConfig
from tiercache.engine.adapter_call import (
    NO_LORA,
    EngineLora,
    adapter_ref,
    generate_with_adapter,
)
from tiercache.engine.events import StreamEvent
from tiercache.engine.trtllm_client import (
    REQUESTED_OUTPUTS,
    EngineLimits,
    KvCacheReuse,
    TrtllmClient,
    load_tokenizer,
    request_lora_from_arrays,
)
from tiercache.errors import (
    CapacityError,
    Forbidden,
    InvalidRequest,
    TierCacheError,
    Unavailable,
)
from tiercache.exact.answer_ids import AnswerIds, AnswerRef, ServedAs
from tiercache.exact.confidence import ConfidencePolicy
from tiercache.exact.flights import EngineUsage
from tiercache.exact.leases import LeaseCoordinator
from tiercache.exact.memo import MEMO_MAX_CHARS, Memo, worth_keeping
from tiercache.exact.request import GenerationRequest
from tiercache.exact.stores import LmdbStore
from tiercache.generation import (
    SERVED_UNCACHED_FINISHES,
    GenerateFn,
    GenerationRecord,
    Generations,
    Responder,
)
from tiercache.padding import MaskedResponder, PaddedResponder, ResponseTimer, uniform_source
from tiercache.semantic.embedder import resolve_embedder
from tiercache.semantic.entry_trust import length_class, record_outcome, verification_stamp
from tiercache.semantic.redis_rows import RowSharing
from tiercache.semantic.store import SemanticStore
from tiercache.stages.common import (
    DraftMetrics,
    admin_inputs,
    admin_seal,
    engine_inputs,
    export_late_calls,
    export_redis,
    status_counters,
)
from tiercache.stages.contract import LLM, llm_terms, write_terms
from tiercache.stages.envelope import (
    ENVELOPE_TENSOR,
    Envelope,
    Freshness,
    ReceivedEnvelope,
    seal_of,
)
from tiercache.stages.parts import (
    ExactTiers,
    kv_reuse_scope,
    load_secret,
    open_adapter_cipher,
    open_exact_cache,
    open_freshness,
    open_sealer,
    padding_policy,
)
from tiercache.stages.seal import (
    ANSWER_LABEL,
    ANSWER_TENSORS,
    LORA_LABEL,
    NO_TOKENS,
    TRT_LORA_INPUTS,
    Part,
    Sealer,
    Tokens,
    check_tensors,
    lora_inputs,
    tokens_of,
)
from tiercache.stages.transport import AdapterCipher, seal_views
from tiercache.triton import io
from tiercache.triton import metrics as tm
from tiercache.triton.bls import BlsClient
from tiercache.vocabulary import CacheStatus, EngineKind, Tier, choices, is_hit

ENGINE_OUTPUTS = [
    "TEXT",
    "FINISH_REASON",
    "GENERATED_TOKENS",
    "PROMPT_TOKENS",
    "REUSED_TOKENS",
    "COMPUTED_TOKENS",
    "SPECULATED_TOKENS",
    "MEAN_LOGPROB",
    "ENGINE_S",
]


@dataclass(frozen=True, slots=True)
class LlmInput:
    """One request to llm, as model.py decoded it."""

    # checked and decoded when first read (an exact hit's at once, `received_exact`; a semantic
    # hit's to read its verify-semantic word, unless the deployment's verify_semantic says it all)
    envelope: ReceivedEnvelope
    status: str  # exact (prompt_cache's hit, or embedding_cache's), semantic, miss or bypass
    cached_text: str  # the answer to serve on a hit
    similarity: float | None  # a semantic hit's
    vector: np.ndarray | None  # the prompt's embedding (indexed with a new answer)
    lora: EngineLora  # what lora_cache sent for the engine
    tokens: Tokens = NO_TOKENS  # a hit's stored token accounting (tiercache.stages.seal)
    # a miss's semantic neighbours' answer digests (drafts); a semantic hit's: the one it serves
    neighbours: tuple[str, ...] = ()
    # a semantic hit's trust decision (embedding_cache's semantic_max_error): its calibrated
    # score (0.0: no gate decided) and whether the engine must verify it first
    hit_score: float = 0.0
    must_verify: bool = False


def open_lora(
    cipher: AdapterCipher, trtllm: bool, tensors: dict[str, Part], bound: str
) -> EngineLora:
    """What lora_cache sent for the engine (its tensors `lora_inputs(trtllm)` as received: the
    adapter files closed for the answer `bound`, tiercache.stages.transport), opened. Forbidden
    when a file does not open."""
    if trtllm:
        task_id = tensors.get("LORA_TASK_ID")
        trt = request_lora_from_arrays(
            task_id if isinstance(task_id, np.ndarray) else None,
            *(cipher.open_array(n, _blob(tensors.get(n)), bound) for n in TRT_LORA_INPUTS[1:]),
        )
        return EngineLora(trtllm=trt)
    config = cipher.open("LORA_CONFIG", _blob(tensors.get("LORA_CONFIG")), bound)
    try:
        config_json = config.decode("utf-8")
        evict = json.loads(_blob(tensors.get("LORA_EVICT")) or b"[]")
    except ValueError as exc:  # UnicodeDecodeError included
        raise InvalidRequest(f"lora_cache's adapter tensors do not decode: {exc}") from exc
    return EngineLora(
        config_json=config_json,
        weights=cipher.open("LORA_WEIGHTS", _blob(tensors.get("LORA_WEIGHTS")), bound),
        evict=tuple(str(digest) for digest in evict),
    )


def _blob(value: Part) -> bytes:
    """A bytes tensor's value as received (str as UTF-8; none and arrays as b"")."""
    if isinstance(value, str):
        return value.encode("utf-8")
    return value if isinstance(value, bytes) else b""


# A generation's answer id, issued from its final response's finish reason (`LlmStage.answer_id`)
LazyAnswerId = Callable[[str | None], str | None]


class IdentifiedAtFinal:
    """A generation's responder (`outer`: padded and masked when its tenant is) whose answer id
    is issued when its final response is handed in, once the answer is made, and given to the
    `innermost` responder (the one that sends it): before padding holds the final, so a held
    miss's release does what a held hit's does; none (logged) should issuing fail."""

    __slots__ = ("_outer", "_innermost", "_issue")

    def __init__(self, outer: Responder, innermost: Responder, issue: LazyAnswerId) -> None:
        self._outer = outer
        self._innermost = innermost
        self._issue = issue

    def is_cancelled(self) -> bool:
        return self._outer.is_cancelled()

    def send_chunk(self, text: str) -> None:
        self._outer.send_chunk(text)

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        usage: EngineUsage | None = None,
        finish_reason: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        try:
            answer_id = self._issue(finish_reason)
        except Exception:  # noqa: BLE001 - the answer is served without an id, not lost
            io.log.exception("no answer id for a generated answer")
            answer_id = None
        if answer_id is not None:
            self._innermost.identify(answer_id)
        self._outer.send_final(
            text, status, similarity, usage, finish_reason=finish_reason, tokens=tokens
        )

    def send_cancelled(self) -> None:
        self._outer.send_cancelled()

    def identify(self, answer_id: str) -> None:
        self._innermost.identify(answer_id)

    def send_error(self, exc: BaseException) -> None:
        self._outer.send_error(exc)


# Padded requests one llm instance holds at once, from arrival to their last response (each
# keeps its answer and Triton's request until the floor): more are refused at once.
MAX_HELD_PADDED = 4096

# Adapter files llm keeps until the engine was seen to take them (`EngineBls.expect`): a few
# new adapters at once, within a byte bound; one dropped only costs the engine's refusal.
MAX_UNCONFIRMED_ADAPTERS = 8
MAX_UNCONFIRMED_BYTES = 256 << 20


class EngineBls:
    """The engine model over BLS, as `GenerateFn`s: torch_llm (the envelope in, text chunks
    out) or TensorRT-LLM (token ids in and out, through `TrtllmClient`)."""

    def __init__(
        self,
        config: LlmConfig,
        sealer: Sealer,
        cipher: AdapterCipher,
        on_kv: Callable[[KvCacheReuse], None],
    ) -> None:
        self.model_name = config.engine_model
        self.sealer = sealer
        self.cipher = cipher
        self.client = BlsClient(
            config.engine_model,
            label=f"engine {config.engine_model}",
            stream_idle_s=config.engine_timeout_s or None,
        )
        self.lora_client = BlsClient(config.lora_model, timeout_s=config.lora_timeout_s or None)
        self._on_kv = on_kv
        # (source, proposed, accepted) per speculative step of a finished TensorRT-LLM answer
        self.on_drafts: Callable[[tuple[tuple[str, int, int], ...]], None] | None = None
        self.trtllm: TrtllmClient | None = None
        # the one tenant scope the engine's prefix KV reuse may serve (trtllm_kv_reuse_tenant)
        self.kv_reuse_scope: str | None = None
        if config.engine_kind == EngineKind.TENSORRT_LLM:
            self.trtllm = TrtllmClient(
                load_tokenizer(config.tokenizer_dir),
                limits=EngineLimits(
                    config.trtllm_max_input_len,
                    config.trtllm_max_seq_len,
                    config.trtllm_build_draft_len,
                ),
                max_draft_len=config.trtllm_max_draft_len,
            )
        # Engine calls open at once (torch_llm: more wait here, not in the engine's queue).
        self._streams = threading.BoundedSemaphore(config.engine_streams or config.max_concurrency)
        # torch_llm adapters' files lora_cache sent, by (task id, digest), until a call that
        # carried them was answered (`expect`)
        self._unconfirmed: OrderedDict[tuple[int, str], EngineLora] = OrderedDict()
        self._unconfirmed_lock = threading.Lock()

    def generate(
        self, request: GenerationRequest, lora: EngineLora = NO_LORA
    ) -> Iterator[StreamEvent]:
        if self.trtllm is not None:
            return self._generate_trtllm(self.trtllm, request, lora)
        return self._generate_torch(request, lora)

    def expect(self, request: GenerationRequest, lora: EngineLora) -> None:
        """Keep the adapter files lora_cache sent with `request` (torch_llm) until a call that
        carried them was answered: lora_cache counts an adapter loaded once it has planned
        the request that carries its files, and sends the requests after it without; one of
        those may reach the engine first (a coalesced follower's own call never runs, and
        another flight may take an engine stream first), and any call for the adapter
        without files takes them from here meanwhile (docs/lora.md). The eviction list
        stays with its own request: the engine makes room by itself (`lora_slots`)."""
        ref = adapter_ref(request)
        if ref is None or not lora.weights or self.trtllm is not None:
            return
        if len(lora.weights) + len(lora.config_json) > MAX_UNCONFIRMED_BYTES:
            return
        key = (ref.task_id, ref.digest)
        with self._unconfirmed_lock:
            self._unconfirmed[key] = EngineLora(lora.config_json, lora.weights)
            self._unconfirmed.move_to_end(key)
            kept = self._unconfirmed.values()
            while len(self._unconfirmed) > MAX_UNCONFIRMED_ADAPTERS or (
                sum(len(f.weights) + len(f.config_json) for f in kept) > MAX_UNCONFIRMED_BYTES
            ):
                self._unconfirmed.popitem(last=False)

    def unconfirmed(self) -> int:
        """Adapters whose files llm still keeps for the engine (`expect`)."""
        with self._unconfirmed_lock:
            return len(self._unconfirmed)

    def _with_expected(
        self, request: GenerationRequest, lora: EngineLora
    ) -> tuple[EngineLora, tuple[int, str] | None]:
        """`lora` with the files `expect` keeps for the request's adapter when it carries none;
        and the key to confirm once a call carrying files was answered (None: nothing to)."""
        ref = adapter_ref(request)
        if ref is None or self.trtllm is not None:
            return lora, None
        key = (ref.task_id, ref.digest)
        if not lora.loads:
            with self._unconfirmed_lock:
                kept = self._unconfirmed.get(key)
            if kept is None:
                return lora, None
            lora = dataclasses.replace(lora, config_json=kept.config_json, weights=kept.weights)
        return lora, key

    def _confirmed(self, key: tuple[int, str] | None) -> None:
        if key is not None:
            with self._unconfirmed_lock:
                self._unconfirmed.pop(key, None)

    def _generate_torch(
        self, request: GenerationRequest, lora: EngineLora
    ) -> Iterator[StreamEvent]:
        """One engine call, as a stream of events. A stream given up on (the engine's deadline,
        a flight nobody waits for) is cancelled where python_backend can (25.05 and later:
        torch_llm then stops generating); before that the generation runs to max_tokens and is
        discarded.
        A call for an adapter that goes out without its files while another request's files
        for it wait for the engine's answer carries them too (`expect`)."""
        with self._streams:  # held until the stream ends (engine_streams)
            # its turn: an event with nothing in it, so that a caller whose requesters all left
            # while it waited closes the stream here, before the call goes out
            yield StreamEvent(text="")
            # sealed as it goes out (issued now: torch_llm checks its age), no key: no caller
            # sees an engine call
            envelope = Envelope(request=request).seal(self.sealer)
            # the adapter's files decided when the call goes out: the engine takes calls in
            # order, and files another request brought may have come while this one waited
            lora, carried = self._with_expected(request, lora)
            values: dict[str, str | bytes] = {ENVELOPE_TENSOR: envelope}
            if lora.loads:
                values["LORA_CONFIG"] = lora.config_json
                values["LORA_WEIGHTS"] = lora.weights
            if lora.evict:
                values["LORA_EVICT"] = json.dumps(list(lora.evict))
            try:
                inputs = engine_inputs(self.sealer, values)
                responses = iter(self.client.stream(inputs, ENGINE_OUTPUTS, cancel_on_close=True))
                first = next(responses, None)
            finally:  # answered (the engine holds the adapter) or refused (not sent again)
                self._confirmed(carried)
            if first is None:
                return
            for response in itertools.chain([first], responses):
                finish = io.output_string(response, "FINISH_REASON")
                yield StreamEvent(
                    text=io.output_string(response, "TEXT") or "",
                    finish_reason=finish or None,
                    generated_tokens=io.output_int(response, "GENERATED_TOKENS") or 0,
                    prompt_tokens=io.output_int(response, "PROMPT_TOKENS") or 0,
                    reused_tokens=io.output_int(response, "REUSED_TOKENS") or 0,
                    computed_tokens=io.output_int(response, "COMPUTED_TOKENS") or 0,
                    accepted_tokens=io.output_int(response, "SPECULATED_TOKENS") or 0,
                    mean_logprob=io.output_float(response, "MEAN_LOGPROB"),
                    engine_s=io.output_float(response, "ENGINE_S"),
                )

    def check_tenant(self, request: GenerationRequest) -> None:
        """Forbidden for a tenant the engine's prefix KV reuse must not serve
        (`trtllm_kv_reuse_tenant`)."""
        if self.kv_reuse_scope is not None and request.tenant_scope != self.kv_reuse_scope:
            raise Forbidden(
                "this server's engine reuses cached prefixes for one tenant only (it was started "
                "with an API key file of one tenant); restart it to serve another"
            )

    def check_admits(self) -> None:
        """Unavailable while the engine's stream watch refuses new calls (`StreamDeadline`)."""
        watch = self.client.stream_deadline
        if watch is not None:
            watch.admit()

    def _generate_trtllm(
        self, trtllm: TrtllmClient, request: GenerationRequest, lora: EngineLora
    ) -> Iterator[StreamEvent]:
        """One generation on Triton's TensorRT-LLM backend model. An answer that ends early (a
        stop word) cancels the rest of the engine's stream."""
        self.check_tenant(request)
        call = trtllm.request(request, lora.trtllm)
        if trtllm.speculates(request, call):
            for event in trtllm.speculative_events(request, call, self._trtllm_step, self._on_kv):
                if event.finish_reason is not None and self.on_drafts is not None:
                    self.on_drafts(event.draft_steps)
                yield event
            return
        tensors = [pb_utils.Tensor(name, array) for name, array in call.tensors.items()]
        responses = self.client.stream(tensors, list(REQUESTED_OUTPUTS), cancel_on_close=True)
        outputs = ({t.name(): t.as_numpy() for t in r.output_tensors()} for r in responses)
        try:
            yield from trtllm.events(request, call, outputs, self._on_kv)
        finally:
            responses.close()  # cancels the rest and hands the stream to the keeper

    def _trtllm_step(self, arrays: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        """One speculative step's engine request (not streamed: one response with its tokens)."""
        tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()]
        responses = self.client.stream(tensors, list(REQUESTED_OUTPUTS), cancel_on_close=True)
        try:
            for response in responses:
                yield {t.name(): t.as_numpy() for t in response.output_tensors()}
        finally:
            responses.close()

    def fetch_weights(self, ref: AdapterRef) -> EngineLora:
        """Ask lora_cache again for an adapter the engine says it lost (see engine_call)."""
        admin = json.dumps({"op": "weights", "lora": json.loads(ref.to_json())})
        trtllm = self.trtllm is not None
        wanted = lora_inputs(trtllm)
        response = self.lora_client.infer(admin_inputs(self.sealer, admin), list(wanted))
        tensors: dict[str, Part] = {
            name: _output_array(response, name)
            if name == "LORA_TASK_ID"
            else io.output_blob(response, name)
            for name in wanted
        }
        # lora_cache closed the files for this call: bound to its seal (admin_seal)
        lora = open_lora(self.cipher, trtllm, tensors, admin_seal(self.sealer, admin))
        if not trtllm:
            return lora
        trt = lora.trtllm
        if trt is None or trt.lora is None:
            raise Unavailable(
                f"{self.lora_client.model_name} sent no TensorRT-LLM weights for {ref.short} "
                "(is its engine_kind tensorrt_llm?)"
            )
        return lora

    def call_with(self, lora: EngineLora) -> GenerateFn:
        """This request's engine call: with what lora_cache sent, retried once on a lost adapter."""
        return lambda request: generate_with_adapter(
            self.generate, self.fetch_weights, request, lora
        )


def _output_array(response: object, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return None if tensor is None else tensor.as_numpy()


# What llm reads of a hit that comes through embedding_cache (model.py's `decode`): an exact hit
# (with an empty stored answer) whose inputs are these tensors byte for byte decodes to what it
# did before (`LlmStage.known_hit`); one with a text is keyed by EXACT_INPUTS.
HIT_INPUTS = (
    "LOOKUP_STATUS",
    "ENVELOPE",
    "CACHED_TEXT",
    "SIMILARITY",
    "EMBEDDING",
    "ANSWER_TOKENS",
    "NEIGHBOURS",
    "HIT_TRUST",
    "ANSWER_SEAL",
)
# What llm reads of an exact hit with an answer (model.py's `decode`): prompt_cache's envelope,
# text and token counts, handed on directly (embedding_cache's answer is empty for it).
EXACT_INPUTS = ("ENVELOPE", "EXACT_TEXT", "EXACT_TOKENS")
# a key holds at most this many bytes of values (an answer and its envelope, as `worth_keeping`
# allows for ASCII text); an entry also holds the answer's text and the decoded envelope (the
# memo counts an entry's characters: `remember_hit`)
HIT_KEY_MAX_BYTES = 5 * MEMO_MAX_CHARS + 1024


class LlmStage:
    """Hits served, misses submitted to `Generations`, every response padded for untrusted
    tenants, and generated answers indexed (semantic rows, shared through Redis with L3)."""

    def __init__(
        self,
        config: LlmConfig,
        tiers: ExactTiers,
        metrics: tm.Metrics,
        secret: bytes,
        sealer: Sealer,
        cipher: AdapterCipher,
        freshness: Freshness | None = None,
    ) -> None:
        self.config = config
        self.sealer = sealer
        # what an envelope must be past its seal to be served (age; key, with a key file)
        self.freshness = freshness or Freshness(config.envelope_max_age_s)
        self.answer_ids = AnswerIds(secret)
        # exact hits decoded, by their inputs as received (`known_hit`): a repeated hit skips
        # decoding its inputs and the HMAC over them
        self._hits: Memo[LlmInput] = Memo()
        self.metrics = m = metrics
        self.requests = status_counters(
            m,
            "tiercache_llm_requests_total",
            "Responses by cache status",
            "status",
            (*choices(CacheStatus), "error"),
        )
        self.generations = m.counter("tiercache_llm_generations_total", "Engine generations")
        self.verifications = status_counters(
            m,
            "tiercache_llm_semantic_verifications_total",
            "Semantic hits sent to the engine to verify (verify_semantic): served as its own "
            "output, refuted and decoded on, or unchecked (answered otherwise: an answer stored "
            "meanwhile, another replica's, an error or a cancellation)",
            "outcome",
            ("verified", "refuted", "unchecked"),
        )
        self.coalesced = m.counter(
            "tiercache_llm_coalesced_total", "Misses served by joining an identical in-flight one"
        )
        self.write_backs = m.counter("tiercache_llm_write_backs_total", "Answers stored in L2")
        self.write_failures = tm.DeltaCounter(
            m.counter(
                "tiercache_llm_write_failures_total", "Failed writes of an answer or its index row"
            )
        )
        self._failures_lock = threading.Lock()  # producers finish on several threads
        self.tokens = m.counter("tiercache_llm_generated_tokens_total", "Tokens generated")
        self.ttft_s = m.histogram(
            "tiercache_llm_time_to_first_token_seconds",
            "Engine TTFT on a miss",
            buckets=tm.GENERATION_BUCKETS_S,
        )
        self.duration_s = m.histogram(
            "tiercache_llm_generation_seconds",
            "Engine time per miss",
            buckets=tm.GENERATION_BUCKETS_S,
        )
        self.engine = EngineBls(config, sealer, cipher, self._record_kv)
        self.engine.kv_reuse_scope = kv_reuse_scope(config, secret)
        self.engine_late = export_late_calls(  # by event; none without engine_timeout_s
            m,
            self.engine.client.stream_deadline,
            "tiercache_llm_engine_late_total",
            "Engine streams with no response within engine_timeout_s (timed_out), and engine "
            "calls not made while too many such streams were still out (refused); their "
            "requests failed as unavailable",
        )
        if self.engine.trtllm is not None:
            self.drafts = DraftMetrics(m)  # TensorRT-LLM's speculative steps (torch_llm: its own)
            self.engine.on_drafts = self.drafts.record
            self.kv_reused_blocks = m.counter(
                "tiercache_trtllm_kv_cache_reused_blocks_total",
                "KV-cache blocks TensorRT-LLM reused from earlier requests (prefix reuse)",
            )
            self.kv_total_blocks = m.counter(
                "tiercache_trtllm_kv_cache_blocks_total",
                "KV-cache blocks TensorRT-LLM's requests used in all, reused or new",
            )
        l2 = tiers.cache.store(Tier.L2)  # its watch on the disk, shared: one warning a change
        self.semantic = SemanticStore(
            config.semantic_path(),
            config.semantic_max_bytes,
            dimensions=resolve_embedder(config.embedder)[1].dimensions if config.embedder else None,
            max_scopes=config.semantic_max_scopes,
            max_scopes_per_tenant=config.semantic_max_scopes_per_tenant,
            disk=l2.disk if isinstance(l2, LmdbStore) else None,
        )
        rows_skipped = tm.DeltaCounter(
            m.counter(
                "tiercache_semantic_rows_skipped_total",
                "Semantic rows not logged: the state directory's disk under half of "
                "disk_headroom_bytes, or full (the answers are stored all the same)",
            )
        )
        m.on_flush(lambda: rows_skipped.update(self.semantic.disk_skipped))
        if isinstance(l2, LmdbStore):  # llm writes the answers: its L2 writes that found no disk
            l2_store = l2
            l2_rejected = tm.DeltaCounter(
                m.counter(
                    "tiercache_cache_rejected_total",
                    tm.REJECTED_HELP,  # one help text for the family, as prompt_cache's
                    tier=Tier.L2.value,
                )
            )
            m.on_flush(lambda: l2_rejected.update(l2_store.rejected))
        # Response-time padding for untrusted tenants (tiercache.padding); off at floor 0.
        self.padding = padding_policy(config, secret)
        self.padding_timer = ResponseTimer() if self.padding.enabled else None
        self.padding_jitter = uniform_source()
        self._held_padded = 0  # padded requests from arrival to their last response
        self._held_lock = threading.Lock()
        link = tiers.link
        self.core = Generations(
            tiers.cache,
            self.engine.generate,
            max_workers=config.max_concurrency,
            on_generation=self._record,
            on_follow=lambda: self.coalesced.increment(1),
            leases=(
                LeaseCoordinator(link, config.lease_ttl_s, config.lease_wait_s)
                if link is not None
                else None
            ),
            confidence=ConfidencePolicy(config.confidence_floor, config.unsure_ttl_s),
        )
        self.sharing: RowSharing | None = None
        if self.core.leases is not None:
            tm.LeaseMetrics(m, self.core.leases, self.core.stats)

    # -- requests ------------------------------------------------------------------------------

    def received(
        self, data: bytes | None, answer_seal: str | None, answer: dict[str, Part]
    ) -> ReceivedEnvelope:
        """The envelope, once embedding_cache's seal over its answer (the tensors
        ANSWER_TENSORS, bound to the envelope's seal) verifies; Forbidden otherwise. The envelope
        itself is checked when first read: on an exact hit (whose stored answer is empty: one
        with a text comes as EXACT_TEXT, `received_exact`, and is refused here) against that
        empty text and the token counts, as prompt_cache sealed them; against none otherwise."""
        check_tensors(
            self.sealer,
            answer_seal,
            ANSWER_LABEL,
            ANSWER_TENSORS,
            answer,
            bound=seal_of(data),
            what="embedding_cache's answer",
        )
        if answer["ANSWER_STATUS"] != CacheStatus.EXACT:
            return ReceivedEnvelope(data, self.sealer, self.freshness)
        text = str(answer["ANSWER_TEXT"])
        if text:  # no stage sends one this way (`received_exact`): refused, not served
            raise Forbidden(
                "an exact hit's text comes from prompt_cache (EXACT_TEXT), not in "
                "embedding_cache's answer"
            )
        tokens = answer.get("ANSWER_TOKENS")
        counts = tokens_of(tokens if isinstance(tokens, np.ndarray) else None)
        return ReceivedEnvelope(data, self.sealer, self.freshness, text, counts)

    def received_exact(self, data: bytes | None, text: str, tokens: Tokens) -> ReceivedEnvelope:
        """An exact hit as prompt_cache handed it on (EXACT_TEXT, EXACT_TOKENS): its envelope,
        opened now against them (the seal binds an envelope to its exact hit's text and token
        counts; prompt_cache seals a text only with an exact hit's envelope, and one that says
        anything else is Forbidden all the same). Nothing of embedding_cache's is read."""
        envelope = ReceivedEnvelope(data, self.sealer, self.freshness, text, tokens)
        if envelope.get().status != CacheStatus.EXACT:
            raise Forbidden("EXACT_TEXT came with an envelope that is not an exact hit's")
        return envelope

    def known_hit(self, key: tuple[object, ...] | None) -> LlmInput | None:
        """The exact hit decoded earlier from inputs equal to `key` byte for byte
        (`io.Inputs.raw_key` over HIT_INPUTS, or tagged "exact" over EXACT_INPUTS): decoding
        is a function of those inputs alone, so it is what decoding them again would give,
        their seal checked then."""
        return None if key is None else self._hits.get(key)

    def remember_hit(self, key: tuple[object, ...] | None, item: LlmInput) -> None:
        """Keep a decoded exact hit for `known_hit`: one without neighbours, whose answer and
        envelope are small enough (`worth_keeping`) and whose envelope opens (its seal is
        checked when first read: a forged envelope behind a replayed answer seal is refused on
        every request, never kept)."""
        if (
            key is None
            or item.status != CacheStatus.EXACT
            or item.neighbours
            or not worth_keeping(item.cached_text, item.envelope.data)
        ):
            return
        try:
            request = item.envelope.get().request  # decoded once here; read next (answer id)
        except TierCacheError:
            return  # the request's own error follows when it reads the envelope
        # the key's answer and envelope, the entry's answer and decoded request
        held = 2 * len(item.cached_text) + len(item.envelope.data or b"") + request.text_chars()
        self._hits.put(key, item, held)

    def received_lora(
        self, envelope: ReceivedEnvelope, lora_seal: str | None, tensors: dict[str, Part]
    ) -> EngineLora:
        """What lora_cache sent for the engine (`tensors`, by name as received): Forbidden
        unless lora_cache's seal over them (bound to the envelope's) verifies and its adapter
        files open (tiercache.stages.transport)."""
        trtllm = self.engine.trtllm is not None
        envelope.get()  # a stale or revoked envelope costs no HMAC or decryption of the files
        check_tensors(
            self.sealer,
            lora_seal,
            LORA_LABEL,
            lora_inputs(trtllm),
            seal_views(tensors),
            bound=envelope.seal,
            what="lora_cache's adapter tensors",
        )
        lora = open_lora(self.engine.cipher, trtllm, tensors, envelope.seal)
        if lora.loads:
            self.engine.expect(envelope.get().request, lora)
        return lora

    def serve(self, item: LlmInput, responder: Responder, arrival_s: float) -> None:
        """Answer one request through `responder` (a hit at once, a miss from a worker); its
        final response names the answer (`answer_id`) when the request has a digest. Every
        request's envelope is checked (its seal once, its freshness every time: a kept hit
        may be replayed)."""
        try:
            item.envelope.fresh()
            answer_id = self.answer_id(item)
            if isinstance(answer_id, str):
                responder.identify(answer_id)
            innermost = responder
            request = item.envelope.get().request
            self.engine.check_tenant(request)  # a refused tenant's hits too: not the cache's
            if self.padding_timer is not None and self.padding.pads(request.tenant_scope):
                # An engine that refuses calls would fail a padded miss and not a hit: the
                # error would tell one from the other. Refused alike, before any lookup.
                self.engine.check_admits()
            responder = self._padded(responder, item.envelope, arrival_s)
            if answer_id is not None and not isinstance(answer_id, str):
                responder = IdentifiedAtFinal(responder, innermost, answer_id)
        except Exception as exc:  # noqa: BLE001 - no envelope: its error, at once (see count_error)
            self.count_error(responder, exc)
            return
        try:
            self._serve(item, responder)
        except Exception as exc:  # noqa: BLE001 - this request's error, padded like the rest
            self.requests["error"].increment(1)
            responder.send_error(exc)

    def answer_id(self, item: LlmInput) -> str | LazyAnswerId | None:
        """The id of the answer `item` will be served (tiercache.exact.answer_ids): a semantic
        hit's names the neighbour's entry it serves (unless the engine verifies it: then the
        answer is the request's own generation); anything else the request's own digest. None
        for a request without a digest (sampled without a seed: never stored), and for a
        generation that is not stored (`no-store`). A generation's (a miss, a verified hit) is
        issued when its final response is handed in (a function here, of the final's finish
        reason: `IdentifiedAtFinal`): its answer is made by then (stored with its generation's
        start as `created_s`), so the id says, as an exact hit's does, that it names an answer
        made before it, and a verdict sent after the answer was generated again (expired,
        evicted, or invalidated and asked for anew) is not taken for one on the new answer
        (tiercache.feedback). An answer served but not stored (a refusal) gets none."""
        if item.status == CacheStatus.SEMANTIC and not self._verifies(item):
            if not item.neighbours:
                return None
            envelope = item.envelope.get()
            ref = AnswerRef(
                item.neighbours[0], ServedAs.SEMANTIC, item.similarity or 0.0, score=item.hit_score
            )
            request = envelope.request
            return self._issue(
                ref.digest, self.answer_ids.issue, ref, request.tenant_scope, request.lora_name
            )
        envelope = item.envelope.get()
        if not envelope.digest:
            return None
        if item.status != CacheStatus.EXACT and not envelope.write_back:
            # a generation that is not stored (`no-store`): its digest names whatever answer
            # is cached under it, not this one, which a verdict must not act on
            return None
        request = envelope.request
        if item.status != CacheStatus.EXACT:  # issued once the generation has made it
            return functools.partial(self._generated_id, envelope.digest, request)
        return self._own_id(envelope.digest, request)

    def _own_id(self, digest: str, request: GenerationRequest) -> str | None:
        """The id of the request's own entry, made before the id is issued (`ServedAs.CACHED`)."""
        return self._issue(
            digest,
            self.answer_ids.issue_digest,
            digest,
            ServedAs.CACHED,
            request.tenant_scope,
            request.lora_name,
        )

    def _generated_id(
        self, digest: str, request: GenerationRequest, finish_reason: str | None
    ) -> str | None:
        """A generation's id (`answer_id`), or None for an answer served but not stored."""
        if finish_reason in SERVED_UNCACHED_FINISHES:
            return None  # not cached: the digest names another answer, or none
        return self._own_id(digest, request)

    def _issue(self, digest: str, issue: Callable[..., str], *args: object) -> str | None:
        """`issue(*args)`, or None (logged) for a `digest` that is not one: the answer is served
        without an id rather than not at all."""
        try:
            return issue(*args)
        except ValueError:
            io.log.exception("no answer id for %r", digest[:80])
            return None

    def _serve(self, item: LlmInput, responder: Responder) -> None:
        status = item.status
        if status == CacheStatus.SEMANTIC and self._verifies(item):
            self._verify_hit(item, responder)
            return
        if is_hit(status):
            similarity = item.similarity if status == CacheStatus.SEMANTIC else None
            self.core.serve_hit(item.cached_text, status, responder, similarity, item.tokens)
            self.requests[status].increment(1)
            return
        if status not in (CacheStatus.MISS, CacheStatus.BYPASS):
            raise Unavailable(f"llm got an incomplete lookup (status {status!r})")
        envelope = item.envelope.get()
        self.core.submit_miss(
            envelope.request,
            envelope.digest,
            status,
            envelope.write_back,
            responder,
            self._index_writer(envelope, item.vector),
            self.engine.call_with(item.lora),
            tags=envelope.cache_tags,
            max_age_s=envelope.max_age_s,
            serve_ttl_s=envelope.serve_ttl_s,
            draft_digest=envelope.draft_digest,
            neighbours=item.neighbours,
        )
        self.requests[status].increment(1)

    def _verifies(self, item: LlmInput) -> bool:
        """Whether a semantic hit goes to the engine for verification first (embedding_cache's
        trust gate, the deployment's `verify_semantic`, or the request's cache_control word)."""
        return (
            item.must_verify or self.config.verify_semantic or item.envelope.get().verify_semantic
        )

    def _verify_hit(self, item: LlmInput, responder: Responder) -> None:
        """A semantic hit the engine verifies: its answer is the first draft, checked whole in
        the prefill pass; served as `verified` when the engine's answer is exactly it, else the
        engine's answer is a miss (generated on from the agreed prefix, stored as any miss)."""
        envelope = item.envelope.get()

        def verified(ok: bool | None) -> None:
            outcome = "unchecked" if ok is None else "verified" if ok else "refuted"
            self.verifications[outcome].increment(1)
            self.requests[CacheStatus.VERIFIED.value if ok else envelope.status.value].increment(1)
            # a sampled request's engine answer is a draw, not the model's one answer: its
            # mismatch says nothing of the cached one (the gate sends only greedy ones)
            greedy = envelope.request.greedy
            if ok is not None and greedy and item.hit_score > 0.0 and item.neighbours:
                self._learn(item, envelope, ok)

        self.core.submit_miss(
            envelope.request,
            envelope.digest,
            envelope.status.value,  # miss, or bypass (semantic-only): as its lookup said
            envelope.write_back,
            responder,
            None,  # a hit carries no vector: the prompt is not indexed again
            self.engine.call_with(item.lora),
            tags=envelope.cache_tags,
            max_age_s=envelope.max_age_s,
            serve_ttl_s=envelope.serve_ttl_s,
            draft_digest=envelope.draft_digest,
            verify=item.cached_text,
            on_verified=verified,
        )

    def _learn(self, item: LlmInput, envelope: Envelope, right: bool) -> None:
        """Record a verification's outcome against the entry whose answer was checked
        (tiercache.semantic.entry_trust), what embedding_cache's trust gate decides by next;
        stamped by what was checked, so the requests sharing one check (a coalesced flight, a
        replay) count it once."""
        digest = item.neighbours[0]
        stamp = verification_stamp(envelope.digest or "", digest, item.cached_text)
        try:
            cache, request = self.core.cache, envelope.request
            adapter = request.lora_digest  # a semantic hit's answer is of the request's adapter
            record_outcome(
                cache, digest, item.hit_score, right, request.tenant_scope, stamp, adapter,
                length_class(item.cached_text),
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - the answer is served; the outcome is extra
            io.log.exception("recording a verification against %s... failed", digest[:12])

    def count_error(self, responder: Responder, exc: BaseException) -> None:
        """A request whose inputs did not decode: its error response (never padded: without an
        envelope its tenant is unknown, and the error does not depend on the cache)."""
        self.requests["error"].increment(1)
        responder.send_error(exc)

    def _padded(
        self, responder: Responder, envelope: ReceivedEnvelope, arrival_s: float
    ) -> Responder:
        """`responder`, held until the padding floor and masked (tiercache.padding) if this
        request's tenant is padded."""
        timer = self.padding_timer
        if timer is None or not self.padding.pads(envelope.get().request.tenant_scope):
            return responder
        with self._held_lock:  # decided on arrival, before any lookup: it tells nothing
            if self._held_padded >= MAX_HELD_PADDED:
                raise CapacityError(
                    f"{MAX_HELD_PADDED} padded requests are held already; try again later"
                )
            self._held_padded += 1
        release_s = self.padding.release_at(arrival_s, self.padding_jitter)
        padded = PaddedResponder(responder, release_s, timer, on_done=self._padded_done)
        return MaskedResponder(padded)

    def _padded_done(self) -> None:
        with self._held_lock:
            self._held_padded -= 1

    def _index_writer(
        self, envelope: Envelope, vector: np.ndarray | None
    ) -> Callable[[], None] | None:
        """What to run once the answer is stored: add the prompt's vector to its scope's rows.
        A row that starts a scope counts toward the request's tenant scope (its cap on the
        host's scopes, `semantic_max_scopes_per_tenant`)."""
        scope, digest = envelope.semantic_scope, envelope.digest
        if not scope or not digest or vector is None or vector.size == 0:
            return None
        row = vector.reshape(-1).astype(np.float32)
        prompt, tenant = envelope.request.prompt, envelope.request.tenant_scope
        cache = self.core.cache
        sharing = self.sharing

        def write() -> None:
            self.semantic.append_or_compact(
                scope, digest, prompt, row, cache.exists, tenant, cache.answer_value
            )
            if sharing is not None:  # then to the other replicas, through Redis
                sharing.publish(scope, digest, prompt, row)

        return write

    # -- metrics -------------------------------------------------------------------------------

    def _record(self, record: GenerationRecord) -> None:
        self.generations.increment(1)
        with self._failures_lock:
            self.write_failures.update(self.core.stats().write_failures)
        self.tokens.increment(record.generated_tokens)
        if record.ttft_s is not None:
            self.ttft_s.observe(record.ttft_s)
        self.duration_s.observe(record.duration_s)
        if record.stored:
            self.write_backs.increment(1)

    def _record_kv(self, reuse: KvCacheReuse) -> None:
        self.kv_reused_blocks.increment(reuse.reused_blocks)
        self.kv_total_blocks.increment(reuse.total_blocks)

    def close(self) -> None:
        if self.sharing is not None:
            self.sharing.close()  # joins the follower before the core closes the Redis link
        # Misses in flight first (their rows go to the semantic store), then the semantic
        # store (a compaction it runs checks answers in the cache, which must still be open),
        # then the cache.
        self.core.drain()
        self.semantic.close()
        self.core.close()
        if self.padding_timer is not None:
            self.padding_timer.close()  # after the core: its last misses may still be held
        self.engine.client.keeper.clear()
        self.engine.lora_client.close()
        self.metrics.close()


def share_rows(stage: LlmStage, config: LlmConfig, tiers: ExactTiers) -> RowSharing | None:
    """With L3: share index rows through Redis (tiercache.semantic.redis_rows), catch up with
    the fleet's rows (waiting up to redis_semantic_warm_s) and follow them."""
    link = tiers.link
    if link is None or config.redis_semantic_max_rows <= 0 or not config.embedder:
        return None
    _, embedder = resolve_embedder(config.embedder)
    sharing = RowSharing(
        tiers.cache,
        stage.semantic,
        link,
        max_rows=config.redis_semantic_max_rows,
        embedder=embedder.key,
        dimensions=embedder.dimensions,
        retry_s=config.redis_retry_s,
        listener=tiers.listener,
    ).start()
    events = ("published", "publish_failed", "added", "duplicate", "own", "dead", "foreign")
    counters = tm.delta_counters(
        stage.metrics,
        "tiercache_semantic_redis_rows_total",
        "Semantic index rows shared through Redis: published here, or read from the stream "
        "and added, already held, own, dead (invalidated/expired), foreign",
        "event",
        (*events, "malformed"),
    )

    def refresh() -> None:
        f = sharing.follower.stats()
        p = sharing.publisher
        totals: dict[str, Any] = {
            "published": p.published,
            "publish_failed": p.failed,
            "added": f.added,
            "duplicate": f.duplicate,
            "own": f.own,
            "dead": f.dead,
            "foreign": f.foreign,
            "malformed": f.malformed,
        }
        tm.update_all(counters, totals)

    stage.metrics.on_flush(refresh)
    caught_up = sharing.follower.wait_caught_up(config.redis_semantic_warm_s)
    io.log.info(
        "semantic rows from Redis: %s",
        "caught up" if caught_up else "catching up in the background",
    )
    return sharing


def open_llm(config: LlmConfig, model_name: str) -> LlmStage:
    """The stage over the host's L2 (no L1: lookups happen in prompt_cache) and L3 with
    `redis_url`, the semantic row log, the engine over BLS, and its metrics (started)."""
    tiers = open_exact_cache(config.cache())
    secret = load_secret(config.cache(), tiers.link)  # answer ids, padding
    metrics = tm.Metrics(model_name)
    state = config.state_path()
    freshness = open_freshness(config.envelope_max_age_s, config.api_keys_file)
    cipher = open_adapter_cipher(state)
    stage = LlmStage(config, tiers, metrics, secret, open_sealer(state), cipher, freshness)
    export_redis(metrics, tiers)  # with L3: Redis health and invalidations applied
    stage.sharing = share_rows(stage, config, tiers)
    # What the gateway's edge must match, and whom prompt_cache must not look up (padded
    # tenants): required when llm pads, since prompt_cache would otherwise look them all up.
    # With one KV-reuse tenant they are required too: the edge must refuse every other tenant.
    terms = llm_terms(stage.padding, stage.engine.kv_reuse_scope)
    required = stage.padding.enabled or stage.engine.kv_reuse_scope is not None
    write_terms(state, LLM, terms, required=required)
    metrics.start()
    return stage
