"""tiercache_native.SharedTable: the API, its errors, and the publication protocol across real
processes (writers and readers at once, a writer killed in the middle of a publish).

The workers run in spawned processes (a fresh interpreter each, as Triton's model instances
are), each opening the table file by path.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import re
import signal
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import tiercache_native as native
from tiercache_native import testing

WIDTH = 16


def check_ids(first: int, n: int, writer: int = 0) -> np.ndarray:
    return (np.uint64(writer) << np.uint64(32)) | np.arange(first, first + n, dtype=np.uint64)


def wait_until(predicate, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for a condition")
        time.sleep(0.001)


# --- API ------------------------------------------------------------------------------------------


def test_publish_and_snapshot(tmp_path: Path) -> None:
    table = native.SharedTable(tmp_path / "t.tbl", WIDTH, 100)
    assert (table.count(), table.capacity(), table.width()) == (0, 100, WIDTH)
    assert table.generation() == 0
    assert table.snapshot().shape == (0, WIDTH)
    rows = testing.make_rows(np.arange(3, dtype=np.uint64), WIDTH)
    assert table.publish(rows) == 0
    assert table.publish(rows[0]) == 3  # one row as a 1-d array
    snap = table.snapshot()
    assert snap.shape == (4, WIDTH) and snap.dtype == np.float32
    np.testing.assert_array_equal(snap[:3], rows)
    np.testing.assert_array_equal(table.ids(), [0, 1, 2, 3])  # default ids: the row indices
    assert table.claimed() == table.count() == 4


def test_ids_are_stored_with_the_rows(tmp_path: Path) -> None:
    table = native.SharedTable(tmp_path / "t.tbl", WIDTH, 100)
    ids = check_ids(0, 5, writer=7)
    table.publish(testing.make_rows(ids, WIDTH), ids)
    np.testing.assert_array_equal(table.ids(), ids)
    np.testing.assert_array_equal(table.ids(2), ids[:2])
    assert testing.bad_rows(table.snapshot(), table.ids()) == 0
    with pytest.raises(IndexError):
        table.ids(6)
    table.publish(np.zeros((2, WIDTH), dtype=np.float32), np.array([40, 41]))  # int64: cast
    np.testing.assert_array_equal(table.ids()[-2:], [40, 41])
    with pytest.raises(ValueError, match="ids has 2 values for 5 rows"):
        table.publish(testing.make_rows(ids, WIDTH), ids[:2])


def test_snapshot_is_a_read_only_zero_copy_view_that_outlives_the_table(tmp_path: Path) -> None:
    table = native.SharedTable(tmp_path / "t.tbl", WIDTH, 100)
    table.publish(np.ones((2, WIDTH), dtype=np.float32))
    first = table.snapshot()
    table.publish(np.full((1, WIDTH), 2.0, dtype=np.float32))
    second = table.snapshot()
    assert first.__array_interface__["data"][0] == second.__array_interface__["data"][0]
    assert not first.flags.writeable
    with pytest.raises(ValueError):
        first[0, 0] = 5.0
    table.close()
    del table
    assert float(second.sum()) == 4 * WIDTH  # the mapping lives as long as a view of it


def test_closed_table_refuses_use(tmp_path: Path) -> None:
    with native.SharedTable(tmp_path / "t.tbl", WIDTH, 10) as table:
        table.publish(np.zeros((1, WIDTH), dtype=np.float32))
    assert table.closed
    with pytest.raises(ValueError, match="closed"):
        table.count()


def test_rows_are_converted_and_shape_is_checked(tmp_path: Path) -> None:
    table = native.SharedTable(tmp_path / "t.tbl", WIDTH, 10)
    doubles = np.arange(2 * WIDTH, dtype=np.float64).reshape(2, WIDTH)
    table.publish(doubles)  # type: ignore[arg-type]  # converted to float32
    assert table.snapshot()[1, 0] == WIDTH
    with pytest.raises(ValueError, match=r"shape \(n, 16\), not \(2, 3\)"):
        table.publish(np.zeros((2, 3), dtype=np.float32))


def test_capacity_is_all_or_nothing(tmp_path: Path) -> None:
    table = native.SharedTable(tmp_path / "t.tbl", WIDTH, 5)
    table.publish(np.zeros((3, WIDTH), dtype=np.float32))
    with pytest.raises(native.TableFullError, match="3 of 5 rows used, 3 more do not fit"):
        table.publish(np.zeros((3, WIDTH), dtype=np.float32))
    assert table.count() == table.claimed() == 3
    assert table.publish(np.zeros((2, WIDTH), dtype=np.float32)) == 3
    for timeout_s in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_s must be >= 0"):
            table.publish(np.zeros((1, WIDTH), dtype=np.float32), timeout_s=timeout_s)


def test_a_second_handle_sees_the_same_rows(tmp_path: Path) -> None:
    a = native.SharedTable(str(tmp_path / "t.tbl"), WIDTH, 10)
    b = native.SharedTable(tmp_path / "t.tbl", WIDTH, 10)
    a.publish(np.full((2, WIDTH), 3.0, dtype=np.float32))
    assert b.count() == 2 and float(b.snapshot().sum()) == 6.0 * WIDTH
    assert b.path == str(tmp_path / "t.tbl")


def test_opening_validates_the_header(tmp_path: Path) -> None:
    path = tmp_path / "t.tbl"
    native.SharedTable(path, WIDTH, 10).close()
    with pytest.raises(native.TableFormatError, match="16 floats wide, not 8"):
        native.SharedTable(path, 8, 10)
    with pytest.raises(native.TableFormatError, match="capacity is 10 rows, not 20"):
        native.SharedTable(path, WIDTH, 20)
    assert issubclass(native.TableFormatError, ValueError)
    junk = tmp_path / "junk.tbl"
    junk.write_bytes(b"x" * 8192)
    junk.chmod(0o600)  # private, as a table is: its content is what is refused
    with pytest.raises(native.TableFormatError, match="bad magic"):
        native.SharedTable(junk, WIDTH, 10)
    short = tmp_path / "short.tbl"
    short.write_bytes(b"x" * 10)
    short.chmod(0o600)
    with pytest.raises(native.TableFormatError, match="too short"):
        native.SharedTable(short, WIDTH, 10)
    with pytest.raises(ValueError, match="width"):
        native.SharedTable(tmp_path / "zero.tbl", 0, 10)


# Layout version 1: the published count and the claimed end each on their own cache line.
COUNT_OFFSET, CLAIMED_OFFSET = 128, 192


def _write_u64(path: Path, offset: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value.to_bytes(8, "little"))


@pytest.mark.parametrize(("offset", "what"), [(COUNT_OFFSET, "11 rows"), (CLAIMED_OFFSET, "(99")])
def test_opening_refuses_row_counts_past_the_capacity(
    tmp_path: Path, offset: int, what: str
) -> None:
    """A damaged or forged count would make every view, and the next publish, run off the end
    of the mapping: the header's counts are checked against the capacity at open."""
    path = tmp_path / "t.tbl"
    with native.SharedTable(path, WIDTH, 10) as table:
        table.publish(np.ones((3, WIDTH), dtype=np.float32))
    _write_u64(path, offset, 11 if offset == COUNT_OFFSET else 99)
    with pytest.raises(native.TableFormatError, match="in a table of 10 rows; the file is damaged"):
        native.SharedTable(path, WIDTH, 10)
    with pytest.raises(native.TableFormatError, match=re.escape(what)):
        native.SharedTable(path, WIDTH, 10)


def test_an_open_that_finds_the_counts_damaged_retires_the_table(tmp_path: Path) -> None:
    """Whoever mapped the file before keeps reading it: the open that finds its counts damaged
    marks it retired, so they reopen through the manifest (only `claimed` damaged leaves their
    own reads working, and would leave them on a table no one publishes to)."""
    path = tmp_path / "t.tbl"
    reader = native.SharedTable(path, WIDTH, 10)
    reader.publish(np.ones((3, WIDTH), dtype=np.float32))
    _write_u64(path, CLAIMED_OFFSET, 99)
    assert reader.count() == 3 and not reader.retired()
    with pytest.raises(native.TableFormatError, match="damaged"):
        native.SharedTable(path, WIDTH, 10)
    assert reader.retired()
    reader.close()


def test_a_count_damaged_after_the_open_is_refused_by_every_use(tmp_path: Path) -> None:
    path = tmp_path / "t.tbl"
    table = native.SharedTable(path, WIDTH, 10)
    table.publish(np.ones((2, WIDTH), dtype=np.float32))
    _write_u64(path, COUNT_OFFSET, 1 << 40)
    with pytest.raises(native.TableFormatError, match="the file is damaged"):
        table.count()  # first: a build without the check would read past the mapping below
    with pytest.raises(native.TableFormatError):
        table.snapshot()
    with pytest.raises(native.TableFormatError):
        table.ids()
    with pytest.raises(native.TableFormatError, match="nothing was published"):
        table.publish(np.ones((1, WIDTH), dtype=np.float32))
    _write_u64(path, COUNT_OFFSET, 2)  # repaired: usable again
    assert table.count() == 2 and table.snapshot().shape == (2, WIDTH)


def test_table_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        native.SharedTable(tmp_path / "t.tbl", WIDTH, 10).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.tbl").stat().st_mode) == 0o600


def test_the_first_open_after_a_reboot_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "t.tbl"
    with native.SharedTable(path, WIDTH, 10) as table:
        table.publish(np.ones((3, WIDTH), dtype=np.float32))
    # Layout version 1 keeps the boot id of the last initialization at bytes 56..104.
    with open(path, "r+b") as f:
        f.seek(56)
        f.write(b"another-boot".ljust(48, b"\0"))
    reopened = native.SharedTable(path, WIDTH, 10)
    assert (reopened.count(), reopened.claimed(), reopened.generation()) == (0, 0, 1)
    assert reopened.publish(np.ones((1, WIDTH), dtype=np.float32)) == 0
    again = native.SharedTable(path, WIDTH, 10)  # same boot now: no second reset
    assert (again.count(), again.generation()) == (1, 1)


def test_a_table_with_no_stored_boot_is_not_reset(tmp_path: Path) -> None:
    """An empty stored boot id proves no reboot (a file made where the boot id could not be
    read): resetting it under a live writer would rewind `count` under readers' views."""
    path = tmp_path / "t.tbl"
    with native.SharedTable(path, WIDTH, 10) as table:
        table.publish(np.ones((3, WIDTH), dtype=np.float32))
    with open(path, "r+b") as f:
        f.seek(56)
        f.write(b"\0" * 48)
    reopened = native.SharedTable(path, WIDTH, 10)
    assert (reopened.count(), reopened.generation()) == (3, 0)


@pytest.mark.parametrize("unsafe", ["group-writable", "other-readable", "symlink", "owner"])
def test_only_a_private_regular_file_of_this_user_is_opened(tmp_path: Path, unsafe: str) -> None:
    """A table file another local user could write (a planted file in a shared /dev/shm
    folder) is refused before it is mapped or locked: they could read every tenant's vectors,
    rewrite rows, truncate it under the readers or hold its lock for ever."""
    path = tmp_path / "t.tbl"
    with native.SharedTable(path, WIDTH, 10) as table:
        table.publish(np.ones((2, WIDTH), dtype=np.float32))
    if unsafe == "group-writable":
        path.chmod(0o620)
    elif unsafe == "other-readable":
        path.chmod(0o604)
    elif unsafe == "symlink":
        real = tmp_path / "elsewhere.tbl"
        path.rename(real)
        path.symlink_to(real)
    else:
        if os.geteuid() != 0:
            pytest.skip("changing a file's owner needs root")
        os.chown(path, 4242, 4242)
    with pytest.raises((RuntimeError, OSError), match="not a private regular file|cannot open"):
        native.SharedTable(path, WIDTH, 10)


@pytest.mark.parametrize("pause", [float("inf"), float("nan"), -1.0])
def test_the_pause_hook_refuses_what_no_clock_can_wait(tmp_path: Path, pause: float) -> None:
    """A non-finite duration converted to the clock's integer ticks is undefined behaviour."""
    with native.SharedTable(tmp_path / "t.tbl", WIDTH, 4) as table:
        with pytest.raises(ValueError, match="finite"):
            table.publish(np.ones((1, WIDTH), dtype=np.float32), _pause_after_copy_s=pause)
        assert table.count() == 0


def test_creation_leaves_no_temporary_files(tmp_path: Path) -> None:
    native.SharedTable(tmp_path / "t.tbl", WIDTH, 10).close()
    assert sorted(os.listdir(tmp_path)) == ["t.tbl"]


def test_retire_stops_writers_and_tells_readers(tmp_path: Path) -> None:
    writer = native.SharedTable(tmp_path / "t.tbl", WIDTH, 10)
    reader = native.SharedTable(tmp_path / "t.tbl", WIDTH, 10)
    writer.publish(np.zeros((1, WIDTH), dtype=np.float32))
    assert not reader.retired()
    writer.retire()
    assert reader.retired()
    with pytest.raises(native.TableRetiredError, match="reopen"):
        reader.publish(np.zeros((1, WIDTH), dtype=np.float32))
    assert reader.count() == 1


def test_fence_and_cuda_queries() -> None:
    native.fence()
    assert isinstance(native.cuda_compiled(), bool)
    assert native.cuda_device_count() >= 0
    assert isinstance(native.cuda_status(), str)
    assert native.LAYOUT_VERSION == 1


@pytest.mark.skipif(native.cuda_device_count() > 0, reason="this host has a CUDA device")
def test_cuda_objects_refuse_clearly_without_a_device() -> None:
    with pytest.raises(native.CudaUnavailableError, match="CUDA|cuda"):
        native.DeviceTable(WIDTH, 10)
    with pytest.raises(native.CudaUnavailableError):
        native.ReplicaSet(WIDTH, 10)
    with pytest.raises(native.CudaUnavailableError):
        native.ReplicaSet(WIDTH, 10, devices=[0, 0], allow_peer=False)


def test_check_rows_catch_torn_and_missing_rows() -> None:
    ids = np.arange(4, dtype=np.uint64)
    rows = testing.make_rows(ids, WIDTH)
    assert testing.bad_rows(rows, ids) == 0
    torn = rows.copy()
    torn[1, 3] = rows[2, 3]  # one value from another row
    assert testing.bad_rows(torn, ids) == 1
    assert testing.bad_rows(np.zeros_like(rows), ids) == 4  # never written
    assert testing.bad_rows(rows, ids + np.uint64(1)) == 4  # someone else's row


# --- Processes ------------------------------------------------------------------------------------


def _writer(
    path: str, capacity: int, writer: int, rows: int, seed: int, start: object = None
) -> None:
    table = native.SharedTable(path, WIDTH, capacity)
    rng = np.random.default_rng(seed)
    if start is not None:
        start.wait(timeout=60)  # type: ignore[attr-defined]
    seq = batches = 0
    while seq < rows:
        n = min(int(rng.integers(1, 65)), rows - seq)
        ids = check_ids(seq, n, writer)
        table.publish(testing.make_rows(ids, WIDTH), ids)
        seq += n
        batches += 1
        if batches % 20 == 0:
            time.sleep(0.002)  # let readers in while the table fills, even on a busy machine


def _reader(
    path: str,
    capacity: int,
    writers: int,
    total: int,
    out: mp.Queue,  # type: ignore[type-arg]
    start: object,
) -> None:
    """Checks every row as it appears: its checksum (no torn row, no count ahead of its data),
    each writer's rows in the order it published them, and that views taken earlier never
    change."""
    table = native.SharedTable(path, WIDTH, capacity)
    last_seq = [-1] * writers
    checked = snapshots = bad = out_of_order = partial = 0
    start.wait(timeout=60)  # type: ignore[attr-defined]
    early: np.ndarray | None = None
    early_copy: np.ndarray | None = None
    deadline = time.monotonic() + 60
    while checked < total and time.monotonic() < deadline:
        rows = table.snapshot()
        ids = table.ids(len(rows))
        snapshots += 1
        partial += 0 < len(rows) < total
        if len(rows) > checked:
            bad += testing.bad_rows(rows[checked:], ids[checked:])
            for ident in ids[checked:].tolist():
                writer, seq = ident >> 32, ident & 0xFFFFFFFF
                if seq <= last_seq[writer]:
                    out_of_order += 1
                last_seq[writer] = seq
            checked = len(rows)
            if early is None and checked > 0:
                early, early_copy = rows, rows.copy()
    unchanged = early is not None and early_copy is not None and np.array_equal(early, early_copy)
    out.put((checked, partial, bad, out_of_order, unchanged))


def test_writers_and_readers_in_separate_processes(tmp_path: Path) -> None:
    writers, readers, rows_each = 3, 3, 6000
    total = writers * rows_each
    path = str(tmp_path / "t.tbl")
    native.SharedTable(path, WIDTH, total).close()
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    start = ctx.Barrier(readers + writers)  # everyone starts at once, the table still empty
    procs = [
        ctx.Process(target=_reader, args=(path, total, writers, total, results, start))
        for _ in range(readers)
    ]
    procs += [
        ctx.Process(target=_writer, args=(path, total, w, rows_each, w, start))
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=90) for _ in range(readers)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    table = native.SharedTable(path, WIDTH, total)
    assert table.count() == total and table.generation() == 0
    assert testing.bad_rows(table.snapshot(), table.ids()) == 0
    for checked, _, bad, out_of_order, unchanged in outcomes:
        assert (checked, bad, out_of_order) == (total, 0, 0)
        assert unchanged
    # Readers ran while the table filled (else the test would check nothing concurrent).
    assert sum(partial for _, partial, *_ in outcomes) > 0


def test_concurrent_creators_share_one_table(tmp_path: Path) -> None:
    path = str(tmp_path / "t.tbl")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, 1000, w, 50, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    table = native.SharedTable(path, WIDTH, 1000)
    assert table.count() == 200
    assert testing.bad_rows(table.snapshot(), table.ids()) == 0
    assert sorted(os.listdir(tmp_path)) == ["t.tbl"]


def _stalled_writer(path: str, capacity: int) -> None:
    """Publishes 5 rows, then 7 more that it copies but stalls on before publishing."""
    table = native.SharedTable(path, WIDTH, capacity)
    table.publish(testing.make_rows(check_ids(0, 5), WIDTH), check_ids(0, 5))
    ids = check_ids(100, 7)
    table.publish(testing.make_rows(ids, WIDTH), ids, _pause_after_copy_s=120.0)


def test_a_writer_killed_mid_publish_is_recovered(tmp_path: Path) -> None:
    path = str(tmp_path / "t.tbl")
    table = native.SharedTable(path, WIDTH, 100)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_stalled_writer, args=(path, 100))
    proc.start()
    try:
        wait_until(lambda: table.claimed() == 12)  # holds the lock, 7 rows claimed
        assert table.count() == 5 and len(table.snapshot()) == 5  # unpublished rows: unseen
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="live writer"):
            table.publish(np.zeros((1, WIDTH), dtype=np.float32), timeout_s=0.2)
        assert time.monotonic() - started >= 0.19  # the deadline is the timeout's, not earlier
    finally:
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL
    assert table.count() == 5 and table.generation() == 0

    ids = check_ids(5, 3, writer=1)
    assert table.publish(testing.make_rows(ids, WIDTH), ids) == 5  # over the dead writer's rows
    assert table.generation() == 1
    assert table.count() == table.claimed() == 8
    np.testing.assert_array_equal(table.ids()[5:], ids)
    assert testing.bad_rows(table.snapshot(), table.ids()) == 0
    table.publish(np.zeros((1, WIDTH), dtype=np.float32))
    assert table.generation() == 1  # one recovery, one bump


def _hold_the_lock(path: str, capacity: int, hold_s: float) -> None:
    """Publishes 7 rows, holding the writer lock for `hold_s` after copying them."""
    table = native.SharedTable(path, WIDTH, capacity)
    ids = check_ids(0, 7)
    table.publish(testing.make_rows(ids, WIDTH), ids, _pause_after_copy_s=hold_s)


def test_the_lock_timeout_runs_on_the_monotonic_clock_with_glibc() -> None:
    """A publish's lock deadline does not move with the wall clock (NTP steps, an operator
    setting the time) where the C library has pthread_mutex_clocklock (glibc >= 2.30, as on
    every machine this project is built for); the timeout itself is tested below."""
    libc = platform.libc_ver()
    if libc[0] != "glibc" or tuple(int(x) for x in libc[1].split(".")[:2]) < (2, 30):
        pytest.skip(f"C library {libc}: the lock deadline runs on CLOCK_REALTIME")
    assert native.lock_clock() == "monotonic"


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e300])
def test_an_unbounded_timeout_waits_for_a_live_writer(tmp_path: Path, timeout_s: float) -> None:
    # Converting these to a time_t deadline used to be undefined (an immediate TimeoutError on
    # x86-64); they mean "wait forever", as None does.
    path = str(tmp_path / "t.tbl")
    table = native.SharedTable(path, WIDTH, 100)
    proc = mp.get_context("spawn").Process(target=_hold_the_lock, args=(path, 100, 0.5))
    proc.start()
    try:
        wait_until(lambda: table.claimed() == 7)  # the other writer holds the lock
        assert table.count() == 0
        row = testing.make_rows(check_ids(7, 1), WIDTH)
        assert table.publish(row, check_ids(7, 1), timeout_s=timeout_s) == 7  # after its rows
    finally:
        proc.join(timeout=30)
    assert proc.exitcode == 0
    assert table.count() == 8 and table.generation() == 0
    assert testing.bad_rows(table.snapshot(), table.ids()) == 0


def _publish_and_exit(path: str) -> None:
    native.SharedTable(path, WIDTH, 100).publish(np.zeros((2, WIDTH), dtype=np.float32))
    os._exit(0)  # no cleanup: the lock was released by publish, nothing to recover


def test_a_writer_that_exits_between_publishes_needs_no_recovery(tmp_path: Path) -> None:
    path = str(tmp_path / "t.tbl")
    proc = mp.get_context("spawn").Process(target=_publish_and_exit, args=(path,))
    proc.start()
    proc.join(timeout=60)
    table = native.SharedTable(path, WIDTH, 100)
    table.publish(np.zeros((1, WIDTH), dtype=np.float32))
    assert (table.count(), table.generation()) == (3, 0)
