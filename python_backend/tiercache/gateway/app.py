"""`tiercache gateway`: an OpenAI-compatible HTTP endpoint over the tiercache ensemble.

Starlette on uvicorn (the well-kept asynchronous toolkit FastAPI is built on: routing, streaming
responses and a lifespan, without FastAPI's per-request dependency and validation layers, which
the gateway does not use since it checks OpenAI bodies itself, and which showed as a large share
of a cached answer's time in a profile) and tritonclient's asyncio gRPC client: one event loop
carries every request, and a streamed answer goes from the ensemble's gRPC stream to the
caller's Server-Sent Events as each chunk arrives. The caller's `Authorization: Bearer <key>`
header is forwarded to Triton, where prompt_cache maps the key to its tenant (the operator's key
file, docs/security.md); a missing or unknown key is then a 401 here.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET
/metrics (the gateway's own Prometheus metrics). With the model repository Triton serves (on
the same host), the edge layer answers exact hits from the host's tiers without crossing
Triton (tiercache.gateway.edge).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import ipaddress
import json
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import orjson
import tritonclient.grpc.aio as grpc_aio
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from tritonclient.utils import InferenceServerException

from tiercache.errors import InvalidRequest
from tiercache.exact.request import DEFAULT_LIMITS, RawInputs
from tiercache.exact.tenant_keys import key_from_parameter
from tiercache.gateway import openai_api as api
from tiercache.gateway.edge import EdgeCache, open_edge
from tiercache.gateway.protocol import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_PIPELINED,
    DEFAULT_STALLED_PEER_S,
    whole_body_received,
)
from tiercache.log_throttle import LogThrottle
from tiercache.threads import NamedThread
from tiercache_client.client import (
    FEEDBACK_MODEL,
    FEEDBACK_OUTPUT,
    build_inputs,
    feedback_inputs,
)
from tiercache_client.errors import (
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    TierCacheClientError,
    UnavailableError,
    classify,
)

log = logging.getLogger("tiercache.gateway")
_FAILED_LOG = LogThrottle()  # requests failed on an unexpected error: once a minute


class JSONResponse(Response):
    """A JSON response rendered by orjson (several times faster than the standard library's
    encoder, on the hit path of every answer)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


ENSEMBLE = "ensemble"
ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/feedback", "/v1/models", "/health", "/metrics"}
)
CACHE_STATUS_HEADER = "x-tiercache-cache-status"
SIMILARITY_HEADER = "x-tiercache-similarity"
ANSWER_ID_HEADER = "x-tiercache-answer-id"


IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK_NETWORKS: tuple[IpNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)


def metrics_networks(specs: list[str]) -> tuple[IpNetwork, ...]:
    """`--metrics-from` values: addresses or networks (CIDR), `loopback`, or `any`; none given:
    loopback. ValueError names a value that is none of these."""
    networks: list[IpNetwork] = []
    for spec in specs or ["loopback"]:
        for part in spec.split(","):
            part = part.strip().lower()
            if part == "loopback":
                networks += LOOPBACK_NETWORKS
            elif part == "any":
                networks += [ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")]
            else:
                try:
                    networks.append(ipaddress.ip_network(part.strip("[]"), strict=False))
                except ValueError:
                    raise ValueError(
                        f"{part!r} is not an address, a network (CIDR), 'loopback' or 'any'"
                    ) from None
    return tuple(networks)


def peer_in(host: str | None, networks: tuple[IpNetwork, ...]) -> bool:
    """Whether a peer's address (the socket's: the gateway trusts no forwarded header) is in
    one of `networks`; an unknown or unparsable peer is not. An IPv4-mapped IPv6 peer
    (::ffff:a.b.c.d, a dual-stack listener) counts as its IPv4 address."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address.version == n.version and address in n for n in networks)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Where the ensemble is, and what the gateway calls the models it serves."""

    triton_url: str = "127.0.0.1:8001"  # gRPC host:port
    base_model: str = "tiercache"  # the `model` id of the base model
    adapters: frozenset[str] = frozenset()  # adapter names, each a `model` id
    timeout_s: float = 300.0  # a whole generation
    ensemble: str = ENSEMBLE
    # The repository Triton serves, on this host: the edge layer answers exact hits from the
    # host's tiers (None: every request goes to the ensemble).
    model_repository: Path | None = None
    state_dir: Path | None = None  # the stages' state folder when their parameters name none
    # uvicorn's limit_concurrency: past this many open connections (or running requests) a new
    # request is a 503; well under a process's usual 1024 open files, so the gateway refuses
    # before accept() fails for want of file descriptors
    max_connections: int = 512
    # a request's whole body must arrive within this (408 past it): a body announced and never
    # sent would otherwise hold its connection for ever
    body_timeout_s: float = 10.0
    # generations one API key may have in flight at once (past it: 429), so that one caller
    # cannot take every connection; requests without a key are not counted (0: no limit)
    max_requests_per_key: int = 128
    # generation requests one API key may send a minute (past it: 429 with retry-after;
    # KeyRate), 0: no limit
    requests_per_minute_per_key: int = 0
    # requests a client may pipeline behind the one in progress on a connection (past it: the
    # connection closed, nothing written; tiercache.gateway.protocol)
    max_pipelined: int = DEFAULT_MAX_PIPELINED
    # a peer that acknowledges none of a response's bytes for this long loses its connection
    # (TCP_USER_TIMEOUT; a client waiting for a slow answer owes none and is not affected)
    stalled_peer_s: float = DEFAULT_STALLED_PEER_S
    # a request's line and headers: at most this many bytes (else 431, closed), complete within
    # header_timeout_s of the connection opening or of the previous response's end (else closed)
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # the Host header must name this server by a loopback name (DNS rebinding from a web page
    # the operator opens cannot reach a gateway on 127.0.0.1). None: on where `server_config`
    # listens on a loopback address, off elsewhere (an app built alone: off)
    loopback_hosts_only: bool | None = None
    # peers `GET /metrics` answers (anyone else: 403): its counts are every tenant's volume
    # and hit ratio. Default this host only; `metrics_networks(["any"])` opens it to all
    metrics_from: tuple[IpNetwork, ...] = ()


def ensemble_fields(gen: api.Generation) -> dict[str, Any]:
    """The ensemble inputs of `gen` (tiercache_client.build_inputs's arguments): one mapping
    for the gRPC request and the edge layer's lookup, so both see the same request."""
    return {
        "max_tokens": gen.max_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "seed": gen.seed,
        "stop_words": list(gen.stop_words) or None,
        "cache_control": gen.cache_control,
        "lora_name": gen.lora_name,
        "stream": gen.stream,
        "history": list(gen.history) or None,
        # A completion's prompt is the model's input as it is (OpenAI's /v1/completions); a
        # chat is templated once, by the engine.
        "raw_prompt": None if gen.chat else True,
    }


def raw_inputs(gen: api.Generation) -> RawInputs:
    """`gen` as prompt_cache reads it from the ensemble's inputs (`ensemble_fields`)."""
    fields = ensemble_fields(gen)
    history = fields.pop("history")
    return RawInputs(
        text_input=gen.prompt,
        history=None if history is None else json.dumps(history, ensure_ascii=False),
        **fields,
    )


class Gateway:
    """The ensemble over one asyncio gRPC channel."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.client = grpc_aio.InferenceServerClient(settings.triton_url)
        self._ready: tuple[float, asyncio.Future[bool]] | None = None  # (asked at, answer)

    async def close(self) -> None:
        await self.client.close()

    READY_FOR_S = 1.0  # `GET /health` needs no key: at most one pair of probes a second
    PROBE_TIMEOUT_S = 2.0  # a Triton that hangs is not ready

    async def ready(self) -> bool:
        """Whether Triton and the ensemble are ready, asked at most once per READY_FOR_S (the
        answer is shared meanwhile, also by requests that arrive while it is being asked)."""
        now = time.monotonic()
        pending = self._ready is not None and not self._ready[1].done()
        if not pending and (self._ready is None or now - self._ready[0] >= self.READY_FOR_S):
            self._ready = (now, asyncio.ensure_future(self._probe()))
        assert self._ready is not None
        return await asyncio.shield(self._ready[1])

    async def _probe(self) -> bool:
        """One pair of probes, each answered within PROBE_TIMEOUT_S or taken as not ready."""
        timeout = self.PROBE_TIMEOUT_S
        try:
            return bool(
                await self.client.is_server_ready(client_timeout=timeout)
                and await self.client.is_model_ready(self.settings.ensemble, client_timeout=timeout)
            )
        except Exception:  # noqa: BLE001 - not ready, whatever the transport said
            return False

    async def generate(
        self, gen: api.Generation, authorization: str | None
    ) -> AsyncIterator[str | api.Outcome]:
        """The answer's text chunks as they arrive, then one Outcome; a TierCacheClientError
        for what the ensemble or the transport refused. Closing the iterator early cancels the
        gRPC call (the generation goes on for the requests that share it)."""
        inputs = build_inputs(gen.prompt, **ensemble_fields(gen))

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.settings.ensemble, "inputs": inputs, "request_id": gen.id}

        headers = {"authorization": authorization} if authorization else None
        responses = self.client.stream_infer(
            requests(), stream_timeout=self.settings.timeout_s, headers=headers
        )
        outcome = api.Outcome()
        try:
            async for result, error in _transport_errors_classified(responses):
                if error is not None:
                    raise served_error(str(error.message()), error.status())
                if result is None:
                    continue
                for text in _texts(result, "text_output"):
                    if text:
                        outcome.text += text
                        yield text
                status = _texts(result, "cache_status")
                if status:  # llm's final response carries the status: the answer is complete
                    outcome.cache_status = status[0]
                    similarity = result.as_numpy("cache_similarity")
                    if similarity is not None and similarity.size:
                        outcome.similarity = float(similarity.reshape(-1)[0])
                    finish = _texts(result, "finish_reason")
                    outcome.finish_reason = finish[0] if finish and finish[0] else None
                    outcome.prompt_tokens = _count(result, "prompt_tokens")
                    outcome.completion_tokens = _count(result, "completion_tokens")
                    outcome.cached_tokens = _count(result, "kv_reused_tokens") or 0
                    outcome.speculated_tokens = _count(result, "speculated_tokens") or 0
                    ids = _texts(result, "answer_id")
                    outcome.answer_id = ids[0] if ids and ids[0] else None
                    yield outcome
                    return
        finally:
            responses.cancel()
        raise UnavailableError("the ensemble's stream ended without a final response")

    async def feedback(
        self, answer_id: str, verdict: str, authorization: str | None
    ) -> dict[str, Any]:
        """The feedback model's JSON answer for one verdict, as the caller's key's tenant (its
        typed errors as the client's)."""
        inputs = feedback_inputs(answer_id, verdict)
        headers = {"authorization": authorization} if authorization else None
        try:
            result = await self.client.infer(
                FEEDBACK_MODEL,
                inputs,
                outputs=[grpc_aio.InferRequestedOutput(FEEDBACK_OUTPUT)],
                client_timeout=self.settings.timeout_s,
                headers=headers,
            )
        except InferenceServerException as exc:
            raise classify(str(exc.message()), exc.status()) from None
        except grpc.RpcError as exc:  # what tritonclient does not wrap: as the stream's
            raise _rpc_error(exc) from None
        texts = _texts(result, FEEDBACK_OUTPUT)
        if not texts:
            raise UnavailableError("the feedback model answered without FEEDBACK_RESULT")
        answer: dict[str, Any] = json.loads(texts[0])
        return answer


async def _transport_errors_classified(responses: Any) -> AsyncIterator[Any]:
    """`responses` as they come; a gRPC failure of the stream itself (Triton down, the deadline
    passed), which tritonclient's asyncio client raises instead of yielding, as the client's
    typed error (UnavailableError for both: a 503)."""
    iterator = responses.__aiter__()
    while True:
        try:
            item = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except grpc.RpcError as exc:
            raise _rpc_error(exc) from None
        yield item


def _rpc_error(exc: grpc.RpcError) -> TierCacheClientError:
    """A gRPC failure as the client's typed error."""
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    return classify(str(details or exc), None if code is None else str(code))


def _count(result: Any, name: str) -> int | None:
    array = result.as_numpy(name)
    return None if array is None or not array.size else int(array.reshape(-1)[0])


def _texts(result: Any, name: str) -> list[str]:
    array = result.as_numpy(name)
    if array is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


class Children:
    """A labelled metric's children by their label values, kept: prometheus-client's `labels()`
    checks the values and takes a lock on every call (3 % of an edge hit's CPU). At most
    `limit` are kept; past that `labels()` answers as before."""

    __slots__ = ("metric", "limit", "kept")

    def __init__(self, metric: Any, limit: int = 256) -> None:
        self.metric = metric
        self.limit = limit
        self.kept: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self.kept.get(values)
        if child is None:
            child = self.metric.labels(*values)
            if len(self.kept) < self.limit:
                self.kept[values] = child
        return child


class GatewayMetrics:
    """The gateway's own Prometheus metrics, on its `GET /metrics` (Triton's stay on Triton's
    metrics port): requests by route and status code, their latency to the response's start
    (the whole answer when not streamed), answers by cache status, streamed chunks."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tiercache_gateway_requests",
            "HTTP requests by route and status code",
            ["route", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tiercache_gateway_request_seconds",
            "Time to the response's start (the whole answer when not streamed)",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.answers = Counter(
            "tiercache_gateway_answers",
            "Answers by the ensemble's cache status",
            ["cache_status"],
            registry=self.registry,
        )
        self.chunks = Counter(
            "tiercache_gateway_stream_chunks",
            "Text chunks sent as Server-Sent Events",
            registry=self.registry,
        )
        self.edge_hits = Counter(
            "tiercache_gateway_edge_hits",
            "Exact hits the edge layer answered without Triton, by the tier that held them",
            ["tier"],
            registry=self.registry,
        )
        self.requests_by = Children(self.requests)
        self.latency_by = Children(self.latency)
        self.answers_by = Children(self.answers)
        self.edge_hits_by = Children(self.edge_hits)

    def exposition(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


MAX_AUTHORIZATION_CHARS = 1024  # a key is tens of characters; gRPC bounds its metadata


class MalformedKey(Exception):
    """An Authorization header no key file can hold and gRPC metadata cannot carry (a 401, as
    an unknown key is, decided here: sent on, gRPC would refuse it as an internal error)."""

    message = (
        "malformed API key: the Authorization header must be printable ASCII, at most "
        f"{MAX_AUTHORIZATION_CHARS} characters"
    )


def authorization(request: Request) -> str | None:
    """The request's Authorization header, to forward to Triton; MalformedKey for one that
    cannot be forwarded (non-ASCII, a tab or control character, over MAX_AUTHORIZATION_CHARS)."""
    value = request.headers.get("authorization")
    if value and (
        len(value) > MAX_AUTHORIZATION_CHARS or not (value.isascii() and value.isprintable())
    ):
        raise MalformedKey(MalformedKey.message)
    return value or None


def _no_valid_key(message: str) -> bool:
    """Whether a refusal is for the key itself (missing or unknown: 401), not for what a valid
    key asked (another tenant, an adapter or cache_control word it may not use: 403)."""
    return "API key is required" in message or "unknown API key" in message


# Where the gateway's servers are is not the caller's to know: gRPC's transport errors name
# Triton's address ("ipv4:10.0.0.5:8001"), a stage's Redis errors its URL (password masked).
_ADDRESSES = re.compile(
    r"\b(?:ipv4|ipv6|unix|dns):\S+|\brediss?://\S+"
    r"|\[[0-9A-Fa-f:.]+\]:\d{1,5}\b|\b[\w.-]+:\d{3,5}\b"  # [v6]:port, host:port
)


_UNAVAILABLE_LOG = LogThrottle()  # a caller can repeat a failing request at will
_EDGE_LOG = LogThrottle()  # the edge layer's failed lookups: once a minute


def _public(message: str) -> str:
    """`message` with server addresses and URLs taken out (the log keeps them, at most a line
    a minute)."""
    scrubbed = _ADDRESSES.sub("<server>", message)
    if scrubbed != message and _UNAVAILABLE_LOG.ready():
        skipped = _UNAVAILABLE_LOG.suppressed
        log.warning("unavailable: %s (%d more in the last minute not logged)", message, skipped)
    return scrubbed


def error_response(exc: BaseException) -> JSONResponse:
    """OpenAI's error JSON with the status code OpenAI uses for that kind of error; a server
    error carries no traceback."""
    if isinstance(exc, api.UnknownModel):
        status, kind, code = 404, "invalid_request_error", "model_not_found"
        message = str(exc.message)
    elif isinstance(exc, InvalidRequest):
        status, kind, code, message = 400, "invalid_request_error", None, str(exc.message)
    elif isinstance(exc, MalformedKey):
        status, kind, code, message = 401, "authentication_error", "invalid_api_key", exc.message
    elif isinstance(exc, ForbiddenError) and _no_valid_key(exc.message):
        status, kind, code = 401, "authentication_error", "invalid_api_key"
        message = exc.message
    elif isinstance(exc, ForbiddenError):  # a valid key asking what it may not use
        status, kind, code, message = 403, "permission_error", "forbidden", exc.message
    elif isinstance(exc, NotFoundError):
        status, kind, code, message = 404, "invalid_request_error", "not_found", exc.message
    elif isinstance(exc, InvalidRequestError):
        status, kind, code, message = 400, "invalid_request_error", None, exc.message
    elif isinstance(exc, UnavailableError):
        status, kind, code, message = 503, "server_error", "unavailable", _public(exc.message)
    elif isinstance(exc, TierCacheClientError) and exc.kind == "capacity":
        status, kind, code, message = 429, "rate_limit_error", "capacity", exc.message
    else:
        # a stage that is down answers every retry so: a traceback each, once a minute
        if _FAILED_LOG.ready():
            log.error(
                "request failed (%d such failures not logged)", _FAILED_LOG.suppressed, exc_info=exc
            )
        status, kind, code, message = 500, "server_error", None, "internal error"
    return JSONResponse(api.error_body(message, kind, code), status_code=status)


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


def create_app(settings: GatewaySettings) -> Starlette:
    """The gateway's ASGI app; its Triton channel opens with the app and closes with it."""
    gateway: Gateway | None = None
    edge: EdgeCache | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal gateway, edge
        if settings.model_repository is not None:  # hashes the weights once: off the loop
            edge = await asyncio.to_thread(open_edge, settings.model_repository, settings.state_dir)
        gateway = Gateway(settings)
        try:
            yield
        finally:
            await gateway.close()
            if edge is not None:
                edge.close()

    metrics = GatewayMetrics()

    async def edge_hit(gen: api.Generation, authorization: str | None) -> api.Outcome | None:
        """The edge layer's exact hit for `gen`, as the ensemble would have answered it."""
        if edge is None:
            return None
        raw = raw_inputs(gen)
        try:
            if edge.blocking:  # Redis round trips: off the event loop
                hit = await asyncio.to_thread(edge.answer, raw, authorization)
            else:  # the host's memory-mapped L2 and this process's L1: microseconds
                hit = edge.answer(raw, authorization)
        except Exception:  # noqa: BLE001 - the edge is a shortcut: the ensemble answers instead
            if _EDGE_LOG.ready():  # a caller can repeat a failing lookup at will
                log.exception(
                    "the edge layer's lookup failed; asking the ensemble (%d such failures "
                    "not logged)",
                    _EDGE_LOG.suppressed,
                )
            return None
        if hit is None:
            return None
        metrics.edge_hits_by(hit.tier).inc()
        prompt, completion, truncated = hit.tokens
        return api.Outcome(
            text=hit.text,
            cache_status="exact",
            prompt_tokens=prompt,
            completion_tokens=completion,
            finish_reason="length" if truncated else "stop",
            answer_id=hit.answer_id,
        )

    metrics_from = settings.metrics_from or LOOPBACK_NETWORKS

    async def prometheus(request: Request) -> Response:
        peer = request.client.host if request.client is not None else None
        if not peer_in(peer, metrics_from):
            message = (
                "GET /metrics is served to the operator's addresses only (`tiercache gateway "
                "--metrics-from`; default this host): it counts every tenant's answers"
            )
            return JSONResponse(
                api.error_body(message, "permission_error", "metrics_restricted"), status_code=403
            )
        return metrics.exposition()

    def the_gateway() -> Gateway:
        assert gateway is not None, "the app's lifespan has not started"
        return gateway

    async def health(request: Request) -> JSONResponse:
        if await the_gateway().ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def models(request: Request) -> JSONResponse:
        ids = [settings.base_model, *sorted(settings.adapters)]
        data = [{"id": i, "object": "model", "created": 0, "owned_by": "tiercache"} for i in ids]
        return JSONResponse({"object": "list", "data": data})

    def checked_key(request: Request) -> tuple[str | None, JSONResponse | None]:
        """The request's Authorization, or its refusal (a 401) when it is malformed, or when
        the edge's copy of the key file refuses it: decided before the body is read."""
        try:
            key = authorization(request)
        except MalformedKey as exc:
            return None, error_response(exc)
        if edge is not None and (refusal := edge.refuses_key(key)) is not None:
            return None, error_response(ForbiddenError(refusal))
        return key, None

    async def serve(request: Request, chat: bool) -> Any:
        key, refused_key = checked_key(request)
        if refused_key is not None:
            return refused_key
        body, refused = await json_body(request, settings.body_timeout_s)
        if refused is not None:
            return refused
        try:
            gen = api.parse_request(
                body,
                chat=chat,
                base_model=settings.base_model,
                adapters=settings.adapters,
                # every Cache-Control line, as HTTP combines them (the first alone would drop
                # a no-store sent on a second)
                cache_header=", ".join(request.headers.getlist("cache-control")) or None,
            )
        except Exception as exc:  # noqa: BLE001 - this request's error response
            return error_response(exc)
        del body  # its parsed JSON (many times the body's bytes) is not held while it generates
        hit = await edge_hit(gen, key)
        if hit is not None:
            if gen.stream:
                return await streamed(request, gen, _replayed(hit))
            metrics.answers_by(hit.cache_status).inc()
            return JSONResponse(api.completion(gen, hit), headers=cache_headers(hit))
        stream = the_gateway().generate(gen, key)
        if gen.stream:
            return await streamed(request, gen, stream)

        async def whole() -> api.Outcome:
            outcome = api.Outcome()
            try:
                async for item in stream:
                    if isinstance(item, api.Outcome):
                        outcome = item
            finally:  # also when cancelled: closing the stream cancels the gRPC call
                await stream.aclose()  # type: ignore[attr-defined]
            return outcome

        try:
            outcome = await unless_disconnected(request, whole())
        except ClientGone:
            return client_gone()
        except Exception as exc:  # noqa: BLE001 - this request's error response
            return error_response(exc)
        metrics.answers_by(outcome.cache_status or "unknown").inc()
        return JSONResponse(api.completion(gen, outcome), headers=cache_headers(outcome))

    async def streamed(
        request: Request, gen: api.Generation, stream: AsyncIterator[str | api.Outcome]
    ) -> Any:
        """Server-Sent Events; the first item is awaited before the response starts, so an
        error the ensemble answers at once (a bad key, a bad word) is a plain error response
        with its status code, not an event."""
        try:  # for a padded tenant the first item is the whole answer: watch the client
            first = await unless_disconnected(request, anext(stream))
        except StopAsyncIteration:
            return error_response(UnavailableError("the ensemble sent nothing"))
        except ClientGone:
            await stream.aclose()  # type: ignore[attr-defined]
            return client_gone()
        except Exception as exc:  # noqa: BLE001 - this request's error response
            return error_response(exc)
        headers = {"cache-control": "no-cache"}
        if isinstance(first, api.Outcome):
            headers.update(cache_headers(first))

        async def events() -> AsyncIterator[bytes]:
            try:
                yield _sse(api.first_chunk(gen))
                item: str | api.Outcome | None = first
                while item is not None:
                    if isinstance(item, api.Outcome):
                        metrics.answers_by(item.cache_status or "unknown").inc()
                        yield _sse(api.chunk(gen, "", final=item))
                        if gen.include_usage:
                            yield _sse(api.usage_chunk(gen, item))
                        break
                    metrics.chunks.inc()
                    yield _sse(api.chunk(gen, item))
                    # A client that leaves is seen by Starlette's own listener, which cancels
                    # this generator (its `finally` closes `stream`: the gRPC call is cancelled).
                    # No poll per chunk: each would let uvicorn read on what the client
                    # pipelined meanwhile.
                    item = await anext(stream, None)
                yield _sse("[DONE]")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the status is sent: an error event
                body = json.loads(bytes(error_response(exc).body))
                yield _sse(body)
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def feedback(request: Request) -> Any:
        """POST /v1/feedback {"answer_id", "verdict": "good" | "bad"}: the feedback model's
        answer, as the caller's API key's tenant (docs/gateway.md). A missing or unknown key
        is refused before the body is read, as for a generation; a client that leaves cancels
        the call."""
        key, refused_key = checked_key(request)
        if refused_key is not None:
            return refused_key
        body, refused = await json_body(request, settings.body_timeout_s)
        if refused is not None:
            return refused
        try:
            answer_id, verdict = api.parse_feedback(body)
            call = the_gateway().feedback(answer_id, verdict, key)
            answer = await unless_disconnected(request, call)
        except ClientGone:
            return client_gone()
        except Exception as exc:  # noqa: BLE001 - this request's error response
            return error_response(exc)
        return JSONResponse(answer)

    async def chat_completions(request: Request) -> Any:
        return await serve(request, chat=True)

    async def completions(request: Request) -> Any:
        return await serve(request, chat=False)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/feedback", feedback, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
        ],
        middleware=[
            Middleware(CountRequests, metrics=metrics),
            *([Middleware(LoopbackHostOnly)] if settings.loopback_hosts_only else []),
            *(
                [
                    Middleware(
                        PerKeyLimit,
                        limit=settings.max_requests_per_key,
                        per_minute=settings.requests_per_minute_per_key,
                    )
                ]
                if settings.max_requests_per_key > 0 or settings.requests_per_minute_per_key > 0
                else []
            ),
        ],
        exception_handlers={404: no_route, 405: no_route},
        lifespan=lifespan,
    )


async def no_route(request: Request, exc: Exception) -> Response:
    """A path or method the gateway has no route for, in OpenAI's error JSON (Starlette answers
    these in plain text)."""
    status = getattr(exc, "status_code", 404)
    if status == 405:
        message = f"{request.method} is not allowed on {request.url.path[:200]}"
        code = "method_not_allowed"
    else:
        message = f"no route {request.url.path[:200]} (the API is under /v1)"
        code = "not_found"
    headers = getattr(exc, "headers", None)
    return JSONResponse(
        api.error_body(message, "invalid_request_error", code), status_code=status, headers=headers
    )


async def _replayed(outcome: api.Outcome) -> AsyncIterator[str | api.Outcome]:
    """An edge hit as `Gateway.generate` yields the ensemble's: its text, then the outcome."""
    if outcome.text:
        yield outcome.text
    yield outcome


def served_error(message: str, status: str | None) -> TierCacheClientError:
    """The typed error of an ensemble call; Triton's "unknown model" (the ensemble not loaded,
    or unloaded) is the server's trouble, a 503, not a model the caller named (a 404)."""
    exc = classify(message, status)
    if isinstance(exc, NotFoundError) and "unknown model" in exc.message.lower():
        return UnavailableError(f"the ensemble is not loaded: {exc.message}", status=status)
    return exc


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def unless_disconnected(request: Request, work: Any) -> Any:
    """`work`'s result (an awaitable), or ClientGone once the client disconnected first: `work`
    is then cancelled (a generation's stream closed with it, which cancels its gRPC call)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request cancelled (a shutdown): its work goes with it
        task.cancel()
        raise
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        cancelling = getattr(current, "cancelling", None)  # Python >= 3.11
        if cancelling is not None and cancelling():  # our own cancellation, not the task's
            raise
    except Exception:  # noqa: BLE001 - the work's failure, once its client is gone: moot
        pass
    raise ClientGone()


async def _disconnect(request: Request) -> None:
    """Returns when the client has disconnected (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


CLIENT_GONE_STATUS = 499  # nginx's "client closed request": counted, never delivered


def client_gone() -> Response:
    return Response(status_code=CLIENT_GONE_STATUS)


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """Whether the address a server listens on is a loopback one."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_host_name(host: str) -> bool:
    """Whether a Host header's name (`host_name`) names this machine: localhost, *.localhost,
    or a loopback address (127.0.0.0/8, ::1). A page using DNS rebinding sends its own name."""
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def send_error(
    send: Any,
    status: int,
    message: str,
    kind: str,
    code: str,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """OpenAI's error JSON sent straight from an ASGI middleware (no route ran)."""
    headers = ((b"content-type", b"application/json"), *headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    body = orjson.dumps(api.error_body(message, kind, code))
    await send({"type": "http.response.body", "body": body})


GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
# what the per-key limits count: every route that costs a Triton call (a `bad` verdict writes
# an invalidation; feedback was not counted)
LIMITED_ROUTES = GENERATION_ROUTES | {"/v1/feedback"}


class KeyRate:
    """Requests per minute per API key, as a token bucket per key: `per_minute` tokens, refilled
    evenly over a minute, one taken per request; a key may send a burst of `per_minute`, then
    one every 60 / `per_minute` s. Buckets are kept by a 16-byte digest of the key (a key may be
    kilobytes long and need not be valid), for at most `max_keys` keys, the least recently used
    dropped first (a dropped key starts again with a full bucket, as an idle one would). For one
    event loop (not thread-safe)."""

    def __init__(
        self,
        per_minute: int,
        max_keys: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute must be >= 1, got {per_minute}")
        self.per_minute = per_minute
        self.capacity = float(per_minute)
        self.refill_per_s = per_minute / 60.0
        self.max_keys = max_keys
        self.clock = clock
        # the key's digest: (tokens, when they were counted)
        self.buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()

    def take(self, key: str) -> float:
        """0 when `key` may send a request now (its token taken), else the seconds until it
        may (nothing taken)."""
        now = self.clock()
        name = hashlib.blake2b(key.encode(), digest_size=16).digest()
        tokens, at = self.buckets.pop(name, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - at) * self.refill_per_s)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.refill_per_s
        self.buckets[name] = (tokens, now)  # the most recently used last
        while len(self.buckets) > self.max_keys:
            self.buckets.popitem(last=False)
        return wait


class PerKeyLimit:
    """Pure ASGI middleware, per Authorization header, for generation and feedback requests
    (`LIMITED_ROUTES`): at most
    `limit` in flight (a stream counts until its last byte is sent; 0: no limit) and, with
    `per_minute`, at most that many a minute (`KeyRate`); a request past either is answered 429
    at once. The counts live in this process: with several gateway processes each has its own."""

    def __init__(self, app: Any, limit: int, per_minute: int = 0) -> None:
        self.app = app
        self.limit = limit
        self.in_flight: dict[str, int] = {}  # only keys with requests in flight
        self.rate = KeyRate(per_minute) if per_minute > 0 else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        key: str | None = None
        if scope["type"] == "http" and scope.get("path") in LIMITED_ROUTES:
            for name, value in scope.get("headers", ()):
                if name == b"authorization":  # the first, as `authorization` forwards it
                    # counted by the key itself, as prompt_cache reads it: "Bearer K",
                    # "bearer  K" and "K" are one key
                    key = key_from_parameter(value.decode("latin-1"))
                    break
        if not key:
            await self.app(scope, receive, send)
            return
        held = self.in_flight.get(key, 0)
        if self.limit and held >= self.limit:
            await send_error(
                send,
                429,
                f"this API key already has {held} requests in flight, the most one key may have "
                "at once: wait for some to finish",
                "rate_limit_error",
                "too_many_requests",
            )
            return
        if self.rate is not None and (wait := self.rate.take(key)) > 0:
            await send_error(
                send,
                429,
                f"this API key sent more than {self.rate.per_minute} requests a minute, the most "
                f"one key may send: try again in {wait:.1f} s",
                "rate_limit_error",
                "rate_limit_exceeded",
                headers=((b"retry-after", str(math.ceil(wait)).encode()),),
            )
            return
        self.in_flight[key] = held + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[key] - 1
            if left:
                self.in_flight[key] = left
            else:
                del self.in_flight[key]


class LoopbackHostOnly:
    """Pure ASGI middleware: a request whose Host header does not name this server by a
    loopback name (localhost, *.localhost, a loopback address: 127.0.0.0/8, ::1) is refused
    with 421 before any route runs. A web page the operator opens can make the browser send
    requests to 127.0.0.1 under a name it controls (DNS rebinding) and read the answers; its
    Host header then names that name."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = ""
            for name, value in scope.get("headers", ()):
                if name == b"host":
                    host = host_name(value.decode("latin-1"))
                    break
            if not loopback_host_name(host):
                await send_error(
                    send,
                    421,
                    "this gateway listens on loopback and answers requests for a loopback host "
                    "name only (localhost, 127.0.0.1, [::1])",
                    "invalid_request_error",
                    "misdirected_request",
                )
                return
        await self.app(scope, receive, send)


class CountRequests:
    """Pure ASGI middleware (no per-request task, unlike Starlette's BaseHTTPMiddleware):
    requests by route and status code, and the time to the response's start."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests_by(route, str(message["status"])).inc()
                self.metrics.latency_by(route).observe(time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, counted)


# 12 bytes: a character outside the BMP (an emoji, "\ud83d\ude00") as a client that escapes
# non-ASCII sends it; the ensemble's limits count characters
JSON_ESCAPED_CHAR_BYTES = 12
# A request body: the longest prompt and history the ensemble accepts (its default limits), every
# character escaped, the JSON around each history turn, and 28 KiB for every other field; 992 KiB.
MAX_BODY_BYTES = (
    JSON_ESCAPED_CHAR_BYTES * (DEFAULT_LIMITS.max_prompt_chars + DEFAULT_LIMITS.max_history_chars)
    + 64 * DEFAULT_LIMITS.max_history_turns
    + (28 << 10)
)


class BodyTooLarge(Exception):
    pass


async def json_body(request: Request, timeout_s: float) -> tuple[Any, Response | None]:
    """The request body as JSON, or the error response that refuses it: 415 unless it is sent
    as application/json (a web page can post text/plain across sites without asking; it cannot
    send application/json without a preflight this server does not grant), 413 past
    MAX_BODY_BYTES, 408 when it has not all arrived within `timeout_s`, 400 for a body that is
    not JSON."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        message = "the request body must be sent as content-type: application/json"
        return None, JSONResponse(
            api.error_body(message, "invalid_request_error", "unsupported_media_type"),
            status_code=415,
        )
    try:
        if whole_body_received(request.receive):  # came with its head: nothing to wait for
            body = await bounded_body(request)
        else:
            body = await asyncio.wait_for(bounded_body(request), timeout_s)
        return json.loads(body), None
    except BodyTooLarge as exc:
        return None, JSONResponse(
            api.error_body(str(exc), "invalid_request_error", "request_too_large"),
            status_code=413,
        )
    except asyncio.TimeoutError:  # the connection goes with it: the rest may still come
        message = f"the request body did not arrive within {timeout_s:g} s"
        return None, JSONResponse(
            api.error_body(message, "invalid_request_error", "request_timeout"),
            status_code=408,
            headers={"connection": "close"},
        )
    except (ValueError, RecursionError):  # not JSON, not UTF-8, numbers past int limits
        return None, error_response(InvalidRequest("the request body is not JSON"))
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        return None, client_gone()


async def bounded_body(request: Request) -> bytes:
    """The request body, read up to MAX_BODY_BYTES (BodyTooLarge past it, before reading more
    when Content-Length says so)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge(f"the request body is over {MAX_BODY_BYTES >> 10} KiB")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(f"the request body is over {MAX_BODY_BYTES >> 10} KiB")
        chunks.append(chunk)
    return b"".join(chunks)


def cache_headers(outcome: api.Outcome) -> dict[str, str]:
    headers = {CACHE_STATUS_HEADER: outcome.cache_status}
    if outcome.similarity is not None:
        headers[SIMILARITY_HEADER] = f"{outcome.similarity:.6f}"
    if outcome.answer_id is not None:
        headers[ANSWER_ID_HEADER] = outcome.answer_id
    return headers


def server_config(settings: GatewaySettings, host: str, port: int) -> Any:
    """uvicorn's configuration of the gateway: no access log (Prometheus counts requests), no
    proxy-header rewriting (the gateway trusts no forwarded client address), no Server header,
    at most `settings.max_connections` connections. uvicorn picks uvloop and httptools, which
    the requirements install."""
    import uvicorn

    from tiercache.gateway.protocol import bounded_protocol

    if settings.loopback_hosts_only is None:
        settings = dataclasses.replace(settings, loopback_hosts_only=is_loopback(host))
    return uvicorn.Config(
        create_app(settings),
        host=host,
        port=port,
        # uvicorn warns once per unparseable request and per request past the connection limit:
        # anyone could fill the log with them
        log_level="error",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        limit_concurrency=settings.max_connections,
        # no WebSocket upgrades (the gateway has no WebSocket route, and the header timer of
        # tiercache.gateway.protocol would outlive a connection handed to another protocol)
        ws="none",
        # httptools (installed), not h11, which parses headers in Python on every edge hit;
        # with the gateway's bounds on headers, pipelining, disconnects and peers that stop
        # reading (tiercache.gateway.protocol).
        http=bounded_protocol(
            settings.max_pipelined,
            settings.stalled_peer_s,
            settings.max_header_bytes,
            settings.header_timeout_s,
        ),
    )


@contextlib.contextmanager
def running_in_thread(
    settings: GatewaySettings, port: int, host: str = "127.0.0.1", start_timeout_s: float = 60.0
) -> Iterator[str]:
    """The gateway served by uvicorn on a thread of this process (tests, benchmarks, embedding
    it in another program), its base URL; stopped on exit. RuntimeError when it does not start
    within `start_timeout_s`."""
    import uvicorn  # the server, imported only where one is run

    config = server_config(settings, host, port)
    server = uvicorn.Server(config)
    thread = NamedThread(target=server.run, name="tiercache-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the gateway did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
