"""tiercache.gateway.app at its edges: malformed keys, bodies that are too long, too slow or
name too much, the feedback route's checks and errors, the server's bounds, and the standalone
command's loopback rule. No Triton: the gateway runs in front of a closed port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tiercache.config import API_KEYS_FILE_ENV
from tiercache.errors import InvalidRequest
from tiercache.exact.request import DEFAULT_LIMITS
from tiercache.gateway import app
from tiercache.gateway import openai_api as api
from tiercache_client.errors import UnavailableError

BASE = "tiercache"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from tiercache.server import free_port

    settings = app.GatewaySettings(
        triton_url=f"127.0.0.1:{free_port()}", timeout_s=10, body_timeout_s=0.5
    )
    with app.running_in_thread(settings, free_port()) as base:
        yield base


def _post(url: str, path: str, body: bytes, authorization: bytes) -> Any:
    import httpx2

    headers = {b"content-type": b"application/json", b"authorization": authorization}
    return httpx2.post(f"{url}{path}", content=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer éx".encode(),  # non-ASCII
        b"Bearer a\tb",  # a tab: HTTP allows it, gRPC metadata does not
        b"Bearer " + b"k" * app.MAX_AUTHORIZATION_CHARS,
    ],
)
@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            b'{"model": "tiercache", "messages": [{"role": "user", "content": "Hi"}]}',
        ),
        ("/v1/completions", b'{"model": "tiercache", "prompt": "Hi", "stream": true}'),
        ("/v1/feedback", b'{"answer_id": "a1", "verdict": "good"}'),
    ],
)
def test_a_malformed_key_is_a_401_not_a_500(
    url: str, path: str, body: bytes, authorization: bytes
) -> None:
    refused = _post(url, path, body, authorization)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert "malformed API key" in refused.json()["error"]["message"]


def test_feedback_refuses_an_answer_id_that_cannot_be_one(url: str) -> None:
    surrogate = _post(url, "/v1/feedback", b'{"answer_id": "\\ud800", "verdict": "bad"}', b"")
    assert surrogate.status_code == 400 and "not valid Unicode" in surrogate.text
    long_id = b'{"answer_id": "' + b"a" * 513 + b'", "verdict": "bad"}'
    assert _post(url, "/v1/feedback", long_id, b"").status_code == 400
    # a well-formed request reaches the (absent) server: its error, classified
    assert (
        _post(url, "/v1/feedback", b'{"answer_id": "a", "verdict": "bad"}', b"").status_code == 503
    )


def test_a_body_announced_and_not_sent_is_a_408(url: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
        )
        answer = b""
        while chunk := conn.recv(4096):  # the gateway closes the connection after its answer
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"request_timeout" in body and b"connection: close" in head.lower()


def test_the_body_bound_follows_the_ensemble_s_limits() -> None:
    """The longest prompt and history the ensemble takes, every character an emoji escaped as a
    surrogate pair (12 bytes), fit under the bound."""
    import json

    emoji = "\U0001f600"
    body = json.dumps(
        {
            "model": BASE,
            "messages": [
                {"role": "user", "content": emoji * (DEFAULT_LIMITS.max_history_chars // 2)},
                {"role": "assistant", "content": emoji * (DEFAULT_LIMITS.max_history_chars // 2)},
                {"role": "user", "content": emoji * DEFAULT_LIMITS.max_prompt_chars},
            ],
        }
    ).encode()
    assert len(body) < app.MAX_BODY_BYTES == 992 << 10


def test_more_messages_than_the_history_limit_are_refused_before_reading_them() -> None:
    def parse(messages: list[Any]) -> api.Generation:
        body = {"model": BASE, "messages": messages}
        return api.parse_request(
            body, chat=True, base_model=BASE, adapters=frozenset(), cache_header=None
        )

    turn = {"role": "user", "content": "Hi"}
    assert len(parse([turn] * api.MAX_MESSAGES).history) == DEFAULT_LIMITS.max_history_turns
    with pytest.raises(InvalidRequest, match="over the limit of 65"):
        parse([None] * (api.MAX_MESSAGES + 1))  # not one message is looked at


def test_parse_feedback_names_the_problem() -> None:
    assert api.parse_feedback({"answer_id": "a1", "verdict": "good"}) == ("a1", "good")
    for body, fragment in [
        ({"answer_id": "a1", "verdict": "good", "x": 1}, "the body must be"),
        ({"answer_id": "", "verdict": "good"}, "non-empty string"),
        ({"answer_id": "\udfff", "verdict": "good"}, "not valid Unicode"),
        ({"answer_id": "a" * (api.MAX_ANSWER_ID_CHARS + 1), "verdict": "good"}, "over the limit"),
        ({"answer_id": "a1", "verdict": "ok"}, "'verdict'"),
    ]:
        with pytest.raises(InvalidRequest, match=fragment):
            api.parse_feedback(body)


class _Unreachable(grpc.RpcError):
    def details(self) -> str:
        return "failed to connect to all addresses"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _RefusingClient:
    async def infer(self, *args: Any, **kwargs: Any) -> Any:
        raise _Unreachable()


def test_feedback_classifies_every_client_error() -> None:
    gateway = app.Gateway.__new__(app.Gateway)  # no channel: the client is a stand-in
    gateway.settings = app.GatewaySettings()
    gateway.client = _RefusingClient()  # type: ignore[assignment]
    with pytest.raises(UnavailableError):
        asyncio.run(gateway.feedback("a1", "good", None))


class _CountingClient:
    def __init__(self) -> None:
        self.probes = 0

    async def is_server_ready(self, client_timeout: float | None = None) -> bool:
        assert client_timeout == app.Gateway.PROBE_TIMEOUT_S  # a hung Triton is not waited on
        self.probes += 1
        await asyncio.sleep(self.takes_s)
        return True

    async def is_model_ready(self, name: str, client_timeout: float | None = None) -> bool:
        assert client_timeout == app.Gateway.PROBE_TIMEOUT_S
        return True

    takes_s = 0.01


def test_health_asks_triton_at_most_once_a_second() -> None:
    """`GET /health` needs no key: a flood of it costs Triton one probe per second, shared by
    the requests that arrive while it is out."""
    gateway = app.Gateway.__new__(app.Gateway)  # no channel: the client is a stand-in
    gateway.settings = app.GatewaySettings()
    gateway._ready = None
    gateway.client = client = _CountingClient()  # type: ignore[assignment]

    async def flood() -> list[bool]:
        first = await asyncio.gather(*(gateway.ready() for _ in range(50)))
        await asyncio.sleep(app.Gateway.READY_FOR_S + 0.05)
        return [*first, await gateway.ready()]

    assert all(asyncio.run(flood()))
    assert client.probes == 2
    # a probe still out after READY_FOR_S is waited on, not doubled
    gateway._ready = None
    client.takes_s = app.Gateway.READY_FOR_S * 1.5

    async def slow() -> list[bool]:
        first = asyncio.ensure_future(gateway.ready())
        await asyncio.sleep(app.Gateway.READY_FOR_S + 0.1)
        return [await gateway.ready(), await first]

    assert all(asyncio.run(slow()))
    assert client.probes == 3


def test_a_cancelled_request_cancels_the_work_it_waited_on() -> None:
    """unless_disconnected's caller cancelled (a shutdown): the generation goes with it."""

    class NeverGone:
        async def receive(self) -> dict[str, str]:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

    async def scenario() -> bool:
        work = asyncio.ensure_future(asyncio.sleep(3600))
        waiter = asyncio.ensure_future(app.unless_disconnected(NeverGone(), work))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0)
        return work.cancelled()

    assert asyncio.run(scenario())


def test_the_server_bounds_its_connections() -> None:
    config = app.server_config(app.GatewaySettings(max_connections=7), "127.0.0.1", 0)
    assert config.limit_concurrency == 7


def test_the_standalone_gateway_listens_beyond_loopback_only_with_keys(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import uvicorn

    from tiercache.cli import main

    served: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: served.append(self.config))
    monkeypatch.delenv(API_KEYS_FILE_ENV, raising=False)
    assert main(["gateway", "--host", "0.0.0.0"]) == 2 and not served
    assert "--server-has-api-keys" in capsys.readouterr().err
    assert main(["gateway", "--host", "0.0.0.0", "--server-has-api-keys"]) == 0
    monkeypatch.setenv(API_KEYS_FILE_ENV, "/etc/tiercache/api_keys.json")  # as serve hands it on
    assert main(["gateway", "--host", "0.0.0.0", "--max-connections", "64"]) == 0
    assert [c.limit_concurrency for c in served] == [512, 64]
    monkeypatch.delenv(API_KEYS_FILE_ENV)
    assert main(["gateway", "--host", "::1"]) == 0  # loopback needs no key file


def test_an_unavailable_servers_address_stays_out_of_the_answer() -> None:
    """Triton's address in gRPC's transport error, a stage's Redis URL: not the caller's to
    know (the gateway's log keeps them)."""
    for message, kept in [
        ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.5:8001: refused",
         "failed to connect to all addresses"),
        ("Redis redis://10.0.0.7:6379/0 is unavailable: applied on this replica only",
         "applied on this replica only"),
        ("ipv6:[fd00::5]:8001 is down", "is down"),
        ("DNS resolution failed for triton.internal.10.0.0.9:8001", "DNS resolution failed"),
    ]:  # fmt: skip
        body = app.error_response(UnavailableError(message)).body.decode()
        assert kept in body and "10.0.0" not in body and "fd00" not in body, body
    assert (
        "the ensemble is not ready"
        in app.error_response(UnavailableError("the ensemble is not ready")).body.decode()
    )


def test_an_ensemble_that_is_not_loaded_is_a_503_and_an_unknown_adapter_a_404() -> None:
    unloaded = app.served_error("Request for unknown model: 'ensemble' is not found", None)
    assert app.error_response(unloaded).status_code == 503
    adapter = app.served_error("unknown adapter 'x'", "StatusCode.NOT_FOUND")
    assert app.error_response(adapter).status_code == 404


def test_every_cache_control_line_reaches_the_request(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP combines repeated header lines: a no-store sent on a second Cache-Control line is as
    binding as on the first (Starlette's `get` returns the first line alone)."""
    import httpx2

    seen: list[api.Generation] = []
    parse = api.parse_request

    def spy(*args: Any, **kwargs: Any) -> api.Generation:
        seen.append(parse(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(api, "parse_request", spy)
    body = b'{"model": "tiercache", "messages": [{"role": "user", "content": "Hi"}]}'
    headers = [
        (b"content-type", b"application/json"),
        (b"cache-control", b"max-age=600"),
        (b"cache-control", b'no-store, max-age="0"'),
    ]
    httpx2.post(f"{url}/v1/chat/completions", content=body, headers=headers, timeout=60)
    assert seen and seen[0].cache_control == "max-age=600, no-store, max-age=0"


def test_unexpected_failures_are_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """A stage that is down answers every client retry with the same INTERNAL error: each was
    a traceback in the gateway's log."""
    from tiercache_client.errors import ServerError

    with caplog.at_level("ERROR", logger="tiercache.gateway"):
        for _ in range(50):
            response = app.error_response(ServerError("Stub process is not healthy"))
            assert response.status_code == 500
    logged = [r for r in caplog.records if "request failed" in r.getMessage()]
    assert len(logged) <= 1
