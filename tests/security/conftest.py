"""The security suite (issue 14): attacks against a real tritonserver, each shown refused.

`served` is `tiercache serve` itself, with its defaults, on free ports and a fresh state
directory: what an operator runs, so what an attacker meets. The integration suite's helpers
(tests/integration/conftest.py: `start_server`, the metric readers) are reused by import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from integration.conftest import MODEL_REPOSITORY

from tiercache.server import Ports

pytestmark = pytest.mark.integration

TIERCACHE = Path(sys.executable).parent / "tiercache"
READY_TIMEOUT_S = 600.0  # a first start converts the weights and loads the LLM


@dataclass(frozen=True, slots=True)
class Served:
    """A running `tiercache serve`: its process, ports, state directory and output file."""

    process: subprocess.Popen[bytes]
    ports: Ports
    state_dir: Path
    output_path: Path

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
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`tiercache serve` with its defaults (no --host, no --http, nothing opened), no
    TIERCACHE_HOST or TIERCACHE_ADMIN_TOKEN_FILE in its environment."""
    root = tmp_path_factory.mktemp("served")
    ports = Ports.free()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TIERCACHE_HOST", "TIERCACHE_ADMIN_TOKEN_FILE")
    }
    output_path = root / "serve.out"
    with open(output_path, "wb") as output:
        process = subprocess.Popen(
            [str(TIERCACHE), "serve", f"--model-repository={MODEL_REPOSITORY}",
             f"--state-dir={root / 'state'}", f"--http-port={ports.http}",
             f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}", "--no-restart"],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    server = Served(process, ports, root / "state", output_path)
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
