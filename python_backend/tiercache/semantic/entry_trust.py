"""Per-entry acceptance learned online (issue 18, item 4; vCache's idea, our own model): the
decision core. Not wired into the stages yet (docs/semantic_guard.md says what is left).

A semantic decision scores a candidate entry with a calibrated probability `s` that serving it is
right (the guard's score, or a verifier's). Entries differ: a short generic prompt attracts
wrong neighbours at scores where a specific one never does. Each entry's outcomes (a hit on it
that the engine verified or refuted, `bad` feedback) move its own correction `b`:

    P(right | s, entry) = sigmoid(logit(s) + b_entry),   b_entry ~ Normal(0, PRIOR_SD) a priori

The posterior over `b` is kept on a fixed grid (exact, no fitting loop; a few hundred floats of
work per decision). A deployment states its maximum error rate `max_error`; an entry is served
when its posterior predictive P(right) is at least 1 - max_error, verified by the engine
(exploration: the answer is then exactly the engine's own, so exploring never serves a wrong
answer) when it is close but not there and the request can be verified, and missed otherwise.
Verified and refuted outcomes of those explorations are what tighten or loosen the entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

PRIOR_SD = 1.5  # logit units: a priori an entry's scores are right within about 4x odds
GRID = np.linspace(-6.0, 6.0, 241)  # the offsets b considered (logit units)
MAX_OBSERVATIONS = 64  # per entry, the most recent kept
_LOG_PRIOR = -0.5 * (GRID / PRIOR_SD) ** 2


class Decision(str, Enum):
    SERVE = "serve"  # predictive P(right) >= 1 - max_error
    VERIFY = "verify"  # close: let the engine check it (only offered when the request allows)
    MISS = "miss"


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1.0 - 1e-6)
    return math.log(p / (1.0 - p))


def _log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


@dataclass
class EntryTrust:
    """One entry's outcomes: (score at which it was offered, whether serving it was right)."""

    observations: list[tuple[float, bool]] = field(default_factory=list)

    def observe(self, score: float, right: bool) -> None:
        if not 0.0 <= score <= 1.0 or math.isnan(score):
            raise ValueError(f"score must be a probability, got {score}")
        self.observations.append((float(score), bool(right)))
        del self.observations[:-MAX_OBSERVATIONS]

    def posterior(self) -> np.ndarray:
        """P(b) over GRID given the observations (sums to 1)."""
        log_post = _LOG_PRIOR.copy()
        for score, right in self.observations:
            z = _logit(score) + GRID
            log_post += _log_sigmoid(z) if right else _log_sigmoid(-z)
        log_post -= log_post.max()
        post = np.exp(log_post)
        return post / post.sum()

    def p_right(self, score: float) -> float:
        """Posterior predictive P(serving this entry at `score` is right)."""
        z = _logit(score) + GRID
        return float(np.dot(self.posterior(), np.exp(_log_sigmoid(z))))


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """`max_error`: the error rate a deployment accepts on served semantic hits; `explore_band`:
    how far under 1 - max_error a candidate may be and still be verified rather than missed."""

    max_error: float = 0.05
    explore_band: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 < self.max_error < 1.0:
            raise ValueError(f"max_error must be in (0, 1), got {self.max_error}")
        if not 0.0 <= self.explore_band <= 1.0:
            raise ValueError(f"explore_band must be in [0, 1], got {self.explore_band}")

    def decide(self, trust: EntryTrust, score: float, can_verify: bool) -> Decision:
        p = trust.p_right(score)
        if p >= 1.0 - self.max_error:
            return Decision.SERVE
        if can_verify and p >= 1.0 - self.max_error - self.explore_band:
            return Decision.VERIFY
        return Decision.MISS


def replay(
    policy: TrustPolicy,
    events: Iterable[tuple[str, float, bool]],
    can_verify: bool = True,
) -> dict[str, int]:
    """Run `policy` over a stream of (entry, score, whether serving it would be right), learning
    from every verification, and count what happened: served right, served wrong (the errors
    the bound is about), verified (right or refuted: never wrong for the caller), missed. For
    checking a policy offline against labelled data."""
    trusts: dict[str, EntryTrust] = {}
    counts = {"served_right": 0, "served_wrong": 0, "verified": 0, "refuted": 0, "missed": 0}
    for entry, score, right in events:
        trust = trusts.setdefault(entry, EntryTrust())
        decision = policy.decide(trust, score, can_verify)
        if decision is Decision.SERVE:
            counts["served_right" if right else "served_wrong"] += 1
        elif decision is Decision.VERIFY:
            counts["verified" if right else "refuted"] += 1
            trust.observe(score, right)
        else:
            counts["missed"] += 1
    return counts
