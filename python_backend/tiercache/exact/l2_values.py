"""What L2's entries are worth: GreedyDual-Size-Frequency values shared by every process of the
host (issue 19).

L2 is written and read by every stage process of the host, so no process can keep its order in
memory as L1 does (`tiercache.eviction`). This keeps the policy's state on disk instead, in an
LMDB environment beside L2 (its own file, so its writes never wait for L2's): per entry its value
`H`, its request count and its weight (generation seconds per stored byte), and the host's
inflation level `L`. The rules are GreedyDual-Size-Frequency's (Cherkasova 1998), as L1 applies
them:

- an admission (an answer written to L2, generated or filled from L3) counts one request, plus
  one per `good` verdict the entry holds: `H = L + count x weight`. A key written again with a
  new answer (regenerated after an invalidation) goes on from its record's count; the same
  answer written again (an endorsement, a refill) adds only the verdicts it did not have;
- a hit counts one more request; hits are added up in each process and written at its next L2
  read or write once `FLUSH_INTERVAL_S` has passed (and before an eviction, and at close), so
  an L2 read costs a dictionary update, and a short write transaction every 2 s at most;
- an eviction takes the lowest `H` first, and raises `L` to the highest `H` it took: what was
  asked for long ago falls behind what is asked for now, at the rate L2 turns over. An entry
  without a record (written by a process whose admission failed, or set to `oldest`) ranks as a
  fresh admission of the median weight, oldest first among equals;
- an entry deleted from L2 (invalidated, expired, cleared) loses its record with it.

An unknown cost (a warmed answer) counts as the mean of the known ones admitted lately, as in L1;
a stored cost is capped at `MAX_COST_S`. The values are advice: an error reading or writing them
(logged at most once a minute) never fails an L2 read or write (and when they cannot be read at
all, L2 evicts oldest first). The file is not flushed to disk at each commit (a crash of the
process loses nothing; of the machine, recent values, or the file's consistency): it is rebuilt
empty when the machine's boot id changes, when it is damaged as it opens, and its records are
checked as they are read. Why it is worth it: on the soak's mix
with production answer lengths, L2's oldest-first order saved 0.78x to 0.95x what LRU saves;
these values, evicting in L2's batches of a tenth, save 1.12x to 2.02x what it does, within 8 %
of L1's policy evicting one entry at a time (docs/kv_reuse.md, "L2").
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import lmdb
import numpy as np

from tiercache.exact.stores import check_readers, open_lmdb
from tiercache.stats import top_share

log = logging.getLogger(__name__)

# H, weight, count, endorsements, the entry's created_s, when the record was written
_RECORD = struct.Struct("<ddIIdd")
_META_KEY = b"\x00meta"  # never an answer key (hex digests)
# version, the boot id it was written under, L, known cost sum and count, hit skew, when the
# last eviction was
_META = struct.Struct("<4s16sddddd")
_VERSION = b"L2V2"
COST_WINDOW = 10_000.0  # known costs before both sums halve (as the L1 policy's window)
MAX_COST_S = 86_400.0  # a cost above a day is counted as a day (a hostile or broken writer)
FLUSH_INTERVAL_S = 2.0
EVICTED_CHUNK = 256  # records an eviction deletes per write transaction
MIN_MAP_BYTES = 16 << 20
_LOG_EVERY_S = 60.0
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def l2_values_map_bytes(l2_max_bytes: int) -> int:
    """The values' map for an L2 of `l2_max_bytes`: half of it, at least MIN_MAP_BYTES (a
    record takes about 150 bytes of pages, a short answer in L2 about 370; LMDB's file is
    sparse, so map it does not use costs no disk)."""
    return max(MIN_MAP_BYTES, l2_max_bytes // 2)


def boot_id(path: Path = _BOOT_ID) -> bytes:
    """This boot of the machine (16 bytes; zeros where the kernel does not say)."""
    try:
        return bytes.fromhex(path.read_text().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return bytes(16)


class L2Values:
    """The values of one host's L2 entries, in the LMDB environment at `path`. Thread-safe;
    shared by the host's processes through the file."""

    def __init__(
        self,
        path: Path,
        map_size: int,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        boot: bytes | None = None,
    ) -> None:
        self.path = path
        # not durable: a crash may lose the last values, never an answer (see the docstring)
        self._env = open_lmdb(path, map_size, "L2 values", clock, durable=False)
        self._monotonic = monotonic
        self.now = clock
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}  # hits not written yet
        self._flushed_s = monotonic()
        self._logged_s = -_LOG_EVERY_S
        self._boot = boot_id() if boot is None else boot
        try:
            self._check_boot()
        except BaseException:
            self._env.close()
            raise

    def _check_boot(self) -> None:
        """Start empty when the file was written under another boot of the machine (or by
        another format): its pages may not all have reached the disk."""
        with self._env.begin(write=True) as txn:
            meta = self._meta_of(txn.get(_META_KEY))
            if meta is not None and meta[0] == self._boot:
                return
            if txn.stat(self._env.open_db())["entries"]:
                log.info("L2 values %s: written under another boot or format; rebuilt", self.path)
                txn.drop(self._env.open_db(), delete=False)
            txn.put(_META_KEY, self._pack_meta([0.0] * 5))

    def _failed(self, what: str) -> None:
        now = self._monotonic()
        if now - self._logged_s >= _LOG_EVERY_S:
            self._logged_s = now
            log.exception("L2 values %s: %s failed", self.path, what)

    def _meta_of(self, raw: bytes | memoryview | None) -> tuple[bytes, list[float]] | None:
        if raw is None or len(raw) != _META.size:
            return None
        version, boot, *numbers = _META.unpack(raw)
        if version != _VERSION or not all(math.isfinite(x) for x in numbers):
            return None
        return boot, list(numbers)

    def _meta(self, txn: lmdb.Transaction) -> list[float]:
        """[L, known cost sum, known cost count, skew, last eviction]; zeros when missing or
        damaged."""
        found = self._meta_of(txn.get(_META_KEY))
        return found[1] if found is not None else [0.0] * 5

    def _pack_meta(self, numbers: list[float]) -> bytes:
        return _META.pack(_VERSION, self._boot, *numbers)

    @staticmethod
    def _record(
        raw: bytes | memoryview | None,
    ) -> tuple[float, float, int, int, float, float] | None:
        """(H, weight, count, endorsements, created_s, written_s); None when absent or
        damaged."""
        if raw is None or len(raw) != _RECORD.size:
            return None
        record = _RECORD.unpack(raw)
        if not all(math.isfinite(x) for x in (record[0], record[1], record[4], record[5])):
            return None
        return record

    def admitted(
        self,
        key: str,
        size: int,
        cost_s: float,
        endorsements: int = 0,
        created_s: float = 0.0,
    ) -> None:
        """`key` was written to L2 (`size` stored bytes, `cost_s` generation seconds, 0.0 when
        unknown; the entry's `endorsements` and `created_s`, which tell a new answer from the
        same one written again)."""
        try:
            with self._env.begin(write=True) as txn:
                self._write_pending(txn)
                meta = self._meta(txn)
                inflation = meta[0]
                raw_key = key.encode()
                record = self._record(txn.get(raw_key))
                now = self.now()
                if record is not None and record[4] == created_s:
                    # the same answer again (an endorsement, a refill): its new verdicts only
                    count = record[2] + max(endorsements - record[3], 0)
                    endorsements = max(endorsements, record[3])
                    weight = record[1]
                else:  # a new answer: one more request, and its verdicts
                    if cost_s > 0.0:
                        cost_s = min(cost_s, MAX_COST_S)
                        meta[1], meta[2] = meta[1] + cost_s, meta[2] + 1.0
                        if meta[2] > COST_WINDOW:
                            meta[1], meta[2] = meta[1] / 2, meta[2] / 2
                        txn.put(_META_KEY, self._pack_meta(meta))
                    else:
                        cost_s = meta[1] / meta[2] if meta[2] else 1.0
                    count = (record[2] if record is not None else 0) + 1 + endorsements
                    weight = cost_s / max(size, 1)
                value = inflation + count * weight
                txn.put(raw_key, _RECORD.pack(value, weight, count, endorsements, created_s, now))
        except Exception:  # noqa: BLE001 - advice only: the entry is stored
            self._failed("recording an admission")

    def hit(self, key: str) -> None:
        """`key` was read from L2 (written with the next flush)."""
        raw_key = key.encode()
        with self._lock:
            self._pending[raw_key] = self._pending.get(raw_key, 0) + 1
            due = self._monotonic() - self._flushed_s >= FLUSH_INTERVAL_S
        if due:
            self.flush()

    def _take_pending(self) -> dict[bytes, int]:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._flushed_s = self._monotonic()
        return pending

    def _write_pending(self, txn: lmdb.Transaction) -> None:
        """Write this process's counted hits in `txn` (a write transaction already open)."""
        pending = self._take_pending()
        if not pending:
            return
        inflation = self._meta(txn)[0]
        for raw_key, hits in pending.items():
            record = self._record(txn.get(raw_key))
            if record is None:
                continue  # not admitted through the values (or gone since)
            _, weight, count, endorsements, created_s, written_s = record
            count += hits
            value = inflation + count * weight
            txn.put(raw_key, _RECORD.pack(value, weight, count, endorsements, created_s, written_s))

    def flush(self) -> None:
        """Write the hits counted in this process since the last flush."""
        with self._lock:
            if not self._pending:
                return
        try:
            with self._env.begin(write=True) as txn:
                self._write_pending(txn)
        except Exception:  # noqa: BLE001 - advice only
            self._failed("recording hits")

    def nominate(self, entries: Sequence[tuple[bytes, float]], count: int) -> list[bytes] | None:
        """The `count` of `entries` ((key, created_s) pairs: L2's keys) to evict first: lowest
        value first. An entry without a record ranks as a fresh admission of the median weight
        if it was made since the last eviction, else at the current level `L` (it ages as if
        never asked for again); oldest first among equals. None when the values cannot be read
        (the caller evicts oldest first)."""
        self.flush()
        try:
            with self._env.begin() as txn:
                meta = self._meta(txn)
                inflation, last_eviction_s = meta[0], meta[4]
                found = [
                    (self._record(txn.get(raw_key)), created_s, raw_key)
                    for raw_key, created_s in entries
                ]
        except Exception:  # noqa: BLE001 - advice only
            self._failed("reading values")
            return None
        # the weights' upper median, and the ranking below, in numpy: a sort of Python objects
        # holds the interpreter lock for its whole length, stalling the host's writes when this
        # runs on L2's evictor thread (tens of ms at tens of thousands of entries)
        weights = np.fromiter((r[1] for r, _, _ in found if r is not None), dtype=np.float64)
        middle = len(weights) // 2
        fresh = inflation + (float(np.partition(weights, middle)[middle]) if len(weights) else 0.0)

        def value(record: tuple[float, ...] | None, created_s: float) -> float:
            if record is not None:
                return record[0]
            return fresh if created_s >= last_eviction_s else inflation

        # lowest value, then oldest, then L2's key order (as the cursor gave them: lexsort is
        # stable)
        n = len(found)
        values = np.fromiter((value(r, c) for r, c, _ in found), dtype=np.float64, count=n)
        created = np.fromiter((c for _, c, _ in found), dtype=np.float64, count=n)
        order = np.lexsort((created, values))[: max(count, 0)]
        return [found[i][2] for i in order.tolist()]

    def evicted(self, victims: Iterable[bytes]) -> int:
        """`victims` left L2: `L` rises to the highest value among them and their records go.
        Returns the requests they had had after their first (the value eviction gave up), and
        records the hit skew of what stays (`skew`, read outside the write)."""
        given_up = 0
        try:
            victims = list(victims)
            with self._env.begin() as txn:  # L's new level first: every chunk raises it whole
                top = max(
                    (r[0] for raw_key in victims if (r := self._record(txn.get(raw_key)))),
                    default=-math.inf,
                )
            # in chunks: one write transaction over a tenth of L2's records would hold this
            # file's write lock, and with it every write-back's `admitted`, for its whole length
            for start in range(0, max(len(victims), 1), EVICTED_CHUNK):
                chunk_given_up = 0
                with self._env.begin(write=True) as txn:
                    meta = self._meta(txn)
                    meta[0] = max(meta[0], top)
                    for raw_key in victims[start : start + EVICTED_CHUNK]:
                        record = self._record(txn.get(raw_key))
                        if record is not None:
                            meta[0] = max(meta[0], record[0])
                            chunk_given_up += max(record[2] - 1, 0)
                            txn.delete(raw_key)
                    meta[4] = self.now()
                    txn.put(_META_KEY, self._pack_meta(meta))
                given_up += chunk_given_up  # committed
            with self._env.begin() as txn:  # a snapshot: writers go on meanwhile
                repeats = [
                    max(record[2] - 1, 0)
                    for raw_key, raw in txn.cursor()
                    if raw_key != _META_KEY and (record := self._record(raw)) is not None
                ]
            skew = top_share(repeats)
            with self._env.begin(write=True) as txn:
                meta = self._meta(txn)
                meta[3] = skew
                txn.put(_META_KEY, self._pack_meta(meta))
        except Exception:  # noqa: BLE001 - advice only
            self._failed("recording an eviction")
        return given_up

    def sweep(self, live: set[bytes], since_s: float) -> int:
        """Drop the records of keys L2 no longer holds: not in `live` (L2's keys in a snapshot
        taken at `since_s`, on this clock) and written before it (a record written since is of
        a key written since, which the snapshot cannot show). They are left by a process set
        to `oldest`, a crash between L2's delete and the values', or a failed update. Returns
        how many went."""
        try:
            with self._env.begin() as txn:
                stale = [
                    raw_key
                    for raw_key, raw in txn.cursor()
                    if raw_key != _META_KEY
                    and raw_key not in live
                    and ((record := self._record(raw)) is None or record[5] < since_s)
                ]
            gone = 0
            for start in range(0, len(stale), 256):
                with self._env.begin(write=True) as txn:
                    for raw_key in stale[start : start + 256]:
                        record = self._record(txn.get(raw_key))
                        if record is None or record[5] < since_s:  # not rewritten meanwhile
                            gone += bool(txn.delete(raw_key))
            return gone
        except Exception:  # noqa: BLE001 - advice only
            self._failed("sweeping records of entries gone")
            return 0

    def forget(self, keys: Iterable[bytes]) -> None:
        """`keys` were deleted from L2 (not evicted): their records go, `L` stays."""
        try:
            with self._env.begin(write=True) as txn:
                for raw_key in keys:
                    txn.delete(raw_key)
        except Exception:  # noqa: BLE001 - advice only
            self._failed("forgetting deleted entries")

    def forget_all(self) -> None:
        """L2 was cleared: every record goes (the level and the cost mean stay)."""
        try:
            with self._env.begin(write=True) as txn:
                meta = self._meta(txn)
                txn.drop(self._env.open_db(), delete=False)
                txn.put(_META_KEY, self._pack_meta(meta))
        except Exception:  # noqa: BLE001 - advice only
            self._failed("forgetting every entry")

    def skew(self) -> float:
        """Share of L2's requests after the first taken by its hottest 1 % of entries, as of
        the last eviction (0.0 before one, or when the values cannot be read)."""
        try:
            with self._env.begin() as txn:
                return self._meta(txn)[3]
        except Exception:  # noqa: BLE001 - advice only
            self._failed("reading the skew")
            return 0.0

    def value(self, key: str) -> tuple[float, int] | None:
        """(value, request count) of `key`; None without a record."""
        with self._env.begin() as txn:
            record = self._record(txn.get(key.encode()))
        return None if record is None else (record[0], record[2])

    def inflation(self) -> float:
        with self._env.begin() as txn:
            return self._meta(txn)[0]

    def reader_check(self) -> int:
        """Free the values' reader slots of dead processes (as L2's own)."""
        return check_readers(self._env, "L2 values", self.path)

    def close(self) -> None:
        self.flush()
        self._env.close()
