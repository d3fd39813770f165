"""The host's semantic rows as writers see them: the row log, its shared tables and compaction.

Rows live in an append-only LMDB log on the host (`RowLog`): durable, and the source of each
row's scope, answer digest and normalized prompt. Each scope's vectors are also published to a
shared table of the host (`tiercache_native.SharedTable`, see `shared_rows`), with the row's log
sequence number as its id, so every process searches the same rows without copying them or
catching up on the log (`tiercache.semantic.index`).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import lmdb
import numpy as np

from tiercache.machine import CRITICAL, ROOM, DiskRoom
from tiercache.semantic.compaction import Compactor, Row
from tiercache.semantic.row_log import (
    DEFAULT_MAX_SCOPES,
    DEFAULT_MAX_SCOPES_PER_TENANT,
    RowLog,
    ScopeLimitReached,
    check_vector,
)
from tiercache.semantic.shared_rows import ScopeTables

log = logging.getLogger(__name__)
_DISK_LOG_INTERVAL_S = 60.0


_DISK_FULL = os.strerror(errno.ENOSPC)  # the native table's errors end with strerror's text


class SemanticStore(RowLog):
    """The host's semantic rows: an append-only log in LMDB (durable, the source of each row's
    scope, digest and prompt; LMDB serializes writers across processes) and, per scope, a
    shared table of the vectors (`ScopeTables`) that readers scan without copying.

    A write appends to the log first, then publishes to the scope's table; a writer that dies
    between the two leaves a row the next publish to that scope (or the next process that
    opens the table) publishes. `tables_path` defaults to `<path>/tables`; it may be anywhere
    on the host (e.g. under /dev/shm) as long as every process of the host passes the same.

    Vectors are checked before they are written (`check_vector`: width, finite values, unit
    norm; InvalidVector otherwise), and the host holds at most `max_scopes` scopes (one table
    file, so one mmap per process that searches it, each), of which each tenant scope starts at
    most `max_scopes_per_tenant` (so one tenant cannot take every place): a row of a new scope
    past either is not indexed (`append_or_compact` returns None, counted in
    `scopes_refused`). A writer names the row's tenant scope (`tenant`, `tenants`); rows
    without one count under the tenant "".

    With `disk` (the state directory's `DiskRoom`), `append_or_compact` logs no new row while
    the disk is critically short (under half of `disk_headroom_bytes`), nor when a write meets
    a full disk (ENOSPC; EIO or EDQUOT, or a scope's table that cannot be sized, while the disk
    is short): the row is dropped (the answer is served and cached all the same; only reworded
    requests miss it), counted in `disk_skipped`, logged at most once a minute."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = 2 << 30,
        clock: Callable[[], float] = time.time,
        tables_path: Path | None = None,
        *,
        dimensions: int | None = None,
        max_scopes: int = DEFAULT_MAX_SCOPES,
        max_scopes_per_tenant: int = DEFAULT_MAX_SCOPES_PER_TENANT,
        disk: DiskRoom | None = None,
    ) -> None:
        super().__init__(
            path,
            max_bytes,
            clock,
            dimensions=dimensions,
            max_scopes=max_scopes,
            max_scopes_per_tenant=max_scopes_per_tenant,
        )
        self.tables = ScopeTables(self, tables_path or path / "tables")
        self._compactor = Compactor(self, self.tables, self.append_many, max_bytes)
        self._disk = disk
        self.disk_skipped = 0
        self._disk_lock = threading.Lock()
        self._disk_logged_s = -_DISK_LOG_INTERVAL_S

    def append(
        self, scope: str, digest: str, prompt: str, vector: np.ndarray, tenant: str = ""
    ) -> int:
        return self.append_many([(scope, digest, prompt, vector)], tenants={scope: tenant})[0]

    def append_many(
        self, rows: list[Row], *, tenants: Mapping[str, str] | None = None
    ) -> list[int]:
        """Append (scope, digest, prompt, vector) rows in one transaction (one fsync), then
        publish them to their scopes' tables. A digest the scope already has keeps its row
        (the returned seq is that row's). `tenants`: the tenant scope of each scope a row
        starts, by scope (`RowLog.log_rows`); ScopeLimitReached past a cap, nothing written."""
        seqs, fresh = self.log_rows(rows, tenants=tenants)
        for tag, (new_seqs, vectors) in fresh.items():
            self.tables.publish(tag, new_seqs, np.stack(vectors))
        return seqs

    def append_or_compact(
        self,
        scope: str,
        digest: str,
        prompt: str,
        vector: np.ndarray,
        answer_exists: Callable[[str], bool],
        tenant: str = "",
        answer_value: Callable[[str], float] | None = None,
    ) -> int | None:
        """Append and return the row's seq; None when the log is full or being compacted, in
        which case the row waits for the background compaction this starts and is appended
        after it (`Compactor.append_or_compact`). The caller never waits for a compaction.
        None too, and the row is dropped, when it would start a scope past `max_scopes`, or
        past `max_scopes_per_tenant` for `tenant` (the request's tenant scope; counted in
        `scopes_refused`, logged at most once a minute; the answer is served and cached all
        the same, only reworded requests miss it). InvalidVector for a vector `check_vector`
        refuses. `answer_value` ranks the rows a compaction gives up when every answer still
        exists (`Compactor.compact`)."""
        row = check_vector(vector, self.dimensions)
        if self.disk_critical():
            self._note_disk_skipped("the disk is under half of disk_headroom_bytes")
            return None
        refusal = self.scope_refusal(scope, tenant)
        if refusal is not None:
            self.note_scope_refused(refusal)
            return None
        try:
            return self._compactor.append_or_compact(
                (scope, digest, prompt, row), answer_exists, tenant, answer_value
            )
        except ScopeLimitReached as exc:  # another process took the last place meanwhile
            self.note_scope_refused(exc.reason)
            return None
        except (lmdb.Error, RuntimeError) as exc:
            if not self.disk_error(exc):
                raise
            self._note_disk_skipped(str(exc))
            return None

    def disk_critical(self) -> bool:
        """The state directory's disk under half of `disk_headroom_bytes` (no `disk`: never)."""
        return self._disk is not None and self._disk.state() == CRITICAL

    def disk_error(self, exc: Exception) -> bool:
        """Whether a failed write is the disk's: ENOSPC (the transaction wrote nothing); EIO
        (a short write) or EDQUOT, or a scope's table that cannot be sized (the row is logged:
        the next publish to the scope takes it), while the disk is short of the headroom."""
        if isinstance(exc, lmdb.DiskError):
            return True
        if isinstance(exc, RuntimeError) and not (
            str(exc).startswith("cannot size") or _DISK_FULL in str(exc)
        ):
            return False
        return self._disk is not None and self._disk.state() != ROOM

    def _note_disk_skipped(self, reason: str) -> None:
        with self._disk_lock:
            self.disk_skipped += 1
            now = time.monotonic()
            if now - self._disk_logged_s < _DISK_LOG_INTERVAL_S:
                return
            self._disk_logged_s = now
            skipped = self.disk_skipped
        log.warning(
            "semantic log %s: %s; new rows are not logged (%d so far, logged at most once a "
            "minute)",
            self.path,
            reason,
            skipped,
        )

    def wait_compacted(self, timeout_s: float = 60.0) -> bool:
        """Wait for a running background compaction (and its appends); False on timeout."""
        return self._compactor.wait(timeout_s)

    def compact(
        self,
        answer_exists: Callable[[str], bool],
        fallback_fraction: float = 0.1,
        answer_value: Callable[[str], float] | None = None,
    ) -> int:
        """Compact now, on this thread (`Compactor.compact`); the number of rows deleted."""
        return self._compactor.compact(answer_exists, fallback_fraction, answer_value)

    def compaction_due(self) -> bool:
        """Past the mark where compaction starts (`Compactor.due`): for writers that do not go
        through `append_or_compact` (the Redis row follower)."""
        return self._compactor.due()

    def close(self) -> None:
        self.wait_compacted()
        super().close()
