"""What L2's entries are worth: GreedyDual-Size-Frequency values shared by every process of the
host (issue 19).

L2 is written and read by every stage process of the host, so no process can keep its order in
memory as L1 does (`tiercache.eviction`). This keeps the policy's state on disk instead, in an
LMDB environment beside L2 (its own file, so its writes never wait for L2's): per entry its value
`H`, its request count and its weight (generation seconds per stored byte), and the host's
inflation level `L`. The rules are GreedyDual-Size-Frequency's (Cherkasova 1998), as L1 applies
them:

- an admission (an answer written to L2, generated or filled from L3) counts one request, plus
  one per `good` verdict the entry holds: `H = L + count x weight`; the count of a key written
  again (regenerated after an invalidation, endorsed) goes on from its record;
- a hit counts one more request; hits are added up in each process and written every
  `FLUSH_INTERVAL_S` (and before an eviction), so an L2 read costs a dictionary update, not a
  write;
- an eviction takes the lowest `H` first (entries without a record, written before this or by a
  process without values, go first, oldest first), and raises `L` to the highest `H` it took:
  what was asked for long ago falls behind what is asked for now, at the rate L2 turns over.

An unknown cost (a warmed answer) counts as the mean of the known ones admitted lately, as in L1.
The values are advice: an error reading or writing them (logged at most once a minute) leaves
L2 evicting oldest first, never fails a read or a write. Why it is worth it: on the soak's mix
with production answer lengths, L2's oldest-first order saved 0.78x to 0.95x what LRU saves;
these values, evicting in L2's batches of a tenth, save 1.12x to 2.02x what it does, within 8 %
of L1's policy evicting one entry at a time (docs/kv_reuse.md, "L2").
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import lmdb

from tiercache.exact.stores import open_lmdb
from tiercache.stats import top_share

log = logging.getLogger(__name__)

_RECORD = struct.Struct("<ddI")  # H, weight, count
_META_KEY = b"\x00meta"  # never an answer key (hex digests)
# L, known cost sum, known cost count, hit skew (the hottest 1 %'s share, as of the last eviction)
_META = struct.Struct("<dddd")
COST_WINDOW = 10_000.0  # known costs before both sums halve (as the L1 policy's window)
FLUSH_INTERVAL_S = 2.0
MIN_MAP_BYTES = 16 << 20


def l2_values_map_bytes(l2_max_bytes: int) -> int:
    """The values' map for an L2 of `l2_max_bytes`: an eighth of it, at least MIN_MAP_BYTES (a
    record takes about 150 bytes of pages, an entry of L2 more than a kilobyte; LMDB's file is
    sparse, so unused map costs no disk)."""
    return max(MIN_MAP_BYTES, l2_max_bytes // 8)


_LOG_EVERY_S = 60.0


class L2Values:
    """The values of one host's L2 entries, in the LMDB environment at `path`. Thread-safe;
    shared by the host's processes through the file."""

    def __init__(
        self,
        path: Path,
        map_size: int,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        # not durable: a crash may lose the last values, never an answer (and damage rebuilds)
        self._env = open_lmdb(path, map_size, "L2 values", clock, durable=False)
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}  # hits not written yet
        self._flushed_s = monotonic()
        self._logged_s = -_LOG_EVERY_S

    def _failed(self, what: str) -> None:
        now = self._monotonic()
        if now - self._logged_s >= _LOG_EVERY_S:
            self._logged_s = now
            log.exception(
                "L2 values %s: %s failed; L2 evicts oldest first meanwhile", self.path, what
            )

    @staticmethod
    def _meta(txn: lmdb.Transaction) -> list[float]:
        raw = txn.get(_META_KEY)
        return list(_META.unpack(raw)) if raw is not None and len(raw) == _META.size else [0.0] * 4

    @staticmethod
    def _record(raw: bytes | None) -> tuple[float, float, int] | None:
        if raw is None or len(raw) != _RECORD.size:
            return None
        return _RECORD.unpack(raw)

    def admitted(self, key: str, size: int, cost_s: float, endorsements: int = 0) -> None:
        """`key` was written to L2 (`size` stored bytes, `cost_s` generation seconds, 0.0 when
        unknown)."""
        try:
            with self._env.begin(write=True) as txn:
                inflation, known_sum, known_count, skew = self._meta(txn)
                if cost_s > 0.0:
                    known_sum, known_count = known_sum + cost_s, known_count + 1.0
                    if known_count > COST_WINDOW:
                        known_sum, known_count = known_sum / 2, known_count / 2
                else:
                    cost_s = known_sum / known_count if known_count else 1.0
                txn.put(_META_KEY, _META.pack(inflation, known_sum, known_count, skew))
                raw_key = key.encode()
                record = self._record(txn.get(raw_key))
                count = (record[2] if record is not None else 0) + 1 + endorsements
                weight = cost_s / max(size, 1)
                txn.put(raw_key, _RECORD.pack(inflation + count * weight, weight, count))
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

    def flush(self) -> None:
        """Write the hits counted in this process since the last flush."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._flushed_s = self._monotonic()
        if not pending:
            return
        try:
            with self._env.begin(write=True) as txn:
                inflation = self._meta(txn)[0]
                for raw_key, hits in pending.items():
                    record = self._record(txn.get(raw_key))
                    if record is None:
                        continue  # not admitted through the values (or evicted since)
                    _, weight, count = record
                    count += hits
                    txn.put(raw_key, _RECORD.pack(inflation + count * weight, weight, count))
        except Exception:  # noqa: BLE001 - advice only
            self._failed("recording hits")

    def nominate(self, entries: Sequence[tuple[bytes, float]], count: int) -> list[bytes] | None:
        """The `count` of `entries` ((key, created_s) pairs: L2's keys) to evict first: lowest
        value first, entries without a record before every other, oldest first among them.
        None when the values cannot be read (the caller evicts oldest first)."""
        self.flush()
        try:
            with self._env.begin() as txn:
                ranked = []
                for raw_key, created_s in entries:
                    record = self._record(txn.get(raw_key))
                    value = record[0] if record is not None else -float("inf")
                    ranked.append((value, created_s, raw_key))
        except Exception:  # noqa: BLE001 - advice only
            self._failed("reading values")
            return None
        ranked.sort()
        return [raw_key for _, _, raw_key in ranked[:count]]

    def evicted(self, victims: Iterable[bytes], live: set[bytes]) -> int:
        """`victims` left L2: `L` rises to the highest value among them, and their records
        go, with those of every key no longer in L2 (`live`: the keys it still holds). Returns
        the requests the victims had had after their first (the value eviction gave up), and
        records the hit skew of what stays (`skew`)."""
        given_up = 0
        try:
            with self._env.begin(write=True) as txn:
                meta = self._meta(txn)
                for raw_key in victims:
                    record = self._record(txn.get(raw_key))
                    if record is not None:
                        meta[0] = max(meta[0], record[0])
                        given_up += max(record[2] - 1, 0)
                repeats: list[int] = []
                stale: list[bytes] = []
                for raw_key, raw in txn.cursor():
                    if raw_key == _META_KEY:
                        continue
                    if raw_key not in live:
                        stale.append(raw_key)
                        continue
                    record = self._record(raw)
                    repeats.append(max(record[2] - 1, 0) if record is not None else 0)
                for raw_key in stale:  # not while the cursor walks
                    txn.delete(raw_key)
                # entries without a record count as never asked for again
                repeats += [0] * max(len(live) - len(repeats), 0)
                meta[3] = top_share(repeats)
                txn.put(_META_KEY, _META.pack(*meta))
        except Exception:  # noqa: BLE001 - advice only
            self._failed("recording an eviction")
        return given_up

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
        """(value, request count) of `key`; None without a record. For tests and inspection."""
        with self._env.begin() as txn:
            record = self._record(txn.get(key.encode()))
        return None if record is None else (record[0], record[2])

    def inflation(self) -> float:
        with self._env.begin() as txn:
            return self._meta(txn)[0]

    def close(self) -> None:
        self.flush()
        self._env.close()
