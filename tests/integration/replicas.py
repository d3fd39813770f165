"""Helpers for tests that stand up several "replicas" (each its own state dir, so its own L1 and
L2) against one real redis-server (the fixtures in tests/conftest.py). The replicas of a test are
one fleet: each state dir is given the same secret file (`FLEET_SECRET`), as an operator gives
the replicas of a fleet one secret (Redis only checks its fingerprint)."""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.config import CacheConfig
from tiercache.engine.events import StreamEvent
from tiercache.exact.flights import EngineUsage
from tiercache.exact.invalidation import InvalidationListener, RestartSweeper
from tiercache.exact.keys import replace_secret
from tiercache.exact.redis_tier import RedisLink, RedisStore
from tiercache.exact.request import GenerationRequest
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import DEFAULT_MAX_EVENTS
from tiercache.stages import parts

TIMEOUT_S = 10.0
FLEET_SECRET = bytes(range(32))  # the test fleet's secret (each test has a prefix of its own)


def give_secret(state_dir: Path, secret: bytes = FLEET_SECRET) -> Path:
    """Put `secret` in `state_dir` (`<state>/secret`, 0600) unless it has a secret already, as
    when the operator copies the fleet's secret file to a new replica; the file's path."""
    path = state_dir / "secret"
    if not path.exists():
        replace_secret(path, secret)
    return path


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


_OPENED: weakref.WeakKeyDictionary[TieredCache, parts.ExactTiers] = weakref.WeakKeyDictionary()


def open_replica(
    state_dir: Path,
    url: str,
    prefix: str,
    with_l1: bool = True,
    secret: bytes = FLEET_SECRET,
    *,
    max_events: int = DEFAULT_MAX_EVENTS,
    environ: Mapping[str, str] | None = None,
    **overrides: object,
) -> TieredCache:
    """One replica's exact cache, as the stages open it (tiercache.stages.parts), in the fleet
    of `secret` (given to its state dir unless it has one). `max_events` and `environ` (where
    the eviction override is read; None: the process's environment) go to `open_exact_cache`."""
    give_secret(state_dir, secret)
    config = replica_config(state_dir, url, prefix, **overrides)
    if not with_l1:
        config = dataclasses.replace(config, l1_max_bytes=0)
    tiers = parts.open_exact_cache(config, max_events=max_events, environ=environ)
    _OPENED[tiers.cache] = tiers
    return tiers.cache


def redis_link(cache: TieredCache) -> RedisLink | None:
    """The Redis link of a cache's L3 (None without one)."""
    return next((s.link for _, s in cache.stores() if isinstance(s, RedisStore)), None)


def invalidation_listener(cache: TieredCache) -> InvalidationListener | None:
    """The listener `open_replica` started beside `cache`."""
    return _OPENED[cache].listener


def restart_sweeper(cache: TieredCache) -> RestartSweeper:
    """The L2 sweep at start `open_replica` started beside `cache`."""
    sweeper = _OPENED[cache].sweeper
    assert sweeper is not None, "a replica without redis_url has no restart sweep"
    return sweeper


def load_secret(config: CacheConfig, cache: TieredCache) -> bytes:
    return parts.load_secret(config, redis_link(cache))


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
    """A Responder (tiercache.generation) that records the final outcome."""

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
        usage: EngineUsage | None = None,
        finish_reason: str | None = None,
        tokens: tuple[int, int] | None = None,
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
