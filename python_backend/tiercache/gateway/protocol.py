"""The gateway's HTTP/1.1 connection protocol: uvicorn's httptools protocol with three bounds a
server facing the internet needs and uvicorn 0.54 does not set.

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


class PipelineTooDeep(Exception):
    """Raised from the parser's callback: httptools stops parsing and uvicorn answers 400."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_pipelined = DEFAULT_MAX_PIPELINED
    stalled_peer_s = DEFAULT_STALLED_PEER_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: Any = None  # the request cycle started last (the one in progress)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
        if sock is None or timeout is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, timeout, int(self.stalled_peer_s * 1000))
        except OSError:  # not a TCP socket after all, or a kernel without it: as uvicorn is
            pass

    def on_headers_complete(self) -> None:
        in_progress = self.cycle is not None and not self.cycle.response_complete
        if in_progress and len(self.pipeline) >= self.max_pipelined:
            raise PipelineTooDeep(f"more than {self.max_pipelined} pipelined requests")
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        cycles = [cycle for cycle, _ in self.pipeline]
        if self._running is not None:
            cycles.append(self._running)
        for cycle in cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)


def bounded_protocol(
    max_pipelined: int = DEFAULT_MAX_PIPELINED, stalled_peer_s: float = DEFAULT_STALLED_PEER_S
) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for uvicorn's `http=` with these bounds."""
    if max_pipelined < 0:
        raise ValueError(f"max_pipelined must be >= 0, got {max_pipelined}")
    if not stalled_peer_s > 0:
        raise ValueError(f"stalled_peer_s must be > 0, got {stalled_peer_s}")
    return type(
        "GatewayHttpProtocol",
        (BoundedHttpToolsProtocol,),
        {"max_pipelined": max_pipelined, "stalled_peer_s": stalled_peer_s},
    )
