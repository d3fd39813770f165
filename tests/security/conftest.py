"""The security suite (issue 14): attacks against a real tritonserver, each shown refused.

`served` is `tiercache serve` itself, with its exposure defaults (loopback, HTTP off, the
restricted APIs closed, the admin token), on free ports and a fresh state directory, deployed as
a company would expose it: an API key file (three tenants: two trusted, one padded), the
deployment's Redis (a real redis-server) behind the Redis stages (tiercache.server.REDIS_STAGES),
the committed adapters. What an operator runs, so what an attacker meets. The integration
suite's helpers are reused by import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from integration.conftest import MODEL_REPOSITORY, REPO
from redis_server import RedisServer

from tiercache.exact.tenant_keys import add_key
from tiercache.server import REDIS_STAGES, Ports, copy_repository, free_port

pytestmark = pytest.mark.integration

TIERCACHE = Path(sys.executable).parent / "tiercache"
READY_TIMEOUT_S = 600.0  # a first start converts the weights and loads the LLM


TENANTS = ("acme", "globex", "public")  # public is padded (not in trusted_tenants)
REDIS_PREFIX = "security:"
PADDING_MS = 150


@dataclass(frozen=True, slots=True)
class Served:
    """A running `tiercache serve`: its process, ports, state directory and output file, the
    API key of each tenant, and the deployment's Redis."""

    process: subprocess.Popen[bytes]
    ports: Ports
    state_dir: Path
    output_path: Path
    keys: dict[str, str] = field(default_factory=dict)
    redis_url: str = ""
    gateway_port: int = 0  # serve's OpenAI endpoint (docs/gateway.md)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def output(self) -> str:
        """What `tiercache serve` printed so far (stdout and stderr)."""
        return self.output_path.read_text(errors="replace")


def _wait_ready(served: Served) -> None:
    """Until serve prints that it is ready (it checks Triton's readiness itself)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "tiercache: ready." not in served.output():
        if served.process.poll() is not None:
            raise AssertionError(f"tiercache serve exited:\n{served.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"tiercache serve not ready:\n{served.output()[-3000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Served]:
    """`tiercache serve` with its exposure defaults (no --host, no --http, nothing opened), no
    TIERCACHE_HOST or TIERCACHE_ADMIN_TOKEN_FILE in its environment; an API key file per
    tenant (globex may use no adapter), Redis, padding for the untrusted tenant."""
    root = tmp_path_factory.mktemp("served")
    ports = Ports.free()
    gateway_port = free_port()
    keys_file = root / "api_keys.json"
    keys = {"acme": add_key(keys_file, "acme")[0]}
    keys["globex"] = add_key(keys_file, "globex", adapters=[])[0]
    keys["public"] = add_key(keys_file, "public")[0]
    shared = {"redis_url": redis_server.url, "redis_prefix": REDIS_PREFIX}
    parameters: dict[str, dict[str, str]] = {stage: dict(shared) for stage in REDIS_STAGES}
    parameters["llm"].update({"hit_padding_ms": str(PADDING_MS), "trusted_tenants": "acme,globex"})
    repository = copy_repository(MODEL_REPOSITORY, root / "model_repository", parameters)
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "TIERCACHE_HOST",
            "TIERCACHE_ADMIN_TOKEN_FILE",
            "TIERCACHE_API_KEYS_FILE",
            "TIERCACHE_ADAPTERS_DIR",
        )
    }
    output_path = root / "serve.out"
    with open(output_path, "wb") as output:
        process = subprocess.Popen(
            [str(TIERCACHE), "serve", f"--model-repository={repository}",
             f"--state-dir={root / 'state'}", f"--http-port={ports.http}",
             f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}", "--no-restart",
             f"--api-keys={keys_file}", f"--adapters-dir={REPO / 'adapters'}",
             f"--gateway-port={gateway_port}"],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    server = Served(
        process, ports, root / "state", output_path, keys, redis_server.url, gateway_port
    )
    try:
        _wait_ready(server)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # serve stops tritonserver and its stubs
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
