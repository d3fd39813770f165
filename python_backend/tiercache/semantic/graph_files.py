"""Saved HNSW graphs of large scopes, in a folder beside the row log (`<row log>/graphs`).

Building a large scope's graph dominates a start (about 12 s for 100,000 rows on 2 cores), so
graphs are saved and a start loads the newest one that covers a prefix of the scope's table,
then adds only the rows after it (`tiercache.semantic.index`). This module is the files alone:
their names, their integrity checks and their atomic replacement.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.semantic.row_log import scope_tag

# HNSW parameters. They are hashed into every saved graph's prefix digest, so a graph built with
# other parameters is never loaded; bump the format tag when the file layout changes.
HNSW_M = 12
HNSW_EF_CONSTRUCTION = 40
HNSW_EF_SEARCH = 128
GRAPH_FORMAT = f"tiercache-hnsw-v1 ip M={HNSW_M} ef_construction={HNSW_EF_CONSTRUCTION}"
_GRAPH_NAME = re.compile(r"^([0-9a-f]{24})\.(\d+)\.([0-9a-f]{32})\.([0-9a-f]{32})\.hnsw$")
_ABANDONED_TMP_S = 3600.0  # a temporary file this old is left over from a crashed save
# How long a process waits for another that is building the same scope's graph (100,000 rows:
# about 13 s on 2 cores) before building its own
BUILD_WAIT_S = 300.0


class GraphFileError(Exception):
    """A saved graph that must not be used (its bytes or contents do not match its name)."""


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class GraphFile:
    """A saved graph: `<scope tag>.<rows>.<prefix digest>.<content digest>.hnsw`."""

    path: Path
    scope_tag: str
    rows: int  # it holds the scope's first `rows` rows, labelled 0 .. rows - 1
    prefix: str  # digest of those rows' identities (see `ScopeSearch.prefix_digest`)
    content: str  # digest of the file's bytes


class GraphFiles:
    """Saved HNSW graphs of large scopes, in a folder beside the row log.

    A file's name ties it to its scope and to the exact rows it covers (the digest of those
    rows' sequence numbers and checksums, in index order, and of the graph parameters), and to
    its own bytes. A start uses a file only when both match; anything else is rebuilt. Writers
    save under a private temporary name and rename, so no reader sees a partial file and
    processes saving at once cannot damage each other's files. No fsync: a file torn by a crash
    fails its content check and is rebuilt.
    """

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock

    def candidates(self, scope: str) -> list[GraphFile]:
        """The scope's saved graphs, the one covering most rows first."""
        tag = scope_tag(scope)
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _GRAPH_NAME.match(name)
            if match and match.group(1) == tag:
                rows, prefix, content = int(match.group(2)), match.group(3), match.group(4)
                found.append(GraphFile(self.path / name, tag, rows, prefix, content))
        return sorted(found, key=lambda f: f.rows, reverse=True)

    def load(self, file: GraphFile, dimensions: int, max_elements: int) -> Any:
        """The graph in `file`, room for `max_elements`; GraphFileError if it must not be used,
        OSError if it went away (another process replaced or deleted it)."""
        if file_digest(file.path) != file.content:
            raise GraphFileError("its bytes do not match the digest in its name")
        import hnswlib

        index = hnswlib.Index(space="ip", dim=dimensions)
        try:
            index.load_index(str(file.path), max_elements=max(max_elements, file.rows))
        except RuntimeError as exc:  # hnswlib's "Index seems to be corrupted or unsupported"
            raise GraphFileError(f"hnswlib: {exc}") from exc
        if index.get_current_count() != file.rows:
            raise GraphFileError(f"it holds {index.get_current_count()} rows, not {file.rows}")
        labels = np.asarray(index.get_ids_list(), dtype=np.int64)
        if len(labels) != file.rows or not np.array_equal(np.sort(labels), np.arange(file.rows)):
            # a label past the table would fail every search of the scope (or read past it)
            raise GraphFileError("its labels are not the table's rows 0..rows-1")
        index.set_ef(HNSW_EF_SEARCH)
        return index

    def save(self, scope: str, rows: int, prefix: str, index: Any) -> GraphFile | None:
        """Save `index`, which covers the scope's first `rows` rows (digest `prefix`), then
        delete the scope's files that cover fewer rows. None when another process already saved
        a graph of the same rows. Raises OSError or RuntimeError (hnswlib) when it cannot write."""
        tag = scope_tag(scope)
        existing = self.candidates(scope)
        if any(f.rows == rows and f.prefix == prefix for f in existing):
            return None
        self.path.mkdir(parents=True, exist_ok=True)
        self._remove_abandoned(tag)
        tmp = self.path / f".{tag}.{uuid.uuid4().hex}.tmp"
        try:
            index.save_index(str(tmp))
            content = file_digest(tmp)
            path = self.path / f"{tag}.{rows}.{prefix}.{content}.hnsw"
            os.replace(tmp, path)  # atomic: readers see the old name set or the whole new file
        finally:
            tmp.unlink(missing_ok=True)
        for f in existing:
            if f.rows < rows:
                self.discard(f)
        return GraphFile(path, tag, rows, prefix, content)

    def discard(self, file: GraphFile) -> None:
        file.path.unlink(missing_ok=True)

    def discard_over(self, tag: str, rows: int) -> int:
        """Delete scope `tag`'s files covering more than `rows` rows: after a compaction
        rewrote the scope's table down to `rows`, a row inside their prefix is gone, so they can
        never match again (they stayed until the scope grew past them). How many went."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return 0
        gone = 0
        for name in names:
            match = _GRAPH_NAME.match(name)
            if match and match.group(1) == tag and int(match.group(2)) > rows:
                (self.path / name).unlink(missing_ok=True)
                gone += 1
        return gone

    @contextlib.contextmanager
    def building(self, scope: str, wait_s: float = BUILD_WAIT_S) -> Iterator[bool]:
        """Held while this process builds `scope`'s graph, so that processes starting cold
        together build it once: the others wait here (at most `wait_s`), then find the file it
        saved. An advisory lock (flock) on `.<scope tag>.lock` in the folder, let go when the
        holder's process ends however it ends. Yields whether it is held (False: waited
        `wait_s`, or the folder cannot be written; the caller builds all the same)."""
        lock = self.path / f".{scope_tag(scope)}.lock"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            fd = -1
        if fd < 0:  # outside the except: the caller's errors carry no OSError as context
            yield False
            return
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        held = False
                        break
                    time.sleep(0.05)
            try:
                yield held
            finally:
                if held:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _remove_abandoned(self, tag: str) -> None:
        for tmp in self.path.glob(f".{tag}.*.tmp"):
            try:
                if self._clock() - tmp.stat().st_mtime > _ABANDONED_TMP_S:
                    tmp.unlink()
            except FileNotFoundError:
                pass
