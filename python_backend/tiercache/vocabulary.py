"""The words every layer shares: cache statuses, tier names, invalidation kinds, engine kinds,
draft sources.

One definition each, so a stage, a metric label and a test never spell them differently. Each is
a `str` Enum: its members compare equal to their wire spelling (`CacheStatus.EXACT == "exact"`).
"""

from __future__ import annotations

from enum import Enum


class CacheStatus(str, Enum):
    """How a request was answered (the ensemble's `cache_status` output)."""

    EXACT = "exact"  # served from the exact cache
    MISS = "miss"  # looked up, not found: generated (and stored if allowed)
    BYPASS = "bypass"  # not looked up: `no-cache`, or a sampled request without a seed
    SEMANTIC = "semantic"  # served from the answer of a reworded request in the same scope
    # a semantic hit's answer the engine verified as its own output (`verify-semantic`): the
    # answer a fresh generation gives, found in one forward pass over prompt plus answer
    VERIFIED = "verified"


def is_hit(status: str) -> bool:
    """Whether a lookup status means a cached answer is served (no engine call)."""
    return status in (CacheStatus.EXACT, CacheStatus.SEMANTIC)


class Tier(str, Enum):
    """The exact cache's tiers, nearest first."""

    L1 = "l1"  # this process
    L2 = "l2"  # this host (LMDB)
    L3 = "l3"  # every replica (Redis)


class InvalidationKind(str, Enum):
    """What an invalidation matches (tiercache.exact.invalidation)."""

    KEY = "key"  # one exact-cache digest
    TAG = "tag"  # every entry stored with this cache_control tag
    TENANT = "tenant"  # every entry of a tenant scope (tiercache.exact.keys.tenant_scope)
    ADAPTER = "adapter"  # every entry generated with this adapter digest


class EngineKind(str, Enum):
    """The engine behind the llm stage (the stages' `engine_kind` parameter)."""

    TORCH_LLM = "torch_llm"  # canonical request in, text out (tiercache.engine.torch_engine)
    TENSORRT_LLM = "tensorrt_llm"  # Triton's TensorRT-LLM backend, token ids in and out


class DraftSource(str, Enum):
    """Where a speculative draft came from (tiercache.engine.drafts), all in the request's scope."""

    ANSWER = "answer"  # the same prompt's cached answer under other max_tokens or stop words
    NEIGHBOUR = "neighbour"  # a semantic neighbour's cached answer (refused by the guard too)
    INDEX = "index"  # the engine's recent answers in the scope
    CONTEXT = "context"  # the prompt and the tokens generated so far
    # a semantic hit's answer the engine verifies whole, in the prompt's prefill pass
    VERIFY = "verify"


# The sources llm hands the engine, as texts inside the sealed envelope (the others are the
# engine's own).
REQUEST_DRAFT_SOURCES = (
    DraftSource.ANSWER.value,
    DraftSource.NEIGHBOUR.value,
    DraftSource.VERIFY.value,
)


def choices(kind: type[Enum]) -> tuple[str, ...]:
    """The wire spellings of an Enum's members, in declaration order."""
    return tuple(str(member.value) for member in kind)
