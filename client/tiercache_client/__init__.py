"""Client for the tiercache cache-first LLM server (Triton model `ensemble`, gRPC streaming)."""

from .client import GenerationResult, TierCacheClient, build_inputs
from .errors import (
    CapacityError,
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
]
