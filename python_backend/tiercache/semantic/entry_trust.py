"""Per-entry acceptance learned online (issue 18, item 4; vCache's idea, our own model).

A semantic decision scores a candidate entry with a calibrated probability `s` that serving it is
right (`SemanticGuard.calibrated`, or a verifier's score). Two things make `s` wrong: a guard
calibrated on other data than a tenant's traffic (every entry off the same way), and entries
that differ (a short generic prompt attracts wrong neighbours at scores where a specific one
never does). So the log-odds that serving an entry at score `s` is right is

    t = slope * logit(s) + offset + b_entry

with (slope, offset) the tenant's calibration (a priori Normal(1, SLOPE_SD) and Normal(0,
PRIOR_SD)), its posterior on a grid from the outcomes of the tenant's entries of the same
adapter and answer length class (`Calibration`, the last TENANT_OBSERVATIONS; `length_class`),
and b_entry the entry's own deviation (a priori Normal(0, ENTRY_SD)) from its outcomes (the last
MAX_OBSERVATIONS). An entry's prediction integrates the tenant's posterior at its score, spread
by ENTRY_SD, taken without the entry's own outcomes (`Calibration.excluding`), and then counts
those: an approximation of the joint posterior (the entry's outcomes at other scores are moved
by the tenant's mean slope), on grids, no fitting loop. Per tenant, so one tenant's verdicts
never move what another is served.

A deployment states its maximum error rate `max_error`; an entry is served when its predictive
P(right) is at least 1 - max_error, sent to the engine to verify (the answer is then exactly the
engine's own, so exploring never serves a wrong answer) when it is within `explore_band` of it
and the request can be verified, and missed otherwise. A share of the hits it would serve is
verified anyway (`audit_rate`): a served hit teaches nothing, and without audits a calibration
that became too kind would never be corrected. Outcomes: the engine's verifications (right when
its answer is exactly the cached one) and feedback on a gated semantic hit (`good` right, `bad`
wrong).

Where it runs: `embedding_cache` decides with a `TrustGate` when a deployment sets
`semantic_max_error`; `llm` records each verification of a gated hit, `feedback` each verdict on
one (of greedy requests only). Every outcome carries a stamp (a `verification_stamp` of what was
checked, a `feedback_stamp` of the answer a verdict is on, or, for an answer no longer held, the
answer id's issue time), so one check, or one verdict of each kind on an answer, counts once, on
every replica. An entry's outcomes and
its tenant's are side entries in the exact cache's shared tiers (tiercache.semantic.side_entries:
the answer's tenant and TTL; L2 and L3), read merged from both tiers and written back merged
with what each tier holds at that moment (`TieredCache.merge_side`: compared and written as one
step, so two processes or replicas recording at the same moment both keep their outcomes); an
outcome is dropped, never the record, when a shared tier cannot be read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from tiercache.exact.tiered import TieredCache
from tiercache.log_throttle import LogThrottle
from tiercache.semantic.side_entries import read_sides, side_key

log = logging.getLogger(__name__)
# records a damaged or planted state directory serves on every request: once a minute
_DAMAGE_LOG = LogThrottle()

PRIOR_SD = 1.5  # logit units: a priori scores are right within about 4x odds
SLOPE_SD = 0.5  # a tenant's slope on the score's logit, a priori Normal(1, SLOPE_SD)
ENTRY_SD = 1.0  # how far one entry strays from its tenant's calibration, a priori
MAX_OBSERVATIONS = 64  # per entry, the most recent kept
TENANT_OBSERVATIONS = 256  # per tenant (its calibration, which every entry starts from)
AUDIT_RATE = 0.05  # of the hits a gate would serve, the share verified anyway (greedy ones)
# Calibrations a gate keeps computed (one per tenant, adapter and answer-length class: a
# rebuild from 256 outcomes takes milliseconds), and the versions without an entry's own
# outcomes each keeps (`excluding`, least recently used out): about 20 KB each, so at most
# about 512 x 9 x 20 KB, 92 MB, where 1,024 x 257 came to 5.4 GB
MEMO_TENANTS = 512
MEMO_EXCLUDING = 8
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


def _log_likelihood(observations: Sequence[tuple[float, bool, float]]) -> np.ndarray:
    """The log-likelihood of `observations` over the calibration grid (SLOPES x OFFSETS)."""
    if not observations:
        return np.zeros((len(SLOPES), len(OFFSETS)))
    logits, signs = _held(observations)
    z = SLOPES[:, None, None] * logits + OFFSETS[None, :, None]
    return _log_sigmoid(signs * z).sum(axis=2)


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

    def merge(self, other: EntryTrust) -> None:
        """Add `other`'s stamped outcomes this record does not hold: what two tiers hold, one
        written by another replica (appended after this record's own, so which of them count
        as the most recent is approximate). Unstamped ones are not merged: they cannot be told
        apart from this record's own."""
        held = {stamp for _, _, stamp in self.observations if stamp}
        for score, right, stamp in other.observations:
            if stamp and stamp not in held:
                self.observations.append((score, right, stamp))
                held.add(stamp)
        del self.observations[: -self.limit]

    def p_right(
        self, score: float, calibration: Calibration | None = None, lower: float = 0.0
    ) -> float:
        """Posterior predictive P(serving this entry at `score` is right): from its tenant's
        `calibration` (None: the score taken at its word, give or take PRIOR_SD), corrected
        by this entry's own outcomes. `lower` in (0, 0.5): instead, the P(right) the entry
        reaches with posterior probability 1 - `lower` (its `lower` quantile: a credible
        bound; ValueError outside [0, 0.5))."""
        if not 0.0 <= lower < 0.5:  # NaN fails too
            raise ValueError(f"lower must be a quantile in [0, 0.5), got {lower}")
        cal = (calibration or UNCALIBRATED).excluding(self.observations)
        at = _logit(score)
        log_post = cal.log_prior_at(at)
        if self.observations:
            logits, signs = _held(self.observations)
            z = T_GRID[None, :] + cal.slope * (logits[:, None] - at)
            log_post = log_post + _log_sigmoid(signs[:, None] * z).sum(axis=0)
        log_post = log_post - log_post.max()
        post = np.exp(log_post)
        if lower > 0.0:
            cdf = np.cumsum(post) / post.sum()
            at_quantile = T_GRID[min(int(np.searchsorted(cdf, lower)), len(T_GRID) - 1)]
            return float(math.exp(float(_log_sigmoid(np.array(at_quantile)))))
        return float(np.dot(post, np.exp(_log_sigmoid(T_GRID))) / post.sum())


class Calibration:
    """How one tenant's scores turn into P(right): t = slope * logit(s) + offset, its posterior
    over (slope, offset) from the outcomes of all the tenant's entries (a priori the score at
    its word: slope 1, offset 0). A guard calibrated on other data than the tenant's traffic is
    corrected here, so an entry seen for the first time is judged by what the tenant's other
    entries taught, uncertainty included."""

    def __init__(
        self,
        observations: Sequence[tuple[float, bool, float]] = (),
        log_post: np.ndarray | None = None,
    ) -> None:
        if log_post is None:
            log_post = _LOG_CALIBRATION_PRIOR + _log_likelihood(observations)
        self._log_post = log_post
        self._stamps = frozenset(stamp for _, _, stamp in observations if stamp)
        # `excluding`'s, by stamps, least recently used first
        self._without: OrderedDict[frozenset[float], Calibration] = OrderedDict()
        post = np.exp(log_post - log_post.max())
        self.weights = post / post.sum()
        self.slope = float((self.weights.sum(axis=1) * SLOPES).sum())

    def excluding(self, observations: Sequence[tuple[float, bool, float]]) -> Calibration:
        """This calibration without the outcomes among `observations` it was learnt from (by
        stamp): an entry's prior must not count the entry's own outcomes, which its own
        posterior counts again."""
        own = [o for o in observations if o[2] and o[2] in self._stamps]
        if not own:
            return self
        key = frozenset(o[2] for o in own)
        found = self._without.get(key)
        if found is not None:
            self._without.move_to_end(key)
            return found
        # kept: an entry's next decisions reuse it until an outcome changes it
        found = Calibration(log_post=self._log_post - _log_likelihood(own))
        self._without[key] = found
        while len(self._without) > MEMO_EXCLUDING:
            self._without.popitem(last=False)
        return found

    def log_prior_at(self, at: float) -> np.ndarray:
        """The log prior over T_GRID of a candidate at score logit `at`, for an entry of this
        tenant: the tenant's t at that score (held to the grid's ends), spread by ENTRY_SD (the
        entry's own part)."""
        t = np.clip(SLOPES[:, None] * at + OFFSETS[None, :], T_GRID[0], T_GRID[-1])
        mass, _ = np.histogram(t.ravel(), bins=_T_EDGES, weights=self.weights.ravel())
        spread = np.convolve(mass, _KERNEL, mode="same")
        return np.log(np.maximum(spread / spread.sum(), 1e-300))


class _Uncalibrated(Calibration):
    """The score at its word, give or take PRIOR_SD: an entry-only model."""

    def __init__(self) -> None:
        self.slope = 1.0

    def excluding(self, observations: Sequence[tuple[float, bool, float]]) -> Calibration:
        return self

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
    # 0: serve on the predictive P(right); in (0, 0.5): on its `bound_quantile` quantile (a
    # credible bound: served only where the posterior is that sure of 1 - max_error); what
    # is verified is still chosen by the predictive P(right)
    bound_quantile: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.max_error < 1.0:
            raise ValueError(f"max_error must be in (0, 1), got {self.max_error}")
        if not 0.0 <= self.explore_band <= 1.0:
            raise ValueError(f"explore_band must be in [0, 1], got {self.explore_band}")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise ValueError(f"audit_rate must be in [0, 1], got {self.audit_rate}")
        if not 0.0 <= self.bound_quantile < 0.5:
            raise ValueError(f"bound_quantile must be in [0, 0.5), got {self.bound_quantile}")

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
        sure = (
            p if not self.bound_quantile else trust.p_right(score, calibration, self.bound_quantile)
        )
        if sure >= 1.0 - self.max_error:
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
        self._stamp = 0.0  # each outcome its own stamp, as serving's are

    def decide(self, entry: object, score: float, can_verify: bool) -> Decision:
        trust = self.entries.get(entry) or EntryTrust()
        draw = self._random.random()
        return self.policy.decide(trust, score, can_verify, self.calibration, draw)

    def observe(self, entry: object, score: float, right: bool) -> None:
        self._stamp += 1.0
        self.entries.setdefault(entry, EntryTrust()).observe(score, right, self._stamp)
        if self.tenant is not None:
            self.tenant.observe(score, right, self._stamp)
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


_TENANT_PURPOSE = b"tiercache semantic trust of a tenant, by answer length"
# the tenant's record before it was kept by answer length (read while a class has none of its
# own: an upgrade does not start every tenant over from the prior)
_POOLED_PURPOSE = b"tiercache semantic trust of a tenant"
_FEEDBACK_PURPOSE = b"tiercache semantic trust, one verdict of each kind per answer"
LENGTH_CLASSES = 7


def trust_key(digest: str) -> str:
    """The cache key of `digest`'s outcomes."""
    return side_key(_PURPOSE, digest)


def length_class(answer: str) -> int:
    """The class of a cached answer's length whose outcomes calibrate each other: its UTF-8
    bytes in powers of 4 (0: under 4 bytes, 1: under 16, ..., 6: 4,096 and more). How often
    an engine's answer is exactly the cached one depends on its length above all (a one-token
    answer nearly always; a long one rarely): pooled, a tenant's short answers, verified by
    the hundred at max_tokens 1, calibrated its long ones to be served unverified."""
    size = max(len(answer.encode("utf-8")), 1)
    return min((size.bit_length() - 1) // 2, LENGTH_CLASSES - 1)


def tenant_trust_key(tenant_scope: str, adapter: str = "", answer_class: int = 0) -> str:
    """The cache key of the outcomes of every entry of `tenant_scope` and `adapter` (its
    digest; "" for the base model) whose answer is of `answer_class` (`length_class`): a key
    limited to one adapter teaches the calibration of that adapter's entries alone, never its
    tenant's others, and an answer length teaches its own."""
    if not 0 <= answer_class < LENGTH_CLASSES:
        raise ValueError(f"an answer length class is in 0..{LENGTH_CLASSES - 1}")
    return side_key(_TENANT_PURPOSE, "\x00".join((tenant_scope, adapter, str(answer_class))))


def pooled_trust_key(tenant_scope: str, adapter: str = "") -> str:
    """The key of a tenant's (and adapter's) record as versions before the answer length
    classes kept it: all lengths together."""
    return side_key(_POOLED_PURPOSE, tenant_scope + ("\x00" + adapter if adapter else ""))


def feedback_stamp(entry_digest: str, created_s: float, right: bool) -> float:
    """The stamp of a `good` (`right`) or `bad` verdict on the answer `entry_digest` holds,
    made at `created_s`: the same for every verdict of that kind on that answer, so each
    answer counts one of each (stamped by the answer id, which each semantic hit issues
    afresh, asking again and saying `good` each time added an outcome each time): a whole
    number in [2**49, 2**50), never a verification's stamp nor an answer id's issue time."""
    material = "\x00".join((entry_digest, repr(float(created_s)), "good" if right else "bad"))
    digest = side_key(_FEEDBACK_PURPOSE, material)
    return float(int(digest[:12], 16) | 1 << 49)


def encode_trust(trust: EntryTrust) -> str:
    rows = [[round(s, 6), int(r), t] for s, r, t in trust.observations]
    return _PREFIX + json.dumps(rows, separators=(",", ":"))


MAX_RECORD_CHARS = 64 << 10  # far above a full record's text: a longer one is refused unread


def decode_trust(text: str, limit: int = MAX_OBSERVATIONS) -> EntryTrust:
    """The outcomes `encode_trust` wrote (at most `limit`); ValueError for anything else."""
    if not text.startswith(_PREFIX) or len(text) > MAX_RECORD_CHARS:
        raise ValueError("not a trust record")
    try:
        rows = json.loads(text[len(_PREFIX) :])
    except RecursionError as exc:
        raise ValueError("a trust record nests too deep") from exc
    if not isinstance(rows, list) or len(rows) > limit:
        raise ValueError(f"a trust record is a list of at most {limit} outcomes")
    try:
        table = np.array(rows, dtype=np.float64).reshape(len(rows), 3)
    except (TypeError, ValueError, OverflowError) as exc:
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
    """`digest`'s outcomes as the shared tiers hold them, merged (`read_sides`: another
    tenant's record is not read); none held, or one that does not parse (logged), adds
    nothing."""
    return _read(cache, trust_key(digest), tenant_scope, MAX_OBSERVATIONS)[0]


def read_tenant_trust(
    cache: TieredCache, tenant_scope: str, adapter: str = "", answer_class: int = 0
) -> EntryTrust:
    """The outcomes of all of `tenant_scope`'s entries of `adapter` whose answers are of
    `answer_class` (their `Calibration`)."""
    key = tenant_trust_key(tenant_scope, adapter, answer_class)
    return _read(cache, key, tenant_scope, TENANT_OBSERVATIONS)[0]


def _read(
    cache: TieredCache, key: str, tenant_scope: str | None, limit: int
) -> tuple[EntryTrust, bool, bool]:
    """The record under `key` merged from every shared tier, whether every tier could be read
    (`read_sides`), and whether every record it found parsed (one that did not is left out:
    a decision must take it as unknown and fail closed, a new outcome may replace it)."""
    texts, complete = read_sides(cache, key, tenant_scope)
    trust = EntryTrust(limit=limit)
    parsed = True
    for text in texts:
        decoded = _decoded(text, key, limit)
        if decoded is None:
            parsed = False
            continue
        trust.merge(decoded)
    return trust, complete, parsed


def _decoded(text: str, key: str, limit: int) -> EntryTrust | None:
    """The record `text` holds; None (logged) for one that does not parse."""
    try:
        return decode_trust(text, limit)
    except (ValueError, TypeError):  # json's errors are ValueErrors
        if _DAMAGE_LOG.ready():
            log.warning(
                "a malformed trust record %s...: taken as unknown (%d such lines not logged)",
                key[:12],
                _DAMAGE_LOG.suppressed,
            )
        return None


def verification_stamp(request_digest: str, entry_digest: str, answer: str) -> float:
    """The stamp of an engine's verification of `entry_digest`'s `answer` for the request
    `request_digest`: the same for every request that shares the check (a coalesced flight's
    followers, a replayed sealed answer, the same request on another replica), since its
    outcome is the same, so it is counted once: a whole number in [2**48, 2**49), never an
    answer id's issue time (unix seconds, far below 2**48)."""
    material = "\x00".join((request_digest, entry_digest, answer)).encode("utf-8")
    return float(int.from_bytes(hashlib.sha256(material).digest()[:6], "big") | 1 << 48)


# one outcome at a time per tenant in a process (its record is read, changed and written back)
_RECORDING = tuple(threading.Lock() for _ in range(16))


def record_outcome(
    cache: TieredCache,
    digest: str,
    score: float,
    right: bool,
    tenant_scope: str,
    stamp: float,
    adapter: str | None = "",
    answer_class: int = 0,
) -> bool:
    """Add one outcome (`stamp`: a `feedback_stamp`, an answer id's issue time, or a
    `verification_stamp`) to `digest`'s record and to its tenant's for `adapter` (the entry's
    adapter digest, "" for the base model; None, not known: the entry's record alone) and
    `answer_class` (the `length_class` of the entry's answer), merged from the shared tiers
    and written to every
    tier. False, writing nothing, when `stamp` was counted already, or when a shared tier could
    not be read (writing the rest back would overwrite what it holds: the outcome is lost
    instead, never the record). Two processes or replicas recording at the same moment both
    keep their outcomes: each tier merges what it holds as it is written (`_merge_into`)."""
    if not stamp:
        raise ValueError("an outcome needs a stamp (a verification's, or an answer id's)")
    lock = _RECORDING[int(hashlib.sha256(tenant_scope.encode("utf-8")).digest()[0]) % 16]
    with lock:
        created_s = cache.now()  # before the read: an invalidation since covers what it read
        # a record that did not parse is replaced by what is written now (it held nothing
        # readable); a tier that could not be read is not overwritten
        trust, complete, _ = _read(cache, trust_key(digest), tenant_scope, MAX_OBSERVATIONS)
        tenant_key = tenant_trust_key(tenant_scope, adapter or "", answer_class)
        tenant, tenant_complete, _ = _read(cache, tenant_key, tenant_scope, TENANT_OBSERVATIONS)
        if not (complete and tenant_complete):
            log.warning(
                "an outcome for %s... not recorded: a shared tier is unreadable", digest[:12]
            )
            return False
        if not trust.observe(score, right, stamp):
            return False
        _merge_into(cache, trust_key(digest), trust, tenant_scope, created_s)
        if adapter is not None and tenant.observe(score, right, stamp):
            _merge_into(cache, tenant_key, tenant, tenant_scope, created_s)
        return True


def _merge_into(
    cache: TieredCache, key: str, trust: EntryTrust, tenant_scope: str, created_s: float
) -> None:
    """Write `trust` (what was read, with the new outcome) into each shared tier merged with
    what that tier holds at the moment of writing (`TieredCache.merge_side`: another process's
    or replica's outcome recorded since the read is kept, not overwritten)."""

    def merged(held: str | None) -> str:
        record = EntryTrust(list(trust.observations), trust.limit)
        if held is not None:
            found = _decoded(held, key, trust.limit)
            if found is not None:  # one that does not parse is replaced
                found.merge(record)  # the tier's own first: the new outcome stays the latest
                record = found
        return encode_trust(record)

    cache.merge_side(key, merged, tenant_scope, created_s)


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
        # each tenant's calibration with its record's text, the most recently used last
        self._calibrations: OrderedDict[str, tuple[str, tuple[Calibration, bool]]] = OrderedDict()
        self._memo_lock = threading.Lock()

    def decide(
        self,
        digest: str,
        score: float,
        tenant_scope: str | None,
        can_verify: bool,
        adapter: str = "",
        answer_class: int = 0,
    ) -> Decision:
        """`adapter`: the entry's adapter digest ("" for the base model) and `answer_class`
        its answer's `length_class`, whose calibration within the tenant applies."""
        scope = tenant_scope or ""
        calibration, calibrated = self.calibration_checked(scope, adapter, answer_class)
        trust, complete, parsed = _read(self.cache, trust_key(digest), scope, MAX_OBSERVATIONS)
        if not (calibrated and complete and parsed):
            # A shared tier could not be read (Redis down), or a record did not parse:
            # refutations recorded there are unknown, and the prior alone would serve.
            # Failing closed.
            return Decision.VERIFY if can_verify else Decision.MISS
        return self.policy.decide(trust, score, can_verify, calibration, random.random())

    def calibration(
        self, tenant_scope: str, adapter: str = "", answer_class: int = 0
    ) -> Calibration:
        """`tenant_scope`'s calibration for `adapter`'s entries of `answer_class` from its
        record as the shared tiers hold it now (recomputed only when the record changed)."""
        return self.calibration_checked(tenant_scope, adapter, answer_class)[0]

    def calibration_checked(
        self, tenant_scope: str, adapter: str = "", answer_class: int = 0
    ) -> tuple[Calibration, bool]:
        """`calibration`, and whether every shared tier could be read (`read_sides`) and every
        record found parsed (False otherwise: a decision fails closed)."""
        key = tenant_trust_key(tenant_scope, adapter, answer_class)
        texts, complete = read_sides(self.cache, key, tenant_scope)
        pooled = False
        if not texts and complete:
            # none for this class yet: the tenant's record from before the classes, if any,
            # read only and its refutations alone (what the tenant was judged by until the
            # upgrade can make this class stricter, never kinder: its verifications may be of
            # short answers by the hundred, which made long ones look safe); new outcomes go
            # to the class's own record, which replaces it once it has one
            texts, complete = read_sides(
                self.cache, pooled_trust_key(tenant_scope, adapter), tenant_scope
            )
            pooled = bool(texts)
        text = ("pooled\x00" if pooled else "") + "\x00".join(texts)
        with self._memo_lock:
            memo = self._calibrations.get(key)
            if memo is not None and memo[0] == text:
                self._calibrations.move_to_end(key)
                return memo[1][0], complete and memo[1][1]
        trust = EntryTrust(limit=TENANT_OBSERVATIONS)
        parsed = True
        for one in texts:
            decoded = _decoded(one, key, TENANT_OBSERVATIONS)
            if decoded is None:
                parsed = False
                continue
            trust.merge(decoded)
        observations = trust.observations
        if pooled:
            observations = [o for o in observations if not o[1]]
        found = Calibration(observations)
        with self._memo_lock:
            self._calibrations[key] = (text, (found, parsed))
            self._calibrations.move_to_end(key)
            while len(self._calibrations) > MEMO_TENANTS:
                self._calibrations.popitem(last=False)
        return found, complete and parsed
