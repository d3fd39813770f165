"""The semantic index: prompt vectors of cached answers, searched only inside their scope.

Rows are written through `SemanticStore` (`tiercache.semantic.store`): an LMDB row log on the
host, and per scope a shared table of the vectors that every process maps. A search takes the
table's snapshot (zero copy, an acquire load of its count), scans it (`ScopeSearch`: flat, or an
HNSW graph once the scope is large), and reads only the top k rows' metadata from the log.

Graphs are per process. Building a large scope's graph dominates a start (about 12 s for
100,000 rows on 2 cores), so graphs are saved next to the row log (`GraphFiles`) and a start
loads the newest one that covers a prefix of the table's rows, then adds only the rows after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from tiercache_native import TableFormatError

from tiercache.log_throttle import LogThrottle
from tiercache.semantic.graph_files import GraphFile, GraphFileError, GraphFiles
from tiercache.semantic.row_log import check_vector, scope_tag
from tiercache.semantic.scope_search import ScopeSearch, graph_bytes_for
from tiercache.semantic.store import SemanticStore
from tiercache.threads import NamedThread

log = logging.getLogger(__name__)

_BUILD_RETRY_S = 60.0  # a scope whose graph build failed scans flat this long before a retry
_RESAVE_FRACTION = 0.1  # after a load, re-save when the rows added on top reach this share
_GRAPH_TAIL_ROWS = 256  # rows past a graph's end are scanned flat until this many, then added
# ... at most this many a search: adding holds the index's lock (256 rows of 384 floats took
# 44 ms here), and a tail of 50,000 rows caught up after a Redis outage took seconds of every
# lookup of the process; the rest is scanned flat meanwhile (20,000 rows: 4 ms)
_GRAPH_ADD_ROWS = 512
_META_CACHE_ROWS = 1 << 16  # metadata of the candidates a process served lately
_DEAD_OVERFETCH = 64  # extra candidates a search fetches to make up for hidden rows


@dataclass(frozen=True, slots=True)
class Neighbour:
    similarity: float
    digest: str
    prompt: str


@dataclass(frozen=True, slots=True)
class _RowMeta:
    scope: str
    digest: str
    prompt: str
    vector_print: bytes  # `_vector_print` of the log's checksummed vector


def _vector_print(vector: np.ndarray) -> bytes:
    """A row's vector, fingerprinted: the table's copy of a row must be the log's, bit for bit
    (the table is published from the log's float32 vectors)."""
    return hashlib.blake2b(np.ascontiguousarray(vector, np.float32).data, digest_size=8).digest()


_MISMATCH_LOG = LogThrottle()


def _since(started: float) -> float:
    return time.perf_counter() - started


@dataclass(frozen=True, slots=True)
class IndexStats:
    rows: int
    scopes: int
    graphs_built: int  # HNSW graphs built from rows
    graphs_loaded: int  # HNSW graphs loaded from a saved file
    graphs_saved: int  # graph files written by this process
    graph_files_rejected: int  # saved files not used: other rows, damaged, unreadable
    tables_reopened: int = 0  # scope tables found retired (compacted, grown) and reopened
    scopes_refused: int = 0  # rows not indexed: their new scope would pass the host's limit


_TIMED_FLAT_ROWS = 256  # flat scans at least this large measure the flat rate


def _moving(average: float, sample: float) -> float:
    return sample if not average else 0.9 * average + 0.1 * sample


def estimated_graph_bytes(rows: int, dimensions: int) -> int:
    """What a graph of `rows` rows holds (`ScopeSearch.graph_bytes`, at the capacity a build
    or load gives it: twice the rows)."""
    return graph_bytes_for(rows, 2 * rows, dimensions)


class SemanticIndex:
    """Search of the host's semantic rows: each scope's vectors come from its shared table
    (`SemanticStore.tables`), a zero-copy snapshot per search; the digest and prompt of the
    top k from the row log, by seq. A table found retired (compaction, growth) is reopened.

    Graph files (`persist_graphs`, under `<row log>/graphs`) are saved after a build, after a
    load that had to add many rows on top (a restart after a crash), when the graphs' budget
    drops one (on a thread of its own), and at `close`; a search never writes one itself
    (a search builds a first graph in the background; the index builds them in place only while
    it opens, before it serves).
    """

    def __init__(
        self,
        store: SemanticStore,
        dimensions: int,
        flat_max_rows: int = 10_000,
        persist_graphs: bool = True,
    ) -> None:
        self.store = store
        self.dimensions = dimensions
        self.flat_max_rows = flat_max_rows
        self.graphs = GraphFiles(store.path / "graphs") if persist_graphs else None
        self._scopes: dict[str, ScopeSearch] = {}
        self._visible = 0  # rows seen by the last refresh
        self._meta: dict[int, _RowMeta] = {}  # by log seq, see _metadata
        self._lock = threading.Lock()
        self._built = self._loaded = self._saved = self._rejected = self._reopened = 0
        self._builders: dict[str, threading.Thread] = {}  # scopes whose graph is being built
        self._build_failed: dict[str, float] = {}  # scope -> when its last build failed
        # The graphs' byte budget (`resize_graphs`; None: unbounded) and what its bytes save
        # (`graphs_value_reading`): search seconds a graph saved or would have saved, and the
        # bytes of the graphs held and of those it lacks (dropped, or refused for the budget)
        self._graph_budget: int | None = None
        self._wanting: dict[str, int] = {}  # scope -> bytes of the graph it lacks for the budget
        self._graph_gained_s = 0.0
        self._unsaved: list[tuple[str, Any, int, str]] = []  # dropped under the lock, to save
        self._savers: set[threading.Thread] = set()  # saving dropped graphs (`_save_later`)
        self._flat_s_per_row = 0.0  # a flat scan's seconds per row (moving average)
        self._graph_search_s = 0.0  # a graph search's seconds (moving average, every scope)
        self.graphs_dropped = 0
        self.scopes_failed = 0  # scopes a refresh could not open (damaged files): logged

    def refresh(self) -> int:
        """Open every scope's table of the host (a start: large scopes get their graph here,
        holding every row); the number of rows that became visible since the last refresh."""
        with self._lock:
            for _, manifest in self.store.manifests():
                if manifest.width == self.dimensions:
                    try:
                        scope = self._open(manifest.scope, background=False)
                        if scope is not None and scope.hnsw is not None:
                            scope.hnsw_add(scope.table.snapshot())
                    except Exception:  # noqa: BLE001 - one damaged scope must not stop a start
                        self.scopes_failed += 1
                        log.exception(
                            "opening semantic scope %s... failed; it is tried again at its next "
                            "search",
                            manifest.scope[:8],
                        )
            visible = sum(s.count for s in self._scopes.values())
            fresh, self._visible = max(0, visible - self._visible), visible
            return fresh

    def _open(self, name: str, background: bool = True) -> ScopeSearch | None:
        """The scope, its table reopened if it was retired; None when it has no rows. Call
        with the lock held. A graph the scope needs (it crossed `flat_max_rows`, or compaction
        rewrote its rows) is built on a background thread (`background`; searches scan flat
        meanwhile), or here (a start: `refresh`)."""
        scope = self._scopes.get(name)
        if scope is not None and not scope.table.retired():
            try:
                self._grow_graph(scope, background)
                return scope
            except TableFormatError as exc:
                # its header damaged since it was mapped (the open checks it, a mapped table
                # does not retire itself): opened again below, which rebuilds it from the log,
                # rather than fail every search of the scope in this process until a restart
                log.error(
                    "scope %s...: its table is damaged (%s); rebuilt from the log", name[:12], exc
                )
        table = self.store.tables.open_current(scope_tag(name), self.dimensions)
        if table is None:
            gone = self._scopes.pop(name, None)
            self._wanting.pop(name, None)
            if gone is not None:  # dropped (no rows left): unmap its deleted file now
                gone.table.close()
            return None
        if scope is None:
            scope = self._scopes[name] = ScopeSearch(
                name, self.dimensions, self.store.log_id, table
            )
        else:
            old, scope.table = scope.table, table
            old.close()
            self._reopened += 1
            if scope.dead:  # compaction drops hidden rows whose answers are gone: forget them
                scope.dead &= set(np.asarray(table.ids(table.count())).tolist())
            if scope.hnsw is not None and (
                table.count() < scope.graph_rows
                or scope.prefix_digest(scope.graph_rows) != scope.graph_prefix
            ):  # the rows were rewritten (compaction): the graph's labels no longer hold
                scope.hnsw, scope.graph_rows, scope.graph_prefix = None, 0, ""
        self._grow_graph(scope, background)
        return scope

    def _grow_graph(self, scope: ScopeSearch, background: bool = False) -> None:
        if scope.hnsw is None:
            if scope.count <= self.flat_max_rows:
                self._wanting.pop(scope.name, None)
            elif not self._graph_fits(scope.count):  # searched flat; valued as wanting one
                self._wanting[scope.name] = estimated_graph_bytes(scope.count, self.dimensions)
            elif background:
                self._attach_later(scope.name)
            else:
                self._attach_graph(scope)
        elif scope.count - scope.graph_rows >= _GRAPH_TAIL_ROWS:
            scope.hnsw_add(scope.table.snapshot()[: scope.graph_rows + _GRAPH_ADD_ROWS])
            if self._graph_budget is not None:  # a grown graph may no longer fit
                self._unsaved += self._fit_graphs(self._graph_budget)  # saved after the lock

    def _graph_fits(self, rows: int) -> bool:
        """Whether a graph of `rows` rows fits the graphs' budget beside those held. Call with
        the lock held."""
        if self._graph_budget is None:
            return True
        held = sum(s.graph_bytes() for s in self._scopes.values())
        return held + estimated_graph_bytes(rows, self.dimensions) <= self._graph_budget

    def resize_graphs(self, max_bytes: int) -> int:
        """A new byte budget for this process's graphs (tiercache.budgets): the graphs of the
        scopes searched longest ago are dropped at once until the rest fit (each saved first,
        outside the lock, when it holds rows its file does not: coming back is a load, not a
        build); a scope without its graph is scanned flat, and gets it back when the budget
        allows. Returns `max_bytes`."""
        if max_bytes < 0:
            raise ValueError(f"the graphs' budget must be >= 0, got {max_bytes}")
        with self._lock:
            self._graph_budget = max_bytes
            detached = self._fit_graphs(max_bytes)
        self._save_detached(detached)
        return max_bytes

    def _fit_graphs(self, max_bytes: int) -> list[tuple[str, Any, int, str]]:
        """Drop graphs, the scope searched longest ago first, until the rest fit `max_bytes`
        (lock held); the dropped graphs that hold rows their file does not, to save."""
        held = [s for s in self._scopes.values() if s.hnsw is not None]
        total = sum(s.graph_bytes() for s in held)
        detached = []
        for scope in sorted(held, key=lambda s: s.last_search_s):
            if total <= max_bytes:
                break
            size = scope.graph_bytes()
            if scope.graph_rows > scope.saved_rows and not scope.table.retired():
                detached.append((scope.name, scope.hnsw, scope.graph_rows, scope.graph_prefix))
            scope.hnsw, scope.graph_rows, scope.graph_prefix = None, 0, ""
            self._wanting[scope.name] = estimated_graph_bytes(scope.count, self.dimensions)
            self.graphs_dropped += 1
            total -= size
        return detached

    def _save_later(self, detached: list[tuple[str, Any, int, str]]) -> None:
        """Save the graphs a search dropped (a grown graph past the budget) on a thread of
        their own: a large one is a file of a hundred MB and more, written and hashed, which
        the search and the lookups batched with it must not wait for. `wait_graphs` joins it."""
        if not detached or self.graphs is None:
            return

        def run() -> None:
            try:
                self._save_detached(detached)
            finally:
                with self._lock:
                    self._savers.discard(thread)

        thread = NamedThread(target=run, name="semantic-graph-save", daemon=True)
        with self._lock:
            self._savers.add(thread)
        thread.start()

    def _save_detached(self, detached: list[tuple[str, Any, int, str]]) -> None:
        """Save graphs no scope holds any more (nothing else touches them): outside the lock,
        so searches do not wait for the file and its checksum. Best effort."""
        if self.graphs is None:
            return
        for name, index, rows, prefix in detached:
            try:
                saved = self.graphs.save(name, rows, prefix, index)
            except (OSError, RuntimeError) as exc:
                log.warning("could not save a dropped graph (%d rows): %s", rows, exc)
                continue
            with self._lock:
                self._saved += saved is not None

    def graphs_value_reading(self) -> tuple[float, float]:
        """(search seconds the graphs saved, and those the graphs a scope lacks for the budget
        would have saved, cumulative; the bytes of both): the graphs' budget's `ShadowValue`
        reads it. Valued on average, not at the margin: a graph is dropped or loaded whole."""
        with self._lock:
            held = sum(s.graph_bytes() for s in self._scopes.values())
            return self._graph_gained_s, float(held + sum(self._wanting.values()))

    def graph_bytes(self) -> int:
        """What this process's graphs hold (`ScopeSearch.graph_bytes`)."""
        with self._lock:
            return sum(s.graph_bytes() for s in self._scopes.values())

    def _attach_later(self, name: str) -> None:
        """Start building (or loading) `name`'s graph on a thread of its own, unless one is
        already at it. Call with the lock held."""
        if name in self._builders:
            return
        failed_s = self._build_failed.get(name)
        if failed_s is not None and time.monotonic() - failed_s < _BUILD_RETRY_S:
            return  # failed lately: scan flat, try again later
        builder = NamedThread(
            target=self._build_detached, args=(name,), name="semantic-graph", daemon=True
        )
        self._builders[name] = builder
        builder.start()

    def _build_detached(self, name: str) -> None:
        """Load or build a graph on this thread's own handle of the scope's table, then give it
        to the scope if its rows are still the ones it covers (same log seqs, same order)."""
        try:
            table = self.store.tables.open_current(scope_tag(name), self.dimensions)
            if table is None:
                return
            shadow = ScopeSearch(name, self.dimensions, self.store.log_id, table)
            try:
                self._attach_graph(shadow)
                with self._lock:
                    scope = self._scopes.get(name)
                    if (
                        scope is not None
                        and scope.hnsw is None
                        and not scope.table.retired()
                        and scope.count >= shadow.graph_rows
                        and scope.prefix_digest(shadow.graph_rows) == shadow.graph_prefix
                        and self._graph_fits(shadow.graph_rows)
                    ):
                        self._wanting.pop(name, None)
                        scope.hnsw, scope.graph_rows = shadow.hnsw, shadow.graph_rows
                        scope.graph_prefix, scope.saved_rows = (
                            shadow.graph_prefix,
                            shadow.saved_rows,
                        )
            finally:
                table.close()
        except Exception:  # noqa: BLE001 - searches go on scanning flat; retried later
            log.exception("building the graph of a scope failed; retried in %.0f s", _BUILD_RETRY_S)
            with self._lock:
                self._build_failed[name] = time.monotonic()
        finally:
            with self._lock:
                self._builders.pop(name, None)

    def wait_graphs(self, timeout_s: float = 120.0) -> bool:
        """Wait for the graphs being built or saved in the background; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                builders = [*self._builders.values(), *self._savers]
            if not builders:
                return True
            for builder in builders:
                builder.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                with self._lock:
                    return not self._builders and not self._savers

    def _attach_graph(self, scope: ScopeSearch) -> None:
        """Give a scope that outgrew the flat scan its graph: the newest saved one that matches
        its rows plus the rows after it, else a new build."""
        started = time.perf_counter()
        rows = scope.table.snapshot()
        covered = self._load_graph(scope, rows)
        if covered is None:
            with contextlib.ExitStack() as building:
                if self.graphs is not None:  # another process may be building it: wait
                    building.enter_context(self.graphs.building(scope.name))
                    started = time.perf_counter()
                    rows = scope.table.snapshot()  # rows may have come while it waited
                    covered = self._load_graph(scope, rows)  # saved while this one waited
                if covered is None:
                    scope.build_hnsw(rows)
                    self._built += 1
                    log.info("built a graph of %d rows in %.1f s", len(rows), _since(started))
                    self._save_graph(scope)
                    return
        self._loaded += 1
        scope.hnsw_add(rows)
        log.info(
            "loaded a saved graph of %d rows and added %d in %.1f s",
            covered,
            len(rows) - covered,
            _since(started),
        )
        if len(rows) - covered >= _RESAVE_FRACTION * covered:
            self._save_graph(scope)

    def _load_graph(self, scope: ScopeSearch, rows: np.ndarray) -> int | None:
        """Attach the newest usable saved graph; the number of rows it covers, or None."""
        if self.graphs is None:
            return None
        for file in self.graphs.candidates(scope.name):
            if file.rows > len(rows):
                continue  # saved by a process that has seen more rows than this one
            prefix = scope.prefix_digest(file.rows)
            if prefix != file.prefix:
                # It covers other rows than the table holds in that order (compacted or
                # rebuilt since, or another log's), so it can never match again.
                log.info("graph %s covers other rows than the table; deleted", file.path.name)
                self._reject(file)
                continue
            try:
                index = self.graphs.load(file, self.dimensions, 2 * len(rows))
                if not scope.holds_own_vectors(index, rows, file.rows):
                    raise GraphFileError("its vectors differ from the table's rows")
            except GraphFileError as exc:
                log.warning("graph %s is unusable (%s); deleted", file.path.name, exc)
                self._reject(file)
                continue
            except OSError as exc:  # replaced or deleted by another process meanwhile
                log.info("graph %s could not be read (%s)", file.path.name, exc)
                self._rejected += 1
                continue
            scope.hnsw, scope.graph_rows, scope.graph_prefix = index, file.rows, prefix
            scope.saved_rows = file.rows
            return file.rows
        return None

    def _reject(self, file: GraphFile) -> None:
        self._rejected += 1
        if self.graphs is not None:
            self.graphs.discard(file)

    def _save_graph(self, scope: ScopeSearch) -> None:
        """Best effort: a graph that cannot be saved is rebuilt at the next start."""
        if self.graphs is None or scope.hnsw is None:
            return
        try:
            saved = self.graphs.save(scope.name, scope.graph_rows, scope.graph_prefix, scope.hnsw)
        except (OSError, RuntimeError) as exc:
            log.warning("could not save a scope's graph (%d rows): %s", scope.graph_rows, exc)
            return
        scope.saved_rows = scope.graph_rows
        self._saved += saved is not None

    def save_graphs(self) -> None:
        """Add the rows past each graph's end to it, and save every graph that has grown since
        its file was written."""
        with self._lock:
            for scope in self._scopes.values():
                if scope.hnsw is not None and not scope.table.retired():
                    scope.hnsw_add(scope.table.snapshot())
                    if scope.graph_rows > scope.saved_rows:
                        self._save_graph(scope)

    def search(self, scope: str, query: np.ndarray, k: int = 5) -> list[Neighbour]:
        """Nearest rows of `scope` only, best first. Best effort: a row deleted from the log
        since the snapshot (compaction) or damaged there is left out, so fewer than k may
        come back."""
        with self._lock:
            rows = self._open(scope)
            if rows is None:
                return []
            snapshot = rows.table.snapshot()
            # Hidden rows are skipped by fetching a few more, bounded: a tag or tenant that hid
            # thousands of rows must not make every search fetch thousands (recall may drop
            # where hidden rows crowd the top; a hidden row is never returned).
            started = time.perf_counter()
            nearest = rows.search(snapshot, query, k + min(len(rows.dead), _DEAD_OVERFETCH))
            self._timed(rows, len(snapshot), time.perf_counter() - started)
            ids = rows.table.ids(len(snapshot))
            if rows.dead:
                nearest = [(sim, i) for sim, i in nearest if int(ids[i]) not in rows.dead][:k]
            unsaved, self._unsaved = self._unsaved, []
        self._save_later(unsaved)
        found = self._metadata([int(ids[i]) for _, i in nearest])
        neighbours = []
        for (similarity, i), row in zip(nearest, found, strict=True):
            if row is None or row.scope != scope:
                continue
            if _vector_print(snapshot[i]) != row.vector_print:
                self._mismatched(rows, int(ids[i]))
                continue
            neighbours.append(Neighbour(similarity, row.digest, row.prompt))
        return neighbours

    def _mismatched(self, scope: ScopeSearch, seq: int) -> None:
        """A table row whose vector is not its id's row in the log (an id or a row changed in
        the table's file): its similarity is some other row's, so it is left out, a miss, never
        another row's answer served for it; counted with the damaged rows and logged."""
        with self._lock:
            scope.damaged += 1
        if _MISMATCH_LOG.ready():
            log.error(
                "scope %s...: a table row's vector is not its row %d's in the log (an id or a "
                "vector changed in the table's file) and was left out of a search (%d such lines "
                "not logged): stop the server and remove the scope's table file so that it is "
                "rebuilt from the row log",
                scope.name[:12],
                seq,
                _MISMATCH_LOG.suppressed,
            )

    def _timed(self, scope: ScopeSearch, rows: int, seconds: float) -> None:
        """Note a search's time (lock held) for the graphs' value: a search with a graph saved
        what a flat scan of its rows takes (at the flat scans' measured rate) less its time; a
        flat search of a scope lacking its graph for the budget would have saved its time less
        a graph search's."""
        scope.last_search_s = time.monotonic()
        if scope.hnsw is not None:
            self._graph_search_s = _moving(self._graph_search_s, seconds)
            if self._graph_budget is not None:
                self._graph_gained_s += max(rows * self._flat_s_per_row - seconds, 0.0)
            return
        if rows >= _TIMED_FLAT_ROWS:
            self._flat_s_per_row = _moving(self._flat_s_per_row, seconds / rows)
        if scope.name in self._wanting:
            self._graph_gained_s += max(seconds - self._graph_search_s, 0.0)

    def _metadata(self, seqs: list[int]) -> list[_RowMeta | None]:
        """The rows' scope, digest and prompt: from this process's cache, else the log (a row
        never changes under its seq; one deleted since is at worst a stale candidate, whose
        answer is gone too). The cache is bounded: it is cleared when full."""
        cache = self._meta
        wanted = [seq for seq in seqs if seq not in cache]
        if wanted:
            if len(cache) + len(wanted) > _META_CACHE_ROWS:
                cache.clear()
            for seq, row in zip(wanted, self.store.rows(wanted), strict=True):
                if row is not None:
                    cache[seq] = _RowMeta(
                        row.scope, row.digest, row.prompt, _vector_print(row.vector)
                    )
        return [cache.get(seq) for seq in seqs]

    def add(self, scope: str, digest: str, prompt: str, vector: np.ndarray) -> int:
        """Append a row; InvalidVector unless `vector` is a finite unit vector of this index's
        `dimensions`, ScopeLimitReached when `scope` is new and the host holds its limit of
        scopes (`SemanticStore`)."""
        return self.store.append(scope, digest, prompt, check_vector(vector, self.dimensions))

    def forget(self, digests: list[str]) -> int:
        """Stop returning the rows of these answers' digests (their answers were invalidated);
        how many rows this process stopped returning. Every process that hears of the
        invalidation calls this: the first one moves each digest's row from the scope's
        digest key to its forgotten list in the log (so the answer, generated again, is indexed
        as a new row), and every process hides the rows on that list. Hidden until the process
        restarts; after that such a row is a `stale` miss (its answer is gone), never a wrong
        answer. A message handled only after the answer was generated again (here or by
        another replica) names no digest for it: the listener finds the newer answer in a tier,
        L3 included (`InvalidationListener._newer_held`), and the row stays.

        The log is read and written without the index's lock (searches go on: a large
        invalidation held it for seconds), which is taken only to note the hidden rows; a scope
        this process opens meanwhile is as one opened after the call (its forgotten rows are
        `stale` misses)."""
        wanted = sorted(set(digests))
        if not wanted:
            return 0
        with self._lock:
            tags = {name: scope_tag(name) for name in self._scopes}
            sizes = {tags[name]: scope.count for name, scope in self._scopes.items()}
        present = self.store.present_digests(sizes, wanted)
        hidden = {
            name: set(self.store.forget_digests(tag, present[tag]))
            for name, tag in tags.items()
            if tag in present
        }
        forgotten = 0
        with self._lock:
            for name, seqs in hidden.items():
                scope = self._scopes.get(name)
                if scope is not None and (seqs := seqs - scope.dead):
                    scope.dead |= seqs
                    forgotten += len(seqs)
        return forgotten

    def size(self, scope: str | None = None) -> int:
        """Rows in `scope`'s table, or in every table this process has opened."""
        with self._lock:
            if scope is not None:
                rows = self._open(scope)
                return 0 if rows is None else rows.count - len(rows.dead)
            return sum(s.count - len(s.dead) for s in self._scopes.values())

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                sum(s.count - len(s.dead) for s in self._scopes.values()),
                len(self._scopes),
                self._built,
                self._loaded,
                self._saved,
                self._rejected,
                self._reopened,
                self.store.scopes_refused,
            )

    def close(self) -> None:
        self.wait_graphs()
        self.save_graphs()
        with self._lock:
            for scope in self._scopes.values():
                scope.table.close()
            self._scopes.clear()
        self.store.close()
