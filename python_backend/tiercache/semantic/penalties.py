"""Similarity floors per answer, raised by `bad` feedback on a semantic hit (issue 19).

When a caller says an answer served as a semantic hit was wrong, the neighbour whose answer it
was needs a higher similarity to be served to a rewording again. The floor is a side entry
beside the answer (tiercache.semantic.side_entries: shared tiers, every replica, the answer's
tenant and TTL). It outlives the answer itself: bad feedback also invalidates the answer, and
when its own prompt generates it again, the rewording that was answered wrongly still needs
more than the similarity it was served at.

The floor is on the embedding's cosine similarity (the score every candidate has, whatever
chooses among them): the served similarity plus `MARGIN`, never lowered. The per-entry trust
model (tiercache.semantic.entry_trust, when a deployment sets `semantic_max_error`) learns a
calibrated correction from the same verdicts as well; this plain rule holds either way.
"""

from __future__ import annotations

import logging
import math

from tiercache.exact.tiered import TieredCache
from tiercache.log_throttle import LogThrottle
from tiercache.semantic.side_entries import read_sides, side_key

log = logging.getLogger(__name__)
# records a damaged or planted state directory serves on every request: once a minute
_DAMAGE_LOG = LogThrottle()

MARGIN = 0.01  # above the similarity a wrong hit was served at
_PURPOSE = b"tiercache semantic floor"
_PREFIX = "semantic-floor:"


def floor_key(digest: str) -> str:
    """The cache key of `digest`'s similarity floor."""
    return side_key(_PURPOSE, digest)


def read_floor(cache: TieredCache, digest: str, tenant_scope: str | None = None) -> float | None:
    """The similarity a rewording needs to be served `digest`'s answer: the highest floor the
    shared tiers hold (`read_sides`: another tenant's, an expired or invalidated one left out);
    None when none was set. One that does not parse is left out here (logged);
    `read_floor_checked` says it was not known."""
    return read_floor_checked(cache, digest, tenant_scope)[0]


def read_floor_checked(
    cache: TieredCache, digest: str, tenant_scope: str | None = None
) -> tuple[float | None, bool]:
    """`read_floor`, and whether every shared tier could be read: False (Redis down) means a
    floor held only there is not known, and a hit must not be served on its absence. A floor
    that does not parse is not known either (False: failing closed, as for an unread tier)."""
    texts, complete = read_sides(cache, floor_key(digest), tenant_scope)
    floors = []
    for text in texts:
        try:
            if not text.startswith(_PREFIX):
                raise ValueError(text[:40])
            value = float(text[len(_PREFIX) :])
            if math.isnan(value):
                raise ValueError("nan")
        except ValueError:
            if _DAMAGE_LOG.ready():
                log.warning(
                    "a malformed similarity floor for %s...: taken as unknown, no hit served "
                    "on its answer (%d such lines not logged)",
                    digest[:12],
                    _DAMAGE_LOG.suppressed,
                )
            complete = False
            continue
        floors.append(value)
    return max(floors, default=None), complete


def raise_floor(cache: TieredCache, digest: str, served_at: float, tenant_scope: str) -> float:
    """Raise `digest`'s floor above `served_at` (by MARGIN; never lowered); the floor now. Each
    shared tier keeps the higher of what it holds and the new floor, compared and written as
    one step (`TieredCache.merge_side`): two replicas raising it at once keep the higher, where
    a read, then a write, could leave the lower one in Redis. Every shared tier is offered the
    highest floor known (this one, or a higher one a tier holds), even when a tier already
    holds it: one that was down when that floor was raised would otherwise never get it (a
    tier as high as that needs no write)."""
    current = read_floor(cache, digest, tenant_scope)
    floor = round(served_at + MARGIN, 6)
    if current is not None and current > floor:
        floor = current

    def higher(held: str | None) -> str | None:
        value = None if held is None else _parsed(held)
        return None if value is not None and value >= floor else f"{_PREFIX}{floor!r}"

    cache.merge_side(floor_key(digest), higher, tenant_scope)
    return floor


def _parsed(text: str) -> float | None:
    """The floor `text` holds; None for one that does not parse (replaced by a new one)."""
    try:
        value = float(text[len(_PREFIX) :]) if text.startswith(_PREFIX) else math.nan
    except ValueError:
        return None
    return None if math.isnan(value) else value
