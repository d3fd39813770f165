"""Similarity floors per answer, raised by `bad` feedback on a semantic hit (issue 19).

When a caller says an answer served as a semantic hit was wrong, the neighbour whose answer it
was needs a higher similarity to be served to a rewording again. The floor is kept in the exact
cache's own tiers, as a small entry under a key derived from the answer's digest: so it reaches
every replica through L3 as answers do, is signed there like every L3 value, survives a restart
in L2, belongs to the answer's tenant (a tenant invalidation drops it with the tenant's answers)
and ages out with the cache's TTL. It outlives the answer itself: bad feedback also invalidates
the answer, and when its own prompt generates it again, the rewording that was answered wrongly
still needs more than the similarity it was served at.

The floor is on the embedding's cosine similarity (the score every candidate has, whatever
chooses among them): the served similarity plus `MARGIN`, never lowered. The per-entry trust
model of issue 18 (tiercache.semantic.entry_trust) would learn a calibrated correction instead;
this is the plain rule until it is wired.
"""

from __future__ import annotations

import hashlib
import logging
import math

from tiercache.exact.tiered import TieredCache
from tiercache.vocabulary import Tier

log = logging.getLogger(__name__)

MARGIN = 0.01  # above the similarity a wrong hit was served at
_PURPOSE = b"tiercache semantic floor\x00"
_PREFIX = "semantic-floor:"


def floor_key(digest: str) -> str:
    """The cache key of `digest`'s similarity floor (hex SHA-256, like an answer's digest, and
    never one: its input is labelled)."""
    return hashlib.sha256(_PURPOSE + digest.encode("ascii")).hexdigest()


def read_floor(cache: TieredCache, digest: str, tenant_scope: str | None = None) -> float | None:
    """The similarity a rewording needs to be served `digest`'s answer, None when none was
    set. Read from the shared tiers (L2, then L3), never from a process's L1, whose copy would
    not see a floor raised since. A floor stored under another tenant scope than `tenant_scope`
    (when given), an expired one, and one that does not parse (logged) are ignored."""
    key = floor_key(digest)
    entry = None
    for tier, store in cache.stores():
        if tier is Tier.L1:
            continue
        entry = store.get(key)
        if entry is not None:
            break
    if entry is None or entry.expired(cache.now()):
        return None
    if tenant_scope is not None and entry.tenant_scope not in ("", tenant_scope):
        return None
    text = entry.text
    try:
        if not text.startswith(_PREFIX):
            raise ValueError(text[:40])
        value = float(text[len(_PREFIX) :])
        if math.isnan(value):
            raise ValueError("nan")
    except ValueError:
        log.warning("ignoring a malformed similarity floor for %s...", digest[:12])
        return None
    return value


def raise_floor(cache: TieredCache, digest: str, served_at: float, tenant_scope: str) -> float:
    """Raise `digest`'s floor above `served_at` (by MARGIN; never lowered); the floor now."""
    current = read_floor(cache, digest, tenant_scope)
    floor = round(served_at + MARGIN, 6)
    if current is not None and current >= floor:
        return current
    cache.put(floor_key(digest), f"{_PREFIX}{floor!r}", tenant_scope=tenant_scope)
    return floor
