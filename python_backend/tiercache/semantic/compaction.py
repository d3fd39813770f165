"""Compaction of the host's semantic row log: keeps the log inside its LMDB map.

The log only grows (`RowLog`); compaction deletes rows whose answer is gone from the exact
cache (else the tenth whose answers are worth least to the exact cache, oldest first among
equals), then rewrites the touched scopes' shared tables without them
(`ScopeTables.sync_scope`). It runs on one background thread per process, started by the write
that finds the log past `_COMPACT_AT_FRACTION` of its map, so the write-back of a miss never
waits for it: compacting a large log takes seconds. One compaction of a log runs at a time on
the host (an `flock` on `compaction.lock` beside it): the llm stage's thread of each process and
the Redis row follower compact the same log, and two at once gave up twice the rows.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import lmdb
import numpy as np

from tiercache.log_throttle import LogThrottle
from tiercache.semantic.graph_files import GraphFiles
from tiercache.semantic.row_log import RowLog, ScopeLimitReached
from tiercache.semantic.shared_rows import ScopeTables
from tiercache.threads import NamedThread

log = logging.getLogger(__name__)

_MAX_PENDING = 10_000  # rows waiting for a background compaction
_COMPACTION_ROUNDS = 3  # compactions in a row before the waiting rows are dropped
_COMPACT_AT_FRACTION = 0.6  # of the log's map, in data pages: compaction starts there
_COMPACT_BATCH = 64  # rows deleted per write transaction by a compaction
_APPEND_BATCH = 16  # rows that waited for a compaction, appended per transaction after it
RETRY_PAUSE_S = 5.0  # after a failed compaction, before another starts (rows wait meanwhile)
COMPACTION_LOCK = "compaction.lock"  # in the log's folder: one compaction at a time per host

Row = tuple[str, str, str, np.ndarray]
"""(scope, answer digest, normalized prompt, vector): a row to append, before it has a seq."""


class AppendMany(Protocol):
    """Append rows to the log and publish them to their tables (`SemanticStore.append_many`;
    `tenants`: the tenant scope of each new scope, by scope)."""

    def __call__(
        self, rows: list[Row], *, tenants: Mapping[str, str] | None = None
    ) -> list[int]: ...


class Compactor:
    """Compaction of one row log and its tables, on at most one background thread per process.

    Rows that find the log full (or being compacted) wait in a bounded list, with their
    tenant scope (so a row that starts a scope still counts toward its tenant's cap), and are
    appended, through `append_many`, after the compaction."""

    def __init__(
        self, row_log: RowLog, tables: ScopeTables, append_many: AppendMany, max_bytes: int
    ) -> None:
        self._log = row_log
        self._tables = tables
        self._append_many = append_many
        self._compact_at_bytes = int(max_bytes * _COMPACT_AT_FRACTION)
        # Rows that find the log full meanwhile wait for the compaction in `_pending`
        # (bounded) and are appended after it.
        self._lock = threading.Lock()
        self._pending: list[tuple[Row, str]] = []  # (row, tenant scope)
        self._thread: threading.Thread | None = None
        self._failed_s = -math.inf  # when a compaction last failed (monotonic)
        self._failure_log = LogThrottle()

    def append_or_compact(
        self,
        row: Row,
        answer_exists: Callable[[str], bool],
        tenant: str = "",
        answer_value: Callable[[str], float] | None = None,
    ) -> int | None:
        """Append and return the row's seq; None when the log is full or being compacted.
        `tenant` is the tenant scope the row starts its scope for, if the scope is new.
        Once the log's data pages pass `_COMPACT_AT_FRACTION` of its map (or it is full), a
        background compaction starts (one per process): rows whose answer is gone are
        dropped (else the tenth worth least by `answer_value`, or the oldest) and the touched
        scopes' tables rewritten. Rows that
        arrive while it runs wait (LMDB copies every page it changes, so compaction needs
        free pages even to delete) and are appended after it (at most `_MAX_PENDING`; more
        are dropped: a row missing costs a later semantic hit, never a wrong one). The
        caller, a miss's write-back, never waits for it: compacting a large log takes
        seconds. Past the mark a row is never appended before a compaction has brought the log
        under it: while compactions fail (Redis unreadable: they delete nothing) rows waited,
        were dropped after three rounds, and the next write appended again, until the map was
        full, and on a full map not even one row can be deleted (LMDB copies the pages a delete
        changes): the log stayed full for good."""
        with self._lock:
            if self._thread is not None:
                if len(self._pending) < _MAX_PENDING:
                    self._pending.append((row, tenant))
                return None
        seq: int | None = None
        if not self.due():  # past the mark nothing is appended before a compaction (below)
            try:
                seq = self._append_many([row], tenants={row[0]: tenant})[0]
            except lmdb.MapFullError:
                # a reader killed inside a read pins every page freed since: its slot freed,
                # the append may go through without a compaction
                if self._log.reader_check():
                    with contextlib.suppress(lmdb.MapFullError):
                        seq = self._append_many([row], tenants={row[0]: tenant})[0]
        if seq is not None and self._log.data_bytes() < self._compact_at_bytes:
            return seq
        with self._lock:
            if seq is None and len(self._pending) < _MAX_PENDING:
                self._pending.append((row, tenant))
            if self._thread is None and time.monotonic() - self._failed_s >= RETRY_PAUSE_S:
                self._thread = NamedThread(
                    target=self._compact_then_append,
                    args=(answer_exists, answer_value),
                    name="semantic-compaction",
                    daemon=True,
                )
                self._thread.start()
        return seq

    def _compact_then_append(
        self,
        answer_exists: Callable[[str], bool],
        answer_value: Callable[[str], float] | None = None,
    ) -> None:
        """Compact, then append the rows that waited, `_APPEND_BATCH` at a time, until none
        is left; if the log fills again first, compact again, at most `_COMPACTION_ROUNDS`
        times, then drop what still waits (logged). A compaction that fails (a tier it must
        read is down) ends the rounds: the rows past the mark wait for the next one, which the
        first write `RETRY_PAUSE_S` later starts; the failure is logged once a minute."""
        failed = False
        for _ in range(_COMPACTION_ROUNDS):
            started = time.perf_counter()
            try:
                deleted = self.compact(answer_exists, answer_value=answer_value)
                log.info(
                    "semantic log compacted: %d rows deleted in %.1f s",
                    deleted,
                    time.perf_counter() - started,
                )
            except Exception:  # noqa: BLE001 - the waiting rows are tried anyway
                failed = True
                with self._lock:
                    self._failed_s = time.monotonic()
                if self._failure_log.ready():  # a Redis outage fails every one: not a flood
                    log.exception(
                        "compacting the semantic log failed (%d more since the last line; "
                        "tried again %.0f s after a failure, rows past the mark wait)",
                        self._failure_log.suppressed,
                        RETRY_PAUSE_S,
                    )
            while True:
                with self._lock:
                    if not self._pending:
                        self._thread = None
                        return
                if self._log.data_bytes() >= self._compact_at_bytes:
                    break  # past the mark again: compact before the rest
                with self._lock:
                    batch = self._pending[:_APPEND_BATCH]
                    del self._pending[: len(batch)]
                try:
                    left = self._append_batch(batch)
                except lmdb.MapFullError:
                    left = batch
                except Exception:  # noqa: BLE001 - rows lost: fewer semantic hits, logged
                    log.exception("appending %d rows after compaction failed", len(batch))
                    continue
                if left:
                    with self._lock:
                        self._pending[:0] = left
                    break  # full again: another round
            if failed:
                with self._lock:  # the rows left wait (bounded) for the next compaction
                    self._thread = None
                return
        with self._lock:
            dropped, self._pending = len(self._pending), []
            self._thread = None
        log.warning("semantic log still full after compaction: %d rows not indexed", dropped)

    def _append_batch(self, batch: list[tuple[Row, str]]) -> list[tuple[Row, str]]:
        """Append rows that waited; the ones left when the log filled up again. A batch with a
        row whose new scope a cap refuses (its tenant took its last place meanwhile) goes row
        by row, the refused rows counted (`note_scope_refused`), so they cost no other row."""
        try:
            self._append_many([row for row, _ in batch], tenants={r[0]: t for r, t in batch})
            return []
        except ScopeLimitReached:
            pass
        for i, (row, tenant) in enumerate(batch):
            try:
                self._append_many([row], tenants={row[0]: tenant})
            except ScopeLimitReached as exc:
                self._log.note_scope_refused(exc.reason)
            except lmdb.MapFullError:
                return batch[i:]
        return []

    def _delete(
        self, rows: list[tuple[int, tuple[str, str] | None]], mark: int
    ) -> tuple[int, set[str]]:
        """`RowLog.delete_compacted` (sparing the rows claimed since `mark`), in halves when
        the map lacks the free pages one transaction of `rows` copies (its rows' digest keys
        are spread over the whole log, and which pages are free depends on the log's layout):
        MapFullError only when a single row cannot be deleted."""
        try:
            return self._log.delete_compacted(rows, spare_claimed_after=mark)
        except lmdb.MapFullError:
            if len(rows) == 1:
                raise
        half = len(rows) // 2
        first, first_tags = self._delete(rows[:half], mark)
        second, second_tags = self._delete(rows[half:], mark)
        return first + second, first_tags | second_tags

    def _delete_all(
        self, rows: list[tuple[int, tuple[str, str] | None]], mark: int
    ) -> tuple[int, set[str]]:
        """`_delete` in transactions of `_COMPACT_BATCH` rows."""
        touched: set[str] = set()
        deleted = 0
        for start in range(0, len(rows), _COMPACT_BATCH):
            count, tags = self._delete(rows[start : start + _COMPACT_BATCH], mark)
            deleted += count
            touched |= tags
        return deleted, touched

    def due(self) -> bool:
        """Whether the log's data pages passed the mark where compaction starts (while the map
        still has the free pages that deleting needs)."""
        return self._log.data_bytes() >= self._compact_at_bytes

    def wait(self, timeout_s: float = 60.0) -> bool:
        """Wait for a running background compaction (and its appends); False on timeout."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def compact(
        self,
        answer_exists: Callable[[str], bool],
        fallback_fraction: float = 0.1,
        answer_value: Callable[[str], float] | None = None,
    ) -> int:
        """Delete rows whose answer no longer exists, and rows an invalidation made forgotten
        (their digest's key names a newer row, or none: `RowLog.superseded`); if there were
        none, or the log is still past its mark after them, also the `fallback_fraction` of
        the rows whose answers are worth least (`answer_value`: the exact cache's value of an
        answer digest; ties, and without it every row, oldest first). A few dead rows alone
        freed too little to bring the log under its mark, and every write started another
        full pass.
        Then each touched scope's table is rewritten without them (the old one retired).
        Keeps only each row's scope and digest in memory (not its vector), and deletes in
        transactions of `_COMPACT_BATCH` rows: LMDB copies the pages it changes, so one
        transaction over a nearly full map could not even delete.
        One at a time on the host (`COMPACTION_LOCK`): a call that had to wait for another
        thread's or process's compaction returns 0 when the log is under its mark after it."""
        with self._host_exclusive() as waited:
            if waited and self._log.data_bytes() < self._compact_at_bytes:
                return 0  # the compaction it waited for made the room
            return self._compact(answer_exists, fallback_fraction, answer_value)

    @contextmanager
    def _host_exclusive(self) -> Iterator[bool]:
        """Holds the host's compaction lock (an flock: threads and processes alike, each call
        on its own descriptor); yields whether another holder had it first."""
        fd = os.open(
            self._log.path / COMPACTION_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                waited = False
            except BlockingIOError:
                fcntl.flock(fd, fcntl.LOCK_EX)
                waited = True
            yield waited
        finally:
            os.close(fd)  # releases the flock

    def _compact(
        self,
        answer_exists: Callable[[str], bool],
        fallback_fraction: float,
        answer_value: Callable[[str], float] | None,
    ) -> int:
        dead: list[tuple[int, tuple[str, str] | None]] = []
        rows: list[tuple[int, tuple[str, str] | None]] = []
        # an answer stored again after the scan judged it gone claims its row back: spared
        mark = self._log.claims_mark()
        for seq, row in self._log.scan():
            brief = None if row is None else (row.scope, row.digest)
            rows.append((seq, brief))
            if row is None or not answer_exists(row.digest):
                dead.append((seq, brief))
        gone = {seq for seq, _ in dead}
        superseded = self._log.superseded([item for item in rows if item[0] not in gone])
        dead += [item for item in rows if item[0] in superseded]
        gone |= superseded
        deleted, touched = self._delete_all(dead, mark)
        if not dead or self._log.data_bytes() >= self._compact_at_bytes:
            live = [item for item in rows if item[0] not in gone]
            if answer_value is not None:  # a stable sort: rows are in seq order, oldest first
                live.sort(key=lambda item: answer_value(item[1][1]) if item[1] else -math.inf)
            more, tags = self._delete_all(live[: max(1, int(len(rows) * fallback_fraction))], mark)
            deleted += more
            touched |= tags
        del rows
        graphs = GraphFiles(self._log.path / "graphs")
        for tag in touched:
            with self._tables.locked(tag):
                synced = self._tables.sync_scope(tag)
                if synced is not None:
                    synced.close()
                graphs.discard_over(tag, self._log.live_count(tag))
        return deleted
