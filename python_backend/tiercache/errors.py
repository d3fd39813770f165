"""One error hierarchy for the core.

Each class carries a stable `kind` that prefixes the message a client sees ("invalid request: ..."),
because over Triton's gRPC stream the status code is lost and only the message arrives. The Triton
boundary maps `kind` to a Triton error code exactly once (`tiercache.triton.io`).
"""

from __future__ import annotations


class TierCacheError(Exception):
    """Base of every error the core raises on purpose."""

    kind = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def client_message(self) -> str:
        return f"{self.kind}: {self.message}"


class InvalidRequest(TierCacheError):
    """The request itself is wrong; retrying it unchanged fails again."""

    kind = "invalid request"


class Forbidden(InvalidRequest):
    """The caller may not do this: no or a wrong credential (admin token, API key), or an internal
    stage called without the server's seal. A subclass of InvalidRequest, so Triton answers it
    INVALID_ARG (Triton's Python backend has no permission code); its kind names it."""

    kind = "forbidden"


class NotFound(TierCacheError):
    """A named thing (adapter, key) does not exist."""

    kind = "not found"


class Unavailable(TierCacheError):
    """A dependency (engine, store) cannot serve now; retrying later may work."""

    kind = "unavailable"


class CapacityError(TierCacheError):
    """A bounded resource is full and nothing could be evicted."""

    kind = "capacity"


class ConfigError(TierCacheError):
    """A stage's configuration is missing, unknown or malformed (raised at initialize)."""

    kind = "config"
