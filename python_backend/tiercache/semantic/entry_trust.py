"""Per-entry acceptance learned online (issue 18, item 4; vCache's idea, our own model).

A semantic decision scores a candidate entry with a calibrated probability `s` that serving it is
right (the guard's score, or a verifier's). Entries differ: a short generic prompt attracts
wrong neighbours at scores where a specific one never does. Each entry's outcomes (a hit on it
that the engine verified or refuted, `bad` feedback) move its own correction `b`:

    P(right | s, entry) = sigmoid(logit(s) + b_entry),   b_entry ~ Normal(0, PRIOR_SD) a priori

The posterior over `b` is kept on a fixed grid (exact, no fitting loop; a few hundred floats of
work per decision). Scores that are off for a whole deployment (a guard calibrated on other
data than its traffic) are corrected through the tenant: the tenant's offset is learned the same
way from every outcome of its entries, and an entry's prior is that posterior spread by
ENTRY_SD (`entry_prior`), so an entry seen for the first time is judged by what its tenant's
other entries taught, uncertainty included, where an entry-only model would take the score at
its word. Per tenant, so that one tenant's verdicts never move what another is served. A small
share of the hits the gate would serve is verified anyway (`audit_rate`): a served hit teaches
nothing, and without audits a correction that became too kind would never be seen again.

A deployment states its maximum error rate `max_error`; an entry is served when its posterior
predictive P(right) is at least 1 - max_error, verified by the engine (exploration: the answer is
then exactly the engine's own, so exploring never serves a wrong answer) when it is close but not
there and the request can be verified, and missed otherwise. Verified and refuted outcomes of those
explorations are what tighten or loosen the entry, and so does feedback on a semantic hit (`good`:
right, `bad`: wrong).

Where it runs: `embedding_cache` decides with a `TrustGate` when a deployment sets
`semantic_max_error`; `llm` records every verification of a semantic hit it ran (whoever asked
for it), and `feedback` records verdicts on semantic hits, each answer id once. An entry's
outcomes are a side entry beside its answer (tiercache.semantic.side_entries: shared tiers,
every replica through L3, the answer's tenant and TTL), and so is the tenant's record (under a
key derived from the tenant scope); each is read and written whole: two outcomes recorded at the
same instant by two processes may keep only one (a lost observation, never a wrong one).
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from tiercache.exact.tiered import TieredCache
from tiercache.semantic.side_entries import read_side, side_key

log = logging.getLogger(__name__)

PRIOR_SD = 1.5  # logit units: a priori scores are right within about 4x odds
SLOPE_SD = 0.5  # a tenant's slope on the score's logit, a priori Normal(1, SLOPE_SD)
ENTRY_SD = 1.0  # how far one entry strays from its tenant's calibration, a priori
MAX_OBSERVATIONS = 64  # per entry, the most recent kept
TENANT_OBSERVATIONS = 256  # per tenant (its calibration, which every entry starts from)
AUDIT_RATE = 0.05  # of the hits a gate would serve, the share verified anyway (greedy ones)
# t: a candidate's log-odds of being right; the grid its posterior is kept on
T_GRID = np.linspace(-10.0, 14.0, 481)
_T_STEP = float(T_GRID[1] - T_GRID[0])
_T_EDGES = np.append(T_GRID - _T_STEP / 2, T_GRID[-1] + _T_STEP / 2)
_KERNEL = np.exp(-0.5 * (np.arange(-80, 81) * _T_STEP / ENTRY_SD) ** 2)  # +-4 ENTRY_SD
# a tenant's calibration t = slope * logit(s) + offset, its posterior on this grid
SLOPES = np.linspace(0.1, 2.0, 20)
OFFSETS = np.linspace(-6.0, 6.0, 61)
_LOG_CALIBRATION_PRIOR = (
    -0.5 * ((SLOPES[:, None] - 1.0) / SLOPE_SD) ** 2 - 0.5 * (OFFSETS[None, :] / PRIOR_SD) ** 2
)


class Decision(str, Enum):
    SERVE = "serve"  # predictive P(right) >= 1 - max_error
    VERIFY = "verify"  # close: let the engine check it (only offered when the request allows)
    MISS = "miss"


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1.0 - 1e-6)
    return math.log(p / (1.0 - p))


def _held(observations: Sequence[tuple[float, bool, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The observations' score logits and their signs (+1 right, -1 wrong)."""
    table = np.array([(s, r) for s, r, _ in observations], dtype=np.float64)
    p = np.clip(table[:, 0], 1e-6, 1.0 - 1e-6)
    return np.log(p / (1.0 - p)), np.where(table[:, 1] > 0, 1.0, -1.0)


def _log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


@dataclass
class EntryTrust:
    """One entry's outcomes, or a tenant's (`limit` TENANT_OBSERVATIONS): (score at which it
    was offered, whether serving it was right, a stamp naming the outcome's source, 0.0 for
    none: an answer id's issue time, so one id is counted once)."""

    observations: list[tuple[float, bool, float]] = field(default_factory=list)
    limit: int = MAX_OBSERVATIONS

    def observe(self, score: float, right: bool, stamp: float = 0.0) -> bool:
        """Add an outcome (the oldest is dropped past `limit`); False, adding nothing, when
        `stamp` is not 0.0 and an outcome with that stamp is already held."""
        if not 0.0 <= score <= 1.0 or math.isnan(score):
            raise ValueError(f"score must be a probability, got {score}")
        if stamp and any(seen == stamp for _, _, seen in self.observations):
            return False
        self.observations.append((float(score), bool(right), float(stamp)))
        del self.observations[: -self.limit]
        return True

    def p_right(self, score: float, calibration: Calibration | None = None) -> float:
        """Posterior predictive P(serving this entry at `score` is right): from its tenant's
        `calibration` (None: the score taken at its word, give or take PRIOR_SD), corrected
        by this entry's own outcomes."""
        cal = calibration or UNCALIBRATED
        at = _logit(score)
        log_post = cal.log_prior_at(at)
        if self.observations:
            logits, signs = _held(self.observations)
            z = T_GRID[None, :] + cal.slope * (logits[:, None] - at)
            log_post = log_post + _log_sigmoid(signs[:, None] * z).sum(axis=0)
        log_post = log_post - log_post.max()
        post = np.exp(log_post)
        return float(np.dot(post, np.exp(_log_sigmoid(T_GRID))) / post.sum())


class Calibration:
    """How one tenant's scores turn into P(right): t = slope * logit(s) + offset, its posterior
    over (slope, offset) from the outcomes of all the tenant's entries (a priori the score at
    its word: slope 1, offset 0). A guard calibrated on other data than the tenant's traffic is
    corrected here, so an entry seen for the first time is judged by what the tenant's other
    entries taught, uncertainty included."""

    def __init__(self, observations: Sequence[tuple[float, bool, float]] = ()) -> None:
        log_post = _LOG_CALIBRATION_PRIOR.copy()
        if observations:
            logits, signs = _held(observations)
            z = SLOPES[:, None, None] * logits + OFFSETS[None, :, None]
            log_post += _log_sigmoid(signs * z).sum(axis=2)
        post = np.exp(log_post - log_post.max())
        self.weights = post / post.sum()
        self.slope = float((self.weights.sum(axis=1) * SLOPES).sum())

    def log_prior_at(self, at: float) -> np.ndarray:
        """The log prior over T_GRID of a candidate at score logit `at`, for an entry of this
        tenant: the tenant's t at that score, spread by ENTRY_SD (the entry's own part)."""
        t = SLOPES[:, None] * at + OFFSETS[None, :]
        mass, _ = np.histogram(t.ravel(), bins=_T_EDGES, weights=self.weights.ravel())
        spread = np.convolve(mass, _KERNEL, mode="same")
        return np.log(np.maximum(spread / spread.sum(), 1e-300))


class _Uncalibrated(Calibration):
    """The score at its word, give or take PRIOR_SD: an entry-only model."""

    def __init__(self) -> None:
        self.slope = 1.0

    def log_prior_at(self, at: float) -> np.ndarray:
        return -0.5 * ((T_GRID - at) / PRIOR_SD) ** 2


UNCALIBRATED: Calibration = _Uncalibrated()


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """`max_error`: the error rate a deployment accepts on served semantic hits; `explore_band`:
    how far under 1 - max_error a candidate may be and still be verified rather than missed;
    `audit_rate`: the share of hits it would serve that are verified anyway when they can be
    (served hits teach nothing, so without audits a correction that drifts too kind is never
    seen again)."""

    max_error: float = 0.05
    explore_band: float = 0.25
    audit_rate: float = AUDIT_RATE

    def __post_init__(self) -> None:
        if not 0.0 < self.max_error < 1.0:
            raise ValueError(f"max_error must be in (0, 1), got {self.max_error}")
        if not 0.0 <= self.explore_band <= 1.0:
            raise ValueError(f"explore_band must be in [0, 1], got {self.explore_band}")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise ValueError(f"audit_rate must be in [0, 1], got {self.audit_rate}")

    def decide(
        self,
        trust: EntryTrust,
        score: float,
        can_verify: bool,
        calibration: Calibration | None = None,
        draw: float = 1.0,
    ) -> Decision:
        """`calibration`: the entry's tenant's; `draw` in [0, 1) picks the audits (a uniform
        random number; the default 1.0 audits nothing)."""
        p = trust.p_right(score, calibration)
        if p >= 1.0 - self.max_error:
            audit = can_verify and draw < self.audit_rate
            return Decision.VERIFY if audit else Decision.SERVE
        if can_verify and p >= 1.0 - self.max_error - self.explore_band:
            return Decision.VERIFY
        return Decision.MISS


class LocalTrust:
    """The gate's state held in one process, for offline replays: entries' records and one
    tenant's (`tenant_learning` False: entries' alone, every score taken as calibrated)."""

    def __init__(self, policy: TrustPolicy, tenant_learning: bool = True, seed: int = 0) -> None:
        self.policy = policy
        self.entries: dict[object, EntryTrust] = {}
        self.tenant = EntryTrust(limit=TENANT_OBSERVATIONS) if tenant_learning else None
        self.calibration = Calibration() if tenant_learning else UNCALIBRATED
        self._random = random.Random(seed)

    def decide(self, entry: object, score: float, can_verify: bool) -> Decision:
        trust = self.entries.get(entry) or EntryTrust()
        draw = self._random.random()
        return self.policy.decide(trust, score, can_verify, self.calibration, draw)

    def observe(self, entry: object, score: float, right: bool) -> None:
        self.entries.setdefault(entry, EntryTrust()).observe(score, right)
        if self.tenant is not None:
            self.tenant.observe(score, right)
            self.calibration = Calibration(self.tenant.observations)


def replay(
    policy: TrustPolicy,
    events: Iterable[tuple[str, float, bool]],
    can_verify: bool = True,
    tenant_learning: bool = True,
) -> dict[str, int]:
    """Run `policy` over a stream of (entry, score, whether serving it would be right), learning
    from every verification, and count what happened: served right, served wrong (the errors
    the bound is about), verified (right or refuted: never wrong for the caller), missed. For
    checking a policy offline against labelled data."""
    state = LocalTrust(policy, tenant_learning)
    counts = {"served_right": 0, "served_wrong": 0, "verified": 0, "refuted": 0, "missed": 0}
    for entry, score, right in events:
        decision = state.decide(entry, score, can_verify)
        if decision is Decision.SERVE:
            counts["served_right" if right else "served_wrong"] += 1
        elif decision is Decision.VERIFY:
            counts["verified" if right else "refuted"] += 1
            state.observe(entry, score, right)
        else:
            counts["missed"] += 1
    return counts


# -- kept beside the entry's answer ----------------------------------------------------------

_PURPOSE = b"tiercache semantic trust"
_PREFIX = "semantic-trust:"


_TENANT_PURPOSE = b"tiercache semantic trust of a tenant"


def trust_key(digest: str) -> str:
    """The cache key of `digest`'s outcomes."""
    return side_key(_PURPOSE, digest)


def tenant_trust_key(tenant_scope: str) -> str:
    """The cache key of the outcomes of every entry of `tenant_scope`."""
    return side_key(_TENANT_PURPOSE, tenant_scope)


def encode_trust(trust: EntryTrust) -> str:
    rows = [[round(s, 6), int(r), t] for s, r, t in trust.observations]
    return _PREFIX + json.dumps(rows, separators=(",", ":"))


def decode_trust(text: str, limit: int = MAX_OBSERVATIONS) -> EntryTrust:
    """The outcomes `encode_trust` wrote (at most `limit`); ValueError for anything else."""
    if not text.startswith(_PREFIX):
        raise ValueError("not a trust record")
    rows = json.loads(text[len(_PREFIX) :])
    if not isinstance(rows, list) or len(rows) > limit:
        raise ValueError(f"a trust record is a list of at most {limit} outcomes")
    try:
        table = np.array(rows, dtype=np.float64).reshape(len(rows), 3)
    except (TypeError, ValueError) as exc:
        raise ValueError("a trust outcome is [score, 0|1, stamp]") from exc
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for r in rows for x in r):
        raise ValueError("a trust outcome holds numbers only")
    scores, right = table[:, 0], table[:, 1]
    if not np.isfinite(table).all() or ((scores < 0) | (scores > 1)).any():
        raise ValueError("a trust outcome's score is in 0..1")
    if not np.isin(right, (0.0, 1.0)).all():
        raise ValueError("a trust outcome's verdict is 0 or 1")
    held = [(float(a), bool(b), float(c)) for a, b, c in table.tolist()]
    return EntryTrust(held, limit)


def read_trust(cache: TieredCache, digest: str, tenant_scope: str | None = None) -> EntryTrust:
    """`digest`'s outcomes from the shared tiers (`read_side`: another tenant's record is not
    read); none held, or one that does not parse (logged), is the prior alone."""
    return _read(cache, trust_key(digest), tenant_scope, MAX_OBSERVATIONS)


def read_tenant_trust(cache: TieredCache, tenant_scope: str) -> EntryTrust:
    """The outcomes of all of `tenant_scope`'s entries (the tenant's correction, `shift_of`)."""
    return _read(cache, tenant_trust_key(tenant_scope), tenant_scope, TENANT_OBSERVATIONS)


def _read(cache: TieredCache, key: str, tenant_scope: str | None, limit: int) -> EntryTrust:
    return _decode_or_prior(read_side(cache, key, tenant_scope) or "", key, limit)


def _decode_or_prior(text: str, key: str, limit: int) -> EntryTrust:
    """The record `text` holds; none ("") or one that does not parse (logged): no outcomes."""
    if not text:
        return EntryTrust(limit=limit)
    try:
        return decode_trust(text, limit)
    except (ValueError, TypeError):  # json errors are ValueErrors
        log.warning("ignoring a malformed trust record %s...", key[:12])
        return EntryTrust(limit=limit)


def record_outcome(
    cache: TieredCache,
    digest: str,
    score: float,
    right: bool,
    tenant_scope: str,
    stamp: float = 0.0,
) -> bool:
    """Add one outcome to `digest`'s record and to its tenant's, in every tier; False when
    `stamp` was counted already."""
    trust = read_trust(cache, digest, tenant_scope)
    if not trust.observe(score, right, stamp):
        return False
    cache.put(trust_key(digest), encode_trust(trust), tenant_scope=tenant_scope)
    tenant = read_tenant_trust(cache, tenant_scope)
    if tenant.observe(score, right, stamp):
        cache.put(tenant_trust_key(tenant_scope), encode_trust(tenant), tenant_scope=tenant_scope)
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
        # each tenant's calibration, by its record's text (decoded and computed once per change)
        self._calibrations: dict[str, Calibration] = {}

    def decide(
        self, digest: str, score: float, tenant_scope: str | None, can_verify: bool
    ) -> Decision:
        scope = tenant_scope or ""
        calibration = self.calibration(scope)
        trust = read_trust(self.cache, digest, scope)
        return self.policy.decide(trust, score, can_verify, calibration, random.random())

    def calibration(self, tenant_scope: str) -> Calibration:
        """`tenant_scope`'s calibration from its record as the shared tiers hold it now."""
        text = read_side(self.cache, tenant_trust_key(tenant_scope), tenant_scope) or ""
        found = self._calibrations.get(text)
        if found is None:
            trust = _decode_or_prior(text, tenant_trust_key(tenant_scope), TENANT_OBSERVATIONS)
            if len(self._calibrations) >= 256:  # tenants' records as they change: bounded
                self._calibrations.clear()
            found = self._calibrations[text] = Calibration(trust.observations)
        return found
