"""`tiercache serve` restarts tritonserver when a stage process dies (Triton 2.51 does not
restart a dead Python stub; every request through that stage would fail until a restart)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.server import Ports, stage_processes
from tiercache_client import TierCacheClient

from .conftest import MODEL_REPOSITORY

pytestmark = pytest.mark.integration

TIERCACHE = Path(sys.executable).parent / "tiercache"
PROMPT = "Name one colour of the rainbow."


def wait_for_line(path: Path, needle: str, timeout_s: float, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if needle in text:
            return text
        if process.poll() is not None:
            raise AssertionError(f"tiercache serve exited ({process.returncode}):\n{text[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {needle!r} within {timeout_s:.0f} s:\n{path.read_text()[-3000:]}")


def triton_pid(serve_pid: int) -> int:
    """The tritonserver child of `tiercache serve`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == serve_pid and argv0.endswith(b"tritonserver"):
            return int(entry.name)
    raise AssertionError("tiercache serve has no tritonserver child")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path, Ports]]:
    ports = Ports.free()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                str(TIERCACHE),
                "serve",
                f"--model-repository={MODEL_REPOSITORY}",
                f"--state-dir={tmp_path / 'state'}",
                f"--http-port={ports.http}",
                f"--grpc-port={ports.grpc}",
                f"--metrics-port={ports.metrics}",
                "--watch-interval-s=0.5",
                "--no-gateway",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield process, log_path, ports
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # serve stops tritonserver and its stubs
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_serve_restarts_tritonserver_when_a_stage_process_dies(
    serve: tuple[subprocess.Popen, Path, Ports],
) -> None:
    process, log_path, ports = serve
    wait_for_line(log_path, "tiercache: ready.", 600, process)
    with TierCacheClient(f"127.0.0.1:{ports.grpc}", timeout_s=300) as client:
        first = client.generate_text(PROMPT, max_tokens=6)
        assert first.cache_status == "miss"
    server = triton_pid(process.pid)
    stubs = stage_processes(server)
    llm = [pid for pid, model in stubs.items() if model == "llm"]
    assert len(llm) == 1, stubs

    os.kill(llm[0], signal.SIGKILL)
    text = wait_for_line(log_path, "ready again after", 600, process)
    assert "stage process llm (pid" in text

    restarted = triton_pid(process.pid)
    assert restarted != server
    assert not Path(f"/proc/{server}").exists()
    # The old server's other stubs were stopped with it, not left running beside the new ones.
    assert not [pid for pid in stubs if alive(pid)]
    assert sorted(stage_processes(restarted).values()) == sorted(stubs.values())
    with TierCacheClient(f"127.0.0.1:{ports.grpc}", timeout_s=300) as client:
        again = client.generate_text(PROMPT, max_tokens=6)
    # Served again, from L2 on disk: the answer stored before the kill survived the restart.
    assert again.cache_status == "exact"
    assert again.text == first.text
