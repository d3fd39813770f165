"""Exact-cache stores: L1 in process memory, L2 in an embedded LMDB on local disk.

Both keep the same contract (`Store`), checked by one test suite run against each. Store, policy
and codec are separate: each store takes a `tiercache.eviction.EvictionPolicy` (L1: LRU by default,
L2: oldest first) and asks it for victims as its byte budget fills; the store evicts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import lmdb

from tiercache.errors import ConfigError, Unavailable
from tiercache.eviction import EvictionPolicy, KnownCosts, LruPolicy, OldestFirstPolicy
from tiercache.exact.codec import (
    MAX_ENDORSEMENTS,
    CacheEntry,
    CorruptEntry,
    decode_entry,
    encode_entry,
    peek_created_s,
)
from tiercache.log_throttle import LogThrottle
from tiercache.machine import CRITICAL, ROOM, DiskRoom
from tiercache.shadow import ShadowQueue, shadow_bytes
from tiercache.stats import top_share
from tiercache.threads import NamedThread

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoreStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int
    corrupt: int
    # What a tier that counts hits per entry (L1; L2 with values) says of their value; the
    # others leave them at their defaults. `evicted_hits`: hits the evicted entries had had
    # while held (the value eviction gave up); `rejected`: entries not stored (L1: larger than
    # its whole budget; L2: a write that met a full disk even after evicting); `removed`:
    # entries deleted other than by eviction (invalidations, expiry); `hit_skew`: share of the
    # held entries' hits taken by the hottest 1 % of them (None: not counted).
    evicted_hits: int = 0
    rejected: int = 0
    removed: int = 0
    hit_skew: float | None = None
    evicted_bytes: int = 0  # L1: what its evictions freed (with evicted_hits: value per byte)
    # L1: engine seconds the misses on recently evicted keys would have saved (cumulative), and
    # the bytes those keys span (tiercache.shadow: with both, what one more byte saves)
    shadow_gained_s: float = 0.0
    shadow_bytes: int = 0
    # L2 with `evict_early`: evictions its own thread ran ahead of the writes (the others ran
    # in the write that reached the mark)
    early_evictions: int = 0


class Store(Protocol):
    """A bounded key -> CacheEntry map. Thread-safe. Never raises on a corrupt stored value."""

    def get(self, key: str) -> CacheEntry | None: ...

    def peek(self, key: str) -> CacheEntry | None:
        """`get` that counts nothing and changes nothing (no policy update, nothing dropped)."""
        ...

    def put(self, key: str, entry: CacheEntry) -> None: ...

    def delete(self, key: str) -> bool: ...

    def delete_if_same(self, key: str, seen: CacheEntry | None) -> bool:
        """Delete `key` only while it still holds what a read found there: an entry equal to
        `seen`, or, `seen` None, a value that does not decode (a corrupt one). How a reader
        drops what it found unusable (expired, invalidated, corrupt) without deleting an
        answer another process wrote in between. True if deleted."""
        ...

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete `keys`; how many were present. (A loop over `delete` where nothing batches.)"""
        ...

    def delete_unchanged(self, found: list[tuple[str, CacheEntry]]) -> list[str]:
        """Delete each key while it still holds the entry a scan found there (an answer
        written since, generated again after an invalidation, stays); the keys deleted. What
        an invalidation sweep deletes with: its scan takes seconds over a large store."""
        ...

    def scan(self) -> Iterator[tuple[str, CacheEntry]]:
        """Every readable entry, for invalidation sweeps. Best effort: entries written or deleted
        during the scan may or may not appear; corrupt ones are skipped. Not counted as hits."""
        ...

    def clear(self) -> None: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


GREEDY, SAMPLED = 0, 1


def answer_group(entry: CacheEntry) -> int:
    """The eviction group of an answer (`tiercache.eviction`'s `group`): SAMPLED for a seeded
    sampled request's (temperature > 0: asked again only with the same seed), GREEDY otherwise."""
    return SAMPLED if entry.temperature > 0.0 else GREEDY


SKEW_INTERVAL_S = 5.0  # L1's hit skew is recomputed at most this often (O(n log n/100))
RESIZE_SLICE_BYTES = 1 << 20  # L1 evicts at most this much per hold of its lock when resized
MERGE_SLACK_BYTES = 16 << 10  # room a merge makes beyond what its key holds: what it may add
# (a side record at its largest: a trust record of 256 observations, about 8 KB, and margin)


SKETCH_SHARE = 8  # L1's policy's frequency sketch: at most 1/SKETCH_SHARE of its budget beyond it


class MemoryStore:
    """L1: in-process entries bounded in bytes (`CacheEntry.size_bytes` and the policy's own
    `entry_overhead_bytes` per entry, if it has any), evicted in the order of `policy` (LRU when
    not given: a hit is one `access` call, O(1); the stages pass the one their `l1_eviction`
    names, GreedyDual-Size-Frequency by default: about 2 us a hit). Each entry is admitted with
    its size, its generation seconds as its cost and its `answer_group`, then ranked as asked for
    once more per `good` verdict it holds (`CacheEntry.endorsements`, `EvictionPolicy.endorse`;
    one given to a copy already held, `endorse`, counts the same way). Entries
    larger than the whole budget are not stored (and an older value under their key is
    dropped)."""

    def __init__(self, max_bytes: int, policy: EvictionPolicy[str] | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._max_bytes = max_bytes
        self._policy: EvictionPolicy[str] = policy if policy is not None else LruPolicy()
        self._access = self._policy.access  # bound once: the hit path's only policy call
        # what the policy holds per entry beyond an LRU's slots (ENTRY_OVERHEAD_BYTES counts
        # those), counted in every entry's size
        self._policy_bytes = int(getattr(self._policy, "entry_overhead_bytes", 0))
        self._entries: dict[str, CacheEntry] = {}
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._entry_hits: dict[str, int] = {}  # hits per held entry since it was stored
        self._evicted_hits = 0
        self._evicted_bytes = 0
        self._rejected = 0
        self._removed = 0
        self._skew = (0.0, -math.inf)  # the last hit skew and when it was computed (monotonic)
        self._shadow: ShadowQueue[str] = ShadowQueue(shadow_bytes(max_bytes))
        self._costs = KnownCosts(10_000)  # known generation seconds admitted, windowed
        self._limit_sketch(max_bytes)

    def _limit_sketch(self, max_bytes: int) -> None:
        """Keep a policy's frequency sketch (gdsf) within an eighth of the budget beyond it
        (its starting 256 KiB at least): it grew with the keys held, to as much again as the
        entries of a store of short answers."""
        limit = getattr(self._policy, "limit_sketch", None)
        if limit is not None:
            limit(max_bytes // SKETCH_SHARE)

    def get(self, key: str) -> CacheEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
            else:
                self._hits += 1
                self._access(key)
                self._entry_hits[key] = self._entry_hits.get(key, 0) + 1
            return entry

    def credit_miss(self, key: str, saves_s: float | None = None) -> None:
        """A miss on `key` was served without L1 (a lower tier, after `saves_s` seconds; or
        None: the engine, its recorded generation seconds): if L1 evicted `key` lately, that is
        a hit one more byte of L1 would have had (tiercache.shadow)."""
        with self._lock:
            if key not in self._entries:
                self._shadow.credit(key, saves_s)

    def shadow_reading(self) -> tuple[float, float]:
        """(seconds its shadow's hits saved, cumulative; the bytes it spans): a budget's
        `ShadowValue` reads it."""
        with self._lock:
            return self._shadow.gained_s, float(self._shadow.bytes)

    def forget_evicted(self, key: str) -> None:
        """`key`'s answer is no longer servable (invalidated, expired): a later miss on it is
        no hit L1 lost."""
        with self._lock:
            self._shadow.discard(key)

    def peek(self, key: str) -> CacheEntry | None:
        """`get` that counts nothing and leaves the policy's order as it is."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, entry: CacheEntry) -> None:
        size = entry.size_bytes + self._policy_bytes
        with self._lock:
            held = self._entries.get(key)
            if (
                held is not None
                and held.created_s == entry.created_s
                and dataclasses.replace(held, endorsements=entry.endorsements) == entry
            ):
                # The held answer again with more `good` verdicts (filled from a lower tier): each
                # new one counts as a request, as `endorse` does; re-admitting it counted all of
                # them again and made it look proven to the policy's admission prior.
                self._entries[key] = entry
                self._policy.endorse(key, entry.endorsements - held.endorsements)
                return
            if size > self._max_bytes:
                self._rejected += 1
                self._removed += self._discard(key)  # never serve an older value under this key
                return
            replaced = self._sizes.get(key, 0)
            over = self._bytes - replaced + size - self._max_bytes
            if over > 0:
                self._evict(over, key)
            self._entries[key] = entry
            self._sizes[key] = size
            self._bytes += size - replaced
            self._shadow.discard(key)
            self._costs.add(entry.generation_s or 0.0)
            try:
                self._policy.admit(
                    key,
                    size,
                    created_s=entry.created_s,
                    cost_s=entry.generation_s,
                    group=answer_group(entry),
                )
            except BaseException:
                # stored but unknown to the policy, it could never be evicted: once such
                # entries filled the budget every put failed
                self._discard(key)
                raise
            # each `good` verdict ranks it as a request would, while this value is held (into
            # the frequency sketch, which outlives it, each admission counted them again)
            self._policy.endorse(key, entry.endorsements)

    def endorse(self, key: str, created_s: float, endorsements: int) -> int:
        """The held copy of `key`'s answer made at `created_s` now has `endorsements` `good`
        verdicts (learnt from a shared tier): each new one counts as a request, as at admission.
        How many were new: 0, changing nothing, when that copy is not held or already has as
        many."""
        with self._lock:
            held = self._entries.get(key)
            if held is None or held.created_s != created_s or endorsements <= held.endorsements:
                return 0
            self._entries[key] = dataclasses.replace(held, endorsements=endorsements)
            self._policy.endorse(key, endorsements - held.endorsements)
            return endorsements - held.endorsements

    def resize(self, max_bytes: int) -> int:
        """A new byte budget (tiercache.budgets): entries are evicted at once, in the policy's
        order, down to it; returns it."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        with self._lock:
            self._max_bytes = max_bytes
            self._shadow.resize(shadow_bytes(max_bytes))
            self._limit_sketch(max_bytes)
        while True:  # in slices, the lock released between them: lookups go on meanwhile
            with self._lock:
                over = self._bytes - self._max_bytes
                if over <= 0:
                    return max_bytes
                self._evict(min(over, RESIZE_SLICE_BYTES), replacing="")

    def _evict(self, nbytes: int, replacing: str) -> None:
        """Free at least `nbytes` (lock held), never the entry `replacing` (its bytes are
        already counted as freed). Nothing in L1 is pinned and `put` never asks for more than
        the budget, so a policy that cannot name enough is broken: RuntimeError."""
        freed = 0
        for victim in self._policy.nominate(0, nbytes, replacing.__eq__):
            size = self._sizes.get(victim, 0)
            hits = self._entry_hits.get(victim, 0)
            entry = self._entries.get(victim)
            if entry is not None:
                # what a hit on it saves: its generation seconds, else the mean of the known
                self._shadow.add(victim, size, self._costs.resolve(entry.generation_s or 0.0, 0.0))
            if not self._discard(victim):
                raise RuntimeError(f"L1's policy nominated {victim!r}, which L1 does not hold")
            freed += size
            self._evictions += 1
            self._evicted_hits += hits
            self._evicted_bytes += size
        if freed < nbytes:
            raise RuntimeError(f"L1's policy nominated {freed} of the {nbytes} bytes needed")

    def _discard(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= self._sizes.pop(key)
        self._policy.remove(key)
        self._entry_hits.pop(key, None)
        return True

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._delete_locked(key)

    def delete_if_same(self, key: str, seen: CacheEntry | None) -> bool:
        with self._lock:
            held = self._entries.get(key)
            if held is None or seen is None or held != seen:  # L1 holds no undecodable value
                return False
            return self._delete_locked(key)

    def _delete_locked(self, key: str) -> bool:
        self._shadow.discard(key)  # deleted, not evicted: a later miss is no lost hit
        removed = self._discard(key)
        self._removed += removed
        return removed

    def delete_many(self, keys: Iterable[str]) -> int:
        return sum(self.delete(key) for key in keys)

    def delete_unchanged(self, found: list[tuple[str, CacheEntry]]) -> list[str]:
        return [key for key, entry in found if self.delete_if_same(key, entry)]

    def scan(self) -> Iterator[tuple[str, CacheEntry]]:
        with self._lock:  # a snapshot, not counted as reads: the policy's order is unchanged
            items = list(self._entries.items())
        yield from items

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self._entry_hits.clear()
            self._bytes = 0
            self._policy.clear()

    def used_bytes(self) -> int:
        """The bytes its entries hold now (its budget's unfilled part frees nothing)."""
        with self._lock:
            return self._bytes

    def stats(self) -> StoreStats:
        skew, computed_s = self._skew
        fresh = time.monotonic() - computed_s < SKEW_INTERVAL_S
        with self._lock:
            held = len(self._entries)
            # copied here, the skew computed off the lock (and at most every SKEW_INTERVAL_S)
            per_entry = [] if fresh else list(self._entry_hits.values())
            stats = StoreStats(
                entries=held,
                bytes=self._bytes,
                max_bytes=self._max_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                corrupt=0,
                evicted_hits=self._evicted_hits,
                rejected=self._rejected,
                removed=self._removed,
                evicted_bytes=self._evicted_bytes,
                shadow_gained_s=self._shadow.gained_s,
                shadow_bytes=self._shadow.bytes,
            )
        if not fresh:
            # entries never hit count as zeros: the hottest 1 % of all held entries
            skew = top_share(per_entry + [0] * (held - len(per_entry)))
            self._skew = (skew, time.monotonic())
        return dataclasses.replace(stats, hit_skew=skew)

    def close(self) -> None:
        self.clear()


LMDB_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.PageNotFoundError,
    lmdb.BadValsizeError,
    lmdb.BadTxnError,
    lmdb.BadRslotError,
)
"""What a damaged LMDB file raises (as opposed to full maps, full reader tables, locks)."""


class DamagedDatabase(Exception):
    """An LMDB file is shorter than its own meta page says (truncated) or fails a walk."""


def data_bytes(env: lmdb.Environment) -> int:
    """Bytes in an environment's pages that hold data: not the file's size, which never shrinks
    (freed pages are reused)."""
    st = env.stat()
    return int((st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"])


def map_resized_message(path: Path, max_bytes: int) -> str:
    return (
        f"L2 {path} has grown past this process's map of {max_bytes} bytes: another stage of "
        "this host opened it with a larger l2_max_bytes. Set the same l2_max_bytes on every "
        "stage that shares the state_dir and restart; until then this stage cannot use L2"
    )


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_dir(path: Path) -> None:
    """Create `path` and its missing parents with mode 0700 (pathlib's `parents=True` would
    give the parents the umask's mode), and tighten `path` itself when it exists with access
    for others: the state directory holds every tenant's prompts and answers.

    An existing folder is changed only when this user owns it (logged); one owned by another
    user is left as it is, with a warning, since changing it is not ours to do."""
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # another process created it meanwhile
            pass
    tighten_mode(path, PRIVATE_DIR_MODE)


def tighten_mode(path: Path, mode: int) -> bool:
    """Take group and other access away from `path` (to `mode`) if it has any and this user
    owns it; whether it changed. A file that is not there is left alone."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    current = stat.S_IMODE(st.st_mode)
    if not current & 0o077:
        return False
    if st.st_uid != os.geteuid():
        log.warning(
            "%s is open to other users (mode %o) and owned by uid %d, not this process's: "
            "left as it is",
            path,
            current,
            st.st_uid,
        )
        return False
    os.chmod(path, mode)
    log.warning("%s was open to other users (mode %o); now %o", path, current, mode)
    return True


def open_private(path: Path, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """`os.open` of a state file, created 0600 (an existing one is tightened the same way)."""
    fd = os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    try:
        tighten_mode(path, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_readers(env: lmdb.Environment, what: str, path: Path) -> int:
    """Free the reader slots of processes that died holding a read transaction
    (`mdb_reader_check`); how many were freed. A dead reader's slot pins the pages it could
    see, so writes stop reusing pages and the map fills; LMDB frees such slots only when the
    environment is opened with no other process holding it, which a host whose other stages
    keep running never sees. Cheap: one scan of the reader table."""
    freed = int(env.reader_check())
    if freed:
        log.warning("%s %s: freed %d reader slots of dead processes", what, path, freed)
    return freed


def open_lmdb(
    path: Path,
    map_size: int,
    what: str,
    clock: Callable[[], float] = time.time,
    max_readers: int = 512,
    durable: bool = True,
) -> lmdb.Environment:
    """Open the LMDB environment in `path`, checked; a damaged one is moved aside to
    `<name>.corrupt-<time>-<pid>-<random>` (kept for inspection) and rebuilt empty, with a
    warning naming both. Damaged means: LMDB refuses the file, the file is shorter than the last
    page its meta page records (reading past the end of a memory map is SIGBUS, which would kill
    the process on the first read of a truncated file), or a walk over every key fails.

    Under an exclusive lock on `<path>.open-lock`, so that the processes of a host opening the same
    damaged file at once agree: the first moves it aside and creates the new one, the others open
    that. Opening costs one key walk (leaf pages only; values are checked by their own checksums
    when read). Only damage moves a database; any other error (disk full, readers full) is raised,
    because moving a healthy database that other processes use would split it in two.

    The folder is made 0700 and the files 0600 (existing ones tightened, `make_private_dir`),
    and reader slots left by dead processes are freed (`check_readers`). `durable` False: commits
    are not flushed to disk (for advice that a crash may lose, and whose damage rebuilds it)."""
    make_private_dir(path)
    with _exclusive(path.with_name(path.name + ".open-lock")):
        try:
            env = _open_checked(path, map_size, max_readers, durable)
        except (lmdb.MemoryError, OverflowError) as exc:
            # a map the address space cannot take: the operator's byte budget, named
            raise ConfigError(
                f"{what} {path}: a map of {map_size} bytes cannot be mapped ({exc}); give it a "
                "smaller byte budget"
            ) from None
        except (DamagedDatabase, *LMDB_DAMAGE) as exc:
            stamp = f"{int(clock())}-{os.getpid()}-{secrets.token_hex(3)}"
            aside = path.with_name(f"{path.name}.corrupt-{stamp}")
            log.warning(
                "%s %s is damaged (%s); moved aside to %s, rebuilt empty", what, path, exc, aside
            )
            shutil.move(str(path), str(aside))
            make_private_dir(path)
            env = _open_private(path, map_size, max_readers, durable)
    check_readers(env, what, path)
    return env


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    fd = open_private(lock_path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_private(
    path: Path, map_size: int, max_readers: int, durable: bool = True
) -> lmdb.Environment:
    """`lmdb.open` creating data.mdb and lock.mdb 0600; existing ones are tightened first."""
    for name in ("data.mdb", "lock.mdb"):
        tighten_mode(path / name, PRIVATE_FILE_MODE)
    return lmdb.open(
        str(path),
        map_size=map_size,
        max_readers=max_readers,
        mode=PRIVATE_FILE_MODE,
        sync=durable,
        metasync=durable,
    )


def _open_checked(
    path: Path, map_size: int, max_readers: int, durable: bool = True
) -> lmdb.Environment:
    data_file = path / "data.mdb"
    env = _open_private(path, map_size, max_readers, durable)
    try:
        page_size = int(env.stat()["psize"])
        needed = (int(env.info()["last_pgno"]) + 1) * page_size
        if data_file.exists() and data_file.stat().st_size < needed:
            raise DamagedDatabase(
                f"data.mdb has {data_file.stat().st_size} bytes, its pages need {needed}"
            )
        with env.begin() as txn:
            for db_key in txn.cursor().iternext(keys=True, values=False):
                if isinstance(db_key, bytes) and not db_key:
                    raise DamagedDatabase("an empty key")
    except BaseException:
        env.close()
        raise
    return env


class _CountingStore(Protocol):
    def _count(self, *, hits: int = 0, misses: int = 0, corrupt: int = 0) -> None: ...

    def delete_if_same(self, key: str, seen: CacheEntry | None) -> bool: ...


def peeked(data: bytes | None) -> CacheEntry | None:
    """A stored value as a read that is not a request sees it: None when absent or corrupt
    (nothing counted, nothing dropped)."""
    if data is None:
        return None
    try:
        return decode_entry(data)
    except CorruptEntry:
        return None


def read_stored(
    store: _CountingStore, tier: str, key: str, data: bytes | None
) -> CacheEntry | None:
    """A shared tier's read of one stored value: None (a miss) when absent, and when corrupt,
    which also drops it; hits, misses and corrupt entries counted on `store`."""
    if data is None:
        store._count(misses=1)
        return None
    try:
        entry = decode_entry(data)
    except CorruptEntry as exc:
        log.warning("%s entry %s is corrupt (%s); dropped", tier, key, exc)
        store._count(misses=1, corrupt=1)
        store.delete_if_same(key, None)  # unless another process wrote it meanwhile
        return None
    store._count(hits=1)
    return entry


class EntryValues(Protocol):
    """What L2's entries are worth, kept where every process of the host sees it
    (`tiercache.exact.l2_values.L2Values`): told of each write, hit and eviction, asked for
    victims, told of deletions. Never raises (but `value`): advice that fails never fails L2.
    """

    def admitted(
        self,
        key: str,
        size: int,
        cost_s: float,
        endorsements: int = 0,
        created_s: float = 0.0,
    ) -> None: ...

    def hit(self, key: str) -> None: ...

    def nominate(
        self, entries: Sequence[tuple[bytes, float]], count: int
    ) -> list[bytes] | None: ...

    def evicted(self, victims: Iterable[bytes]) -> int: ...

    def forget(self, keys: Iterable[bytes]) -> None: ...

    def forget_all(self) -> None: ...

    def sweep(self, live: set[bytes], since_s: float) -> int: ...

    def now(self) -> float: ...

    def skew(self) -> float: ...

    def value(self, key: str) -> tuple[float, int] | None: ...

    def reader_check(self) -> int: ...

    def close(self) -> None: ...


DELETE_CHUNK = 64  # L2 entries deleted per write transaction when evicting
DISK_RETRY_PAUSE_S = 2.0  # after a write the full disk failed twice: no eviction for it until


def _created_s(data: bytes | memoryview) -> float:
    """A held value's creation time; a damaged one counts as the oldest (it may go)."""
    try:
        return peek_created_s(data)
    except CorruptEntry:
        return float("-inf")


class LmdbStore:
    """L2: an LMDB environment on local disk, shared by every process on the host.

    LMDB gives multi-process readers and one writer at a time with crash-safe commits. The byte
    budget is the map size: LMDB cannot grow past it. Writes keep `headroom_fraction` of the map
    free, because LMDB needs free pages even to delete (a completely full map cannot evict): when
    live pages plus the new value would pass that mark, `evict_fraction` of the entries (the
    policy's choice) go first. A `MapFullError` all the same (a large value, fragmentation)
    evicts again and retries once.
    The policy (default `OldestFirstPolicy`: an L2 read never writes, so L2 keeps no access
    times) sees the whole database at each eviction and nothing in between: other processes
    write L2 too, so no process could keep a lasting view of it. Each eviction clears it, admits
    every entry in key order (size: the stored bytes; `created_s` from the value), asks it for
    victims and clears it again. With `values` (what the stages open: `l2_eviction` gdsf), the
    victims are the lowest-valued entries instead (GreedyDual-Size-Frequency over every
    process's writes and hits, kept beside L2: `tiercache.exact.l2_values`); the policy then
    ranks only when the values cannot be read.
    A database that is damaged when it opens (truncated or corrupt file; `open_lmdb`) is moved
    aside and rebuilt empty; a damaged page met later makes that read a miss.
    """

    def __init__(
        self,
        path: Path,
        max_bytes: int,
        policy: EvictionPolicy[str] | None = None,
        evict_fraction: float = 0.1,
        headroom_fraction: float = 0.25,
        clock: Callable[[], float] = time.time,
        values: EntryValues | None = None,
        disk: DiskRoom | None = None,
        evict_early: bool = False,
    ) -> None:
        """`disk`: the state directory's free disk (None: not watched). While it is short,
        writes keep the live pages under (1 - headroom_fraction) of the size the file had when
        the shortage began, so the file stops growing; while it is critical, under
        (1 - 2 x headroom_fraction) of it, so a write finds free pages inside the file even
        when the disk has none left. L2 keeps taking answers either way: on a host without
        Redis it is how the answers `llm` writes reach prompt_cache and embedding_cache.

        `evict_early` (what the stages open): a write that brings the live pages within half
        an eviction's share (`evict_fraction` / 2) of the mark starts the eviction on this
        store's own thread and goes on, so the write that would reach the mark finds room
        instead of waiting for a scan of every entry (the miss whose answer it is waits for
        its write). A write that reaches the mark all the same (writes faster than an eviction)
        evicts itself, as without it. Off: every eviction runs in the write that reaches the
        mark (deterministic: tests and tools)."""
        self.path = path
        self._max_bytes = max_bytes
        self._values = values
        self._disk = disk
        self._headroom_fraction = headroom_fraction
        self._short_file_bytes = 0  # the file's size when the disk ran short (0: it has room)
        self._rejected = 0  # writes that met a full disk even after evicting
        self._disk_logged_s = -60.0
        self._disk_pause_until_s = 0.0  # no eviction for want of disk before then
        self._policy: EvictionPolicy[str] = policy if policy is not None else OldestFirstPolicy()
        self._evict_fraction = evict_fraction
        self._high_water_bytes = int(max_bytes * (1.0 - headroom_fraction))
        self._clock = clock
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._corrupt = 0
        self._evicted_hits = self._removed = 0  # this process's evictions' and deletions'
        self._env = open_lmdb(path, max_bytes, "L2 store", clock)
        self._damage_log = LogThrottle()
        self._resized_log = LogThrottle()
        self._evict_early = evict_early
        self._early = threading.Event()  # set: the evictor thread looks at the mark again
        self._evictor: threading.Thread | None = None  # started at the first early eviction
        self._closing = False
        self._early_evictions = 0  # evictions this store's own thread ran ahead of the writes
        self._early_pause_until_s = 0.0  # after one that failed or freed nothing: none before
        self._early_logged_s = -60.0

    @property
    def disk(self) -> DiskRoom | None:
        """The state directory's free disk as this store watches it (None: not watched)."""
        return self._disk

    @property
    def rejected(self) -> int:
        """This process's writes that met a full disk even after evicting (`stats().rejected`,
        without reading the database)."""
        with self._lock:
            return self._rejected

    def reader_check(self) -> int:
        """Free reader slots of processes that died in a read (done at open too); how many.
        For a stage to call after another process of the host was restarted."""
        freed = check_readers(self._env, "L2 store", self.path)
        if self._values is not None:
            freed += self._values.reader_check()
        return freed

    def get(self, key: str) -> CacheEntry | None:
        """A damaged page met while reading is a miss (counted as corrupt), never an error: the
        answer is generated again and its write may fail the same way, which llm logs."""
        try:
            with self._env.begin(buffers=False) as txn:
                data = txn.get(key.encode())
        except LMDB_DAMAGE as exc:
            if self._damage_log.ready():  # a caller can repeat the read at will
                log.warning(
                    "L2 read of %s met a damaged page (%s); a miss (%d more not logged)",
                    key[:12],
                    exc,
                    self._damage_log.suppressed,
                )
            self._count(misses=1, corrupt=1)
            return None
        except lmdb.MapResizedError:
            if self._resized_log.ready():  # once a minute, not on every read
                log.warning(map_resized_message(self.path, self._max_bytes) + "; a miss")
            self._count(misses=1)
            return None
        entry = read_stored(self, "L2", key, data)
        if entry is not None and self._values is not None:
            self._values.hit(key)
        return entry

    def put(self, key: str, entry: CacheEntry) -> None:
        data = encode_entry(entry)
        disk = self._make_room(len(data))
        with self._resized_is_an_error():
            try:
                self._write(key.encode(), data)
            except lmdb.MapFullError:
                # a process killed inside a read left its reader slot: LMDB reuses no page
                # freed since, and the map fills though the live pages fit (5,891 of 6,000
                # writes failed, half of L2 evicted each time); freed, the write goes through
                if self.reader_check():
                    try:
                        self._write(key.encode(), data)
                    except lmdb.MapFullError:
                        pass
                    else:
                        self._admitted(key, entry, data)
                        return
                with self._evict_lock:  # the policy is one per store: one eviction at a time
                    self._evict(fraction=max(0.5, self._evict_fraction))
                self._write(key.encode(), data)
            except lmdb.Error as exc:  # ENOSPC; a short write (EIO) or EDQUOT, while short
                if disk == ROOM or isinstance(exc, lmdb.MapFullError):
                    raise
                if not self._write_after_freeing(key, entry, data, exc):
                    return  # not stored (counted): nothing to value
        self._admitted(key, entry, data)

    def _admitted(self, key: str, entry: CacheEntry, data: bytes) -> None:
        if self._values is not None:
            self._values.admitted(
                key, len(data), entry.generation_s, entry.endorsements, entry.created_s
            )

    def _make_room(self, nbytes: int) -> str:
        """Evict before a write of `nbytes` that would pass the limit (or wake the early
        evictor within its band); the disk's state (DiskRoom's) the limit was taken at."""
        disk = ROOM if self._disk is None else self._disk.state()
        with self._resized_is_an_error():
            live = self._live_bytes() + nbytes
            limit = self._limit(disk)
            if live > limit:
                with self._evict_lock:  # one evicting thread per process; the others re-check
                    if self._live_bytes() + nbytes > self._limit(disk):  # after it
                        self._evict()
            elif self._evict_early and live > limit - self._early_band(limit):
                self._evict_soon()
        return disk

    def merge(self, key: str, make: Callable[[CacheEntry | None], CacheEntry | None]) -> bool:
        """Write what `make` makes of `key`'s entry (None: absent or undecodable), read and
        written in one write transaction (LMDB's writers take turns, across processes too), so
        no other writer's change comes in between; False, writing nothing, when `make` says
        None. For small records merged in place (`TieredCache.merge_side`): room is made as
        for a `put` of what the key holds now and `MERGE_SLACK_BYTES`; a full map or, while the
        disk is short, a failed write evicts and tries once more, as `put` does (a merge never
        deletes the key's older copy instead: a floor must not fall). A write that still fails
        is counted as rejected and raised."""
        raw_key = key.encode()
        with self._resized_is_an_error(), self._env.begin() as txn:
            held = txn.get(raw_key)
        disk = self._make_room((0 if held is None else len(held)) + MERGE_SLACK_BYTES)
        try:
            written = self._merged(raw_key, make)
        except lmdb.Error as exc:
            full = isinstance(exc, lmdb.MapFullError)
            if not full and disk == ROOM:
                raise  # with room: the caller's error, as `put` says it
            if not full and time.monotonic() < self._disk_pause_until_s:
                self._reject()  # a while after such a failure: no eviction for want of disk
                raise
            try:
                with self._evict_lock:  # as `put`: room, then once more
                    self._evict(fraction=max(0.5, self._evict_fraction) if full else None)
                written = self._merged(raw_key, make)
            except lmdb.Error:
                if not full:
                    self._disk_pause_until_s = time.monotonic() + DISK_RETRY_PAUSE_S
                self._reject()
                raise
        if written is None:
            return False
        made, size = written
        if self._values is not None:
            self._values.admitted(key, size, made.generation_s, made.endorsements, made.created_s)
        return True

    def _reject(self) -> None:
        with self._lock:
            self._rejected += 1

    def _merged(
        self, raw_key: bytes, make: Callable[[CacheEntry | None], CacheEntry | None]
    ) -> tuple[CacheEntry, int] | None:
        """`merge`'s transaction: the entry written and its size, or None (nothing written)."""
        with self._resized_is_an_error(), self._env.begin(write=True) as txn:
            data = txn.get(raw_key)
            try:
                made = make(None if data is None else decode_entry(bytes(data)))
            except CorruptEntry:
                made = make(None)
            if made is None:
                return None
            stored = encode_entry(made)
            txn.put(raw_key, stored)
        return made, len(stored)

    def _limit(self, disk: str) -> int:
        """The live bytes writes keep under: the high-water mark, and while the disk is short
        (`disk`: DiskRoom's state), a share of the file's size when the shortage began (pinned:
        a limit that followed the file would let it grow)."""
        with self._lock:
            if disk == ROOM:
                self._short_file_bytes = 0
                return self._high_water_bytes
            if not self._short_file_bytes:
                self._short_file_bytes = self._file_bytes()
            if not self._short_file_bytes:
                return self._high_water_bytes
            share = self._headroom_fraction * (2.0 if disk == CRITICAL else 1.0)
            kept = int(self._short_file_bytes * max(1.0 - share, 0.0))
            return min(self._high_water_bytes, kept)

    def _early_band(self, limit: int) -> int:
        """How far under `limit` an early eviction starts: half of what one eviction frees."""
        return int(limit * self._evict_fraction / 2)

    def _evict_soon(self) -> None:
        """Wake this store's evictor thread (started at the first call)."""
        with self._lock:
            if self._closing:
                return
            if self._evictor is None:
                self._evictor = NamedThread(target=self._evict_ahead, name="l2-evict", daemon=True)
                self._evictor.start()
        self._early.set()

    def _evict_ahead(self) -> None:
        """The evictor thread: at each wake-up, evict if the live pages are still within the
        early band (another thread or process may have evicted meanwhile). An eviction that
        failed or freed nothing pauses it for `DISK_RETRY_PAUSE_S` (each write in the band
        would start another scan of every entry); a failure is logged once a minute, and left
        to the write that reaches the mark."""
        while True:
            self._early.wait()
            self._early.clear()
            if self._closing:
                return
            if time.monotonic() < self._early_pause_until_s:
                continue
            try:
                disk = ROOM if self._disk is None else self._disk.state()
                with self._resized_is_an_error(), self._evict_lock:
                    limit = self._limit(disk)
                    before = self._live_bytes()
                    if before <= limit - self._early_band(limit):
                        continue
                    self._evict()
                    with self._lock:
                        self._early_evictions += 1
                    if self._live_bytes() >= before:  # nothing freed: do not scan again at once
                        self._early_pause_until_s = time.monotonic() + DISK_RETRY_PAUSE_S
            except Exception:  # noqa: BLE001 - the write that reaches the mark evicts instead
                self._early_pause_until_s = time.monotonic() + DISK_RETRY_PAUSE_S
                now = time.monotonic()
                if now - self._early_logged_s >= 60.0:  # once a minute
                    self._early_logged_s = now
                    log.exception("L2 %s: evicting ahead of the writes failed", self.path)

    @property
    def early_evictions(self) -> int:
        """Evictions this store's own thread ran ahead of the writes (`evict_early`)."""
        with self._lock:
            return self._early_evictions

    def _write_after_freeing(
        self, key: str, entry: CacheEntry, data: bytes, exc: lmdb.Error
    ) -> bool:
        """The disk short and the write failed for want of it (pages freed inside the file are
        not all reusable while an older reader still sees them): evict `evict_fraction` and
        write again; True when that stored it. Else (and, for `DISK_RETRY_PAUSE_S` after such
        a failure, without evicting again: a disk with no room left must not empty L2 one
        write at a time) the answer is not stored: an older copy of the key is deleted in the
        same breath (never a newer one another writer stored meanwhile), counted as
        `rejected`, logged once a minute; False. When even that delete fails, `exc` is raised
        (the caller counts a failed write)."""
        now = time.monotonic()
        if now >= self._disk_pause_until_s:
            try:
                with self._evict_lock:
                    self._evict()
                self._write(key.encode(), data)
                return True
            except lmdb.Error:
                self._disk_pause_until_s = time.monotonic() + DISK_RETRY_PAUSE_S
        raw = key.encode()
        try:
            with self._env.begin(write=True) as txn:
                held = txn.get(raw)
                older = held is not None and _created_s(held) < entry.created_s
                if older:
                    txn.delete(raw)
        except lmdb.Error:
            raise exc from None
        if older:
            with self._lock:
                self._removed += 1
            if self._values is not None:
                self._values.forget([raw])
        with self._lock:
            self._rejected += 1
        if now - self._disk_logged_s >= 60.0:  # once a minute, not on every put
            self._disk_logged_s = now
            log.warning("L2 %s: %s even after evicting; the answer is not stored", self.path, exc)
        return False

    def _live_bytes(self) -> int:
        return data_bytes(self._env)

    def _file_bytes(self) -> int:
        """What the map's file takes now (it grows as pages are first used, never shrinks); 0
        when it cannot be read (then no limit follows from it)."""
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    def _write(self, key: bytes, data: bytes) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(key, data)

    @contextlib.contextmanager
    def _resized_is_an_error(self) -> Iterator[None]:
        """MDB_MAP_RESIZED as an OSError that says what to do (see map_resized_message)."""
        try:
            yield
        except lmdb.MapResizedError:
            raise OSError(map_resized_message(self.path, self._max_bytes)) from None

    def _evict(self, fraction: float | None = None) -> None:
        """Delete `fraction` of the entries (at least one), as the policy nominates them, and
        every entry too corrupt to rank. Called under `_evict_lock`, which guards the policy."""
        policy = self._policy
        policy.clear()
        since_s = self._values.now() if self._values is not None else 0.0  # before the scan
        broken: list[bytes] = []
        ages: list[tuple[bytes, float]] = []
        sizes: list[int] = []
        try:
            # buffers: each value read in place (its header, its length), not copied whole:
            # the scan covers every entry, and copying them all made one eviction of a 2 GiB
            # file of 16 KB answers take 250 ms (perf.disk_squeeze); keys are copied
            try:
                with self._env.begin(buffers=True) as txn:
                    for raw, value in txn.cursor():
                        try:
                            created_s = peek_created_s(value)
                        except CorruptEntry:
                            broken.append(bytes(raw))
                            continue
                        ages.append((bytes(raw), created_s))
                        sizes.append(len(value))
            except LMDB_DAMAGE as exc:
                # a damaged page met by the scan: what it read is ranked and evicted, so the
                # writes waiting for room go on (raised, every write at the mark failed until
                # a restart moved the file aside); reads of the damage are misses meanwhile
                if self._damage_log.ready():
                    log.error(
                        "L2 %s has a damaged page (%s): evicting from the %d entries read before "
                        "it; restart to rebuild it",
                        self.path,
                        exc,
                        len(ages),
                    )
                if not ages and not broken:
                    raise
            if self._closing:  # closing while the scan ran: nothing deleted
                return
            share = self._evict_fraction if fraction is None else fraction
            count = max(1, int(len(ages) * share))
            chosen = None if self._values is None else self._values.nominate(ages, count)
            if chosen is None:
                for (key, created_s), size in zip(ages, sizes, strict=True):
                    policy.admit(key.decode(), size, created_s=created_s)
                chosen = [k.encode() for k in policy.nominate(count)]
            victims = chosen + broken
        finally:
            policy.clear()
        scanned = dict(ages)
        deleted = self._delete_chunked(victims, scanned)
        self._count(evictions=len(deleted))
        if self._values is not None:
            given_up = self._values.evicted(deleted)
            gone = set(deleted)
            self._values.sweep({key for key, _ in ages if key not in gone}, since_s)
            with self._lock:
                self._evicted_hits += given_up

    def _delete_chunked(
        self, keys: list[bytes], scanned: dict[bytes, float] | None = None
    ) -> list[bytes]:
        """Delete `keys` in key order, `DELETE_CHUNK` per transaction (a chunk that does not
        fit is split down to single keys); the keys that were there. One transaction over a
        tenth of the keys would copy nearly every leaf page (digests are spread over all of
        them), more than the free quarter of the map, and fail; committed chunks free pages
        for the next ones. A key whose entry is newer than `scanned` saw it (written again
        since the scan: a fresh answer) stays. Stops between chunks when the store closes."""
        deleted: list[bytes] = []
        scanned = scanned or {}
        pending = [sorted(keys)[i : i + DELETE_CHUNK] for i in range(0, len(keys), DELETE_CHUNK)]
        while pending and not self._closing:
            chunk = pending.pop(0)
            try:
                # buffers: each victim's header read in place (valid until the delete)
                with self._env.begin(write=True, buffers=True) as txn:
                    gone = [key for key in chunk if self._still_old(txn, key, scanned)]
            except (lmdb.MapFullError, lmdb.DiskError):  # a delete copies pages too
                if len(chunk) == 1:
                    log.warning("L2 %s is too full to delete even one entry", self.path)
                    break
                half = len(chunk) // 2
                pending[:0] = [chunk[:half], chunk[half:]]
                continue
            deleted += gone
        return deleted

    @staticmethod
    def _still_old(txn: lmdb.Transaction, key: bytes, scanned: dict[bytes, float]) -> bool:
        """Delete `key` in `txn` unless it was written again since the scan (its entry newer
        than `scanned` says; a key the scan found damaged goes whatever it holds); whether it
        went (another writer may have deleted it first)."""
        seen = scanned.get(key)
        if seen is not None:
            held = txn.get(key)
            if held is None:
                return False
            if _created_s(held) > seen:
                return False
        return bool(txn.delete(key))

    def endorse(self, key: str, created_s: float, endorsements: int) -> int:
        """The held copy of `key`'s answer made at `created_s` now has `endorsements` `good`
        verdicts (another host's, read from L3): written back with them in one transaction
        that re-reads the copy first (another process may have replaced it), and counted in the
        values as requests; how many were new (0: not held, another answer, no more verdicts,
        or the disk short of its headroom)."""
        if self._disk is not None and self._disk.state() != ROOM:
            return 0
        endorsements = min(endorsements, MAX_ENDORSEMENTS)  # what an entry may carry
        raw_key = key.encode()
        with self._resized_is_an_error(), self._env.begin(write=True) as txn:
            data = txn.get(raw_key)
            if data is None:
                return 0
            try:
                held = decode_entry(bytes(data))
            except CorruptEntry:
                return 0
            if held.created_s != created_s or endorsements <= held.endorsements:
                return 0
            updated = dataclasses.replace(held, endorsements=endorsements)
            stored = encode_entry(updated)
            txn.put(raw_key, stored)
        if self._values is not None:
            self._values.admitted(key, len(stored), held.generation_s, endorsements, created_s)
        return endorsements - held.endorsements

    def change_token(self) -> int | None:
        """A value that changes at every write to L2 from any process of the host (a new
        answer, a replaced one, an endorsement, a deletion: LMDB's last committed transaction
        id, read from the map's meta page without a transaction); None when it cannot be read
        (then a reader must take L2 as changed)."""
        try:
            return int(self._env.info()["last_txnid"])
        except lmdb.Error:
            return None

    def value(self, key: str) -> float | None:
        """What `key`'s entry is worth by the shared values (None without values, or for an
        entry they hold nothing for)."""
        if self._values is None:
            return None
        try:
            found = self._values.value(key)
        except Exception:  # noqa: BLE001 - advice only
            log.exception("reading the L2 value of %s failed", key)
            return None
        return None if found is None else found[0]

    def peek(self, key: str) -> CacheEntry | None:
        """`get` that counts nothing (no hit, no request in the values) and drops nothing: for
        reads that are not requests (feedback checking an answer)."""
        try:
            with self._env.begin(buffers=False) as txn:
                data = txn.get(key.encode())
        except (*LMDB_DAMAGE, lmdb.MapResizedError):
            return None
        return peeked(data)

    def get_or_raise(self, key: str) -> CacheEntry | None:
        """`peek` for a decision that must not take an unreadable L2 for a missing answer
        (semantic compaction deletes the rows of answers that are gone): Unavailable where
        `peek` says None for a damaged page or a map another process resized."""
        return self.peek_with_token(key)[0]

    def peek_with_token(self, key: str) -> tuple[CacheEntry | None, int]:
        """`get_or_raise`, and the change token of the snapshot that read it (the id of the last
        transaction it sees). A comparison keeps this one, not a `change_token` read before it:
        a commit shows in the meta page `change_token` reads while its metadata is being
        synced, before a new read transaction sees it, so a token read first can name a write
        the read then missed."""
        try:
            with self._env.begin(buffers=False) as txn:
                data = txn.get(key.encode())
                token = int(txn.id())
        except (*LMDB_DAMAGE, lmdb.MapResizedError) as exc:
            raise Unavailable(f"L2 {self.path} could not be read: {type(exc).__name__}") from exc
        return peeked(data), token

    def delete(self, key: str) -> bool:
        return self.delete_many([key]) == 1

    def delete_if_same(self, key: str, seen: CacheEntry | None) -> bool:
        """Compared and deleted in one write transaction (LMDB has one writer at a time)."""
        raw = key.encode()
        with self._resized_is_an_error(), self._env.begin(write=True, buffers=False) as txn:
            data = txn.get(raw)
            if data is None or peeked(data) != seen:
                return False
            txn.delete(raw)
        self._deleted([raw])
        return True

    def delete_many(self, keys: Iterable[str]) -> int:
        """One write transaction (one commit) for all of them."""
        with self._resized_is_an_error(), self._env.begin(write=True) as txn:
            gone = [raw for raw in (key.encode() for key in keys) if txn.delete(raw)]
        self._deleted(gone)
        return len(gone)

    def delete_unchanged(self, found: list[tuple[str, CacheEntry]]) -> list[str]:
        """In chunks (`_delete_chunked`), each key only while its entry is no newer than the
        one found: an entry is replaced only by a newer answer (or the same answer again)."""
        scanned = {key.encode(): entry.created_s for key, entry in found}
        with self._resized_is_an_error():
            gone = self._delete_chunked(list(scanned), scanned)
        self._deleted(gone)
        return [key.decode() for key in gone]

    def _deleted(self, gone: list[bytes]) -> None:
        """Count deletions committed, and drop them from the values' record."""
        with self._lock:
            self._removed += len(gone)
        if self._values is not None and gone:
            self._values.forget(gone)

    def scan(self) -> Iterator[tuple[str, CacheEntry]]:
        """One read transaction over the whole map; decoding every entry costs about as much
        as reading it (see docs/replicas.md for the figure)."""
        with self._env.begin(buffers=False) as txn:
            for key, value in txn.cursor():
                try:
                    yield key.decode(), decode_entry(value)
                except CorruptEntry:
                    continue

    def clear(self) -> None:
        with self._env.begin(write=True) as txn:
            txn.drop(self._env.open_db(), delete=False)
        if self._values is not None:
            self._values.forget_all()

    def stats(self) -> StoreStats:
        entries = int(self._env.stat()["entries"])
        live_bytes = self._live_bytes()
        # with values, what eviction gave up and how skewed the host's requests are (None
        # without: L2 then counts no requests per entry)
        skew = None if self._values is None else self._values.skew()
        with self._lock:
            return StoreStats(
                entries=entries,
                bytes=live_bytes,
                max_bytes=self._max_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                corrupt=self._corrupt,
                evicted_hits=self._evicted_hits,
                rejected=self._rejected,
                removed=self._removed,
                hit_skew=skew,
                early_evictions=self._early_evictions,
            )

    def _count(self, hits: int = 0, misses: int = 0, evictions: int = 0, corrupt: int = 0) -> None:
        with self._lock:
            self._hits += hits
            self._misses += misses
            self._evictions += evictions
            self._corrupt += corrupt

    def close(self) -> None:
        with self._lock:
            self._closing = True
            evictor = self._evictor
        if evictor is not None:  # an eviction under way finishes first: its transactions
            self._early.set()  # must end before the environment closes
            evictor.join()
        if self._values is not None:
            self._values.close()
        self._env.close()
