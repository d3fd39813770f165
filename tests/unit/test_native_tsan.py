"""ThreadSanitizer on the table's publication protocol (backends/native/tests/table_threads.cpp).

Builds the test program twice with -fsanitize=thread: as shipped (release store of the count,
acquire load), which must run clean, and with relaxed publication (the bug x86 hides), which
TSan must report as a data race between a writer's row copy and a reader's row read. TSan
follows threads of one process sharing one mapping; processes are out of its reach (the
multi-process test in test_native_table.py covers them by checksums).

The build tree is kept in build/native-tsan/ (ignored by git), so later runs only relink.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "native-tsan"
PROGRAMS = ("table_threads_tsan", "table_threads_tsan_relaxed")


def _run(
    cmd: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=env
    )


@pytest.fixture(scope="module")
def tsan_programs() -> dict[str, Path]:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    configure = _run(
        [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(BUILD),
            "-DTIERCACHE_TSAN=ON",
            "-DTIERCACHE_BUILD_PYTHON=OFF",
            "-DTIERCACHE_ENABLE_CUDA=OFF",
        ],
        timeout_s=300,
    )
    if configure.returncode != 0:
        pytest.fail(f"cmake configure failed:\n{configure.stdout}\n{configure.stderr}")
    build = _run([cmake, "--build", str(BUILD), "--target", *PROGRAMS], timeout_s=600)
    if build.returncode != 0:
        if "tsan" in build.stderr.lower() or "sanitize" in build.stderr.lower():
            pytest.skip(f"this compiler cannot build with ThreadSanitizer:\n{build.stderr[-2000:]}")
        pytest.fail(f"build failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}")
    return {name: BUILD / name for name in PROGRAMS}


def _run_tsan(program: Path, table: Path) -> subprocess.CompletedProcess[str]:
    args = [str(program), str(table), "4", "4", "3000"]
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1"}  # one report is the verdict
    result = _run(args, timeout_s=300, env=env)
    if "FATAL: ThreadSanitizer" in result.stderr:
        # TSan's shadow memory clashes with high mmap randomization on some kernels.
        setarch = shutil.which("setarch")
        if setarch is not None:
            result = _run([setarch, platform.machine(), "-R", *args], timeout_s=300, env=env)
        if "FATAL: ThreadSanitizer" in result.stderr:
            pytest.skip(f"ThreadSanitizer cannot run here: {result.stderr.strip()[:300]}")
    return result


def test_publication_is_race_free_under_tsan(
    tsan_programs: dict[str, Path], tmp_path: Path
) -> None:
    result = _run_tsan(tsan_programs["table_threads_tsan"], tmp_path / "t.tbl")
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bad_rows=0 out_of_order=0" in result.stdout


def test_tsan_reports_relaxed_publication(tsan_programs: dict[str, Path], tmp_path: Path) -> None:
    """The negative control: without release/acquire the same run is a data race."""
    result = _run_tsan(tsan_programs["table_threads_tsan_relaxed"], tmp_path / "t.tbl")
    assert "WARNING: ThreadSanitizer: data race" in result.stderr
    assert "SharedTable::publish" in result.stderr  # the writer's side of the race: its copy
