"""Per-entry acceptance learned online (issue 18, item 4; vCache's idea, our own model).

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
Verified and refuted outcomes of those explorations are what tighten or loosen the entry, and
so does feedback on a semantic hit (`good`: right, `bad`: wrong).

Where it runs: `embedding_cache` decides with a `TrustGate` when a deployment sets
`semantic_max_error`; `llm` records every verification of a semantic hit it ran (whoever asked
for it), and `feedback` records verdicts on semantic hits, each answer id once. An entry's
outcomes are a side entry beside its answer (tiercache.semantic.side_entries: shared tiers,
every replica through L3, the answer's tenant and TTL), read and written whole: two outcomes
recorded at the same instant by two processes may keep only one (a lost observation, never a
wrong one).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from tiercache.exact.tiered import TieredCache
from tiercache.semantic.side_entries import read_side, side_key

log = logging.getLogger(__name__)

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
    """One entry's outcomes: (score at which it was offered, whether serving it was right, a
    stamp naming the outcome's source, 0.0 for none: an answer id's issue time, so one id is
    counted once)."""

    observations: list[tuple[float, bool, float]] = field(default_factory=list)

    def observe(self, score: float, right: bool, stamp: float = 0.0) -> bool:
        """Add an outcome (the oldest is dropped past MAX_OBSERVATIONS); False, adding nothing,
        when `stamp` is not 0.0 and an outcome with that stamp is already held."""
        if not 0.0 <= score <= 1.0 or math.isnan(score):
            raise ValueError(f"score must be a probability, got {score}")
        if stamp and any(seen == stamp for _, _, seen in self.observations):
            return False
        self.observations.append((float(score), bool(right), float(stamp)))
        del self.observations[:-MAX_OBSERVATIONS]
        return True

    def posterior(self) -> np.ndarray:
        """P(b) over GRID given the observations (sums to 1)."""
        log_post = _LOG_PRIOR.copy()
        for score, right, _ in self.observations:
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


# -- kept beside the entry's answer ----------------------------------------------------------

_PURPOSE = b"tiercache semantic trust"
_PREFIX = "semantic-trust:"


def trust_key(digest: str) -> str:
    """The cache key of `digest`'s outcomes."""
    return side_key(_PURPOSE, digest)


def encode_trust(trust: EntryTrust) -> str:
    rows = [[round(s, 6), int(r), t] for s, r, t in trust.observations]
    return _PREFIX + json.dumps(rows, separators=(",", ":"))


def decode_trust(text: str) -> EntryTrust:
    """The outcomes `encode_trust` wrote; ValueError for anything else."""
    if not text.startswith(_PREFIX):
        raise ValueError("not a trust record")
    rows = json.loads(text[len(_PREFIX) :])
    if not isinstance(rows, list) or len(rows) > MAX_OBSERVATIONS:
        raise ValueError("a trust record is a list of at most MAX_OBSERVATIONS outcomes")
    trust = EntryTrust()
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != 3
            or row[1] not in (0, 1)
            or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in row)
        ):
            raise ValueError(f"a trust outcome is [score, 0|1, stamp], got {row!r}"[:120])
        trust.observe(float(row[0]), bool(row[1]), float(row[2]))
    return trust


def read_trust(cache: TieredCache, digest: str, tenant_scope: str | None = None) -> EntryTrust:
    """`digest`'s outcomes from the shared tiers (`read_side`: another tenant's record is not
    read); none held, or one that does not parse (logged), is the prior alone."""
    text = read_side(cache, trust_key(digest), tenant_scope)
    if text is None:
        return EntryTrust()
    try:
        return decode_trust(text)
    except (ValueError, TypeError):  # json errors are ValueErrors
        log.warning("ignoring a malformed trust record for %s...", digest[:12])
        return EntryTrust()


def record_outcome(
    cache: TieredCache,
    digest: str,
    score: float,
    right: bool,
    tenant_scope: str,
    stamp: float = 0.0,
) -> bool:
    """Add one outcome to `digest`'s record in every tier; False when `stamp` was counted."""
    trust = read_trust(cache, digest, tenant_scope)
    if not trust.observe(score, right, stamp):
        return False
    cache.put(trust_key(digest), encode_trust(trust), tenant_scope=tenant_scope)
    return True


# (query, candidate text, cosine) -> the calibrated P(serving it is right) that chose it
ScoreFn = Callable[[str, str, float], float]


class TrustGate:
    """embedding_cache's per-entry decision over the answers' tiers for a chosen candidate;
    `score` gives that candidate's calibrated score (the guard's, or the verifier's when one
    chooses)."""

    def __init__(self, cache: TieredCache, policy: TrustPolicy, score: ScoreFn) -> None:
        self.cache = cache
        self.policy = policy
        self.score = score

    def decide(
        self, digest: str, score: float, tenant_scope: str | None, can_verify: bool
    ) -> Decision:
        return self.policy.decide(read_trust(self.cache, digest, tenant_scope), score, can_verify)
