"""A real `redis-server` on a free loopback port, started and stopped by its own pid (used by the
fixtures in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis

SKIP_ENV = "TIERCACHE_SKIP_REDIS"
READY_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    if os.environ.get(SKIP_ENV):
        pytest.skip(f"redis-server is not installed and {SKIP_ENV} is set")
    pytest.fail(
        "redis-server is not on PATH. `make setup` installs Debian's redis-server when it runs "
        f"as root (or: apt-get install -y redis-server); set {SKIP_ENV}=1 to skip Redis tests.",
        pytrace=False,
    )


class RedisServer:
    """One redis-server process on 127.0.0.1: no persistence, stopped by its own pid. `kill()`
    and `start()` again on the same port simulate an outage (data is lost, as in production
    without persistence)."""

    def __init__(
        self, workdir: Path, port: int | None = None, extra_args: Sequence[str] = ()
    ) -> None:
        """`extra_args`: more redis-server options, e.g. `("--maxmemory", "10mb")`."""
        self.binary = redis_binary()
        self.workdir = workdir
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # noqa: SIM115 - owned by Popen
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *self.extra_args,
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.exceptions.ConnectionError:
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not start "
                        f"(see {self.workdir / f'redis-{self.port}.log'})"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None
