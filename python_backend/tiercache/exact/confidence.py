"""Answer confidence (issue 19): how sure the engine was of an answer, and what a cache does
with an unsure one.

The measure is the answer's geometric-mean token probability, exp(mean token log-probability):
the engine reports the mean over every token it picked, the answer's end included, under the
model's own distribution at temperature 1 (tiercache.engine.torch_engine), and it is stored with
the cached entry (`CacheEntry.mean_logprob`). It is length-neutral (a mean, not a product) and
needs nothing but the logits the engine already computes. docs/feedback.md, "Confidence", has
the measurement that chose the floor.

An answer under the deployment's floor is *unsure*: it is still served to exact repeats of its
own request (it is the engine's answer to exactly that), but never to a rewording (a semantic
hit), and with `unsure_ttl_s` it is kept that long at most. An answer whose confidence is
unknown (a warmed one, TensorRT-LLM's, one stored before this release) is treated as sure: the
floor acts only on what was measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def confidence_of(mean_logprob: float | None) -> float | None:
    """exp(`mean_logprob`), in (0, 1]; None when unknown."""
    if mean_logprob is None or math.isnan(mean_logprob):
        return None
    return math.exp(min(mean_logprob, 0.0))


@dataclass(frozen=True, slots=True)
class ConfidencePolicy:
    """`floor`: the confidence under which an answer is unsure (0: none is); `unsure_ttl_s`:
    how long an unsure answer is kept at most (0: as long as any other)."""

    floor: float = 0.0
    unsure_ttl_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"a confidence floor is in [0, 1], got {self.floor}")
        if self.unsure_ttl_s < 0:
            raise ValueError(f"unsure_ttl_s must be >= 0, got {self.unsure_ttl_s}")

    def unsure(self, mean_logprob: float | None) -> bool:
        confidence = confidence_of(mean_logprob)
        return confidence is not None and confidence < self.floor

    def ttl_s(self, mean_logprob: float | None, default_ttl_s: float) -> float | None:
        """The TTL to store an answer with: None (the cache's default) unless it is unsure and
        `unsure_ttl_s` is set, then the shorter of the two (`default_ttl_s` 0: no expiry)."""
        if not self.unsure_ttl_s or not self.unsure(mean_logprob):
            return None
        if default_ttl_s > 0:
            return min(default_ttl_s, self.unsure_ttl_s)
        return self.unsure_ttl_s
