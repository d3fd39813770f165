"""Bounded and checked state (issue 14, "Bounded inputs"): private state files, LMDB reader
slots of dead processes, vectors written to the semantic index, the caps on semantic scopes (per
host and per tenant), a semantic hit's tenant re-check, and a damaged shared table's header.

The request's input bounds are in test_request.py, the table header's own checks in
test_native_table.py and the CPU engine's context check in test_engine_kv_reuse.py.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import lmdb
import numpy as np
import pytest

from tiercache.config import PARAMETERS
from tiercache.exact.codec import CacheEntry
from tiercache.exact.keys import REDIS_SEMANTIC_ROWS
from tiercache.exact.redis_tier import RedisLink
from tiercache.exact.stores import LmdbStore, MemoryStore, make_private_dir
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import HostWatermarks, InvalidationTable
from tiercache.machine import DiskReading, DiskRoom
from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.redis_rows import STREAM, RowFollower, SharedRow, sign_fields
from tiercache.semantic.row_log import (
    DEFAULT_MAX_SCOPES,
    DEFAULT_MAX_SCOPES_PER_TENANT,
    InvalidVector,
    ScopeLimitReached,
    check_vector,
    scope_tag,
)
from tiercache.semantic.shared_rows import LEFTOVER_AGE_S
from tiercache.semantic.stage import EmbeddingCache, SemanticOutcome
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache
from tiercache.vocabulary import Tier

DIM = 8


def unit(*values: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[: len(values)] = values
    return v / np.linalg.norm(v)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, which alone leaves new folders 0755 and files 0644."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# ---- state directory 0700, files 0600 ---------------------------------------------------------


@pytest.mark.usefixtures("umask_022")
def test_lmdb_state_is_created_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = LmdbStore(state / "l2", 1 << 22)
    store.close()
    marks = HostWatermarks(state / "invalidations")
    marks.close()
    vectors = VectorCache(state / "vectors", DIM, 1 << 10, 1 << 22)
    vectors.close()
    assert mode_of(state) == 0o700  # created by the first store, parents included
    for name in ("l2", "invalidations", "vectors"):
        assert mode_of(state / name) == 0o700
        assert mode_of(state / name / "data.mdb") == 0o600
        assert mode_of(state / name / "lock.mdb") == 0o600
        assert mode_of(state / f"{name}.open-lock") == 0o600


@pytest.mark.usefixtures("umask_022")
def test_semantic_state_and_its_tables_are_created_private(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    store.append("s", "d", "p", unit(1, 0))
    tables = tmp_path / "sem" / "tables"
    assert mode_of(tmp_path / "sem") == 0o700 and mode_of(tables) == 0o700
    files = sorted(tables.iterdir())
    assert {f.suffix for f in files} == {".tbl", ".lock"}
    assert all(mode_of(f) == 0o600 for f in files), [(f.name, oct(mode_of(f))) for f in files]
    store.close()


@pytest.mark.usefixtures("umask_022")
def test_an_open_state_folder_of_ours_is_tightened_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    l2 = tmp_path / "l2"
    LmdbStore(l2, 1 << 22).close()
    l2.chmod(0o755)
    (l2 / "data.mdb").chmod(0o644)
    (tmp_path / "l2.open-lock").chmod(0o666)
    with caplog.at_level(logging.WARNING):
        LmdbStore(l2, 1 << 22).close()
    assert mode_of(l2) == 0o700
    assert mode_of(l2 / "data.mdb") == 0o600
    assert mode_of(tmp_path / "l2.open-lock") == 0o600
    assert "was open to other users (mode 755); now 700" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_owned_by_another_user_is_left_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    os.chown(folder, 4242, -1)
    with caplog.at_level(logging.WARNING):
        make_private_dir(folder)
    assert mode_of(folder) == 0o755
    assert "owned by uid 4242" in caplog.text and "left as it is" in caplog.text


# ---- LMDB reader slots of dead processes --------------------------------------------------------

_DIE_READING = """
import os, sys, lmdb
env = lmdb.open(sys.argv[1], map_size=int(sys.argv[2]), max_readers=512)
txn = env.begin()
txn.get(b"anything")
os._exit(0)  # dies holding its reader slot
"""

_HOLD_OPEN = """
import sys, lmdb
env = lmdb.open(sys.argv[1], map_size=int(sys.argv[2]), max_readers=512)
print("open", flush=True)
sys.stdin.read()  # until the test closes the pipe
"""


def _python(code: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], text=True, **kwargs
    )


def _die_reading(path: Path, map_size: int) -> None:
    assert _python(_DIE_READING, str(path), str(map_size)).wait(60) == 0


MAP_SIZE = 1 << 22

OPENERS: dict[str, Callable[[Path], Any]] = {
    "l2": lambda path: LmdbStore(path, MAP_SIZE),
    "invalidations": lambda path: HostWatermarks(path, map_bytes=MAP_SIZE),
    "vectors": lambda path: VectorCache(path, DIM, 1 << 10, MAP_SIZE),
    "semantic": lambda path: SemanticStore(path, MAP_SIZE),
}


@pytest.mark.parametrize("kind", sorted(OPENERS))
def test_reader_check_frees_the_slot_of_a_dead_reader(tmp_path: Path, kind: str) -> None:
    path = tmp_path / kind
    opened = OPENERS[kind](path)
    _die_reading(path, MAP_SIZE)
    assert opened.reader_check() == 1  # what a stage calls after a restart
    assert opened.reader_check() == 0
    opened.close()


def test_opening_frees_the_slots_of_dead_readers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """LMDB clears its reader table only when no other process holds the environment; here
    another process does, as the other stages of a host do when one restarts."""
    path = tmp_path / "l2"
    LmdbStore(path, MAP_SIZE).close()
    holder = _python(
        _HOLD_OPEN, str(path), str(MAP_SIZE), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        _die_reading(path, MAP_SIZE)
        with caplog.at_level(logging.WARNING):
            store = LmdbStore(path, MAP_SIZE)
        assert "freed 1 reader slots of dead processes" in caplog.text
        assert store.reader_check() == 0
        store.close()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)


# ---- vectors written to the semantic index ------------------------------------------------------

BAD_VECTORS = [
    pytest.param(np.zeros(0, dtype=np.float32), "a vector of 0 floats", id="empty"),
    pytest.param(np.zeros(DIM, dtype=np.float32), "norm 0", id="zero"),
    pytest.param(2 * unit(1, 0), "norm 2", id="norm-2"),
    pytest.param(0.99 * unit(1, 0), "norm 0.99", id="norm-0.99"),
    pytest.param(np.full(DIM, np.nan, dtype=np.float32), "NaN or infinite", id="nan"),
    pytest.param(np.array([np.inf] + [0.0] * (DIM - 1)), "NaN or infinite", id="inf"),
    pytest.param(np.array([1e39] + [0.0] * (DIM - 1)), "NaN or infinite", id="float32-overflow"),
    pytest.param(np.ones(70_000, dtype=np.float32) / 70_000**0.5, "70000 floats", id="too-wide"),
    pytest.param(np.array(["a"] * DIM), "not a vector of numbers", id="strings"),
]


@pytest.mark.parametrize(("vector", "message"), BAD_VECTORS)
def test_invalid_vectors_are_refused_and_nothing_is_written(
    tmp_path: Path, vector: np.ndarray, message: str
) -> None:
    store = SemanticStore(tmp_path / "sem")
    with pytest.raises(InvalidVector, match=message):
        store.append("s", "d", "p", vector)
    with pytest.raises(InvalidVector, match=message):
        store.append_or_compact("s", "d", "p", vector, lambda digest: True)
    with pytest.raises(InvalidVector, match=message):  # the whole batch: all or nothing
        store.log_rows([("s", "ok", "p", unit(1, 0)), ("s", "d", "p", vector)])
    assert store.head() == 0 and store.manifests() == []
    store.close()


def test_a_unit_vector_within_the_tolerance_is_taken(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    assert store.append("s", "d", "p", 1.0005 * unit(1, 1)) == 0
    assert check_vector(unit(0, 1).reshape(1, DIM)).shape == (DIM,)
    store.close()


def test_vectors_of_another_width_than_the_index_are_refused(tmp_path: Path) -> None:
    index = SemanticIndex(SemanticStore(tmp_path / "sem"), DIM)
    other = np.zeros(DIM + 1, dtype=np.float32)
    other[0] = 1.0
    with pytest.raises(InvalidVector, match=f"9 floats where the index has {DIM}"):
        index.add("s", "d", "p", other)
    store = SemanticStore(tmp_path / "sem-dims", dimensions=DIM)
    with pytest.raises(InvalidVector, match=f"where the index has {DIM}"):
        store.append_or_compact("s", "d", "p", other, lambda digest: True)
    store.close()
    index.close()


# ---- semantic scopes capped per host ------------------------------------------------------------


def test_config_default_matches_the_logs_default() -> None:
    assert PARAMETERS["semantic_max_scopes"].default == DEFAULT_MAX_SCOPES


def test_a_new_scope_past_the_cap_is_not_indexed_and_never_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SemanticStore(tmp_path / "sem", max_scopes=2)
    keep = lambda digest: True  # noqa: E731
    assert store.append_or_compact("a", "d1", "p", unit(1, 0), keep) == 0
    assert store.append_or_compact("b", "d2", "p", unit(0, 1), keep) == 1
    with caplog.at_level(logging.WARNING):
        assert store.append_or_compact("c", "d3", "p", unit(1, 1), keep) is None
        assert store.append_or_compact("d", "d4", "p", unit(1, 1), keep) is None
    assert store.scopes_refused == 2
    assert caplog.text.count("holds its limit of 2 scopes") == 1  # logged once a minute
    assert store.manifest(scope_tag("c")) is None
    assert not list((tmp_path / "sem" / "tables").glob(f"{scope_tag('c')}.*.tbl"))
    # existing scopes still take rows
    assert store.append_or_compact("a", "d5", "p", unit(1, 0.5), keep) == 2
    with pytest.raises(ScopeLimitReached, match="limit of 2 scopes"):
        store.append("c", "d3", "p", unit(1, 1))
    assert store.head() == 3
    index = SemanticIndex(store, DIM)
    assert index.stats().scopes_refused == 2
    index.close()


def test_no_new_semantic_row_while_the_disk_is_critical_or_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """disk_headroom_bytes: under half of it, and when the disk is full (the log's
    transaction fails with ENOSPC; EIO, or a scope's table that cannot be sized, while the
    disk is short), a new row is dropped, counted and logged once a minute, never an error;
    other errors are raised; with room, rows are logged again."""
    free = [1 << 40]
    disk = DiskRoom(
        tmp_path, 1 << 30, interval_s=0.0, read=lambda p: DiskReading(str(p), 1 << 41, free[0])
    )
    store = SemanticStore(tmp_path / "sem", disk=disk)
    keep = lambda digest: True  # noqa: E731
    assert store.append_or_compact("a", "d1", "p", unit(1, 0), keep) == 0
    free[0] = (1 << 29) - 1  # critical
    with caplog.at_level(logging.WARNING):
        assert store.append_or_compact("a", "d2", "p", unit(0, 1), keep) is None
        free[0] = 1 << 40
        full = lmdb.DiskError("mdb_txn_commit: No space left on device")
        monkeypatch.setattr(store, "log_rows", Mock(side_effect=full))
        assert store.append_or_compact("a", "d3", "p", unit(1, 1), keep) is None
        # a short write (EIO) or a table that cannot be sized: the disk's, only while short
        monkeypatch.setattr(store, "log_rows", Mock(side_effect=lmdb.Error("Input/output error")))
        with pytest.raises(lmdb.Error):
            store.append_or_compact("a", "d4", "p", unit(1, 1), keep)
        free[0] = (1 << 30) - 1  # short
        assert store.append_or_compact("a", "d4", "p", unit(1, 1), keep) is None
        sizing = RuntimeError("cannot size /x/tables/t.tbl: No space left on device")
        monkeypatch.setattr(store.tables, "publish", Mock(side_effect=sizing))
        monkeypatch.setattr(store, "log_rows", Mock(return_value=([5], {"t": ([5], [unit(1)])})))
        assert store.append_or_compact("a", "d5", "p", unit(1, 1), keep) is None
        # ENOSPC raised while the table's file is made or linked, not only sized
        linking = RuntimeError("cannot create /x/tables/t.tbl.tmp.1.2: No space left on device")
        monkeypatch.setattr(store.tables, "publish", Mock(side_effect=linking))
        assert store.append_or_compact("a", "d5b", "p", unit(1, 1), keep) is None
        monkeypatch.setattr(store.tables, "publish", Mock(side_effect=RuntimeError("a bug")))
        with pytest.raises(RuntimeError, match="a bug"):
            store.append_or_compact("a", "d6", "p", unit(1, 1), keep)
    assert store.disk_skipped == 5 and store.head() == 1
    assert caplog.text.count("new rows are not logged") == 1  # once a minute
    monkeypatch.undo()
    free[0] = 1 << 40
    assert store.append_or_compact("a", "d7", "p", unit(1, 1), keep) == 1
    store.close()


_APPEND_SCOPE_B = """
import sys
from pathlib import Path
import numpy as np
from tiercache.semantic.store import SemanticStore
store = SemanticStore(Path(sys.argv[1]), max_scopes=2)
vector = np.zeros(int(sys.argv[2]), dtype=np.float32)
vector[1] = 1.0
store.append("b", "d2", "p", vector)
store.close()
"""


def test_the_cap_counts_the_scopes_other_processes_started(tmp_path: Path) -> None:
    path = tmp_path / "sem"
    store = SemanticStore(path, max_scopes=2)
    store.append("a", "d1", "p", unit(1, 0))
    assert store.admits_scope("b")
    assert _python(_APPEND_SCOPE_B, str(path), str(DIM)).wait(60) == 0
    assert not store.admits_scope("c") and store.admits_scope("b")
    assert store.append_or_compact("c", "d3", "p", unit(1, 1), lambda d: True) is None
    store.close()


def test_a_batch_from_another_replica_is_refused_whole_past_the_cap(tmp_path: Path) -> None:
    """log_rows (the path of rows shared through Redis) refuses the batch; its caller retries
    row by row and skips the refused ones (tiercache.semantic.redis_rows)."""
    store = SemanticStore(tmp_path / "sem", max_scopes=1)
    with pytest.raises(ScopeLimitReached):
        store.log_rows([("a", "d1", "p", unit(1, 0)), ("b", "d2", "p", unit(0, 1))])
    assert store.head() == 0
    assert store.log_rows([("a", "d1", "p", unit(1, 0))])[0] == [0]
    store.close()


# ---- semantic scopes capped per tenant ----------------------------------------------------------

KEEP: Callable[[str], bool] = lambda digest: True  # noqa: E731 - every answer still cached


def test_config_default_per_tenant_matches_the_logs_default() -> None:
    assert PARAMETERS["semantic_max_scopes_per_tenant"].default == DEFAULT_MAX_SCOPES_PER_TENANT
    assert DEFAULT_MAX_SCOPES_PER_TENANT < DEFAULT_MAX_SCOPES  # several tenants fit on a host


def test_a_tenant_past_its_cap_is_refused_while_another_still_starts_scopes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One tenant sending many max_tokens values (one scope each) takes only its own places."""
    store = SemanticStore(tmp_path / "sem", max_scopes=10, max_scopes_per_tenant=2)
    assert store.append_or_compact("greedy-16", "d1", "p", unit(1, 0), KEEP, "greedy") == 0
    assert store.append_or_compact("greedy-32", "d2", "p", unit(0, 1), KEEP, "greedy") == 1
    with caplog.at_level(logging.WARNING):
        for i, max_tokens in enumerate((64, 128, 256)):
            scope = f"greedy-{max_tokens}"
            assert store.append_or_compact(scope, f"x{i}", "p", unit(1, 1), KEEP, "greedy") is None
    assert store.scopes_refused == 3
    assert caplog.text.count("'greedy' holds its limit of 2 scopes") == 1  # once a minute
    assert store.manifest(scope_tag("greedy-64")) is None
    assert not list((tmp_path / "sem" / "tables").glob(f"{scope_tag('greedy-64')}.*.tbl"))
    with pytest.raises(ScopeLimitReached, match="'greedy' holds its limit of 2 scopes on this"):
        store.append("greedy-64", "x0", "p", unit(1, 1), tenant="greedy")
    # another tenant still starts scopes
    assert store.admits_scope("polite-16", "polite")
    assert store.append_or_compact("polite-16", "d3", "p", unit(1, 0), KEEP, "polite") == 2
    assert store.append_or_compact("polite-32", "d4", "p", unit(0, 1), KEEP, "polite") == 3
    assert (store.scopes_started_by("greedy"), store.scopes_started_by("polite")) == (2, 2)
    assert store.head() == 4
    store.close()


def test_an_existing_scope_of_a_capped_tenant_still_takes_rows(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem", max_scopes_per_tenant=1)
    assert store.append_or_compact("a-16", "d1", "p", unit(1, 0), KEEP, "a") == 0
    assert store.append_or_compact("a-32", "d2", "p", unit(0, 1), KEEP, "a") is None
    assert store.append_or_compact("a-16", "d3", "p", unit(0, 1), KEEP, "a") == 1
    assert store.append_many([("a-16", "d4", "p", unit(1, 1))], tenants={"a-16": "a"}) == [2]
    assert store.log_rows([("a-16", "d5", "p", unit(1, 2))])[0] == [3]  # no tenant: it exists
    assert store.live_count(scope_tag("a-16")) == 4
    assert store.scopes_started_by("a") == 1 and store.scopes_refused == 1
    store.close()


def test_the_host_cap_still_applies_under_the_tenant_caps(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem", max_scopes=3, max_scopes_per_tenant=2)
    for i, (scope, tenant) in enumerate((("a1", "a"), ("a2", "a"), ("b1", "b"))):
        assert store.append(scope, f"d{i}", "p", unit(1, i), tenant=tenant) == i
    assert store.scope_refusal("b2", "b") == "the log holds its limit of 3 scopes"
    assert store.append_or_compact("b2", "d3", "p", unit(0, 1), KEEP, "b") is None
    with pytest.raises(ScopeLimitReached, match="the log holds its limit of 3 scopes"):
        store.log_rows([("c1", "d4", "p", unit(1, 0))], tenants={"c1": "c"})
    assert store.scopes_refused == 1
    assert (store.scopes_started_by("b"), store.scopes_started_by("c")) == (1, 0)
    assert store.head() == 3
    store.close()


def test_rows_that_name_no_tenant_count_under_the_empty_tenant(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem", max_scopes_per_tenant=2)
    store.append("s1", "d1", "p", unit(1, 0))
    store.append_many([("s2", "d2", "p", unit(0, 1))])
    with pytest.raises(ScopeLimitReached, match="'' holds its limit of 2 scopes"):
        store.log_rows([("s3", "d3", "p", unit(1, 1))])
    assert store.scopes_started_by("") == 2
    assert store.append("t1", "d3", "p", unit(1, 1), tenant="t") == 2
    store.close()


def test_a_batch_names_the_tenant_of_each_new_scope_and_is_refused_whole(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem", max_scopes_per_tenant=1)
    rows = [("a1", "d1", "p", unit(1, 0)), ("b1", "d2", "p", unit(0, 1))]
    assert store.log_rows(rows, tenants={"a1": "a", "b1": "b"})[0] == [0, 1]
    with pytest.raises(ScopeLimitReached, match="'a' holds its limit of 1 scopes"):
        store.log_rows(
            [("c1", "d3", "p", unit(1, 1)), ("a2", "d4", "p", unit(1, 1))],
            tenants={"c1": "c", "a2": "a"},
        )
    assert store.head() == 2 and store.scopes_started_by("c") == 0  # all or nothing
    store.close()


def test_tenant_counts_survive_reopening_the_log(tmp_path: Path) -> None:
    path = tmp_path / "sem"
    store = SemanticStore(path, max_scopes_per_tenant=2)
    for i, (scope, tenant) in enumerate((("a1", "a"), ("a2", "a"), ("b1", "b"))):
        store.append(scope, f"d{i}", "p", unit(1, i), tenant=tenant)
    store.close()
    store = SemanticStore(path, max_scopes_per_tenant=2)
    assert (store.scopes_started_by("a"), store.scopes_started_by("b")) == (2, 1)
    assert store.append_or_compact("a3", "d3", "p", unit(0, 1), KEEP, "a") is None
    assert store.append_or_compact("b2", "d4", "p", unit(0, 1), KEEP, "b") == 3
    store.close()


def test_a_scope_compaction_empties_gives_its_place_back_to_its_tenant(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem", max_scopes_per_tenant=1)
    store.append("a1", "gone", "p", unit(1, 0), tenant="a")
    assert not store.admits_scope("a2", "a")
    assert store.compact(lambda digest: digest != "gone") == 1
    assert store.manifest(scope_tag("a1")) is None and store.scopes_started_by("a") == 0
    assert store.append("a2", "d2", "p", unit(0, 1), tenant="a") == 1
    store.close()


def _forget_tenant_counts(store: SemanticStore) -> None:
    """Make `store` a log written before the per-tenant counts: no scope's tenant (`o` keys),
    no tenant's count (`c` keys)."""
    with store._env.begin(write=True) as txn:  # noqa: SLF001 - the keys an older release lacks
        keys = [bytes(k) for k in txn.cursor().iternext(values=False)]
        for key in keys:
            if key[:1] in (b"o", b"c"):
                txn.delete(key)


def test_scopes_of_a_log_from_before_the_counts_belong_to_no_tenant(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem", max_scopes=3, max_scopes_per_tenant=1)
    store.append("old-a", "old-a", "p", unit(1, 0), tenant="a")
    store.append("old-b", "old-b", "p", unit(0, 1), tenant="b")
    _forget_tenant_counts(store)
    assert store.scopes_started_by("a") == 0
    assert store.append("a1", "d1", "p", unit(1, 1), tenant="a") == 2  # old-a is no one's
    assert store.scope_refusal("b1", "b") == "the log holds its limit of 3 scopes"  # the host's
    # emptied by compaction, an old scope gives its tenant nothing back (it has none)
    assert store.compact(lambda digest: digest != "old-a") == 1
    assert store.scopes_started_by("a") == 1
    assert store.append("b1", "d2", "p", unit(1, 2), tenant="b") == 3
    store.close()


def test_rows_waiting_for_a_compaction_keep_their_tenant(tmp_path: Path) -> None:
    """Rows that arrive while a compaction runs wait and are appended after it in batches: the
    tenant of each still counts, and one refused row costs no other row of its batch."""
    store = SemanticStore(tmp_path / "sem", max_bytes=256 * 1024, max_scopes_per_tenant=1)
    gate = threading.Event()

    def held_exists(digest: str) -> bool:
        gate.wait(10)  # the compaction checks every row's answer: held here
        return False

    i = 0
    while (
        store.append_or_compact("fill", f"f{i}", "p" * 1000, unit(1, i), held_exists, "f")
        is not None
    ):
        i += 1  # until a compaction starts
    waiting = [("a1", "a"), ("a2", "a"), ("b1", "b")]  # each passes its check before the wait
    for n, (scope, tenant) in enumerate(waiting):
        assert store.append_or_compact(scope, f"w{n}", "p", unit(1, n), held_exists, tenant) is None
    gate.set()
    assert store.wait_compacted()
    assert {r.digest for r in store.rows_since(0)} == {f"f{i}", "w0", "w2"}  # f{i} waited too
    assert (store.scopes_started_by("a"), store.scopes_started_by("b")) == (1, 1)
    assert store.scopes_refused == 1
    store.close()


class _FakeStream:
    """The Redis calls RowFollower makes, over one stream of fixed entries (no server needed)."""

    def __init__(self, key: str, entries: list[dict[str, bytes]]) -> None:
        self.key = key
        self.entries = [(f"{i + 1}-0", fields) for i, fields in enumerate(entries)]

    def ping(self) -> bool:
        return True

    def exists(self, key: str) -> int:
        return int(key == self.key)

    def xinfo_stream(self, key: str) -> dict[str, bytes]:
        return {"last-generated-id": self.entries[-1][0].encode()}

    def register_script(self, source: str) -> Callable[..., Any]:
        """The follower's bounded read (`redis_rows._BOUNDED_READ`): the entries after an
        exclusive start id, at most `count`, as Lua returns them (fields flattened); these
        rows are small, so no size bound is reached."""

        def run(keys: list[str], args: list[Any], client: Any = None) -> list[Any]:
            assert keys == [self.key] and str(args[0]).startswith("(")
            after = tuple(int(part) for part in str(args[0])[1:].split("-"))
            new = [
                [
                    ident.encode(),
                    [x for name, value in fields.items() for x in (name.encode(), value)],
                ]
                for ident, fields in self.entries
                if tuple(int(part) for part in ident.split("-")) > after
            ][: int(args[1])]
            return [new, 0]

        return run


SHARED_SECRET = b"s" * 32


def _signed_row(scope: str, digest: str, tenant: str, vector: np.ndarray) -> dict[str, bytes]:
    """A row another replica shared through the stream, signed with SHARED_SECRET."""
    entry = CacheEntry("", created_s=time.time() - 1, tenant_scope=tenant)
    row = SharedRow.of_entry(scope, digest, "p", vector, "", entry, origin="other-host")
    signer = RedisLink(None, secret=SHARED_SECRET).signer(REDIS_SEMANTIC_ROWS)  # type: ignore[arg-type]
    return sign_fields(signer, "t:" + STREAM, row.to_fields())


def _follow(store: SemanticStore, rows: list[dict[str, bytes]], tmp_path: Path) -> Any:
    """A follower run over a stream of `rows` until it caught up; its stats."""
    stream = _FakeStream("t:" + STREAM, rows)
    link = RedisLink(stream, prefix="t:", secret=SHARED_SECRET)  # type: ignore[arg-type]
    follower = RowFollower(
        link, store, InvalidationTable(), lock_path=tmp_path / "follower.lock", retry_s=0.05
    ).start()
    try:
        assert follower.wait_caught_up(30)
    finally:
        follower.close()
    return follower.stats()


def test_the_redis_follower_counts_each_shared_row_under_its_answers_tenant(
    tmp_path: Path,
) -> None:
    """Rows shared by another replica start scopes under the tenant their answer carries: a
    tenant past its cap is refused (counted, never an error) and another tenant's row of the
    same batch is still indexed."""
    store = SemanticStore(tmp_path / "sem", max_scopes_per_tenant=1)
    rows = [
        _signed_row("a1", "d1", "tenant-a", unit(1, 0)),
        _signed_row("a2", "d2", "tenant-a", unit(0, 1)),
        _signed_row("b1", "d3", "tenant-b", unit(1, 1)),
    ]
    stats = _follow(store, rows, tmp_path)
    assert (stats.read, stats.added, stats.forged, stats.last_id) == (3, 2, 0, "3-0")
    assert {r.digest for r in store.rows_since(0)} == {"d1", "d3"}
    assert (store.scopes_started_by("tenant-a"), store.scopes_started_by("tenant-b")) == (1, 1)
    assert store.scopes_started_by("") == 0 and store.scopes_refused == 1
    store.close()


def test_a_shared_row_with_an_overlong_digest_is_malformed_and_the_follower_moves_on(
    tmp_path: Path,
) -> None:
    """A signed row whose answer digest passes LMDB's key limit made the whole batch's
    transaction fail (lmdb.BadValsizeError, not a ValueError), retried forever without the
    stream id moving: every host's follower stopped there. It is malformed now, and the rows
    after it are indexed; the log itself refuses such a digest as a ValueError."""
    store = SemanticStore(tmp_path / "sem")
    rows = [
        _signed_row("a1", "d" * 600, "tenant-a", unit(1, 0)),
        _signed_row("a1", "d2", "tenant-a", unit(0, 1)),
    ]
    stats = _follow(store, rows, tmp_path)
    assert (stats.read, stats.added, stats.malformed, stats.last_id) == (2, 1, 1, "2-0")
    assert {r.digest for r in store.rows_since(0)} == {"d2"}
    with pytest.raises(ValueError, match="at most 128 bytes"):
        store.append("a1", "d" * 600, "p", unit(1, 0))
    assert {r.digest for r in store.rows_since(0)} == {"d2"}
    store.close()


def test_while_compactions_fail_the_log_stops_at_its_mark_and_compacts_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compactions that cannot read a tier (Redis down) delete nothing. Rows past the mark
    used to be appended anyway, until the map was full, and a full map cannot commit even one
    row's delete: the log stayed full after Redis came back. Now past the mark rows wait for a
    compaction (and are dropped while it fails); once the tiers read again it compacts."""
    from tiercache.semantic import compaction

    monkeypatch.setattr(compaction, "RETRY_PAUSE_S", 0.0)  # every write may start one
    store = SemanticStore(tmp_path / "sem", max_bytes=256 << 10)
    rng = np.random.default_rng(0)
    down = [True]

    def exists(digest: str) -> bool:
        if down[0]:
            raise ConnectionError("redis is down")
        return digest.endswith("7")  # most answers gone meanwhile

    with caplog.at_level(logging.ERROR):
        for i in range(1500):  # writes slower than a failing compaction; more than fill it
            store.append_or_compact("s", f"d{i}", "p", unit(*rng.random(DIM)), exists)
            assert store.wait_compacted(30)
    assert store.compaction_due()
    assert store.data_bytes() < 0.65 * (256 << 10)  # the mark (0.6) and a row; full was 0.77
    failures = [r for r in caplog.records if "compacting the semantic log failed" in r.message]
    assert len(failures) == 1  # once a minute, not once a write (1,500 lines before)
    down[0] = False  # the next write's compaction works: it can delete, and rows go in again
    store.append_or_compact("s", "first", "p", unit(1, 0), exists)
    assert store.wait_compacted(30)
    store.append_or_compact("s", "after", "p", unit(0, 1), exists)
    assert store.wait_compacted(30)
    assert "after" in {r.digest for r in store.rows_since(0)}
    assert not store.compaction_due()
    store.close()


def test_after_a_failed_compaction_rows_wait_a_pause_before_the_next(tmp_path: Path) -> None:
    """A failed compaction (a tier unreadable) is not retried by every write: rows past the
    mark wait (bounded) for `RETRY_PAUSE_S`, then the next write starts one, and they are
    appended after it."""
    store = SemanticStore(tmp_path / "sem", max_bytes=256 << 10)
    rng = np.random.default_rng(1)
    calls = [0]
    down = [True]

    def exists(digest: str) -> bool:
        calls[0] += 1
        if down[0]:
            raise ConnectionError("redis is down")
        return digest.endswith("3")

    i = 0
    while not store.compaction_due():
        store.append_or_compact("s", f"d{i}", "p", unit(*rng.random(DIM)), exists)
        i += 1
    assert store.wait_compacted(30)
    tried = calls[0]
    for j in range(50):  # within the pause: no compaction, the rows wait
        assert store.append_or_compact("s", f"w{j}", "p", unit(*rng.random(DIM)), exists) is None
    assert store.wait_compacted(30) and calls[0] == tried
    down[0] = False
    store._compactor._failed_s -= 60.0  # the pause is over
    store.append_or_compact("s", "last", "p", unit(1, 0), exists)
    assert store.wait_compacted(30)
    kept = {r.digest for r in store.rows_since(0)}
    assert {f"w{j}" for j in range(50)} | {"last"} <= kept
    store.close()


def _fill_to_the_mark(store: SemanticStore, seed: int) -> int:
    """Rows d0, d1, ... of scope "s" logged (no compaction) until the log is past its
    compaction mark; how many."""
    rng = np.random.default_rng(seed)
    count = 0
    while not store.compaction_due():
        store.log_rows([("s", f"d{count}", "p", unit(*rng.random(DIM)))])
        count += 1
    return count


def _one_shared_row() -> RedisLink:
    """A Redis stream holding one row ("shared", scope "s") another replica shared, signed."""
    secret = b"s" * 32
    key = "t:" + STREAM
    signer = RedisLink(None, secret=secret).signer(REDIS_SEMANTIC_ROWS)  # type: ignore[arg-type]
    entry = CacheEntry("", created_s=time.time() - 1, tenant_scope="tenant-a")
    row = SharedRow.of_entry("s", "shared", "p", unit(1, 0), "", entry, origin="other-host")
    stream = _FakeStream(key, [sign_fields(signer, key, row.to_fields())])
    return RedisLink(stream, prefix="t:", secret=secret)  # type: ignore[arg-type]


def test_the_redis_follower_compacts_at_the_mark_by_the_answers_values(tmp_path: Path) -> None:
    """Shared rows taking the log past its compaction mark: the follower compacts then, as the
    llm stage's writes do (it compacted only once the map was full, when deleting a row needs
    pages the map no longer has: the log stayed full), giving up the rows whose answers are
    worth least (it gave up the oldest, whatever they were worth)."""
    store = SemanticStore(tmp_path / "sem", max_bytes=256 << 10)
    count = _fill_to_the_mark(store, seed=0)  # this host's own rows
    oldest = {f"d{i}" for i in range(count // 5)}  # worth most; the oldest went first before
    link = _one_shared_row()
    follower = RowFollower(
        link,
        store,
        InvalidationTable(),
        lock_path=tmp_path / "follower.lock",
        answer_value=lambda digest: 9.0 if digest in oldest else 1.0,
        retry_s=0.05,
    ).start()
    try:
        assert follower.wait_caught_up(30)
    finally:
        follower.close()
    kept = {r.digest for r in store.rows_since(0)}
    assert "shared" in kept and oldest <= kept
    assert len(kept) == count + 1 - max(1, (count + 1) // 10)  # the tenth worth least went
    assert not store.compaction_due()
    store.close()


def test_a_follower_whose_compaction_fails_waits_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The log past its mark and a tier unreadable (each compaction fails): the follower ran a
    whole compaction and logged a traceback at every retry (every `retry_s`). It tries again
    after the pause and logs once a minute; the rows wait in Redis."""
    store = SemanticStore(tmp_path / "sem", max_bytes=256 << 10)
    _fill_to_the_mark(store, seed=2)
    link = _one_shared_row()
    asked = [0]

    def unreadable(digest: str) -> bool:
        asked[0] += 1
        raise ConnectionError("redis is down")

    with caplog.at_level(logging.ERROR):
        follower = RowFollower(
            link,
            store,
            InvalidationTable(),
            lock_path=tmp_path / "follower.lock",
            answer_exists=unreadable,
            retry_s=0.05,
        ).start()
        try:
            time.sleep(1.0)  # about twenty retries
        finally:
            follower.close()
    assert asked[0] == 1  # one compaction tried, none again within the pause
    assert caplog.text.count("applying 1 semantic rows from Redis failed") == 1
    assert "shared" not in {r.digest for r in store.rows_since(0)}  # it waits in Redis
    store.close()


def test_the_redis_follower_waits_while_the_disk_is_critical_and_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Other replicas' rows are not logged while the state directory's disk is under half of
    disk_headroom_bytes (as the host's own rows): they wait in Redis, the stream id is not
    advanced, one warning, no traceback; with room again they are all logged."""
    free = [(1 << 29) - 1]  # critical
    disk = DiskRoom(
        tmp_path, 1 << 30, interval_s=0.0, read=lambda p: DiskReading(str(p), 1 << 41, free[0])
    )
    store = SemanticStore(tmp_path / "sem", disk=disk)
    secret = b"s" * 32
    key = "t:" + STREAM
    signer = RedisLink(None, secret=secret).signer(REDIS_SEMANTIC_ROWS)  # type: ignore[arg-type]

    def shared(scope: str, digest: str, vector: np.ndarray) -> dict[str, bytes]:
        entry = CacheEntry("", created_s=time.time() - 1, tenant_scope="tenant-a")
        row = SharedRow.of_entry(scope, digest, "p", vector, "", entry, origin="other-host")
        return sign_fields(signer, key, row.to_fields())

    stream = _FakeStream(key, [shared("a", "d1", unit(1, 0)), shared("a", "d2", unit(0, 1))])
    link = RedisLink(stream, prefix="t:", secret=secret)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        follower = RowFollower(
            link, store, InvalidationTable(), lock_path=tmp_path / "follower.lock", retry_s=0.05
        ).start()
        try:
            time.sleep(0.5)  # ten retries
            assert follower.stats().last_id in ("", "0-0", None) and store.head() == 0
            free[0] = 1 << 40
            assert follower.wait_caught_up(30)
        finally:
            follower.close()
    assert {r.digest for r in store.rows_since(0)} == {"d1", "d2"}
    assert caplog.text.count("wait for disk") == 1 and "Traceback" not in caplog.text
    store.close()


# ---- a semantic hit re-checks its answer's tenant -----------------------------------------------


def _stage(tmp_path: Path, query: np.ndarray) -> EmbeddingCache:
    return EmbeddingCache(
        VectorCache(tmp_path / "vec", DIM),
        SemanticIndex(SemanticStore(tmp_path / "sem"), DIM),
        TieredCache([(Tier.L1, MemoryStore(1 << 20))]),
        lambda texts: np.stack([query for _ in texts]),
        lambda q, candidates: 0 if candidates else None,
        "emb@1",
        min_similarity=0.5,
    )


def test_a_row_pointing_at_another_tenants_answer_is_not_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercache.log_throttle import LogThrottle
    from tiercache.semantic import stage as stage_module

    monkeypatch.setattr(stage_module, "_DAMAGE_LOG", LogThrottle())  # once a minute: fresh
    stage = _stage(tmp_path, unit(1, 0))
    l1 = stage.answers.store(Tier.L1)
    assert l1 is not None
    l1.put("victim-digest", CacheEntry("victim's answer", 0.0, tenant_scope="victim"))
    # a row in the attacker's scope naming the victim's answer (forged, or a damaged log)
    stage.index.add("attacker-scope", "victim-digest", "q", unit(1, 0))
    with caplog.at_level(logging.WARNING):
        (refused,) = stage.lookup(["q"], ["attacker-scope"], ["attacker"])
    assert refused.outcome is SemanticOutcome.STALE and refused.text == ""
    assert stage.scope_mismatches == 1 and "another tenant scope" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):  # repeated on every lookup that meets the row: logged once a minute
            stage.lookup(["q"], ["attacker-scope"], ["attacker"])
    assert stage.scope_mismatches == 6 and "another tenant scope" not in caplog.text
    (served,) = stage.lookup(["q"], ["attacker-scope"], ["victim"])
    assert (served.outcome, served.text) == (SemanticOutcome.HIT, "victim's answer")
    stage.close()


# ---- a shared table with a damaged header -------------------------------------------------------

COUNT_OFFSET = 128  # layout version 1: the published count's cache line (shared_table.cpp)


def _search_a_damaged_table(path: str, found: Any) -> None:
    """In a process of its own: a native build without the header check reads past the
    mapping here (SIGBUS), which must fail the test, not end the test run."""
    index = SemanticIndex(SemanticStore(Path(path)), DIM)
    found.put([n.digest for n in index.search("s", unit(1, 2), k=5)])
    index.close()


def test_a_table_whose_count_is_past_its_capacity_is_rebuilt_from_the_log(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sem"
    store = SemanticStore(path)
    for i in range(3):
        store.append("s", f"d{i}", f"p{i}", unit(1, i))
    store.close()
    (table,) = (path / "tables").glob("*.tbl")
    with open(table, "r+b") as f:
        f.seek(COUNT_OFFSET)
        f.write((10**9).to_bytes(8, "little"))
    ctx = multiprocessing.get_context("spawn")
    found = ctx.SimpleQueue()
    searcher = ctx.Process(target=_search_a_damaged_table, args=(str(path), found))
    searcher.start()
    searcher.join(60)
    assert searcher.exitcode == 0
    digests = found.get()
    assert digests[0] == "d2" and sorted(digests) == ["d0", "d1", "d2"]


def test_unfinished_table_files_are_swept_once_old(tmp_path: Path) -> None:
    """A process killed while creating a table leaves its private file (`<table>.tmp.<pid>.
    <random>`, a whole table's size): the next store to open the folder deletes it once it is
    an hour old, and leaves a young one (a creation in progress) and every other file alone."""
    tables = tmp_path / "sem" / "tables"
    tables.mkdir(parents=True)
    old, young = tables / "ab.cd.0.tbl.tmp.123.456", tables / "ab.cd.1.tbl.tmp.124.457"
    kept = [young, tables / "ab.cd.0.tbl", tables / "ab.lock"]
    for path in (old, *kept):
        path.write_bytes(b"x" * 64)
    an_hour_ago = time.time() - LEFTOVER_AGE_S - 5
    os.utime(old, (an_hour_ago, an_hour_ago))
    os.utime(tables / "ab.cd.0.tbl", (an_hour_ago, an_hour_ago))
    store = SemanticStore(tmp_path / "sem")
    assert not old.exists() and all(path.exists() for path in kept)
    assert store.tables.sweep_leftovers(now_s=time.time() + LEFTOVER_AGE_S + 5) == 1  # young
    assert not young.exists()
    store.close()
