"""The gateway's HTTP/1.1 connection protocol: uvicorn's httptools protocol with the bounds a
server facing the internet needs and uvicorn 0.54 does not set.

- **Request headers**: httptools bounds neither their size nor the time they take. Here a
  request's line and headers together may hold `max_header_bytes` (16 KiB; past it 400 and the
  connection closed), and must be complete within `header_timeout_s` (10 s) of the connection
  opening or of the request's first byte: a connection that sends nothing, or trickles its
  headers a byte at a time (slowloris), is closed, so idle sockets cannot hold every slot under
  `--max-connections`. (Between requests uvicorn's own keep-alive timeout, 5 s, closes an idle
  connection.)

- **Pipelined requests**: uvicorn parses every request a client sends ahead on one connection
  and queues it without limit (one small `GET` is about 25 bytes on the wire and a couple of
  KiB once parsed), and it reads on whenever the request in progress reads or a response
  completes. Past `max_pipelined` requests queued behind the one in progress the connection is
  answered 400 and closed, before the rest of what was read is parsed.
- **Disconnects**: when the connection is lost, uvicorn marks only the newest request as
  disconnected; here every request of the connection is, so the one streaming an answer learns
  it (and cancels its gRPC call) even when the client had pipelined another behind it.
- **Peers that stop reading**: a response written to a client that takes none of its bytes
  (a zero TCP window) would hold its connection, and a slot under `--max-connections`, for as
  long as the client keeps the socket open. Each connection's socket gets `TCP_USER_TIMEOUT`:
  the kernel drops it once data it sent stays unacknowledged for `stalled_peer_s` (zero-window
  probes included), and the request sees a disconnect. A client that only waits for a slow
  answer sends and owes nothing, so it is not affected.

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


class HeadersTooLarge(Exception):
    """Raised from the parser's callback, as PipelineTooDeep."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_pipelined = DEFAULT_MAX_PIPELINED
    stalled_peer_s = DEFAULT_STALLED_PEER_S
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: Any = None  # the request cycle started last (the one in progress)
        self._header_bytes = 0  # of the request being parsed
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.max_header_bytes:
            raise HeadersTooLarge(f"request line and headers over {self.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        self._header_bytes = 0
        self._arm_header_timer()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()  # a connection that never sends a request is closed too
        sock = transport.get_extra_info("socket")
        timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
        if sock is None or timeout is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, timeout, int(self.stalled_peer_s * 1000))
        except OSError:  # not a TCP socket after all, or a kernel without it: as uvicorn is
            pass

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        in_progress = self.cycle is not None and not self.cycle.response_complete
        if in_progress and len(self.pipeline) >= self.max_pipelined:
            raise PipelineTooDeep(f"more than {self.max_pipelined} pipelined requests")
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
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
