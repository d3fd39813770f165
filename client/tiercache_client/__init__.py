"""Client for the tiercache cache-first LLM server (Triton model `ensemble`, gRPC streaming)."""

from .client import GenerationResult, TierCacheClient, build_inputs, read_admin_token
from .errors import (
    CapacityError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    ServerError,
    ServerUnreachableError,
    TierCacheClientError,
    UnavailableError,
    classify,
)

__all__ = [
    "CapacityError",
    "ForbiddenError",
    "GenerationResult",
    "InvalidRequestError",
    "NotFoundError",
    "ServerError",
    "ServerUnreachableError",
    "TierCacheClient",
    "TierCacheClientError",
    "UnavailableError",
    "build_inputs",
    "classify",
    "read_admin_token",
]
