"""Small records kept beside an answer in the exact cache's own tiers, under a key derived from
the answer's digest: a similarity floor (tiercache.semantic.penalties), an entry's trust
(tiercache.semantic.entry_trust). So they reach every replica through L3 as answers do, are
signed there like every L3 value, survive a restart in L2, belong to the answer's tenant (a
tenant invalidation drops them with its answers), age out with the cache's TTL, and outlive the
answer itself (another key).

Read from every shared tier (L2 and L3), never from a process's L1, whose copy would not see a
record changed since by another process or replica; a reader combines what the tiers hold (the
highest floor; the union of outcomes), since a host's L2 does not see what another replica
wrote to L3.
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


def read_sides(
    cache: TieredCache, key: str, tenant_scope: str | None = None
) -> tuple[list[str], bool]:
    """The texts stored under `key` in each shared tier that holds a usable one (L2, then L3),
    and whether every shared tier could be read (False: one failed or could not be asked, so
    a writer merging what it read would overwrite what that tier holds). An expired record, one
    an invalidation this process knows of covers (a tenant's: the records go with its answers),
    and one of another tenant scope than `tenant_scope` (when given) are left out."""
    texts: list[str] = []
    complete = True
    cache.note_invalidations()
    now = cache.now()
    for tier, store in cache.stores():
        if tier is Tier.L1:
            continue
        try:
            strict = getattr(store, "get_or_raise", None)
            entry = strict(key) if strict is not None else store.get(key)
        except Exception:  # noqa: BLE001 - a tier that cannot be read: the caller decides
            complete = False
            continue
        if entry is None or entry.expired(now) or cache.invalidations.covers(key, entry):
            continue
        if tenant_scope is not None and entry.tenant_scope not in ("", tenant_scope):
            continue
        texts.append(entry.text)
    return texts, complete
