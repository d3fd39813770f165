"""The gateway's connection bounds (tiercache.gateway.protocol) and its other edges facing
hostile clients, on a real uvicorn over real sockets: pipelined requests past the bound, a
client that leaves while a request waits (also with another request pipelined behind it), a
client that stops reading a response, and the Host header on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx2
import pytest
import uvicorn

from tiercache.gateway import app
from tiercache.gateway.protocol import bounded_protocol, whole_body_received
from tiercache.server import free_port

BODY = b'{"model": "tiercache", "prompt": "Hi", "max_tokens": 4}'


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a Triton that hangs)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


@pytest.fixture(scope="module")
def hung() -> Iterator[str]:
    """A gateway whose Triton never answers: a generation waits for its 30 s deadline."""
    with blackhole() as triton:
        settings = app.GatewaySettings(triton_url=triton, timeout_s=30, max_pipelined=2)
        with app.running_in_thread(settings, free_port()) as base:
            yield base


def _request(path: str = "/v1/completions", body: bytes = BODY) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=20)


def _metric(base: str, code: str) -> float:
    text = httpx2.get(f"{base}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tiercache_gateway_requests_total{") and f'code="{code}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_requests_pipelined_past_the_bound_close_the_connection(hung: str) -> None:
    """A request in progress and 20 small ones pipelined behind it: the connection is closed at
    once (the bound is 2 here), not parsed and queued while the first waits on Triton; nothing
    is written, since a 400 would land inside the first request's response."""
    with _connect(hung) as conn:
        conn.sendall(_request() + b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n" * 20)
        assert _closed_within(conn, 10) == b""  # not after the first request's 30 s deadline


def test_a_client_that_leaves_while_its_answer_is_pending_cancels_it(hung: str) -> None:
    """The client goes while the generation waits (once alone, once with a request pipelined
    behind it, which uvicorn alone would mark as the only one gone): the request ends as 499
    (client closed request) long before its 30 s deadline."""
    for pipelined in (b"", b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"):
        before = _metric(hung, "499")
        with _connect(hung) as conn:
            conn.sendall(_request() + pipelined)
            time.sleep(0.5)  # the request reached the gateway and waits on Triton
        deadline = time.monotonic() + 10
        while _metric(hung, "499") == before:
            assert time.monotonic() < deadline, f"not cancelled (pipelined: {pipelined!r})"
            time.sleep(0.1)


class _StuckTriton:
    """A gRPC server in Triton's place whose stream never answers: it records when a call
    comes and when the call ends (the gateway cancelled it, or the channel went)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.ended = threading.Event()
        handler = grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self._stream)},
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def _stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        context.add_callback(self.ended.set)
        next(requests, None)  # the request arrived
        self.started.set()
        while context.is_active():
            time.sleep(0.02)
        yield from ()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_closes_the_gateways_grpc_call(stream: bool) -> None:
    """What the 499 counter cannot show: the gateway's call to Triton itself ends when the
    client goes (a whole answer pending, a stream before its first chunk), long before the
    call's own 30 s deadline; a generation nobody waits for is not kept open."""
    triton = _StuckTriton()
    triton.server.start()
    settings = app.GatewaySettings(triton_url=f"127.0.0.1:{triton.port}", timeout_s=30)
    body = b'{"model": "tiercache", "prompt": "Hi", "max_tokens": 4, "stream": %s}' % (
        b"true" if stream else b"false"
    )
    try:
        with app.running_in_thread(settings, free_port()) as base:
            with _connect(base) as conn:
                conn.sendall(_request(body=body))
                assert triton.started.wait(10), "the call never reached Triton"
                assert not triton.ended.is_set()
            assert triton.ended.wait(10), "the gRPC call was kept open after the client left"
    finally:
        triton.server.stop(0)


def test_the_host_header_must_name_loopback_on_a_loopback_gateway(hung: str) -> None:
    for host, expected in (
        ("127.0.0.1", 200),
        ("localhost:1", 200),
        ("127.0.0.2:8000", 200),  # any loopback address (`serve --host 127.0.0.2` probes so)
        ("[::1]:1", 200),
        ("evil.example", 421),
        ("127.0.0.1.evil.example", 421),
    ):
        answer = httpx2.get(f"{hung}/v1/models", headers={"host": host}, timeout=10)
        assert answer.status_code == expected, host
    refused = httpx2.get(f"{hung}/v1/models", headers={"host": "evil.example:80"}, timeout=10)
    assert refused.json()["error"]["code"] == "misdirected_request"
    assert app.host_name("[::1]:8080") == "::1" and app.host_name("LocalHost") == "localhost"
    assert app.is_loopback("127.0.0.1") and app.is_loopback("::1")
    assert not app.is_loopback("0.0.0.0") and not app.is_loopback("10.0.0.1")


async def _endless(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app that streams without end: what a long answer is to a client that stops
    reading it."""
    await receive()  # the request (no body)
    gone = asyncio.ensure_future(receive())  # then its disconnect
    await send({"type": "http.response.start", "status": 200, "headers": []})
    chunk = b"x" * 65536
    while not gone.done():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.sleep(0)


def test_a_client_that_stops_reading_loses_its_connection() -> None:
    """A client that reads nothing of a streamed response (its receive window closes) keeps
    its connection only about `stalled_peer_s` (TCP_USER_TIMEOUT), not for ever."""
    with _bounded_server(stalled_peer_s=1.0) as (server, port):
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect(("127.0.0.1", port))
        conn.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        opened = time.monotonic()
        while not server.server_state.connections:
            time.sleep(0.05)
        while server.server_state.connections:  # never read: dropped by the kernel
            assert time.monotonic() - opened < 60, "the stalled connection was kept"
            time.sleep(0.1)
        conn.close()


def test_a_client_that_reads_slowly_loses_its_connection() -> None:
    """A client that takes 4 KiB of a streamed response every tenth of a second (its window
    opens, so what the server sends is acknowledged and TCP_USER_TIMEOUT never fires) would
    hold its connection for as long as the answer lasts, a long one for hours at a slower
    pace: a response whose writing stays paused (the write buffer over its high-water mark) for
    `stalled_peer_s` is aborted."""
    with _bounded_server(stalled_peer_s=1.0) as (server, port):
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect(("127.0.0.1", port))
        conn.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        conn.settimeout(1.0)
        opened = time.monotonic()
        while not server.server_state.connections:
            time.sleep(0.05)
        read = 0
        with contextlib.suppress(OSError):
            while server.server_state.connections:
                assert time.monotonic() - opened < 30, "the trickling reader was kept"
                read += len(conn.recv(4096))
                time.sleep(0.1)
        assert read > 0  # it did read: TCP's own timer alone would not have dropped it
        conn.close()


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
        return answer


def test_idle_connections_make_room_for_requests() -> None:
    """Sockets opened and left (no request head, or half of one) hold no slot a request needs:
    with every slot taken by them, a request closes the longest-waiting and is served, where
    uvicorn alone answers 503 until the header timer closes them (and an attacker opens them
    again as fast). The limit still holds against connections that run requests."""
    with _bounded_server(_ok, limit_concurrency=4, header_timeout_s=60) as (server, port):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
        idle[0].sendall(b"GET / HTTP/1.1\r\nhost: 12")  # a slowloris's start
        time.sleep(0.3)
        assert len(server.server_state.connections) < 4  # the newest made room as they came
        assert _get(port).startswith(b"HTTP/1.1 200")
        # the server closed those that made room (which ones: the order it accepted them in)
        assert sum(_closed_by_server(conn) for conn in idle) >= 3
        for conn in idle:
            conn.close()
    with _bounded_server(limit_concurrency=3, header_timeout_s=60) as (server, port):
        streams = []
        for _ in range(2):  # two connections streaming without end: running, not idle
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            streams.append(conn)
        time.sleep(0.3)
        assert _get(port).startswith(b"HTTP/1.1 503")
        for conn in streams:
            conn.close()


def test_a_connection_answered_before_its_body_came_makes_room() -> None:
    """Requests answered without their bodies being read (a 401 or 415 given first, a route
    that reads none), their bodies never sent: such a connection owes only that body, and
    made no room (it was neither owing a head nor running), so a handful of them held every
    slot with no key at all. They make room now, as idle ones do."""
    head = b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 100000\r\n\r\n"
    with _bounded_server(_ok, limit_concurrency=4, header_timeout_s=60) as (_, port):
        owing = []
        for _ in range(4):
            conn = socket.create_connection(("127.0.0.1", port), timeout=5)
            conn.sendall(head)
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")  # answered; the body is owed
            owing.append(conn)
        for _ in range(3):
            assert _get(port).startswith(b"HTTP/1.1 200")
        assert sum(_closed_by_server(conn) for conn in owing) >= 1
        for conn in owing:
            conn.close()


def test_a_head_pipelined_behind_a_long_body_in_one_read_is_still_bounded() -> None:
    """A POST with a 20 KB body and, in the same write, a GET whose head carries a 100 KB
    header: the body ran past the first 16 KiB slice and the rest of the read went to the
    parser uncounted, so the GET was answered (the same GET alone is a 431). Now the
    connection is closed at the GET's 16 KiB (with the POST's answer, still in progress when
    the head overflowed: nothing is written into a response under way)."""
    body = b"b" * 20_000
    post = b"POST / HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 20000\r\n\r\n" + body
    get = b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: " + b"p" * 100_000 + b"\r\n\r\n"
    with _bounded_server(_tell_body) as (_, port):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(post + get)
            answer = _closed_within(conn, 10)
    assert answer.count(b"HTTP/1.1 200") <= 1  # the GET is never answered


def test_unknown_routes_and_methods_answer_in_openai_s_error_json(hung: str) -> None:
    missing = httpx2.get(f"{hung}/v2/models", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx2.get(f"{hung}/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong.headers["allow"]


@contextlib.contextmanager
def _bounded_server(
    app_: Any = None, limit_concurrency: int | None = None, **bounds: Any
) -> Iterator[tuple[uvicorn.Server, int]]:
    config = uvicorn.Config(
        app_ or _endless,
        host="127.0.0.1",
        port=free_port(),
        log_level="critical",
        lifespan="off",
        limit_concurrency=limit_concurrency,
        http=bounded_protocol(**bounds),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield server, config.port
    finally:
        server.should_exit = True
        thread.join(10)


def _closed_by_server(conn: socket.socket) -> bool:
    """Whether the server has closed `conn` (it reads as ended within a second)."""
    conn.settimeout(1.0)
    try:
        return conn.recv(4096) == b""
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def _closed_within(conn: socket.socket, seconds: float) -> bytes:
    """What the server sent before it closed the connection (AssertionError if it did not
    within `seconds`)."""
    conn.settimeout(seconds)
    answer = b""
    try:
        while chunk := conn.recv(4096):
            answer += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {seconds} s") from None
    return answer


def test_headers_must_arrive_in_time_and_fit() -> None:
    """A connection that sends nothing, or trickles its headers, is closed after
    header_timeout_s; a request line and headers over max_header_bytes is refused (a header
    that ends, and one endless header line, which httptools never reports)."""
    with _bounded_server(header_timeout_s=0.5, max_header_bytes=2048) as (_, port):
        with socket.create_connection(("127.0.0.1", port)) as idle:
            assert _closed_within(idle, 5) == b""
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\n")
            for _ in range(3):  # one header every 0.3 s: never complete within 0.5 s
                time.sleep(0.3)
                with contextlib.suppress(OSError):
                    slow.sendall(b"x-slow: 1\r\n")
            assert _closed_within(slow, 5) == b""
        with socket.create_connection(("127.0.0.1", port)) as big:
            big.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: " + b"a" * 4096 + b"\r\n\r\n")
            assert _closed_within(big, 5).startswith(b"HTTP/1.1 431")
        with socket.create_connection(("127.0.0.1", port)) as endless:
            endless.sendall(b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\nx-long: ")
            with contextlib.suppress(OSError):
                for _ in range(8):  # 64 KiB of one header line, never ended
                    endless.sendall(b"a" * 8192)
            assert _closed_within(endless, 5).startswith(b"HTTP/1.1 431")
    for bad in ({"header_timeout_s": 0}, {"max_header_bytes": 10}, {"max_pipelined": -1}):
        with pytest.raises(ValueError):
            bounded_protocol(**bad)


def test_one_key_may_have_only_so_many_generations_in_flight() -> None:
    """With 2 per key: a third concurrent request of the same key is a 429 at once, another
    key's is taken, and once the first two end (their clients gone) the key is served again."""
    with blackhole() as triton:
        settings = app.GatewaySettings(triton_url=triton, timeout_s=30, max_requests_per_key=2)
        with app.running_in_thread(settings, free_port()) as base:
            held = []
            for _ in range(2):
                conn = _connect(base)
                conn.sendall(_request_with_key(b"Bearer key-a"))
                held.append(conn)
            time.sleep(0.5)
            with _connect(base) as third:
                third.sendall(_request_with_key(b"Bearer key-a"))
                answer = third.recv(4096)
            assert answer.startswith(b"HTTP/1.1 429") and b"too_many_requests" in answer
            with _connect(base) as other:
                other.sendall(_request_with_key(b"Bearer key-b"))
                other.settimeout(1.0)
                with pytest.raises(TimeoutError):  # taken: it waits on Triton like the others
                    other.recv(4096)
            with _connect(base) as respelled:  # "bearer  key-a" and "key-a" are the same key
                respelled.sendall(_request_with_key(b"bearer   key-a"))
                assert respelled.recv(4096).startswith(b"HTTP/1.1 429")
            with _connect(base) as bare:
                bare.sendall(_request_with_key(b"key-a"))
                assert bare.recv(4096).startswith(b"HTTP/1.1 429")
            with _connect(base) as feedback:  # a Triton call too (a `bad` one invalidates)
                verdict = b'{"answer_id": "x", "verdict": "bad"}'
                feedback.sendall(
                    _request_with_key(b"Bearer key-a")
                    .replace(b"/v1/completions", b"/v1/feedback")
                    .replace(
                        f"content-length: {len(BODY)}".encode(),
                        b"content-length: %d" % len(verdict),
                    )
                    .replace(BODY, verdict)
                )
                assert feedback.recv(4096).startswith(b"HTTP/1.1 429")
            for conn in held:
                conn.close()
            deadline = time.monotonic() + 10
            while True:
                with _connect(base) as again:
                    again.sendall(_request_with_key(b"Bearer key-a"))
                    again.settimeout(0.5)
                    try:
                        early = again.recv(4096)
                    except TimeoutError:
                        break  # taken
                assert early.startswith(b"HTTP/1.1 429"), early[:60]
                assert time.monotonic() < deadline, "the key's count never went down"
                time.sleep(0.2)


def _request_with_key(authorization: bytes) -> bytes:
    return _request().replace(
        b"host: 127.0.0.1\r\n", b"host: 127.0.0.1\r\nauthorization: " + authorization + b"\r\n"
    )


def test_a_pipelined_head_waiting_on_a_long_answer_is_not_timed_out() -> None:
    """Request 1 waits on Triton; part of request 2's head came with it (uvicorn stops reading
    while request 1 runs). The header timer must not close the connection under request 1; and
    a large body after small headers is not taken for a large head."""
    with blackhole() as triton:
        settings = app.GatewaySettings(triton_url=triton, timeout_s=30, header_timeout_s=0.5)
        with app.running_in_thread(settings, free_port()) as base:
            with _connect(base) as conn:
                conn.sendall(_request() + b"GET /v1/models HTTP/1.1\r\nhost: 127.")
                conn.settimeout(2.0)
                with pytest.raises(TimeoutError):  # still open, request 1 still waiting
                    conn.recv(4096)
            body = b'{"model": "no-such-model", "prompt": "' + b"a" * 100_000 + b'"}'
            with _connect(base) as big:
                big.sendall(_request(body=body))
                answer = big.recv(4096)
            assert answer.startswith(b"HTTP/1.1 404") and b"model_not_found" in answer


async def _tell_body(scope: Any, receive: Any, send: Any) -> None:
    """Answers `whole` when the request's body had all arrived as the app began (no deadline
    needed to read it), else `partial`, after reading it."""
    if scope["type"] != "http":
        return
    whole = whole_body_received(receive)
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    payload = b"whole" if whole else b"partial"
    headers = [(b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _response(conn: socket.socket) -> bytes:
    conn.settimeout(5)
    answer = b""
    while not answer.endswith((b"whole", b"partial")):
        chunk = conn.recv(4096)
        assert chunk, f"closed after {answer!r}"
        answer += chunk
    return answer


def test_a_whole_request_makes_no_timer_and_a_partial_head_is_still_timed_out() -> None:
    """Heads and bodies that come whole (every client's) cost no timer: none is pending after
    a response on a kept-alive connection, and the body is read without a deadline. A head
    begun after a response, or pipelined behind one, is still closed after header_timeout_s."""
    with _bounded_server(_tell_body, header_timeout_s=0.5) as (server, port):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(_request(path="/"))
            assert _response(conn).endswith(b"whole")
            time.sleep(0.1)
            (protocol,) = server.server_state.connections
            assert protocol._header_timer is None  # type: ignore[attr-defined]
            conn.sendall(_request(path="/")[:-5])  # the body's last 5 bytes come later
            time.sleep(0.3)
            conn.sendall(_request(path="/")[-5:])
            assert _response(conn).endswith(b"partial")  # read under its deadline
            answered = time.monotonic()
            time.sleep(0.35)  # idle (uvicorn's keep-alive is 5 s), then a slow head
            conn.sendall(b"GET / HTTP/1.1\r\nhost: 127.0")
            sent = time.monotonic()
            assert _closed_within(conn, 5) == b""
            # counted from the response's end, not from the head's first byte
            assert 0.4 <= time.monotonic() - answered and time.monotonic() - sent < 0.4
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(_request(path="/") + b"GET / HTTP/1.1\r\nhost: 127.0")  # pipelined
            assert _response(conn).endswith(b"whole")
            assert _closed_within(conn, 5) == b""


def test_key_rate_is_a_token_bucket_per_key() -> None:
    now = [0.0]
    rate = app.KeyRate(per_minute=3, max_keys=2, clock=lambda: now[0])
    assert [rate.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert rate.take("a") == pytest.approx(20.0)  # one token every 20 s, none taken
    assert rate.take("b") == 0.0  # another key has its own
    now[0] = 19.0
    assert rate.take("a") == pytest.approx(1.0)
    now[0] = 20.0
    assert rate.take("a") == 0.0 and rate.take("a") > 0
    rate.take("c")  # a third key: the least recently used ("b") is dropped
    assert len(rate.buckets) == 2 and rate.take("a") > 0  # "a" was used after "b": kept
    assert rate.take("b") == 0.0  # "b" starts again with a full bucket
    with pytest.raises(ValueError):
        app.KeyRate(per_minute=0)


def test_a_key_past_its_requests_per_minute_is_a_429_with_retry_after() -> None:
    """With 2 a minute: a key's third request (here each a quick 404 for an unknown model) is
    a 429 `rate_limit_exceeded` naming when to retry; another key is served."""
    body = b'{"model": "no-such-model", "prompt": "Hi", "max_tokens": 4}'
    with blackhole() as triton:
        settings = app.GatewaySettings(triton_url=triton, requests_per_minute_per_key=2)
        with app.running_in_thread(settings, free_port()) as base:
            answers = []
            for key in (b"Bearer key-a", b"Bearer key-a", b"bearer  key-a", b"Bearer key-b"):
                with _connect(base) as conn:
                    conn.sendall(
                        _request_with_key(key)
                        .replace(BODY, body)
                        .replace(
                            f"content-length: {len(BODY)}".encode(),
                            f"content-length: {len(body)}".encode(),
                        )
                    )
                    answers.append(conn.recv(4096))
    assert [a[:12] for a in answers] == [b"HTTP/1.1 404"] * 2 + [b"HTTP/1.1 429", b"HTTP/1.1 404"]
    head, _, text = answers[2].partition(b"\r\n\r\n")
    assert b"rate_limit_exceeded" in text
    retry = [line for line in head.lower().split(b"\r\n") if line.startswith(b"retry-after:")]
    assert retry and 1 <= int(retry[0].split(b":")[1]) <= 30


async def _early(scope: Any, receive: Any, send: Any) -> None:
    """Answers `early` at once, reading none of the request's body (as a 401 or 404 does)."""
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"5")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"early"})


def _trickled_until_closed(conn: socket.socket, trickle: bytes, limit_s: float = 5.0) -> float:
    """Sends `trickle` every 0.2 s until the server closes the connection; the seconds that
    took (AssertionError past `limit_s`)."""
    started = time.monotonic()
    conn.settimeout(0.2)
    while time.monotonic() - started < limit_s:
        try:
            conn.sendall(trickle)
            if conn.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:  # reset: closed
            return time.monotonic() - started
    raise AssertionError(f"still open after {limit_s} s of {trickle!r}")


@pytest.mark.parametrize(
    ("request_bytes", "trickle"),
    [
        (b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n", b"\r\n"),  # blank lines
        (  # the rest of a body the route never read
            b"POST / HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 1000000\r\n\r\nab",
            b"x",
        ),
        (  # after an upgrade request, every later read is the upgrade's
            b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: upgrade\r\nupgrade: foo\r\n\r\n",
            b"x",
        ),
    ],
    ids=["blank-lines", "unread-body", "upgrade"],
)
def test_bytes_that_make_no_request_after_a_response_are_timed_out(
    request_bytes: bytes, trickle: bytes
) -> None:
    """uvicorn cancels its keep-alive timer on any bytes: a client that answers a response with
    bytes that never make a whole request is still closed after header_timeout_s (0.5 s)."""
    with _bounded_server(_early, header_timeout_s=0.5) as (_, port):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(request_bytes)
            conn.settimeout(5)
            answer = b""
            while not answer.endswith(b"early"):
                chunk = conn.recv(4096)
                assert chunk, answer
                answer += chunk
            took = _trickled_until_closed(conn, trickle)
            # the upgrade's bytes may also be refused at once (uvicorn closes on some)
            assert took < 3 and (took > 0.3 or b"upgrade" in request_bytes), took


def test_a_request_pipelined_behind_a_large_body_is_not_taken_for_a_large_head() -> None:
    """A POST whose body ends inside the first 16 KiB of a read, and a GET with a 2 KiB head
    pipelined behind it in the same read: both answered (the header bound counts the GET's
    head afresh; before, the read's first 16 KiB ending inside a head was refused as 431)."""
    body = b"b" * 15_000
    post = (
        b"POST / HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    get = b"GET / HTTP/1.1\r\nhost: 127.0.0.1\r\nx-pad: " + b"p" * 2000 + b"\r\n\r\n"
    with _bounded_server(_tell_body) as (_, port):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(post + get)
            conn.settimeout(5)
            answer = b""
            while answer.count(b"whole") < 2:
                chunk = conn.recv(4096)
                assert chunk, answer
                answer += chunk
    assert answer.count(b"HTTP/1.1 200") == 2


def test_metrics_answer_the_operators_peers_only() -> None:
    """GET /metrics counts every tenant's answers: by default it answers this host only (a
    403 with OpenAI's error body for any other peer), and `--metrics-from` names who else.
    Checked on real sockets: a gateway whose metrics are for 10.0.0.0/8 refuses loopback."""
    with blackhole() as triton:
        closed = app.GatewaySettings(
            triton_url=triton, metrics_from=app.metrics_networks(["10.0.0.0/8"])
        )
        with app.running_in_thread(closed, free_port()) as base:
            refused = httpx2.get(f"{base}/metrics", timeout=10)
        with app.running_in_thread(app.GatewaySettings(triton_url=triton), free_port()) as base:
            served = httpx2.get(f"{base}/metrics", timeout=10)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "metrics_restricted"
    assert "tiercache_gateway" not in refused.text
    assert served.status_code == 200 and "tiercache_gateway_requests_total" in served.text


def test_metrics_networks_and_peers() -> None:
    loopback = app.metrics_networks([])
    assert app.peer_in("127.0.0.1", loopback) and app.peer_in("::1", loopback)
    assert not app.peer_in("10.1.2.3", loopback) and not app.peer_in(None, loopback)
    assert not app.peer_in("not an address", loopback)
    named = app.metrics_networks(["10.0.0.0/8, 192.168.1.7", "loopback"])
    assert app.peer_in("10.1.2.3", named) and app.peer_in("192.168.1.7", named)
    assert app.peer_in("::ffff:10.1.2.3", named)  # a dual-stack listener's IPv4 peer
    assert app.peer_in("127.0.0.1", named) and not app.peer_in("192.168.1.8", named)
    everyone = app.metrics_networks(["any"])
    assert app.peer_in("203.0.113.9", everyone) and app.peer_in("2001:db8::1", everyone)
    with pytest.raises(ValueError, match="'10.0.0.0/33' is not an address"):
        app.metrics_networks(["10.0.0.0/33"])
