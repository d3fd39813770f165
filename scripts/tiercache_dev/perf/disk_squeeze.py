"""A disk squeeze on a real small filesystem (issue 20): L2 with `disk_headroom_bytes` against L2
without it, side by side, while another writer takes the disk.

Usage (root: it mounts a tmpfs)::

    python -m tiercache_dev.perf.disk_squeeze [--size-mib 96] [--headroom-mib 24]
        [--answer-chars 300] [--out-dir .perf/disk_squeeze]

For each of the two settings (`disk_headroom_bytes` `--headroom-mib`, then 0), on a fresh tmpfs
of `--size-mib`: L2 (`LmdbStore`, the stages' own, with its `DiskRoom`, under keys shaped as
its own: SHA-256 hex) is written with a quarter of the filesystem's size in answers of
`--answer-chars`; then a filler file takes the disk until 3/4 of the headroom is left (short:
L2 turns over inside its file), and L2 is written with four times the filesystem's size in
answers; then until 1/4 of it is left (critical: inside half its file), and written again;
then the filler takes every free byte (full), and L2 is written again; then the filler is
deleted and L2 written once more. Each phase records the writes that failed (the error a full
disk gives), those L2 did not store for want of disk (`rejected`: no error), its file's size,
the least free disk seen, whether the newest answer written reads back, and the writes' time
(median, 99th percentile, slowest: what evicting for room costs the write that waits). Writes
`disk_squeeze.md` and `disk_squeeze.json` to `--out-dir`; exit code 1 when a write to the
guarded L2 failed or was not stored.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import LmdbStore
from tiercache.machine import DiskRoom, read_disk
from tiercache_dev.console import invocation, progress
from tiercache_dev.paths import PERF_DIR

MIB = 1 << 20


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=96, help="the tmpfs's size")
    parser.add_argument("--headroom-mib", type=int, default=24, help="disk_headroom_bytes")
    parser.add_argument("--answer-chars", type=int, default=300, help="each answer's length")
    parser.add_argument("--out-dir", type=Path, default=PERF_DIR / "disk_squeeze")
    return parser.parse_args(argv)


@contextlib.contextmanager
def tmpfs(size_bytes: int, prefix: str) -> Iterator[Path]:
    """A fresh tmpfs of `size_bytes` mounted on a new folder (root only), unmounted and removed
    after."""
    if os.geteuid() != 0:
        raise SystemExit("mounting a tmpfs needs root")
    mount = Path(tempfile.mkdtemp(prefix=prefix))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        shutil.rmtree(mount, ignore_errors=True)


def fill(path: Path, mount: Path, leave: int) -> None:
    """Grow the filler file at `path` until `mount` has about `leave` bytes free (or none:
    another writer may take the last bytes first)."""
    with path.open("ab", buffering=0) as out:  # unbuffered: a full disk fails the write itself
        while (free := read_disk(mount).free_bytes) > leave:
            try:
                out.write(b"\1" * min(MIB, free - leave))
                os.fsync(out.fileno())
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return


class Writer:
    """Writes answers into one L2, counting the writes that failed and those it did not store
    for want of disk (`rejected`: no error, the answer not kept)."""

    def __init__(self, store: LmdbStore, data: Path, mount: Path, answer: str) -> None:
        self.store, self.data, self.mount, self.answer = store, data, mount, answer
        self.number = 0

    def phase(self, name: str, nbytes: int) -> dict[str, Any]:
        failed = 0
        rejected = self.store.rejected
        least_free = read_disk(self.mount).free_bytes
        last = ""
        times: list[float] = []
        for _ in range(max(nbytes // len(self.answer), 1)):
            self.number += 1
            key = hashlib.sha256(f"k{self.number}".encode()).hexdigest()  # as L2's keys are
            begun = time.perf_counter()
            try:
                self.store.put(key, CacheEntry(text=self.answer, created_s=float(self.number)))
                last = key
            except Exception:  # noqa: BLE001 - counted: what a full disk does to a write
                failed += 1
            times.append(time.perf_counter() - begun)
            least_free = min(least_free, read_disk(self.mount).free_bytes)
        stats = self.store.stats()
        return {
            "phase": name,
            "writes": max(nbytes // len(self.answer), 1),
            "failed": failed,
            "rejected": self.store.rejected - rejected,
            "file_mib": round(self.data.stat().st_size / MIB, 2),
            "entries": stats.entries,
            "least_free_mib": round(least_free / MIB, 2),
            "newest_reads": bool(last) and self.store.get(last) is not None,
            # a write's time (ms): what evicting for room costs the writes that wait for it
            "put_p50_ms": round(1000 * statistics.median(times), 3),
            "put_p99_ms": round(1000 * statistics.quantiles(times, n=100)[98], 3)
            if len(times) >= 100
            else None,
            "put_max_ms": round(1000 * max(times), 1),
        }


def run_one(mount: Path, headroom: int, size: int, answer: str) -> list[dict[str, Any]]:
    state = mount / "state"
    filler = mount / "filler"
    store = LmdbStore(
        state / "l2", max(1 << 30, 2 * size), disk=DiskRoom(state, headroom, interval_s=0.0)
    )  # a map larger than the disk: the file, not the map, is what fills it
    writer = Writer(store, state / "l2" / "data.mdb", mount, answer)
    rows = [writer.phase("room", size // 4)]
    fill(filler, mount, 3 * max(headroom, size // 4) // 4)
    rows.append(writer.phase("short", 4 * size))
    fill(filler, mount, max(headroom, size // 4) // 4)
    rows.append(writer.phase("critical", size))
    fill(filler, mount, 0)
    rows.append(writer.phase("full", size))
    filler.unlink()
    rows.append(writer.phase("room again", size // 4))
    for row in rows:
        row["headroom_mib"] = headroom // MIB
    store.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    size, headroom = args.size_mib * MIB, args.headroom_mib * MIB
    rows: list[dict[str, Any]] = []
    for setting in (headroom, 0):
        with tmpfs(size, "tiercache-disk-") as mount:
            progress(f"disk_headroom_bytes {setting // MIB} MiB on a {args.size_mib} MiB tmpfs")
            started = time.monotonic()
            rows += run_one(mount, setting, size, "x" * args.answer_chars)
            progress(f"  done in {time.monotonic() - started:.1f} s")
    (args.out_dir / "disk_squeeze.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"`{invocation('tiercache_dev.perf.disk_squeeze', None)}`",
        "",
        "| disk_headroom_bytes | phase | writes | failed | rejected | L2 file MiB | entries "
        "| least free MiB | newest answer reads back | write p50 / p99 / max ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['headroom_mib']} MiB | {row['phase']} | {row['writes']} | {row['failed']} "
            f"| {row['rejected']} | {row['file_mib']} | {row['entries']} "
            f"| {row['least_free_mib']} | {'yes' if row['newest_reads'] else 'no'} "
            f"| {row['put_p50_ms']} / {row['put_p99_ms']} / {row['put_max_ms']} |"
        )
    (args.out_dir / "disk_squeeze.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    guarded = [r for r in rows if r["headroom_mib"] > 0]
    return 1 if any(r["failed"] or r["rejected"] for r in guarded) else 0


if __name__ == "__main__":
    raise SystemExit(main())
