"""Adapter metadata shared by the replicas through Redis: which version of each adapter the
fleet runs, and how much each adapter is used, so a new replica can warm the adapters the
fleet uses most and a replica whose folder holds another version says so.

Layout under the deployment's prefix (`redis_prefix`):
  `<prefix>adapters`      hash: name -> JSON `{"digest", "bytes", "updated_s", "replica"}`, the
                          fleet's latest version of each name (see below).
  `<prefix>adapter_uses`  hash: name -> requests that needed the adapter (summed over replicas).

Latest: versions are compared by `updated_s`, the newest modification time of the version's
files (the registry's `file_stats`), so a replica started later with an older copy of a folder
does not take over. A replica publishes its version of a name unless the hash holds the same
digest or a version with newer files (one Lua script, so two replicas cannot interleave). Ties
go to the last writer. Clocks: mtimes come from the hosts that wrote the files; copies that keep
mtimes (`cp -p`, rsync -t) compare as the source.

A replica whose folder holds another version than the fleet's latest logs a warning (once per
pair of versions) and `lora_cache`'s `list` shows it (`fleet.mismatched`). It still serves its
own version: the digest is part of every cache key (tiercache.exact.keys), so its answers are kept
apart from the fleet's, never mixed up.

Usage counts are kept in memory per request (no Redis call on the request path) and added to
Redis with one pipelined HINCRBY per adapter every `sync_s` (and at close). Redis down: nothing
is published; counts stay in memory (bounded by the number of adapter names) until Redis is
back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tiercache.errors import TierCacheError
from tiercache.exact.redis_tier import RedisLink
from tiercache.log_throttle import LogThrottle
from tiercache.lora.registry import AdapterRegistry
from tiercache.threads import NamedThread

log = logging.getLogger(__name__)
_OVERSIZED_LOG = LogThrottle()
_USES_LOG = LogThrottle()  # use counts in Redis that were no integers: once a minute

ADAPTERS = "adapters"
USES = "adapter_uses"
MAX_METADATA_BYTES = 4096  # one adapter's JSON is about 150 bytes
MAX_FLEET_FIELDS = 10_000  # adapters (and use counts) one sync reads at most
MAX_FIELD_NAME_BYTES = 256  # an adapter's name (NAME_PATTERN: 64 characters) with room to spare
MAX_USE_BYTES = 32  # a use count's decimal digits
# One hash's fields and values, those longer than a replica writes left in Redis unread (the
# hashes are unsigned: a value planted hundreds of MB long was read by every sync): [the kept
# fields and values, flat; how many were left]. Values are sized (HSTRLEN) before one is read,
# so a planted one is never copied, not even inside Redis; names are read to be sized.
_BOUNDED_FIELDS = """
local name_limit = tonumber(ARGV[1])
local value_limit = tonumber(ARGV[2])
local names = redis.call('HKEYS', KEYS[1])
local kept = {}
local left = 0
for _, name in ipairs(names) do
  if string.len(name) <= name_limit
      and redis.call('HSTRLEN', KEYS[1], name) <= value_limit then
    kept[#kept + 1] = name
    kept[#kept + 1] = redis.call('HGET', KEYS[1], name)
  else
    left = left + 1
  end
end
return {kept, left}
"""
_DIGEST = re.compile(r"[0-9a-f]{64}")  # an adapter version's digest, as replicas write it
MAX_UPDATED_S = 253_402_300_800.0  # 10000-01-01: past it (or NaN, inf) no time a replica wrote
_MISSING = object()

# KEYS[1] the hash; ARGV: name, value (JSON), digest, updated_s. 1 when written.
_PUBLISH_LATEST = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then
  local ok, held = pcall(cjson.decode, current)
  if ok and type(held) == 'table' then
    if held['digest'] == ARGV[3] then return 0 end
    local held_s = tonumber(held['updated_s'])
    if held_s and held_s > tonumber(ARGV[4]) then return 0 end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """One adapter version as a replica publishes it."""

    name: str
    digest: str
    nbytes: int
    updated_s: float  # newest modification time of its files
    replica: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "digest": self.digest,
                "bytes": self.nbytes,
                "updated_s": self.updated_s,
                "replica": self.replica,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, name: str, text: str | bytes) -> AdapterVersion:
        """ValueError (also KeyError, TypeError) for what a replica never writes: Redis's
        fleet metadata is not signed."""
        data = json.loads(text)
        updated_s = float(data["updated_s"])
        if not 0.0 <= updated_s < MAX_UPDATED_S:
            raise ValueError(f"updated_s {updated_s!r} is not a time")
        digest, nbytes = data["digest"], data["bytes"]
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ValueError("digest is not a 64-character hex digest")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes < 2**63:
            raise ValueError(f"bytes {str(nbytes)[:40]!r} is not a size")
        return cls(name, digest, nbytes, updated_s, str(data.get("replica", ""))[:256])


def replica_id(state_path: Path) -> str:
    """This replica's name in the fleet: the host name and a digest of its state dir (two
    replicas on one host have different state dirs)."""
    where = hashlib.sha256(str(state_path.resolve()).encode("utf-8")).hexdigest()[:8]
    return f"{socket.gethostname()}/{where}"


def local_versions(registry: AdapterRegistry) -> list[AdapterVersion]:
    """The versions this replica's folder holds now (broken folders left out)."""
    versions = []
    for item in registry.listing():
        if item.ref is None:
            continue
        try:
            nbytes, updated_s = registry.file_stats(item.name)
        except TierCacheError:
            continue  # removed or broken since the listing
        versions.append(AdapterVersion(item.name, item.ref.digest, nbytes, updated_s))
    return versions


class AdapterFleet:
    """This replica's view of, and contributions to, the fleet's adapter metadata."""

    def __init__(self, link: RedisLink, replica: str) -> None:
        self.link = link
        self.replica = replica
        self.adapters_key = link.key(ADAPTERS)
        self.uses_key = link.key(USES)
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # uses not yet added to Redis
        # name -> the (local, fleet) digests last warned about: one entry per local adapter,
        # whatever Redis offers
        self._warned: dict[str, tuple[str, str]] = {}

    def count_use(self, name: str) -> None:
        """One request needed adapter `name` (no Redis call: see `flush_uses`)."""
        with self._lock:
            self._pending[name] = self._pending.get(name, 0) + 1

    def flush_uses(self) -> bool:
        """Add the counted uses to Redis; on failure they stay counted here. A field Redis
        holds that is no count (planted, or damaged) is replaced by this replica's count: with
        one such field the whole pipeline raised after every other increment had run, and
        each flush added them all again."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return True

        def add(client: Any) -> bool:
            pipe = client.pipeline(transaction=False)
            for name, uses in pending.items():
                pipe.hincrby(self.uses_key, name, uses)
            results = pipe.execute(raise_on_error=False)
            broken = {
                name: uses
                for (name, uses), result in zip(pending.items(), results, strict=True)
                if isinstance(result, redis.exceptions.ResponseError)
            }
            if broken:
                client.hset(self.uses_key, mapping=broken)
                if _USES_LOG.ready():
                    log.warning(
                        "adapter use counts in Redis that were no integers were replaced: %s",
                        ", ".join(sorted(broken)[:8]),
                    )
            return True

        if self.link.call(add, False):
            return True
        with self._lock:
            for name, uses in pending.items():
                self._pending[name] = self._pending.get(name, 0) + uses
        return False

    def publish(self, versions: Sequence[AdapterVersion]) -> bool:
        """Offer this replica's versions as the fleet's latest (see the module docstring)."""
        if not versions:
            return True

        def offer(client: Any) -> bool:
            script = client.register_script(_PUBLISH_LATEST)
            pipe = client.pipeline(transaction=False)
            for v in versions:
                mine = AdapterVersion(v.name, v.digest, v.nbytes, v.updated_s, self.replica)
                script(
                    keys=[self.adapters_key],
                    args=[v.name, mine.to_json(), v.digest, repr(v.updated_s)],
                    client=pipe,
                )
            pipe.execute()
            return True

        return bool(self.link.call(offer, False))

    def fleet(self) -> tuple[dict[str, AdapterVersion], dict[str, int]] | None:
        """The fleet's latest version and use count of each adapter; None when Redis is down."""

        def read(client: Any) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
            # sized first: the hashes are unsigned, and one planted with 200,000 fields cost
            # each replica's sync (every sync_s) 167 MiB and seconds; one past the bound is
            # read as empty (said once a minute)
            pipe = client.pipeline(transaction=False)
            pipe.hlen(self.adapters_key)
            pipe.hlen(self.uses_key)
            sizes = [int(n) for n in pipe.execute()]
            pipe = client.pipeline(transaction=False)
            keys = (self.adapters_key, self.uses_key)
            limits = {self.adapters_key: MAX_METADATA_BYTES, self.uses_key: MAX_USE_BYTES}
            wanted = [key for key, n in zip(keys, sizes, strict=True) if n <= MAX_FLEET_FIELDS]
            for key in wanted:  # sized inside Redis: a long name or value is never sent
                pipe.eval(_BOUNDED_FIELDS, 1, key, MAX_FIELD_NAME_BYTES, limits[key])
            values: dict[str, dict[bytes, bytes]] = {}
            left = 0
            for key, (flat, dropped) in zip(wanted, pipe.execute() if wanted else [], strict=True):
                values[key] = dict(zip(flat[::2], flat[1::2], strict=True))
                left += int(dropped)
            if left and _OVERSIZED_LOG.ready():
                log.warning(
                    "the adapter fleet's hashes hold %d fields with a name or value longer "
                    "than a replica writes: left unread (planted in Redis)",
                    left,
                )
            if len(wanted) < len(keys) and _OVERSIZED_LOG.ready():
                log.warning(
                    "the adapter fleet's hashes hold %s fields (at most %d read): ignored; "
                    "planted in Redis, or more adapters than a fleet keeps",
                    " and ".join(str(n) for n in sizes),
                    MAX_FLEET_FIELDS,
                )
            return values.get(self.adapters_key, {}), values.get(self.uses_key, {})

        found: Any = self.link.call(read, _MISSING)
        if found is _MISSING:
            return None
        raw_adapters, raw_uses = found
        versions: dict[str, AdapterVersion] = {}
        bad: list[str] = []
        for key, value in raw_adapters.items():
            name = key.decode("utf-8", "replace")
            if len(value) > MAX_METADATA_BYTES:  # filtered in Redis; kept as a second bound
                bad.append(name)
                continue
            try:
                versions[name] = AdapterVersion.from_json(name, value)
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
                bad.append(name)
        if bad:  # one line a sync, whatever a hostile Redis holds
            log.warning(
                "ignored oversized or malformed fleet metadata of %d adapters (first: %r)",
                len(bad),
                bad[0][:80],
            )
        uses = {}
        for key, value in raw_uses.items():
            try:
                uses[key.decode("utf-8", "replace")] = int(value)
            except ValueError:
                continue
        return versions, uses

    def top(self, count: int) -> list[str]:
        """The fleet's `count` most-used adapter names, most used first ([] if Redis is down)."""
        found = self.fleet()
        if found is None:
            return []
        _, uses = found
        return [name for name, _ in sorted(uses.items(), key=lambda kv: (-kv[1], kv[0]))][:count]

    def mismatched(
        self, local: Sequence[AdapterVersion], fleet: dict[str, AdapterVersion]
    ) -> list[tuple[AdapterVersion, AdapterVersion]]:
        """(local, fleet's latest) for each name whose versions differ; warns once per pair."""
        out = []
        for mine in local:
            theirs = fleet.get(mine.name)
            if theirs is None or theirs.digest == mine.digest:
                continue
            out.append((mine, theirs))
            pair = (mine.digest, theirs.digest)
            with self._lock:
                new = self._warned.get(mine.name) != pair
                self._warned[mine.name] = pair
            if new:
                log.warning(
                    "adapter %s: this replica's folder holds version %s (files of %s), but the "
                    "fleet's latest is %s (files of %s, from replica %s); this replica serves "
                    "its own version (cache keys keep them apart): update its adapter folder",
                    mine.name,
                    mine.digest[:12],
                    _when(mine.updated_s),
                    theirs.digest[:12],
                    _when(theirs.updated_s),
                    repr(theirs.replica[:64]),  # unsigned text from Redis: quoted, cut
                )
        return out

    def report(self, local: Sequence[AdapterVersion]) -> dict[str, Any]:
        """What `lora_cache`'s `list` shows under "fleet"."""
        found = self.fleet()
        if found is None:
            return {"available": False, "replica": self.replica, "adapters": [], "mismatched": []}
        versions, uses = found
        mine = {v.name: v for v in local}
        rows = []
        for name in sorted(set(versions) | set(uses)):
            latest = versions.get(name)
            local_version = mine.get(name)
            rows.append(
                {
                    "name": name,
                    "digest": latest.digest if latest else None,
                    "bytes": latest.nbytes if latest else None,
                    "updated_s": latest.updated_s if latest else None,
                    "replica": latest.replica if latest else None,
                    "uses": uses.get(name, 0),
                    "local_digest": local_version.digest if local_version else None,
                }
            )
        mismatched = sorted(m.name for m, _ in self.mismatched(local, versions))
        return {
            "available": True,
            "replica": self.replica,
            "adapters": rows,
            "mismatched": mismatched,
        }


class FleetSync:
    """A thread that publishes this replica's versions and usage every `sync_s`, checks them
    against the fleet's (warning on a mismatch), and at start warms the fleet's most-used
    adapters through `warm` (lora_cache's warm: names -> {name: outcome}), retrying names the
    engine could not take yet (it may still be loading) for up to `warm_deadline_s`.
    `close()` joins it, flushes the last counts and closes the fleet's Redis link (it owns
    it)."""

    def __init__(
        self,
        fleet: AdapterFleet,
        local: Callable[[], list[AdapterVersion]],
        *,
        sync_s: float = 10.0,
        warm: Callable[[list[str]], dict[str, str]] | None = None,
        choose_warm: Callable[[list[str]], list[str]] = lambda names: names,
        warm_top: int = 0,
        warm_retry_s: float = 1.0,
        warm_deadline_s: float = 120.0,
    ) -> None:
        """`choose_warm` narrows the fleet's top names to what this replica can warm (known
        here, not already prefetched, as many as its engine slots allow)."""
        self.fleet = fleet
        self._local = local
        self._sync_s = sync_s
        self._warm = warm
        self._choose_warm = choose_warm
        self._warm_top = warm_top
        self._warm_retry_s = warm_retry_s
        self._warm_deadline_s = warm_deadline_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.warmed: dict[str, str] = {}  # name -> the last outcome of its warm-up
        self.syncs = 0

    def start(self) -> FleetSync:
        self._thread = NamedThread(target=self._run, name="tiercache-adapter-fleet")
        self._thread.daemon = True
        self._thread.start()
        return self

    def sync(self) -> None:
        local = self._local()
        self.fleet.publish(local)
        self.fleet.flush_uses()
        found = self.fleet.fleet()
        if found is not None:
            self.fleet.mismatched(local, found[0])
        self.syncs += 1

    def _run(self) -> None:
        self._safely(self.sync)
        if self._warm is not None and self._warm_top > 0:
            self._safely(self._warm_fleet_top)
        while not self._stop.wait(self._sync_s):
            self._safely(self.sync)

    def _warm_fleet_top(self) -> None:
        if self._warm is None:
            return
        names = self._choose_warm(self.fleet.top(self._warm_top))
        if not names:
            return
        log.info("warming the fleet's most-used adapters: %s", ", ".join(names))
        deadline = time.monotonic() + self._warm_deadline_s
        todo = list(names)
        while todo and not self._stop.is_set():
            try:
                outcomes = self._warm(todo)
            except TierCacheError as exc:  # e.g. a name removed from the folder meanwhile
                outcomes = dict.fromkeys(todo, f"error: {exc.client_message()}")
            self.warmed.update(outcomes)
            todo = [n for n in todo if outcomes.get(n, "error").startswith("error")]
            if not todo or time.monotonic() >= deadline:
                break
            self._stop.wait(self._warm_retry_s)
        if todo:
            log.warning("could not warm adapters %s: %s", todo, [self.warmed.get(n) for n in todo])

    def _safely(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # noqa: BLE001 - a failed sync must not stop the thread
            log.exception("adapter fleet sync failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.fleet.flush_uses()
        self.fleet.link.close()


def _when(seconds: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):  # no time a replica writes (from_json refuses)
        return repr(seconds)
