"""Handing freed heap memory back to the system (glibc's `malloc_trim`), at most every so often.

A long-lived stage process that allocates and frees many differently sized buffers on several
threads (the CPU engine: activations of every prompt length, adapter switches) keeps the freed
memory in glibc's per-thread arenas: its RSS climbs for a long time although nothing is live.
`malloc_trim(0)` returns the free pages of every arena. In a soak, torch_llm held about 450 MiB
that one call gave back (docs/soak.md). There is no Python API or library for this; it is one
libc call through ctypes. Elsewhere (musl, macOS) `MemoryTrimmer` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tiercache.errors import ConfigError

log = logging.getLogger(__name__)


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def trim_available() -> bool:
    """Whether this process's C library has malloc_trim (glibc)."""
    return _MALLOC_TRIM is not None


def malloc_trim() -> bool:
    """Return free heap pages to the system now; True if glibc released any."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


@dataclass(frozen=True)
class TrimStats:
    trims: int  # malloc_trim calls made
    seconds: float  # time spent in them


class MemoryTrimmer:
    """`maybe_trim()` after each unit of work: calls malloc_trim when `interval_s` has passed
    since the last call (0 disables it). Thread-safe; cheap when it does nothing."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:  # the stages' parameter memory_trim_interval_s
            raise ConfigError(f"memory_trim_interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._next = clock() + interval_s
        self._lock = threading.Lock()
        self._trims = 0
        self._seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 and trim_available()

    def maybe_trim(self) -> bool:
        """Trim if due; True when it trimmed."""
        if not self.enabled:
            return False
        now = self._clock()
        with self._lock:
            if now < self._next:
                return False
            self._next = now + self.interval_s
        started = time.perf_counter()
        malloc_trim()
        took = time.perf_counter() - started
        with self._lock:
            self._trims += 1
            self._seconds += took
        log.debug("malloc_trim took %.1f ms", took * 1e3)
        return True

    def stats(self) -> TrimStats:
        with self._lock:
            return TrimStats(self._trims, self._seconds)
