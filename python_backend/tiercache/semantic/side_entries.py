"""Small records kept beside an answer in the exact cache's own tiers, under a key derived from
the answer's digest: a similarity floor (tiercache.semantic.penalties), an entry's trust
(tiercache.semantic.entry_trust). So they reach every replica through L3 as answers do, are
signed there like every L3 value, survive a restart in L2, belong to the answer's tenant (a
tenant invalidation drops them with its answers), age out with the cache's TTL, and outlive the
answer itself (another key).

Read from the shared tiers only (L2, then L3), never from a process's L1, whose copy would not
see a record changed since by another process or replica.
"""

from __future__ import annotations

import hashlib

from tiercache.exact.tiered import TieredCache
from tiercache.vocabulary import Tier


def side_key(purpose: bytes, name: str) -> str:
    """The cache key of the record for `purpose` of `name` (an answer's digest, a tenant scope):
    hex SHA-256, like an answer's digest, and never one: its input is labelled by the
    purpose."""
    return hashlib.sha256(purpose + b"\x00" + name.encode("utf-8")).hexdigest()


def read_side(cache: TieredCache, key: str, tenant_scope: str | None = None) -> str | None:
    """The text stored under `key` in the shared tiers; None when none is, when it expired, or
    when it belongs to another tenant scope than `tenant_scope` (when given)."""
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
    return entry.text
