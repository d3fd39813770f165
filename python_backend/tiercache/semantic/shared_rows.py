"""The semantic index's vectors in the host's shared tables: one `tiercache_native.SharedTable`
per scope, keyed by the scope's tag, each row's id its sequence number in the LMDB row log.

The row log (`RowLog`) stays the durable record and the source of every row's metadata;
a table is a copy of one scope's vectors that every process on the host maps, published with
release/acquire ordering (backends/README.md), so readers never copy or catch up on rows.

Files, under the folder the store is given (default `<semantic state>/tables/`):
`<scope tag>.<log id>.<epoch>.tbl`, the scope's current table, and `<scope tag>.lock`, an
`flock` that every process holds while it publishes to, rebuilds or replaces that scope's
table. A table is built under a private name (`<table>.tmp.<pid>.<random>`) and linked into
place; a process killed while building one leaves that file behind, which the next store to
open the folder deletes once it is an hour old (`sweep_leftovers`). The
current epoch, width and capacity are in the log's manifest for the scope (`TableManifest`),
so a process never guesses which file is current. One file per scope keeps each scope's flat
scan one contiguous matrix; a table starts at `INITIAL_CAPACITY` rows (the file is allocated
in full, about 28 KB at 384 floats, so that a full disk fails the creation rather than a later
write into the mapping) and processes map only the scopes they touch. A scope that compaction
leaves without rows loses its table and graphs (`_drop_locked`); its lock file stays (empty).

Invariant, under the scope's lock: the current table holds the scope's live log rows, once
each, or fewer (a writer that died between its log append and its publish, a table emptied by
a reboot or deleted): `sync_scope` publishes what is missing, and rewrites the table into a new
epoch when it holds rows the log no longer has (compaction) or when the rows do not fit
(growth), keeping the order of the rows it keeps (an HNSW graph's labels stay valid).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import tiercache_native as native

from tiercache.exact.stores import make_private_dir, open_private
from tiercache.semantic.row_log import INITIAL_CAPACITY, RowLog, TableManifest

log = logging.getLogger(__name__)

_PUBLISH_CHUNK = 8192  # rows per publish call when a table is rebuilt
# A table's private file lives for the milliseconds of its creation; one this old was left by
# a process killed while creating it (the native create unlinks it on every other way out).
LEFTOVER_AGE_S = 3600.0


def capacity_for(rows: int) -> int:
    """Room for `rows` and as many again: growth rewrites the table, so it must be rare. A
    scope's table starts at `INITIAL_CAPACITY` and doubles (a new epoch) as it grows."""
    capacity = INITIAL_CAPACITY
    while capacity < 2 * rows:
        capacity *= 2
    return capacity


class ScopeTables:
    """The host's shared tables of one row log, as this process sees them. The log is the only
    thing they read; what writes rows calls `publish` after each append to the log."""

    def __init__(self, row_log: RowLog, path: Path) -> None:
        self.row_log = row_log
        self.path = path
        make_private_dir(path)  # 0700: the tables hold every tenant's prompt vectors
        self.sweep_leftovers()

    def sweep_leftovers(self, now_s: float | None = None) -> int:
        """Delete the private files of table creations that never finished (`*.tbl.tmp.*`
        older than LEFTOVER_AGE_S): each is a whole table's size of disk. Returns how many."""
        now_s = time.time() if now_s is None else now_s
        swept = 0
        for leftover in self.path.glob("*.tbl.tmp.*"):
            try:
                if now_s - leftover.lstat().st_mtime < LEFTOVER_AGE_S:
                    continue  # being created now, perhaps
                leftover.unlink()
            except OSError:  # gone meanwhile (another process swept it), or not ours to delete
                continue
            swept += 1
        if swept:
            log.warning("deleted %d unfinished table files left by killed processes", swept)
        return swept

    def table_path(self, tag: str, epoch: int) -> Path:
        """Named by the row log's id too: a table of another log (rebuilt after damage, or a
        `tables_path` shared with another log) is never opened as this log's, whose seqs
        would name other rows."""
        return self.path / f"{tag}.{self.row_log.log_id.hex()[:16]}.{epoch}.tbl"

    @contextmanager
    def locked(self, tag: str) -> Iterator[None]:
        """The scope's writer lock across processes (and threads: each call opens its own
        file description, which flock treats as a separate owner)."""
        fd = open_private(self.path / f"{tag}.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def open_current(self, tag: str, width: int) -> native.SharedTable | None:
        """The scope's current table, complete with the log's live rows; None when the log has
        no rows of the scope or they have another width. Lock-free unless the table is behind
        the log (a writer died before publishing, a reboot emptied it, it was deleted)."""
        manifest = self.row_log.manifest(tag)
        if manifest is None or manifest.width != width:
            return None
        try:
            table = native.SharedTable(
                self.table_path(tag, manifest.epoch), width, manifest.capacity
            )
        except native.TableFormatError:  # damaged: sync_scope rebuilds it from the log
            with self.locked(tag):
                return self.sync_scope(tag)
        # Re-read: a table replaced meanwhile may have been unlinked before the open, which then
        # created a stray file of the old epoch. Epochs only grow, so an unchanged manifest
        # means the file opened is the current one.
        again = self.row_log.manifest(tag)
        count = table.count()
        if (
            again is None
            or again.epoch != manifest.epoch
            or table.retired()
            # behind the log, or ahead of it: a compaction cut short between its deletes and
            # its sync (an emptied scope otherwise kept its place under the caps for good)
            or count != self.row_log.live_count(tag)
            or (count and int(np.max(table.ids(count))) >= self.row_log.head())
        ):
            table.close()
            with self.locked(tag):
                if again is None or again.epoch != manifest.epoch:
                    # opened after its replacement (or the scope's drop) unlinked it: the open
                    # created a stray file, which no manifest names
                    self.table_path(tag, manifest.epoch).unlink(missing_ok=True)
                return self.sync_scope(tag)
        return table

    def publish(self, tag: str, seqs: list[int], vectors: np.ndarray) -> None:
        """Publish rows just appended to the log (the writer's second step)."""
        with self.locked(tag):
            manifest = self.row_log.manifest(tag)
            if manifest is None:  # compacted away before this writer got the lock
                return
            table = self._open_locked(tag, manifest)
            wanted = np.asarray(seqs, dtype=np.uint64)
            foreign = self._holds_other_rows(table, wanted, vectors)
            fast = (
                not foreign
                and not np.isin(wanted, table.ids()).any()
                and not table.retired()
                and table.count() + len(seqs) == self.row_log.live_count(tag)
                and table.count() + len(seqs) <= table.capacity()
            )
            if fast:  # the usual case: the table holds every other live row
                table.publish(np.ascontiguousarray(vectors, dtype=np.float32), wanted)
                table.close()
                return
            table.close()
            synced = self.sync_scope(tag, distrust=foreign)
            if synced is not None:
                synced.close()

    @staticmethod
    def _holds_other_rows(table: native.SharedTable, seqs: np.ndarray, vectors: Any) -> bool:
        """Whether the table holds rows under `seqs` (just given out by the log) with other
        vectors: another log's rows (a log restored from a backup gives the same seqs to other
        rows again). The same vectors are a benign race: a reader or compaction published the
        writer's rows between its log append and this publish."""
        count = table.count()
        ids = np.asarray(table.ids(count))
        present = np.isin(seqs, ids)
        if not present.any():
            return False
        position = {int(seq): i for i, seq in enumerate(ids.tolist())}
        rows = np.asarray(table.snapshot())
        mine = np.asarray(vectors, dtype=np.float32).reshape(len(seqs), -1)
        return any(
            not np.array_equal(rows[position[int(seq)]], mine[i])
            for i, seq in enumerate(seqs.tolist())
            if present[i]
        )

    def sync_scope(self, tag: str, distrust: bool = False) -> native.SharedTable | None:
        """Make the scope's current table hold exactly its live log rows, in place when it
        only lacks rows that fit, else in a new epoch (the old table retired). Call with the
        scope's lock held. Damaged log rows are deleted from the log here. A table holding
        ids this log has not given out, or (`distrust`) ids it just gave to new rows, holds
        another log's rows: it is rebuilt from the log, none of its rows kept."""
        manifest = self.row_log.manifest(tag)
        if manifest is None:
            return None
        table = self._open_locked(tag, manifest)
        manifest = self.row_log.manifest(tag) or manifest  # a damaged table moved it on
        count = table.count()
        have = np.array(table.ids(count), dtype=np.uint64)
        # ids this log has not given out yet: the table holds another log's rows (a log
        # restored from a backup reuses seqs); none of them can be trusted
        foreign = distrust or (bool(count) and int(have.max()) >= self.row_log.head())
        if foreign:
            log.warning("table %s holds rows of another row log; rebuilt", Path(table.path).name)
        live = np.asarray(self.row_log.scope_seqs(tag), dtype=np.uint64)
        if not len(live) and self.row_log.drop_manifest_if_empty(tag):
            self._drop_locked(tag, table)
            return None
        keep = np.zeros(count, dtype=bool) if foreign else np.isin(have, live)
        missing = live if foreign else live[~np.isin(live, have)]
        vectors = np.zeros((0, manifest.width), dtype=np.float32)
        if len(missing):
            rows, damaged = self.row_log.read_vectors(missing.tolist(), manifest.width)
            if damaged:
                log.warning("deleted %d damaged rows from the semantic log", len(damaged))
                self.row_log.delete_rows(tag, damaged)
                missing = missing[~np.isin(missing, np.asarray(damaged, dtype=np.uint64))]
            vectors = rows
        in_place = bool(keep.all()) and not table.retired() and not foreign
        if in_place and count + len(missing) <= table.capacity():
            if len(missing):
                log.info("published %d log rows missing from a scope's table", len(missing))
                table.publish(vectors, missing)
            return table
        kept_rows = np.asarray(table.snapshot())[keep]
        ids = np.concatenate([have[keep], missing])
        rows = np.concatenate([kept_rows, vectors]) if len(missing) else kept_rows
        return self._replace_locked(tag, manifest, table, rows, ids)

    def _drop_locked(self, tag: str, table: native.SharedTable) -> None:
        """A scope with no rows left (compaction): its table and saved graphs go, so scopes
        that are never used again (an old model revision, a seed) cost no disk. Readers
        holding the table find it retired and the scope gone."""
        table.retire()
        Path(table.path).unlink(missing_ok=True)
        table.close()
        for graph in (self.row_log.path / "graphs").glob(f"{tag}.*"):
            graph.unlink(missing_ok=True)
        log.info("scope %s has no rows left: its table and graphs were deleted", tag[:12])

    def _open_locked(self, tag: str, manifest: TableManifest) -> native.SharedTable:
        """The manifest's table; a damaged one is started again, empty, in the next epoch
        (the manifest moved there, the damaged file unlinked): processes that still map the
        damaged file find it retired (the native open marks it so) and reopen the new one."""
        path = self.table_path(tag, manifest.epoch)
        try:
            return native.SharedTable(path, manifest.width, manifest.capacity)
        except native.TableFormatError:  # not a table of ours (damaged): start it again
            epoch = manifest.epoch + 1
            fresh = self.table_path(tag, epoch)
            log.warning("table %s is unreadable; rebuilt from the log as %s", path.name, fresh.name)
            fresh.unlink(missing_ok=True)  # left by a writer that died while replacing
            table = native.SharedTable(fresh, manifest.width, manifest.capacity)
            self.row_log.set_manifest(
                tag, TableManifest(manifest.scope, epoch, manifest.width, manifest.capacity)
            )
            path.unlink(missing_ok=True)
            return table

    def _replace_locked(
        self,
        tag: str,
        manifest: TableManifest,
        old: native.SharedTable,
        rows: np.ndarray,
        ids: np.ndarray,
    ) -> native.SharedTable:
        """Write `rows` into a new epoch's table, make it current, retire the old one."""
        epoch = manifest.epoch + 1
        path = self.table_path(tag, epoch)
        path.unlink(missing_ok=True)  # left by a writer that died while replacing
        capacity = capacity_for(len(ids))
        table = native.SharedTable(path, manifest.width, capacity)
        for start in range(0, len(ids), _PUBLISH_CHUNK):
            stop = start + _PUBLISH_CHUNK
            table.publish(np.ascontiguousarray(rows[start:stop]), ids[start:stop])
        # Retire first: a writer that dies before the manifest moves leaves a retired current
        # table, which the next reader rebuilds under the lock (the other order left readers
        # on the old table, never retired, for good).
        old.retire()  # readers holding it reopen through the manifest
        self.row_log.set_manifest(
            tag, TableManifest(manifest.scope, epoch, manifest.width, capacity)
        )
        Path(old.path).unlink(missing_ok=True)
        old.close()
        log.info("scope table rewritten: epoch %d, %d rows, capacity %d", epoch, len(ids), capacity)
        return table
