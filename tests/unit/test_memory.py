"""tiercache.memory: freed heap memory goes back to the system, at most every interval."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiercache.errors import ConfigError
from tiercache.memory import MemoryTrimmer, trim_available

pytestmark = pytest.mark.skipif(not trim_available(), reason="no glibc malloc_trim here")
PACKAGE = Path(__file__).resolve().parents[2] / "python_backend"


def test_freed_blocks_pinned_under_a_live_one_are_returned() -> None:
    """64 MiB of 16 KiB blocks freed below a live block stay resident until malloc_trim (in a
    child process, so that the RSS is this experiment's alone)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(PACKAGE)!r})
        from tiercache.memory import malloc_trim

        def rss_mib():
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024

        blocks = [bytearray(16384) for _ in range(4096)]
        pin = bytearray(16384)  # above them in the heap: free() alone cannot shrink it
        del blocks
        freed = rss_mib()
        malloc_trim()
        print(freed, rss_mib())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    freed, trimmed = map(float, out.stdout.split())
    assert freed - trimmed > 48, (freed, trimmed)


def test_trims_at_most_once_per_interval() -> None:
    now = [100.0]
    trimmer = MemoryTrimmer(5.0, clock=lambda: now[0])
    assert trimmer.enabled
    assert trimmer.maybe_trim() is False  # the first interval starts at construction
    now[0] = 105.0
    assert trimmer.maybe_trim() is True
    assert trimmer.maybe_trim() is False
    now[0] = 109.9
    assert trimmer.maybe_trim() is False
    now[0] = 110.0
    assert trimmer.maybe_trim() is True
    stats = trimmer.stats()
    assert stats.trims == 2 and stats.seconds >= 0.0


def test_interval_zero_never_trims_and_negative_is_refused() -> None:
    trimmer = MemoryTrimmer(0.0, clock=lambda: 1e9)
    assert not trimmer.enabled
    assert trimmer.maybe_trim() is False
    assert trimmer.stats().trims == 0
    with pytest.raises(ConfigError, match="memory_trim_interval_s must be >= 0"):
        MemoryTrimmer(-1.0)
