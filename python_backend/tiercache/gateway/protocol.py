"""The gateway's HTTP/1.1 connection protocol: uvicorn's httptools protocol with the bounds a
server facing the internet needs and uvicorn 0.54 does not set.

- **Request headers**: httptools bounds neither their size nor the time they take. Here a
  request's line and headers together may hold `max_header_bytes` (16 KiB, counted as raw bytes
  received: httptools reports a header only once its line ends, so one endless line would pass
  a count of the headers it reports; past it 431 and the connection closed; a head pipelined
  behind a body in the same read is counted from the slice of `max_header_bytes` where it
  begins, so it may reach twice that), and must be
  complete within `header_timeout_s` (10 s) of the connection opening or of the previous
  response's end: a connection that sends nothing, or trickles its headers a byte at a time
  (slowloris), is closed.
- **Connection slots**: uvicorn counts every open connection against `--max-connections`
  (`limit_concurrency`) and answers 503 to any request while they reach it, idle ones
  included, so sockets opened and left (closed by the header timer, but opened again as fast)
  could hold every slot. A new connection, and a request whose head completes, first close the
  connections that owe a request head and run nothing (opened and left, a slowloris's trickle,
  a keep-alive connection between requests), longest-waiting first, until there is room; a
  slot is refused only while the connections that hold them are all running requests.
  The timer is made only when needed: between requests uvicorn's own keep-alive timeout, 5 s,
  closes a connection that sends nothing; bytes that do not make a whole request (part of a
  head, the rest of a body its route did not read, blank lines, anything after an upgrade
  request) arm the timer (its deadline still counted from the response's end), which only a
  complete head disarms. A request that comes whole is running by the end of the read, so it
  makes no timer. A connection whose request was answered before its body was read (a 401 or
  413 given first, a route that reads none) owes only the rest of that body: it is closed to
  make room like one that owes a head. The timer does not run while a response is in
  progress: uvicorn then stops reading, so what a client pipelined waits in the kernel, not
  on the client.

- **Pipelined requests**: uvicorn parses every request a client sends ahead on one connection
  and queues it without limit (one small `GET` is about 25 bytes on the wire and a couple of
  KiB once parsed), and it reads on whenever the request in progress reads or a response
  completes. Past `max_pipelined` requests queued behind the one in progress the connection is
  closed, nothing written (a response is in progress on it), before the rest of what was read
  is parsed.
- **Disconnects**: when the connection is lost, uvicorn marks only the newest request as
  disconnected; here every request of the connection is, so the one streaming an answer learns
  it (and cancels its gRPC call) even when the client had pipelined another behind it.
- **Peers that stop reading**: a response written to a client that takes none of its bytes
  (a zero TCP window) would hold its connection, and a slot under `--max-connections`, for as
  long as the client keeps the socket open. Each connection's socket gets `TCP_USER_TIMEOUT`:
  the kernel drops it once data it sent stays unacknowledged for `stalled_peer_s` (zero-window
  probes included), and the request sees a disconnect. A client that only waits for a slow
  answer sends and owes nothing, so it is not affected. A client that takes a few bytes now
  and then (enough to keep TCP's timer from firing) keeps the transport's write buffer over
  its high-water mark: a response whose writing stays paused for `stalled_peer_s` without the
  buffer draining to its low-water mark (a few KiB a minute) is aborted as well.

The class is made per gateway (`bounded_protocol`) because uvicorn builds one instance per
connection with its own arguments.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_PIPELINED = 8
DEFAULT_STALLED_PEER_S = 60.0
DEFAULT_MAX_HEADER_BYTES = 16 << 10
DEFAULT_HEADER_TIMEOUT_S = 10.0


class PipelineTooDeep(Exception):
    """Raised from the parser's callback: httptools stops parsing and uvicorn answers 400."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_pipelined = DEFAULT_MAX_PIPELINED
    stalled_peer_s = DEFAULT_STALLED_PEER_S
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: Any = None  # the request cycle started last (the one in progress)
        # Bytes received since the last request's headers completed: httptools calls back a
        # header only once its line ends, so one endless header line is counted here, raw.
        self._head_bytes = 0
        self._in_head = True  # no request's headers completed since the last one's body
        self._head_open = False  # a request's head has begun and is not complete
        self._header_timer: asyncio.TimerHandle | None = None
        self._owed_since = 0.0  # the loop's time since which the client owes a request
        self._heads_done = 0  # request heads completed on this connection
        self._write_timer: asyncio.TimerHandle | None = None  # writing paused since it was made

    # -- the header timer: armed while the client owes a request head and nothing else runs

    def _responding(self) -> bool:
        return self._running is not None and not self._running.response_complete

    def _arm_header_timer(self) -> None:
        # Not while a response is in progress: uvicorn then stops reading, and a pipelined
        # head that arrived in part waits in the kernel for the response's end, not the client.
        if self._header_timer is None and not self._responding():
            deadline = self._owed_since + self.header_timeout_s
            self._header_timer = self.loop.call_at(deadline, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # -- connection slots: idle connections make room for those with requests

    def _owes_head(self) -> bool:
        """Runs nothing and waits for a request head (none begun, or one begun and not done),
        or for the rest of a body whose request was answered without reading it (a refusal
        before the body, a route that reads none): that body serves no request."""
        if (
            self._responding()
            or self.pipeline
            or self.transport is None
            or self.transport.is_closing()
        ):
            return False
        return self._in_head or (self._running is not None and self._running.response_complete)

    def _make_room(self) -> None:
        """Close other connections that owe a request head, longest-waiting first, until the
        open connections are fewer than `limit_concurrency` (uvicorn's 503 counts them all)."""
        limit = self.limit_concurrency
        connections = self.connections
        if limit is None or len(connections) < limit:
            return
        idle = [
            c
            for c in connections
            if c is not self and isinstance(c, BoundedHttpToolsProtocol) and c._owes_head()
        ]
        idle.sort(key=lambda c: c._owed_since)
        for connection in idle:
            if len(connections) < limit:
                return
            connection.transport.close()
            connections.discard(connection)  # its connection_lost comes later; it discards too

    # -- writing paused too long: a peer that takes a few bytes now and then

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.stalled_peer_s, self._write_stalled)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _write_stalled(self) -> None:
        self._write_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()  # not close(): that would wait for the buffer to drain

    # -- uvicorn's hooks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._owed_since = self.loop.time()
        self._make_room()
        self._arm_header_timer()  # a connection that never sends a request is closed too
        sock = transport.get_extra_info("socket")
        timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
        if sock is None or timeout is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, timeout, int(self.stalled_peer_s * 1000))
        except OSError:  # not a TCP socket after all, or a kernel without it: as uvicorn is
            pass

    def data_received(self, data: bytes) -> None:
        self._received(data)
        # Bytes that started no request (an incomplete head, the rest of a body its route never
        # read, blank lines, anything after an upgrade request) must become a whole request in
        # time: uvicorn cancels its keep-alive timer on any bytes. A request that came whole
        # is running now, so it made no timer (`_arm_header_timer` skips while one runs).
        if not self.transport.is_closing():
            self._arm_header_timer()

    def _received(self, data: bytes) -> None:
        if not self._in_head and len(data) > self.max_header_bytes:
            # a body: fed in slices, so that a head pipelined behind it in this read is
            # counted from the slice where it begins (a head may then reach twice the bound)
            step = self.max_header_bytes
            for start in range(0, len(data), step):
                self._received(data[start : start + step])
                if self.transport.is_closing():
                    return
            return
        if self._in_head:
            room = self.max_header_bytes - self._head_bytes
            if len(data) > room:  # parse up to the bound: the head must end within it
                heads = self._heads_done
                super().data_received(data[:room])
                if self.transport.is_closing():
                    return
                # still in the same head: too large; a head that ended in the slice may have
                # been followed by a whole body and the start of a pipelined request's head,
                # counted afresh from here on
                if self._in_head and self._heads_done == heads:
                    self._refuse(431, "Request Header Fields Too Large")
                    return
                self._received(data[room:])  # a body, or the next request
                return
            self._head_bytes += len(data)
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_open = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._heads_done += 1
        self._disarm_header_timer()
        self._in_head = False
        self._head_open = False
        self._head_bytes = 0
        if self._responding() and len(self.pipeline) >= self.max_pipelined:
            raise PipelineTooDeep(f"more than {self.max_pipelined} pipelined requests")
        self._make_room()  # before uvicorn counts the connections for its 503
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True  # what comes next is the next request's head
        self._head_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if one is queued
        self._owed_since = self.loop.time()  # the next request is owed from now
        if self._head_open or not self._in_head:  # part of the next head, or of this
            self._arm_header_timer()  # request's unread body, is owed: from now
        # else nothing is owed yet: uvicorn's keep-alive timeout closes an idle connection, and
        # the next bytes arm the timer (data_received)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (ours: PipelineTooDeep): nothing is
        written into a response in progress, whose bytes it would corrupt; the connection is
        closed either way."""
        if self._responding():
            self.transport.close()
            return
        super().send_400_response(msg)

    def _refuse(self, status: int, reason: str) -> None:
        if not self._responding() and not self.transport.is_closing():
            head = f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            self.transport.write(head.encode("ascii"))
        self.transport.close()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        self._disarm_header_timer()
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        cycles = [cycle for cycle, _ in self.pipeline]
        if self._running is not None:
            cycles.append(self._running)
        for cycle in cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)


def bounded_protocol(
    max_pipelined: int = DEFAULT_MAX_PIPELINED,
    stalled_peer_s: float = DEFAULT_STALLED_PEER_S,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for uvicorn's `http=` with these bounds."""
    if max_pipelined < 0:
        raise ValueError(f"max_pipelined must be >= 0, got {max_pipelined}")
    for name, value in (("stalled_peer_s", stalled_peer_s), ("header_timeout_s", header_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if max_header_bytes < 1024:
        raise ValueError(f"max_header_bytes must be >= 1024, got {max_header_bytes}")
    return type(
        "GatewayHttpProtocol",
        (BoundedHttpToolsProtocol,),
        {
            "max_pipelined": max_pipelined,
            "stalled_peer_s": stalled_peer_s,
            "max_header_bytes": max_header_bytes,
            "header_timeout_s": header_timeout_s,
        },
    )


def whole_body_received(receive: Any) -> bool:
    """Whether the request behind ASGI `receive` has its whole body in hand already (uvicorn's
    httptools cycle clears `more_body` when the message completes), so that reading it cannot
    wait and needs no deadline. False for any other server's `receive`."""
    return getattr(getattr(receive, "__self__", None), "more_body", True) is False
