"""Typed errors for the tiercache client.

Over Triton's gRPC stream the status code of a failed request is lost and only its message
arrives, so the server prefixes every message with a stable kind ("invalid request: ...",
"forbidden: ...", "not found: ...", "unavailable: ...", "capacity: ..."). `classify` turns such
a message, plus the gRPC status when one is known, into exactly one of the classes below.
"""

from __future__ import annotations

import re


class TierCacheClientError(Exception):
    """Base of every error the client raises on purpose.

    `message` is the human text without the kind prefix, `kind` the stable kind, `status` the
    gRPC status string (e.g. "StatusCode.UNAVAILABLE") when the transport reported one.
    """

    kind = "internal"

    def __init__(self, message: str, *, status: str | None = None) -> None:
        super().__init__(f"{self.kind}: {message}")
        self.message = message
        self.status = status


class InvalidRequestError(TierCacheClientError):
    """The request itself is wrong; retrying it unchanged fails again."""

    kind = "invalid request"


class ForbiddenError(InvalidRequestError):
    """The server refused the caller: no or a wrong credential (e.g. cache_admin's admin token).
    An InvalidRequestError too: retrying unchanged fails again."""

    kind = "forbidden"


class NotFoundError(TierCacheClientError):
    """A named thing (model, adapter) does not exist on the server."""

    kind = "not found"


class UnavailableError(TierCacheClientError):
    """The server (or a dependency of it) cannot serve now, or did not answer in time."""

    kind = "unavailable"


class ServerUnreachableError(UnavailableError):
    """No connection to the server could be made (refused, unresolvable, closed)."""

    kind = "unreachable"


class CapacityError(TierCacheClientError):
    """A bounded server resource is full; retrying later may work."""

    kind = "capacity"


class ServerError(TierCacheClientError):
    """Any other server-side failure (kind "internal", or an unknown server kind)."""


_KIND_CLASSES: dict[str, type[TierCacheClientError]] = {
    "invalid request": InvalidRequestError,
    "forbidden": ForbiddenError,
    "not found": NotFoundError,
    "unavailable": UnavailableError,
    "capacity": CapacityError,
    # the server's own kinds for its failures: known, so that a kind word later in their text
    # ("internal: ValueError: ... not found: x") is not taken for theirs
    "internal": ServerError,
    "config": ServerError,
}

_STATUS_CLASSES: dict[str, type[TierCacheClientError]] = {
    "INVALID_ARGUMENT": InvalidRequestError,
    "NOT_FOUND": NotFoundError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": UnavailableError,
    "RESOURCE_EXHAUSTED": CapacityError,
}

# A kind prefix at the start of the message or after Triton's own wrapping
# ("in ensemble 'ensemble', invalid request: ...").
_KIND_RE = re.compile(
    r"(?:^|[\s,:])(" + "|".join(re.escape(k) for k in _KIND_CLASSES) + r"):\s*", re.IGNORECASE
)
_UNREACHABLE_MARKERS = (
    "failed to connect",
    "connection refused",
    "dns resolution failed",
    "errors resolving",  # gRPC's for a host name that does not resolve
    "name resolution",
    "socket closed",
    "connection reset",
    "no route to host",
)


def classify(message: str, status: str | None = None) -> TierCacheClientError:
    """Map a server/transport error message (and optional gRPC status) to a typed error.

    The kind prefix in the message wins over the status; an UNAVAILABLE status whose message
    names a connection failure becomes `ServerUnreachableError`; Triton's "unknown model" becomes
    `NotFoundError`; anything else is a `ServerError` carrying the whole message.
    """
    code = status.rsplit(".", 1)[-1].upper() if status else ""
    lowered = message.lower()
    # gRPC's own "failed to connect to all addresses; last error: UNAVAILABLE: ..." carries a
    # kind word too: the transport's failure is recognised first
    unreachable = code == "UNAVAILABLE" and lowered.startswith(_UNREACHABLE_MARKERS)
    match = None if unreachable else _KIND_RE.search(message)
    if match is not None:
        cls = _KIND_CLASSES[match.group(1).lower()]
        return cls(message[match.end() :].strip() or message, status=status)
    if unreachable:
        return ServerUnreachableError(message, status=status)
    if code in _STATUS_CLASSES:
        return _STATUS_CLASSES[code](message, status=status)
    if "unknown model" in lowered:
        return NotFoundError(message, status=status)
    return ServerError(message, status=status)
