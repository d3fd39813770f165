"""GPU checks of tiercache_native's CUDA part; prints a short table.

    python3 tests/gpu/run_gpu_checks.py            (exit 0 when every check passes)

- device publication: a host thread spins on the host-visible count of a DeviceTable while
  another thread publishes many small batches; every row below each count it reads must be
  complete in the pinned host mirror (the __threadfence_system() ordering). The device count
  and the rows copied back must match. With PyTorch on the machine, rows published from device
  memory (DLPack) too.
- broadcast: a ReplicaSet over the cards; after every broadcast a kernel on each replica's
  reader stream reads the count and checks every row below it. On one card the replicas share
  it: one by a device copy ("same-card"), one staged through pinned host memory ("staging");
  with two or more cards, peer copies where peer access is on, and the staging path forced.

Without a GPU it says so and exits 0. When tiercache_native is not importable (a bare GPU
machine), it is built first with CMake into build/gpu-checks/ for this machine's card.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 64


def load_native() -> ModuleType | None:
    try:
        return importlib.import_module("tiercache_native")
    except ImportError:
        pass
    if shutil.which("nvidia-smi") is None or shutil.which("cmake") is None:
        return None
    build = ROOT / "build" / "gpu-checks"
    configure = [
        "cmake",
        "-S",
        str(ROOT),
        "-B",
        str(build),
        f"-DPython_EXECUTABLE={sys.executable}",
        "-DCMAKE_CUDA_ARCHITECTURES=native",
        "-DTIERCACHE_BUILD_TESTS=OFF",
    ]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    started = time.perf_counter()
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "-j"], check=True, stdout=subprocess.DEVNULL)
    print(f"built tiercache_native in {time.perf_counter() - started:.0f} s")
    sys.path.insert(0, str(build / "python"))
    return importlib.import_module("tiercache_native")


Row = tuple[str, ...]


def check_device_publication(native: Any, testing: Any) -> list[Row]:
    batch, batches = 16, 2000
    total = batch * batches
    rows = testing.make_rows(np.arange(total, dtype=np.uint64), WIDTH)
    table = native.DeviceTable(WIDTH, total, device=0, host_mirror=True)

    def publish() -> None:
        for i in range(batches):
            table.publish(rows[i * batch : (i + 1) * batch])

    writer = threading.Thread(target=publish)
    started = time.perf_counter()
    writer.start()
    seen = table.watch_mirror(total, timeout_s=60.0)
    writer.join()
    table.synchronize()
    elapsed = time.perf_counter() - started
    ok = (
        seen["bad_rows"] == 0
        and seen["last_count"] == total
        and table.host_count() == total
        and table.device_count() == total
        and np.array_equal(table.rows(), rows)
        and np.array_equal(table.host_snapshot(), rows)
    )
    out: list[Row] = [
        (
            "device publication (host rows)",
            f"{total} rows in {batches} kernels",
            f"host saw {seen['distinct_counts']} counts in {seen['polls']} polls",
            f"{seen['bad_rows']} bad rows",
            f"{elapsed / batches * 1e6:.1f} us/publish",
            "ok" if ok else "FAIL",
        )
    ]
    out.append(check_device_rows(native, testing))
    return out


def check_device_rows(native: Any, testing: Any) -> Row:
    """Rows already on the card (a PyTorch tensor through DLPack), published by the kernel."""
    name = "device publication (device rows)"
    try:
        import torch
    except ImportError:
        return (name, "-", "-", "-", "-", "skipped: no torch")
    if not torch.cuda.is_available():
        return (name, "-", "-", "-", "-", "skipped: torch sees no GPU")
    total = 4096
    rows = testing.make_rows(np.arange(total, dtype=np.uint64), WIDTH)
    table = native.DeviceTable(WIDTH, total, device=0, host_mirror=True)
    on_card = torch.from_numpy(rows).to("cuda:0")
    torch.cuda.synchronize()
    for first in range(0, total, 256):
        table.publish(on_card[first : first + 256])
    seen = table.watch_mirror(total, timeout_s=30.0)
    table.synchronize()
    ok = seen["bad_rows"] == 0 and np.array_equal(table.rows(), rows)
    return (
        name,
        f"{total} rows in {total // 256} kernels",
        f"host saw {seen['distinct_counts']} counts",
        f"{seen['bad_rows']} bad rows",
        "-",
        "ok" if ok else "FAIL",
    )


def check_broadcast(native: Any, testing: Any, devices: list[int], allow_peer: bool) -> list[Row]:
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 300, size=200)]
    total = sum(sizes)
    rows = testing.make_rows(np.arange(total, dtype=np.uint64), WIDTH)
    replicas = native.ReplicaSet(
        WIDTH, total, devices=devices, allow_peer=allow_peer, staging_rows=128
    )
    started = time.perf_counter()
    first = 0
    for n in sizes:
        replicas.broadcast(rows[first : first + n])
        replicas.launch_reader_checks()  # queued right behind the count, no host wait
        first += n
    replicas.synchronize()
    elapsed = time.perf_counter() - started
    report = replicas.reader_report()
    out: list[Row] = []
    for k, (path, seen) in enumerate(zip(replicas.paths(), report, strict=True)):
        ok = (
            seen["bad_rows"] == 0
            and seen["max_count"] == total
            and seen["checks"] == len(sizes)
            and replicas.replica_count(k) == total
            and np.array_equal(replicas.rows(k), rows)
        )
        out.append(
            (
                f"broadcast replica {k} (card {devices[k]})",
                path,
                f"{len(sizes)} broadcasts, {total} rows",
                f"{seen['checks']} reader checks, {seen['bad_rows']} bad rows",
                f"{elapsed / len(sizes) * 1e6:.0f} us/broadcast",
                "ok" if ok else "FAIL",
            )
        )
    return out


def main() -> int:
    native = load_native()
    if native is None or native.cuda_device_count() == 0:
        status = native.cuda_status() if native is not None else "tiercache_native not built"
        print(f"no GPU here ({status}); nothing to check")
        return 0
    testing = importlib.import_module("tiercache_native.testing")
    cards = native.cuda_device_count()
    print(native.cuda_status())
    rows = check_device_publication(native, testing)
    if cards == 1:
        rows += check_broadcast(native, testing, [0, 0], allow_peer=True)
        rows += check_broadcast(native, testing, [0, 0], allow_peer=False)
    else:
        rows += check_broadcast(native, testing, list(range(cards)), allow_peer=True)
        rows += check_broadcast(native, testing, list(range(cards)), allow_peer=False)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)))
    failed = sum(r[-1] == "FAIL" for r in rows)
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
