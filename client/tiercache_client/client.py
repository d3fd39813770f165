"""gRPC client for the tiercache `ensemble` model on Triton.

The model is decoupled, so every request goes over a gRPC stream: one stream per `generate()`
call, on a pooled `InferenceServerClient` (tritonclient allows one stream per client at a time,
so concurrent calls each take their own client and `TierCacheClient` is thread-safe).

Cache administration (`cache_admin`) needs the operator's admin token: `read_admin_token` reads
it from the server's token file (`<state dir>/admin_token`), and `TierCacheClient(...,
admin_token=...)` sends it with every admin call.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .errors import (
    InvalidRequestError,
    TierCacheClientError,
    UnavailableError,
    classify,
)

CACHE_ADMIN_MODEL = "cache_admin"
FEEDBACK_MODEL = "feedback"
FEEDBACK_OUTPUT = "FEEDBACK_RESULT"
ADMIN_TOKEN_MIN_BYTES = 32
_STREAM_POLL_S = 0.25  # how often a generate() call checks that its stream is still there


def _stream_reader_alive(client: grpcclient.InferenceServerClient) -> bool:
    """Whether tritonclient's thread reading `client`'s response stream still runs (True when
    it cannot tell: tritonclient keeps it as `_stream._handler`, a private name)."""
    handler = getattr(getattr(client, "_stream", None), "_handler", None)
    is_alive = getattr(handler, "is_alive", None)
    return True if is_alive is None else bool(is_alive())


# Triton's answer to a call of a restricted API (--grpc-restricted-protocol) without its header.
_RESTRICTED = "This protocol is restricted"
_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """Outcome of one generation.

    `cache_status` is "exact", "semantic", "verified" (a semantic hit the engine verified as its
    own answer, `verify-semantic`), "miss" or "bypass" (empty if the server sent none);
    `similarity` is set only for semantic hits when the server reports it; `latency_s` runs from
    sending the request to the final response, `first_chunk_s` to the first non-empty text chunk
    (None when no text arrived); `chunks` counts non-empty text chunks. For a generated answer,
    `kv_reused_tokens` and `kv_computed_tokens` are its prompt tokens served from the engine's
    prefix KV cache and computed (None when the server did not report them: cache hits),
    `speculated_tokens` its answer tokens taken from drafts the engine verified (speculative
    decoding; 0 when not speculated, None on a hit), and
    `finish_reason` how the engine ended it: "stop", "length" or "content_filter" (an engine
    refusal, never cached); for a cache hit, how its generation ended ("stop" or "length").
    `prompt_tokens` and `completion_tokens` are the answer's token counts: a generation's own,
    or for a hit those of the generation that produced the stored answer (0 when unknown, as
    for a warmed answer); None when the server did not report them (a padded tenant's
    responses carry none). `answer_id` names the answer for `TierCacheClient.feedback` (opaque;
    valid only for the tenant it was served to); None for a request the cache never stores
    (sampled without a seed).
    """

    text: str
    cache_status: str
    similarity: float | None
    latency_s: float
    first_chunk_s: float | None
    chunks: int
    kv_reused_tokens: int | None = None
    kv_computed_tokens: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    speculated_tokens: int | None = None
    answer_id: str | None = None


TOKEN_OUTPUTS = (
    "kv_reused_tokens",
    "kv_computed_tokens",
    "prompt_tokens",
    "completion_tokens",
    "speculated_tokens",
)


def _error(exc: InferenceServerException) -> TierCacheClientError:
    return classify(str(exc.message()), exc.status())


def _bytes_input(name: str, values: Sequence[str]) -> grpcclient.InferInput:
    data = np.array([[v.encode("utf-8") for v in values]], dtype=np.object_)
    tensor = grpcclient.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return tensor


def feedback_inputs(
    answer_id: str, verdict: str, tenant: str | None = None
) -> list[grpcclient.InferInput]:
    """The feedback model's inputs (its answer is the JSON of FEEDBACK_OUTPUT)."""
    inputs = [
        _bytes_input("ANSWER_ID", [_check_str("answer_id", answer_id)]),
        _bytes_input("VERDICT", [_check_str("verdict", verdict)]),
    ]
    if tenant is not None:
        inputs.append(_bytes_input("tenant", [_check_str("tenant", tenant)]))
    return inputs


def _scalar_input(name: str, value: Any, datatype: str, dtype: type) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1, 1], datatype)
    tensor.set_data_from_numpy(np.array([[value]], dtype=dtype))
    return tensor


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= int(value) <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def build_inputs(
    prompt: str,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop_words: Sequence[str] | None = None,
    tenant: str | None = None,
    cache_control: str | None = None,
    lora_name: str | None = None,
    stream: bool = True,
    history: Sequence[dict[str, str]] | None = None,
    raw_prompt: bool | None = None,
) -> list[grpcclient.InferInput]:
    """Build the `ensemble` input tensors, each with a leading batch dim of 1.

    Only the options given (not None) are sent, plus `text_input` and `stream`; an empty
    `stop_words` or `history` is not sent. `history` is the conversation before `prompt` (the
    last user turn), as {"role": "system" | "user" | "assistant", "content": str} dicts; the
    engine applies the chat template once to all of it. `raw_prompt` True sends `prompt` as the
    model's input, untemplated. Raises TypeError for wrong Python types and InvalidRequestError for
    integers that do not fit their tensor type (INT32, UINT64); value ranges are the server's job.
    """
    inputs = [_bytes_input("text_input", [_check_str("prompt", prompt)])]
    if not isinstance(stream, bool):
        raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
    inputs.append(_scalar_input("stream", stream, "BOOL", np.bool_))
    for name, number in (("max_tokens", max_tokens), ("top_k", top_k)):
        if number is not None:
            value = _check_int(name, number, -_INT32_MAX - 1, _INT32_MAX)
            inputs.append(_scalar_input(name, value, "INT32", np.int32))
    for name, real in (("temperature", temperature), ("top_p", top_p)):
        if real is not None:
            inputs.append(_scalar_input(name, _check_float(name, real), "FP32", np.float32))
    if seed is not None:
        value = _check_int("seed", seed, 0, _UINT64_MAX)
        inputs.append(_scalar_input("seed", value, "UINT64", np.uint64))
    if stop_words is not None:
        if isinstance(stop_words, str):
            raise TypeError("stop_words must be a sequence of str, not a str")
        words = [_check_str("stop word", w) for w in stop_words]
        if words:
            inputs.append(_bytes_input("stop_words", words))
    texts = (("tenant", tenant), ("cache_control", cache_control), ("lora_name", lora_name))
    for name, text in texts:
        if text is not None:
            inputs.append(_bytes_input(name, [_check_str(name, text)]))
    if history:
        if isinstance(history, str | bytes):
            raise TypeError("history must be a sequence of {role, content} dicts, not a string")
        document = json.dumps(list(history), ensure_ascii=False, separators=(",", ":"))
        inputs.append(_bytes_input("history", [document]))
    if raw_prompt is not None:
        if not isinstance(raw_prompt, bool):
            raise TypeError(f"raw_prompt must be a bool, got {type(raw_prompt).__name__}")
        inputs.append(_scalar_input("raw_prompt", raw_prompt, "BOOL", np.bool_))
    return inputs


def _texts(result: grpcclient.InferResult, name: str) -> list[str]:
    """The strings of output `name` ([] when absent); UnavailableError when not UTF-8 (what a
    server sends is checked like any input)."""
    array = result.as_numpy(name)
    if array is None:
        return []
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    except UnicodeDecodeError as exc:
        raise UnavailableError(f"the server's {name} is not UTF-8: {exc}") from None


def _number(result: grpcclient.InferResult, name: str, kind: type[int] | type[float]) -> Any:
    """The first value of output `name` as `kind` (None when absent or empty);
    UnavailableError for one that is not a number."""
    array = result.as_numpy(name)
    if array is None or not array.size:
        return None
    try:
        value = kind(array.reshape(-1)[0])
    except (TypeError, ValueError, OverflowError) as exc:
        raise UnavailableError(f"the server's {name} is not a number: {exc}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise UnavailableError(f"the server's {name} is not a finite number")
    return value


def _is_final(result: grpcclient.InferResult) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def read_admin_token(path: str | os.PathLike[str]) -> str:
    """The admin token in the file at `path`, as `cache_admin` takes it: the file's bytes,
    hex-encoded (the server reads its copy of the same file the same way). Read from a file,
    never passed on a command line, where other local users could see it. OSError if the file
    cannot be read; ValueError if it is too short to be a token."""
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < ADMIN_TOKEN_MIN_BYTES:
        raise ValueError(
            f"{os.fspath(path)} holds {len(data)} bytes: an admin token file holds at least "
            f"{ADMIN_TOKEN_MIN_BYTES}"
        )
    return data.hex()


WARM_CALL_PROMPTS = 1_000  # the server's MAX_WARM_PROMPTS
WARM_CALL_BYTES = 16 << 20  # of JSON a call, well under the server's 64 MiB


WARM_CALL_ADAPTERS = 64  # the server's MAX_WARM_ADAPTERS


def _report_field(report: dict[str, Any], name: str, kind: type) -> Any:
    """`report[name]` as `kind` (its empty value when absent or null); UnavailableError for one
    of another kind (a server's answer is checked like any input)."""
    value = report.get(name)
    if value is None:
        return kind()
    malformed = type(value) is not kind or (
        isinstance(value, list) and not all(isinstance(v, dict) for v in value)
    )
    if malformed:
        raise UnavailableError(f"the server's warm report has a malformed {name!r}")
    return value


def _warm_calls(items: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """`items` in parts of at most WARM_CALL_PROMPTS and about WARM_CALL_BYTES (one item
    larger than that goes alone)."""
    part: list[dict[str, Any]] = []
    size = 0
    for item in items:
        item_bytes = len(json.dumps(item, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if part and (len(part) >= WARM_CALL_PROMPTS or size + item_bytes > WARM_CALL_BYTES):
            yield part
            part, size = [], 0
        part.append(item)
        size += item_bytes
    if part:
        yield part


class TierCacheClient:
    """Client of one tiercache server (`url` is gRPC "host:port").

    `timeout_s` bounds a whole `generate()` call and each health RPC; when it passes,
    `UnavailableError` is raised. `idle_timeout_s` (None: off) also fails a `generate()` call
    when no response arrives for that long, the first counted from the call: a long generation
    that streams steadily may then be given a long `timeout_s`, and a stalled one still fails
    soon (an answer sent as one final response, unstreamed, sends nothing before it: there it
    bounds the whole generation). `admin_token` (`read_admin_token`) goes with every
    `cache_admin` call (`stats`, `invalidate`, `flush`, `warm`, `admin`); without it the server
    refuses them (`ForbiddenError`). `api_key` (`tiercache keys add`) goes with every generation
    as the `authorization: Bearer <key>` header: a server with an API key file takes the tenant
    from it and refuses requests without a known key (`ForbiddenError`). Use as a context
    manager or call `close()`.
    """

    def __init__(
        self,
        url: str = "localhost:8001",
        model: str = "ensemble",
        timeout_s: float = 300.0,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        if not 0 < timeout_s < math.inf:  # NaN too: a wait on NaN never ends
            raise ValueError(f"timeout_s must be > 0 and finite, got {timeout_s}")
        if idle_timeout_s is not None and not 0 < idle_timeout_s < math.inf:
            raise ValueError(f"idle_timeout_s must be > 0 and finite, got {idle_timeout_s}")
        self.idle_timeout_s = idle_timeout_s
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self._admin_token = admin_token
        self._idle: list[grpcclient.InferenceServerClient] = []
        self._busy: set[grpcclient.InferenceServerClient] = set()  # in a call now
        self._lock = threading.Lock()
        self._closed = False

    def _acquire(self) -> grpcclient.InferenceServerClient:
        with self._lock:
            if self._closed:
                raise RuntimeError("TierCacheClient is closed")
            if self._idle:
                client = self._idle.pop()
                self._busy.add(client)
                return client
        try:
            client = grpcclient.InferenceServerClient(self.url)
        except InferenceServerException as exc:
            raise _error(exc) from None
        with self._lock:
            closed = self._closed  # `close()` ran while this one was being made
            if not closed:
                self._busy.add(client)
        if closed:
            client.close()
            raise RuntimeError("TierCacheClient is closed")
        return client

    def _release(self, client: grpcclient.InferenceServerClient, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(client)
            if reusable and not self._closed:
                self._idle.append(client)
                return
        client.close()

    def generate(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop_words: Sequence[str] | None = None,
        tenant: str | None = None,
        cache_control: str | None = None,
        lora_name: str | None = None,
        stream: bool = True,
        history: Sequence[dict[str, str]] | None = None,
        raw_prompt: bool | None = None,
    ) -> Iterator[str | GenerationResult]:
        """Run one generation, yielding each non-empty text chunk (str) as it arrives, then one
        `GenerationResult` last. The options are `build_inputs`'s.

        Raises a `TierCacheClientError` subclass for server or transport errors (mapped by
        `errors.classify`), `UnavailableError` when `timeout_s` passes, or `idle_timeout_s`
        with no response. Closing the generator early cancels the request.
        """
        inputs = build_inputs(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_words=stop_words,
            tenant=tenant,
            cache_control=cache_control,
            lora_name=lora_name,
            stream=stream,
            history=history,
            raw_prompt=raw_prompt,
        )
        responses: queue.Queue[
            tuple[grpcclient.InferResult | None, InferenceServerException | None]
        ] = queue.Queue()

        def on_response(
            result: grpcclient.InferResult | None, error: InferenceServerException | None
        ) -> None:
            responses.put((result, error))

        client = self._acquire()
        completed = False
        try:
            start = time.perf_counter()
            deadline = self._deadline(start)
            try:
                client.start_stream(
                    on_response, stream_timeout=self.timeout_s, headers=self._headers
                )
                client.async_stream_infer(
                    self.model,
                    inputs,
                    request_id=uuid.uuid4().hex,
                    enable_empty_final_response=True,
                )
            except InferenceServerException as exc:
                # A stream that already failed reports the real cause through the callback.
                try:
                    _, reported = responses.get(timeout=0.5)
                except queue.Empty:
                    reported = None
                raise _error(reported or exc) from None
            parts: list[str] = []
            cache_status = ""
            similarity: float | None = None
            first_chunk_s: float | None = None
            usage: dict[str, int] = {}
            finish_reason: str | None = None
            answer_id: str | None = None
            while True:
                result, error = self._next_response(client, responses, deadline)
                deadline = self._deadline(start)  # each response restarts the idle wait
                if error is not None:
                    raise _error(error)
                if result is None:
                    continue
                for chunk in _texts(result, "text_output"):
                    if chunk:
                        if first_chunk_s is None:
                            first_chunk_s = time.perf_counter() - start
                        parts.append(chunk)
                        yield chunk
                statuses = _texts(result, "cache_status")
                if statuses:
                    cache_status = statuses[0]
                sim = _number(result, "cache_similarity", float)
                if sim is not None:
                    similarity = sim
                finish = _texts(result, "finish_reason")
                if finish and finish[0]:
                    finish_reason = finish[0]
                ids = _texts(result, "answer_id")
                if ids and ids[0]:
                    answer_id = ids[0]
                for name in TOKEN_OUTPUTS:
                    value = _number(result, name, int)
                    if value is not None:
                        usage[name] = value
                if _is_final(result):
                    break
            completed = True
            yield GenerationResult(
                text="".join(parts),
                cache_status=cache_status,
                similarity=similarity,
                latency_s=time.perf_counter() - start,
                first_chunk_s=first_chunk_s,
                chunks=len(parts),
                kv_reused_tokens=usage.get("kv_reused_tokens"),
                kv_computed_tokens=usage.get("kv_computed_tokens"),
                finish_reason=finish_reason,
                prompt_tokens=usage.get("prompt_tokens"),
                completion_tokens=usage.get("completion_tokens"),
                speculated_tokens=usage.get("speculated_tokens"),
                answer_id=answer_id,
            )
        finally:
            try:
                client.stop_stream(cancel_requests=not completed)
            except Exception:  # noqa: BLE001 - `close()` on another thread stopped it meanwhile
                completed = False  # not reused: its stream's state is not known
            self._release(client, reusable=completed)

    def _deadline(self, start: float) -> tuple[float, float]:
        """When the wait for the next response ends: (the whole call's end, started at
        `start`; that or, with `idle_timeout_s`, the idle wait's end from now if sooner)."""
        whole = start + self.timeout_s
        if self.idle_timeout_s is None:
            return whole, whole
        return whole, min(whole, time.perf_counter() + self.idle_timeout_s)

    def _next_response(
        self,
        client: grpcclient.InferenceServerClient,
        responses: queue.Queue[
            tuple[grpcclient.InferResult | None, InferenceServerException | None]
        ],
        deadline: tuple[float, float],
    ) -> tuple[grpcclient.InferResult | None, InferenceServerException | None]:
        """The stream's next response or error, waited for in short slices: UnavailableError
        once `deadline` (`_deadline`'s) passes, or at once when the stream ended without a
        final response (closed cleanly by a proxy or a misbehaving server, or its reader thread
        gone: tritonclient then calls back nothing, and the wait would last the whole
        timeout)."""
        whole, ends = deadline
        while True:
            remaining = ends - time.perf_counter()
            try:  # what already arrived is served, however long the caller took
                return responses.get(timeout=min(max(remaining, 0.0), _STREAM_POLL_S))
            except queue.Empty:
                pass
            if remaining <= 0:
                if ends < whole:
                    raise UnavailableError(
                        f"no response from {self.url} for {self.idle_timeout_s:g} s (idle timeout)"
                    )
                raise UnavailableError(f"no response from {self.url} within {self.timeout_s:g} s")
            # a reader gone puts nothing more: an empty queue then is the stream's end
            if not _stream_reader_alive(client) and responses.empty():
                raise UnavailableError(f"the stream from {self.url} ended without a final response")

    def generate_text(self, prompt: str, **kwargs: Any) -> GenerationResult:
        """Run `generate()` to the end and return its `GenerationResult` (same errors)."""
        for item in self.generate(prompt, **kwargs):
            if isinstance(item, GenerationResult):
                return item
        raise UnavailableError("stream ended without a final result")

    def health(self) -> dict[str, Any]:
        """Return {"live": bool, "ready": bool, "models": {name: ready}}.

        `models` lists every model of the repository where the server lets clients read its
        index; `tiercache serve` restricts that API (docs/security.md), and then `models` holds
        the client's model and `cache_admin`, asked one by one. A model counts as ready when any
        of its versions is READY. Raises `ServerUnreachableError` when the server cannot be
        reached.
        """
        client = self._acquire()
        reusable = False
        try:
            live = client.is_server_live(client_timeout=self.timeout_s)
            ready = client.is_server_ready(client_timeout=self.timeout_s)
            models = self._model_readiness(client)
            reusable = True
            return {"live": bool(live), "ready": bool(ready), "models": models}
        except InferenceServerException as exc:
            raise _error(exc) from None
        finally:
            self._release(client, reusable)

    def _model_readiness(self, client: grpcclient.InferenceServerClient) -> dict[str, bool]:
        try:
            index = client.get_model_repository_index(as_json=True, client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            if _RESTRICTED not in str(exc.message()):
                raise
            return {
                name: bool(client.is_model_ready(name, client_timeout=self.timeout_s))
                for name in (self.model, CACHE_ADMIN_MODEL)
            }
        models: dict[str, bool] = {}
        for entry in index.get("models", []):
            name = entry.get("name", "")
            models[name] = models.get(name, False) or entry.get("state") == "READY"
        return models

    def adapters(self, warm: Sequence[str] = ()) -> dict[str, Any]:
        """What the `lora_cache` stage reports, through `cache_admin` (with the admin token:
        lora_cache itself takes no outside calls): each adapter's tier (engine, host, disk) as
        it sees it and as the engine reports it. With `warm`, those adapters are first loaded
        into the engine (prefetch before their first request). Raises `ForbiddenError` without
        the right token, `NotFoundError` for an unknown adapter name,
        `ServerUnreachableError` / `UnavailableError` otherwise."""
        names = [_check_str("adapter name", n) for n in warm]
        return self.admin({"op": "adapters", "warm": names})

    def admin(self, op: dict[str, Any]) -> dict[str, Any]:
        """One `cache_admin` call (`{"op": "stats" | "invalidate" | "flush" | "warm", ...}`)
        with the admin token; its JSON answer. `ForbiddenError` without the right token (nothing
        was done), `InvalidRequestError` for a malformed op, `NotFoundError` for an unknown
        adapter, `ServerUnreachableError` / `UnavailableError` otherwise."""
        return self._admin_call(CACHE_ADMIN_MODEL, op, self._admin_token)

    def stats(self) -> dict[str, Any]:
        """Entries, bytes, hits, misses, evictions, corrupt per tier (L2, L3; L1 is per
        prompt_cache process and reported unreachable)."""
        return self.admin({"op": "stats"})

    def invalidate(
        self,
        *,
        key: str | None = None,
        tag: str | None = None,
        tenant: str | None = None,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        """Drop cached answers by exactly one of key (digest), tag, tenant name or adapter
        digest (on every replica with Redis; else on the server's host only)."""
        given = {
            k: _check_str(k, v)
            for k, v in (("key", key), ("tag", tag), ("tenant", tenant), ("adapter", adapter))
            if v is not None
        }
        if len(given) != 1:
            raise TypeError("invalidate takes exactly one of key, tag, tenant, adapter")
        return self.admin({"op": "invalidate", **given})

    def flush(self) -> dict[str, Any]:
        """Delete every entry of L2 and L3 (prompt_cache's L1 copies stay)."""
        return self.admin({"op": "flush", "confirm": True})

    def warm(
        self,
        prompts: Sequence[dict[str, Any]] = (),
        adapters: Sequence[str] = (),
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Pre-load answers (`{"text_input", "answer", ...ensemble inputs}` each; reported per
        item) and load adapters into the engine (`NotFoundError` for an unknown name), the
        adapters first. Sent in calls of at most WARM_CALL_ADAPTERS names, then of at most
        WARM_CALL_PROMPTS prompts and about WARM_CALL_BYTES (the server takes 64 and 1,000 a
        call); `on_progress(done, total)` after each part of prompts. A call that fails raises, the
        report of the parts before it lost: the prompts stored so far stay stored."""
        items = list(prompts)
        names = [_check_str("adapter name", n) for n in adapters]
        report: dict[str, Any] = {"op": "warm"}
        if not items and not names:
            return self.admin(report)
        if items:
            report.update(prompts=[], stored=0, failed=0)
        warmed: dict[str, Any] = {}
        for start in range(0, len(names), WARM_CALL_ADAPTERS):  # first: prompts may name them
            part = self.admin({"op": "warm", "adapters": names[start : start + WARM_CALL_ADAPTERS]})
            listed = _report_field(part, "adapters", dict)  # lora_cache's list, as it stands
            warmed.update(_report_field(listed, "warmed", dict))
            report["adapters"] = {**listed, "warmed": warmed}
        for chunk in _warm_calls(items):
            part = self.admin({"op": "warm", "prompts": chunk})
            report["prompts"].extend(_report_field(part, "prompts", list))
            report["stored"] += _report_field(part, "stored", int)
            report["failed"] += _report_field(part, "failed", int)
            if on_progress is not None:
                on_progress(len(report["prompts"]), len(items))
        return report

    def feedback(
        self, answer_id: str, verdict: str, *, tenant: str | None = None
    ) -> dict[str, Any]:
        """Say whether a served answer was good or bad (`verdict` "good" or "bad"), by the
        `answer_id` of its `GenerationResult`, as the tenant it was served to (`tenant`, or the
        client's API key's). Bad: the answer's cache entry is invalidated (on every replica
        with Redis) and generated again when next asked; good: counted, and the cached answer
        ranks higher in the caches that admit it next. The server's JSON answer: verdict,
        accepted and, unless the deployment pads some tenant's responses, served
        (own|semantic), invalidated, published, endorsed, reaches.
        `ForbiddenError` for an id served to another tenant (or by another deployment),
        `InvalidRequestError` for something that is not an answer id or verdict,
        `UnavailableError` when the server's Redis is down (applied on its host only: retry)."""
        inputs = feedback_inputs(answer_id, verdict, tenant)
        return self._json_call(FEEDBACK_MODEL, inputs, FEEDBACK_OUTPUT)

    def _admin_call(
        self, model: str, admin: dict[str, Any], token: str | None = None
    ) -> dict[str, Any]:
        """`admin` to `model`'s ADMIN input (with ADMIN_TOKEN when `token` is given)."""
        inputs = [_bytes_input("ADMIN", [json.dumps(admin)])]
        if token is not None:
            inputs.append(_bytes_input("ADMIN_TOKEN", [token]))
        return self._json_call(model, inputs, "ADMIN_RESULT")

    def _json_call(
        self, model: str, inputs: list[grpcclient.InferInput], output: str
    ) -> dict[str, Any]:
        """One call of `model` whose answer is a JSON object in `output`."""
        client = self._acquire()
        reusable = False
        try:
            result = client.infer(
                model,
                inputs,
                outputs=[grpcclient.InferRequestedOutput(output)],
                client_timeout=self.timeout_s,
                headers=self._headers,
            )
            reusable = True
        except InferenceServerException as exc:
            raise _error(exc) from None
        finally:
            self._release(client, reusable)
        texts = _texts(result, output)  # UnavailableError when not UTF-8
        if not texts:
            raise UnavailableError(f"{model} answered without {output}")
        try:
            parsed = json.loads(texts[0])
        except (ValueError, RecursionError) as exc:  # not JSON, or nested past the limit
            raise UnavailableError(
                f"{model} answered with {output} that is not JSON: {exc}"
            ) from None
        if not isinstance(parsed, dict):
            raise UnavailableError(f"{model} answered with {output} that is not a JSON object")
        return parsed

    def close(self) -> None:
        """Close every pooled connection and cancel the calls still in progress (a generator
        left paused, another thread's call: their streams would keep the process alive, and
        the server generating, until their timeout); later calls raise RuntimeError."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for client in idle:
            client.close()
        for client in busy:
            try:  # the call's own thread then sees the cancellation and closes the client
                client.stop_stream(cancel_requests=True)
            except Exception:  # noqa: BLE001 - a stream that ended meanwhile
                pass

    def __enter__(self) -> TierCacheClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
