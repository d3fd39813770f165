"""Helpers for tests that stand up several "replicas" (each its own state dir, so its own L1 and
L2) against one real redis-server (the fixtures in tests/conftest.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.config import CacheConfig
from tiercache.engine.events import StreamEvent
from tiercache.prompt_cache import open_tiered_cache
from tiercache.request import GenerationRequest
from tiercache.tiered import TieredCache

TIMEOUT_S = 10.0


def replica_config(state_dir: Path, url: str, prefix: str, **overrides: object) -> CacheConfig:
    values: dict[str, object] = {
        "state_dir": str(state_dir),
        "l1_max_bytes": 1 << 20,
        "l2_max_bytes": 1 << 24,
        "redis_url": url,
        "redis_prefix": prefix,
        "redis_retry_s": 0.2,
    }
    values.update(overrides)
    return CacheConfig(**values)  # type: ignore[arg-type]


def open_replica(
    state_dir: Path, url: str, prefix: str, with_l1: bool = True, **overrides: object
) -> TieredCache:
    return open_tiered_cache(replica_config(state_dir, url, prefix, **overrides), with_l1=with_l1)


def wait_until(
    condition: Callable[[], bool], timeout_s: float = TIMEOUT_S, poll_s: float = 0.01
) -> None:
    """Wait for `condition` with a deadline (for effects of other threads and processes)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        time.sleep(poll_s)


@dataclass
class GatedEngine:
    """A GenerateFn: waits for `gate` (if any), then yields `text` in two chunks and a finish."""

    text: str = "Hello"
    gate: threading.Event | None = None
    finish: str = "stop"
    calls: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        with self._lock:
            self.calls += 1
        self.started.set()
        if self.gate is not None and not self.gate.wait(TIMEOUT_S):
            raise TimeoutError("engine gate never opened")
        half = len(self.text) // 2
        yield StreamEvent(self.text[:half])
        yield StreamEvent(self.text[half:])
        yield StreamEvent("", self.finish, generated_tokens=2)


class Recorder:
    """A Responder (tiercache.llm_stage) that records the final outcome."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.outcome: tuple[str, object, object] | None = None

    def is_cancelled(self) -> bool:
        return False

    def send_chunk(self, text: str) -> None:
        pass

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        prompt_usage: tuple[int, int] | None = None,
        finish_reason: str | None = None,
    ) -> None:
        self.outcome = ("final", text, status)
        self.done.set()

    def send_cancelled(self) -> None:
        self.outcome = ("cancelled", None, None)
        self.done.set()

    def send_error(self, exc: BaseException) -> None:
        self.outcome = ("error", exc, None)
        self.done.set()

    def wait(self, timeout_s: float = TIMEOUT_S) -> tuple[str, object, object]:
        assert self.done.wait(timeout_s), "no final response"
        assert self.outcome is not None
        return self.outcome
