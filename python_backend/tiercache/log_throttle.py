"""At most one log line a minute for an event a caller can repeat at will (a failed request, a
forged Redis value): without it a loop of bad requests fills the disk the operator needs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class LogThrottle:
    """`ready()` says whether to log now: True at most once per `interval_s`, and then
    `suppressed` holds how many were let go since the last line (to say in it). Thread-safe."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_s = -float("inf")
        self._skipped = 0
        self.suppressed = 0

    def ready(self) -> bool:
        now = self._clock()
        with self._lock:
            if now - self._last_s < self.interval_s:
                self._skipped += 1
                return False
            self._last_s = now
            self.suppressed, self._skipped = self._skipped, 0
            return True
