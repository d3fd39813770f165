"""Shared fixtures: a real `redis-server` on a free loopback port (tests/redis_server.py), and
the garbage collector given back its frozen objects after each test.

Tests that need Redis fail (not skip) when `redis-server` is missing, naming the fix; set
TIERCACHE_SKIP_REDIS=1 to skip them on purpose.
"""

from __future__ import annotations

import gc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis_server import RedisServer


@pytest.fixture(autouse=True)
def unfrozen_after() -> Iterator[None]:
    """A stage's `initialize` freezes what it made (`io.freeze_startup_objects`: a stub lives as
    long as its stage); the tests start many stages in one process, so what a test froze is
    unfrozen after it, and cyclic garbage of its finished stages (open LMDB environments among
    it) is collected as it would be without the freeze."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One Redis for the session; tests keep apart by `redis_prefix`."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """Private servers a test may kill and restart."""
    started: list[RedisServer] = []

    def make() -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(started)}").start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
