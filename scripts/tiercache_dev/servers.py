"""The one way the measurements here start servers: a real tritonserver (tiercache.server's
TritonServer, the same launcher `tiercache serve` and the integration tests use) and a real
redis-server, each on free loopback ports, waited for with a timeout, and stopped by its own pid
whatever happened.

    server = triton(repository, state_dir, log_path=out / "server.log")
    progress(f"starting tritonserver (grpc {server.ports.grpc})")  # ports known before start
    with running(server, ready_timeout_s=300):
        ...  # 127.0.0.1:server.ports.grpc / .http / .metrics

    with redis_running(workdir) as redis_server:
        ...  # redis_server.url
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import redis

from tiercache.config import ADAPTERS_DIR_ENV, API_KEYS_FILE_ENV
from tiercache.server import (
    RESTRICTABLE_APIS,
    Exposure,
    Ports,
    ServerError,
    TritonServer,
    free_port,
)

__all__ = [
    "READY_TIMEOUT_S",
    "RedisServer",
    "ServerError",
    "TritonServer",
    "admin_token",
    "free_port",
    "redis_running",
    "running",
    "running_all",
    "triton",
]

READY_TIMEOUT_S = 600.0  # a first start converts the weights and loads the LLM: minutes on 2 CPUs
REDIS_READY_TIMEOUT_S = 10.0
# What a measurement server opens beyond `tiercache serve`'s defaults (tiercache.server.Exposure):
# perf_analyzer reads the model's config (ModelConfig) before it sends a request and the models'
# statistics (ModelStatistics: its server-side figures) around each measurement. Everything else
# stays as served: loopback, no HTTP, the other APIs restricted.
MEASUREMENT_OPEN_APIS = ("model-config", "statistics")


def triton(
    model_repository: Path,
    state_dir: Path,
    *,
    log_path: Path | None = None,
    extra_args: Sequence[str] = (),
    adapters_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    exit_timeout_s: int = 5,
) -> TritonServer:
    """A tritonserver for `model_repository` on free loopback ports, not started yet: its ports
    are known, so a caller can say where it will listen before `running` starts it. `log_path`
    (emptied here) receives its output; `adapters_dir` is the stages' adapters folder
    (tiercache.config.ADAPTERS_DIR_ENV); `env` adds other variables. Exposed as `tiercache serve`
    exposes it, except that MEASUREMENT_OPEN_APIS are open; cache_admin calls need the admin token
    (`admin_token`). Without API keys unless `env` names a key file: a developer's shell that
    sets $TIERCACHE_API_KEYS_FILE does not change what a measurement sends."""
    overrides = {API_KEYS_FILE_ENV: "", **(env or {})}
    if adapters_dir is not None:
        overrides[ADAPTERS_DIR_ENV] = str(adapters_dir)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_bytes(b"")
    return TritonServer(
        model_repository=model_repository,
        state_dir=state_dir,
        ports=Ports.free(),
        extra_args=list(extra_args),
        exit_timeout_s=exit_timeout_s,
        log_path=log_path,
        env_overrides=overrides,
        exposure=Exposure(
            restricted_apis=tuple(a for a in RESTRICTABLE_APIS if a not in MEASUREMENT_OPEN_APIS)
        ),
    )


def admin_token(server: TritonServer) -> str:
    """The admin token of `server` (its cache_admin creates the file at start): for
    `TierCacheClient(..., admin_token=admin_token(server))` in a measurement that warms,
    flushes or invalidates."""
    from tiercache.admin import load_or_create_admin_token

    return load_or_create_admin_token(server.admin_token_file)


@contextlib.contextmanager
def running_all(
    servers: Sequence[TritonServer], ready_timeout_s: float = READY_TIMEOUT_S
) -> Iterator[list[TritonServer]]:
    """Start every server at once (they load side by side), wait until each is ready
    (ServerError when one exits first or is not ready within `ready_timeout_s` of the start),
    and stop all of them on the way out, also after an error or Ctrl-C. Stopping is
    TritonServer.stop: SIGINT (Triton's clean shutdown), then SIGKILL to the process group, so
    Python-backend stubs left behind by a tritonserver that died go too. Stopping a server
    early (e.g. to fail its clients at once) is allowed: stopping is idempotent."""
    try:
        for server in servers:
            server.start()
        deadline = time.monotonic() + ready_timeout_s
        for server in servers:
            server.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))
        yield list(servers)
    finally:
        for server in servers:
            server.stop()


def fresh_state(root: Path, weights_from: Path, name: str = "state") -> Path:
    """An empty state dir `root/name` for a benchmark's server, its `models` linked to
    `weights_from/models` (the converted weights: no conversion at its start but the first)."""
    state = root / name
    state.mkdir(parents=True)
    weights = weights_from / "models"
    weights.mkdir(parents=True, exist_ok=True)  # a first run converts them there, for the next
    (state / "models").symlink_to(weights.resolve(), target_is_directory=True)
    return state


@contextlib.contextmanager
def running(
    server: TritonServer, ready_timeout_s: float = READY_TIMEOUT_S
) -> Iterator[TritonServer]:
    """`running_all` for one server."""
    with running_all([server], ready_timeout_s):
        yield server


class RedisServer:
    """One redis-server on 127.0.0.1 (a free port unless `port` is given): no persistence, its
    files and log in `workdir`, stopped by its own pid. `stop()` and then `start()` on the same
    port is an outage (data is lost, as in production without persistence)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def start(self, ready_timeout_s: float = REDIS_READY_TIMEOUT_S) -> RedisServer:
        """Start it and wait until it answers PING (ServerError when it exits first or does
        not answer within `ready_timeout_s`)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerError("redis-server is not installed (make setup installs it as root)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.workdir)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + ready_timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.exceptions.ConnectionError:
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ServerError(
                        f"redis-server on port {self.port} did not start (see {self.log_path})"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s; nothing when not running."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None


@contextlib.contextmanager
def redis_running(
    workdir: Path, ready_timeout_s: float = REDIS_READY_TIMEOUT_S
) -> Iterator[RedisServer]:
    """A started RedisServer in `workdir`, stopped on the way out whatever happened."""
    server = RedisServer(workdir)
    try:
        yield server.start(ready_timeout_s)
    finally:
        server.stop()
