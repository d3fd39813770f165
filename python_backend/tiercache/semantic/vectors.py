"""The embedding vector cache: the same text is never embedded twice, also across restarts.

Keyed by (embedder id and revision, tenant scope, SHA-256 of the normalized text): one tenant's
prompts never answer another's from this cache, so the time an embedding takes cannot tell a
tenant whether anyone else sent the same text (issue 14). L1 is an in-process LRU
bounded in bytes that a budget controller may resize (tiercache.budgets; its shadow queue says
what one more byte would save: an L2 read, or an embedding when L2 lost the vector too); L2 is
an LMDB environment on the host. Values on disk carry a checksum; a corrupt one is a miss and
is dropped. The L1 is written here, not cachetools': its LRU cannot be resized in place.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from tiercache.exact.stores import check_readers, open_lmdb
from tiercache.log_throttle import LogThrottle
from tiercache.machine import ROOM, DiskRoom
from tiercache.semantic.row_log import InvalidVector, check_vector
from tiercache.shadow import ShadowQueue, shadow_bytes

log = logging.getLogger(__name__)
_CHECKSUM_BYTES = 16
ENTRY_OVERHEAD_BYTES = 100  # what L1 counts per vector beyond its floats (key, bookkeeping)


def vector_key(embedder_key: str, text: str, tenant_scope: str = "") -> bytes:
    """Key of a text's vector: embedder id@revision, the tenant scope it was embedded for, and
    the digest of the normalized text."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return f"{embedder_key}/{tenant_scope}/{digest}".encode()


def encode_vector(vector: np.ndarray) -> bytes:
    data = np.ascontiguousarray(vector, dtype=np.float32).tobytes()
    return hashlib.sha256(data).digest()[:_CHECKSUM_BYTES] + data


def decode_vector(blob: bytes, dimensions: int) -> np.ndarray | None:
    """The vector, or None when the bytes are not a whole, intact vector of `dimensions` the
    index takes (`check_vector`: finite, unit norm). The checksum is not keyed: it catches a
    damaged page, and the check catches a value that passes it but would score past every
    true neighbour (a vector of norm 2 matched every row at 2.0)."""
    data = bytes(blob[_CHECKSUM_BYTES:])
    if len(data) != 4 * dimensions or hashlib.sha256(data).digest()[:_CHECKSUM_BYTES] != bytes(
        blob[:_CHECKSUM_BYTES]
    ):
        return None
    vector = np.frombuffer(data, dtype=np.float32).copy()
    try:
        check_vector(vector, dimensions)
    except InvalidVector:
        return None
    return vector


@dataclass(frozen=True, slots=True)
class VectorCacheStats:
    l1_hits: int
    l2_hits: int
    misses: int
    corrupt: int
    l1_entries: int
    l2_skipped: int = 0  # vectors kept in L1 only: the disk short of its headroom
    l2_clears: int = 0  # times L2 was full and started over


class VectorCache:
    def __init__(
        self,
        path: Path,
        dimensions: int,
        l1_max_bytes: int = 16 << 20,
        l2_max_bytes: int = 1 << 30,
        disk: DiskRoom | None = None,
    ) -> None:
        """`disk`: the state directory's free disk (None: not watched); while it is short of
        its headroom, vectors are kept in L1 only (they are recomputable)."""
        self.dimensions = dimensions
        self.path = path
        self._disk = disk
        self.l2_skipped = 0  # vectors not written to L2 for want of disk
        self.l2_clears = 0  # times L2 was full and started over
        self._clear_log = LogThrottle()
        # Damaged while stopped: moved aside and rebuilt empty (vectors are recomputable).
        # Created 0700 with 0600 files (`open_lmdb`).
        self._env = open_lmdb(path, l2_max_bytes, "vector cache")
        self._l1: OrderedDict[bytes, np.ndarray] = OrderedDict()  # least recently used first
        self._l1_bytes = 0
        self._l1_max_bytes = max(l1_max_bytes, 0)
        self._shadow: ShadowQueue[bytes] = ShadowQueue(shadow_bytes(self._l1_max_bytes))
        self._lock = threading.Lock()
        self._l1_hits = self._l2_hits = self._misses = self._corrupt = 0

    @staticmethod
    def _size(vector: np.ndarray) -> int:
        return vector.nbytes + ENTRY_OVERHEAD_BYTES

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            vector = self._l1.get(key)
            if vector is not None:
                self._l1.move_to_end(key)
                self._l1_hits += 1
                return vector
        started = time.perf_counter()
        with self._env.begin() as txn:
            blob = txn.get(key)
        vector = None if blob is None else decode_vector(blob, self.dimensions)
        read_s = time.perf_counter() - started
        with self._lock:
            if vector is None:
                self._misses += 1
                if blob is not None:
                    self._corrupt += 1
            else:
                self._l2_hits += 1
                self._shadow.credit(key, read_s)  # one more byte of L1: this read saved
                self._admit(key, vector)
        if blob is not None and vector is None:
            log.warning("vector %s is corrupt; dropped", key.decode())
            with self._env.begin(write=True) as txn:
                txn.delete(key)
        return vector

    def put(self, key: bytes, vector: np.ndarray, cost_s: float = 0.0) -> None:
        """Store a vector just embedded; `cost_s` is what embedding it took (its share of the
        embedder's call), what L1 would have saved had it kept an evicted copy."""
        # a copy: a row of the embedder's batch is a view that would keep the whole batch alive
        # in L1, up to its size times the budget
        vector = np.array(vector, dtype=np.float32, copy=True)
        if self._disk is not None and self._disk.state() != ROOM:
            with self._lock:
                self.l2_skipped += 1
        else:
            self._write(key, encode_vector(vector))
        with self._lock:
            self._shadow.credit(key, cost_s)
            self._admit(key, vector)

    def _write(self, key: bytes, blob: bytes) -> None:
        """Into L2. Vectors are recomputable: when its budget is full, L2 starts over and takes
        this one; never fails for it (at worst the vector stays in L1 only). LMDB reuses the
        pages a commit freed only two commits later (the one before stays readable), so the
        emptying commits twice before the retry: the second on the empty table."""
        for attempt in range(3):
            try:
                with self._env.begin(write=True) as txn:
                    txn.put(key, blob)
                return
            except lmdb.MapFullError:
                if attempt == 2:
                    return  # larger than the whole budget: L1 only
            try:
                for _ in range(2):
                    with self._env.begin(write=True) as txn:
                        txn.drop(self._env.open_db(), delete=False)
            except lmdb.MapFullError:
                if self._clear_log.ready():
                    log.warning("vector cache L2 is full and could not be cleared; L1 only")
                return
            if attempt == 0:
                with self._lock:
                    self.l2_clears += 1
                if self._clear_log.ready():  # a budget too small for its traffic clears often
                    log.warning(
                        "vector cache L2 is full; cleared (clears so far: %d; raise "
                        "vector_l2_max_bytes if this recurs)",
                        self.l2_clears,
                    )

    def _admit(self, key: bytes, vector: np.ndarray) -> None:
        """Into L1 as the most recently used (lock held); least recently used out past the
        budget. A vector larger than the whole budget is not kept (cachetools' LRU raised)."""
        size = self._size(vector)
        old = self._l1.pop(key, None)
        if old is not None:
            self._l1_bytes -= self._size(old)
        if size > self._l1_max_bytes:
            return
        self._l1[key] = vector
        self._l1_bytes += size
        self._shadow.discard(key)
        self._trim()

    def _trim(self) -> None:
        """Evict least recently used vectors down to the budget (lock held), each into the
        shadow queue: a miss on it soon is a hit one more byte would have had."""
        while self._l1_bytes > self._l1_max_bytes and self._l1:
            key, vector = self._l1.popitem(last=False)
            size = self._size(vector)
            self._l1_bytes -= size
            self._shadow.add(key, size, 0.0)

    def resize(self, max_bytes: int) -> int:
        """A new L1 byte budget (tiercache.budgets): least recently used vectors go at once;
        returns it."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        with self._lock:
            self._l1_max_bytes = max_bytes
            self._shadow.resize(shadow_bytes(max_bytes))
            self._trim()
        return max_bytes

    def shadow_reading(self) -> tuple[float, float]:
        """(seconds its shadow's hits saved, cumulative; the bytes it spans): a budget's
        `ShadowValue` reads it."""
        with self._lock:
            return self._shadow.gained_s, float(self._shadow.bytes)

    @property
    def l1_bytes(self) -> int:
        with self._lock:
            return self._l1_bytes

    def reader_check(self) -> int:
        """Free reader slots of dead processes (done at open too); how many."""
        return check_readers(self._env, "vector cache", self.path)

    def stats(self) -> VectorCacheStats:
        with self._lock:
            return VectorCacheStats(
                self._l1_hits,
                self._l2_hits,
                self._misses,
                self._corrupt,
                len(self._l1),
                self.l2_skipped,
                self.l2_clears,
            )

    def close(self) -> None:
        self._env.close()
