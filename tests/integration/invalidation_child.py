"""A second replica process for tests/integration/test_invalidation_redis.py.

argv: state_dir redis_url redis_prefix entries_json. It fills its L1 and L2 with the entries
(key -> {tags, scope, adapter}), prints `ready` once its invalidation listener is subscribed, then
one JSON line per invalidation it applies ({"kind", "value", "dropped": [keys], "l1", "l2"}: the
entries still in each tier), and exits when its stdin closes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tiercache.config import CacheConfig
from tiercache.exact.watermarks import Invalidation
from tiercache.stages.parts import open_exact_cache


def main() -> int:
    state_dir, url, prefix, entries_json = sys.argv[1:5]
    config = CacheConfig(state_dir=state_dir, redis_url=url, redis_prefix=prefix, redis_retry_s=0.2)
    tiers = open_exact_cache(config)
    cache = tiers.cache
    for key, meta in json.loads(entries_json).items():
        cache.put(key, f"answer {key}", created_s=time.time() - 1.0, **_meta(meta))
    listener = tiers.listener
    if listener is None or not listener.wait_connected(10.0):
        print("no listener", flush=True)
        return 1

    def report(inv: Invalidation, dropped: list[str]) -> None:
        left = {
            tier.value: sorted(k for k, _ in store.scan()) for tier, store in cache.local_stores()
        }
        line = {"kind": inv.kind.value, "value": inv.value, "dropped": sorted(dropped), **left}
        print(json.dumps(line), flush=True)

    listener.on_dropped(report)
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes it
    cache.close()
    Path(state_dir, "closed").touch()
    return 0


def _meta(meta: dict[str, object]) -> dict[str, object]:
    return {
        "tags": tuple(meta.get("tags", ())),  # type: ignore[call-overload]
        "tenant_scope": str(meta.get("scope", "")),
        "adapter": str(meta.get("adapter", "")),
    }


if __name__ == "__main__":
    sys.exit(main())
