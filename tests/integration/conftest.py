"""A real tritonserver serving the repository's model_repository on free loopback ports."""

from __future__ import annotations

import os
import re
import time
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tiercache.server import Ports, StageWatch, TritonServer
from tiercache_client import TierCacheClient

REPO = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO / "model_repository"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiercache-state")


def start_server(
    state_dir: Path, log_name: str, repository: Path = MODEL_REPOSITORY
) -> TritonServer:
    """A ready tritonserver on `repository` (default: the committed one), its log in the state
    dir; stopped again if it does not become ready."""
    server = TritonServer(
        model_repository=repository,
        state_dir=state_dir,
        ports=Ports.free(),
        exit_timeout_s=5,
        log_path=state_dir / log_name,
    )
    server.start()
    try:
        server.wait_ready(timeout_s=600)
    except BaseException:
        server.stop()
        raise
    return server


class StageDied(UserWarning):
    """A stage process of the session's server died between tests (see `server`)."""


_session_watch: list[StageWatch] = []


@pytest.fixture(scope="session")
def server(state_dir: Path) -> Iterator[TritonServer]:
    srv = start_server(state_dir, "triton-session.log")
    watch = StageWatch(srv)
    watch.reset()
    _session_watch.append(watch)
    yield srv
    _session_watch.clear()
    srv.stop()


@pytest.fixture(autouse=True)
def _session_server_stages_alive(request: pytest.FixtureRequest) -> None:
    """Before each test that uses the session server: if one of its stage processes died since
    the last test, restart the server, as `tiercache serve` does in production (Triton 2.51 does
    not restart a dead Python stub; docs/faults.md), and say so with a StageDied warning in the
    test summary, so an unexplained crash is visible instead of failing every later test. A
    test that failed because the stage died under it is run once more after the restart
    (pytest-rerunfailures, `--only-rerun 'is not healthy'` in pyproject.toml)."""
    if "server" not in request.fixturenames or not _session_watch:
        return
    watch = _session_watch[0]
    dead = watch.dead()
    if not dead:
        return
    names = ", ".join(f"{model} (pid {pid})" for pid, model in sorted(dead.items()))
    warnings.warn(
        f"stage process {names} of the session server died before {request.node.nodeid}; "
        f"server restarted (log: {watch.server.log_path})",
        StageDied,
        stacklevel=1,
    )
    watch.server.stop()
    watch.server.start()
    watch.server.wait_ready(timeout_s=600)
    watch.reset()


@pytest.fixture(scope="session")
def client(server: TritonServer) -> Iterator[TierCacheClient]:
    with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=300) as c:
        yield c


def metric_value(server: TritonServer, name: str, **labels: str) -> float:
    """Sum of a metric's samples on the metrics port whose labels include `labels`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics") as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


# The servers these tests start flush their stages' metrics every 0.25 s (the default is 1 s,
# tiercache.triton.metrics.configured_flush_s), so a test reading a metric waits less.
METRICS_FLUSH_ENV = "TIERCACHE_METRICS_FLUSH_S"  # tiercache.triton.metrics.FLUSH_ENV
os.environ[METRICS_FLUSH_ENV] = "0.25"
METRICS_FLUSH_S = 0.25


def settled_metric(server: TritonServer, name: str, timeout_s: float = 30, **labels: str) -> float:
    """The metric once the stages' deferred updates have been flushed: read until two reads two
    flush intervals apart agree (updates reach the metrics port at most one interval late)."""
    deadline = time.monotonic() + timeout_s
    previous = metric_value(server, name, **labels)
    while True:
        time.sleep(2 * METRICS_FLUSH_S)
        current = metric_value(server, name, **labels)
        if current == previous:
            return current
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not settle within {timeout_s} s")
        previous = current


@dataclass(frozen=True, slots=True)
class RawOutcome:
    responses: list[grpcclient.InferResult]
    error: str | None


def raw_stream_infer(server: TritonServer, inputs: list[grpcclient.InferInput]) -> RawOutcome:
    """One request over the gRPC stream with hand-built tensors (for malformed requests)."""
    import queue

    results: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    try:
        c.start_stream(callback=lambda result, error: results.put((result, error)))
        c.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                return RawOutcome(responses, str(error.message()))
            responses.append(result)
            params = result.get_response().parameters
            if params["triton_final_response"].bool_param:
                return RawOutcome(responses, None)
    finally:
        c.stop_stream()
        c.close()


def tensor(name: str, values: list, datatype: str) -> grpcclient.InferInput:
    if datatype == "BYTES":
        array = np.array([values], dtype=np.object_)
    else:
        dtype = {
            "INT32": np.int32,
            "FP32": np.float32,
            "BOOL": np.bool_,
            "UINT64": np.uint64,
            "INT64": np.int64,
        }[datatype]
        array = np.array([values], dtype=dtype)
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t
