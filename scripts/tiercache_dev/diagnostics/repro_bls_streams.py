"""Reproduces the Python-stub crash of Triton 2.51 under many decoupled BLS streams, and checks
tiercache's workaround (tiercache.triton.bls.StreamKeeper).

Usage::

    python -m tiercache_dev.diagnostics.repro_bls_streams [--keep-s 30] [--duration 120]
        [--threads 8]

Starts tritonserver on a two-model repository written to a temp dir: `source` (decoupled, three
responses per request: a BYTES and an INT32 tensor each) and `caller`, whose `execute` runs many
short decoupled BLS streams to `source` on `--threads` threads, as `llm` does to its engine. With
`--keep-s 0` each finished stream's response iterator is dropped as soon as it is read (what
`for response in request.exec(decoupled=True)` does); with `--keep-s N` it is handed to a
StreamKeeper that drops it N seconds later. Every 5 s it prints the streams read and whether a
stub died. Exit code 1 if a stub died, else 0.

The cause (read in python_backend's source, r24.10 and still at its head): when a stream ends,
the stub queues a cleanup that erases the stream's entry from its `response_iterator_map_` on its
stub-to-parent thread, which does not hold the GIL. If the model already dropped its Python
reference, that erase destroys the iterator there, and with it the responses' numpy arrays:
Python objects freed without the GIL corrupt the interpreter's heap, and some later allocation
segfaults (the core of a `tiercache_dev.diagnostics.stress_llm_streams` crash: `pymalloc_alloc`
under `PbTensor::LoadFromSharedMemory` on the main thread). Keeping the iterator a while makes
the model's own reference the last one, dropped with the GIL.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tiercache_dev.console import exit_on_sigterm
from tiercache_dev.diagnostics.stress_llm_streams import drive
from tiercache_dev.servers import TritonServer, running, triton

SOURCE_CONFIG = """
name: "source"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

SOURCE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            for i in range(n):
                outputs = [
                    pb_utils.Tensor("TEXT", np.array([f"chunk {i}".encode()], dtype=np.object_)),
                    pb_utils.Tensor("COUNT", np.array([i], dtype=np.int32)),
                ]
                flags = FINAL if i == n - 1 else 0
                sender.send(pb_utils.InferenceResponse(outputs), flags=flags)
        return None
"""

CALLER_CONFIG = """
name: "caller"
backend: "python"
max_batch_size: 0
input [ { name: "STREAMS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "READ" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters [
  { key: "keep_s" value: { string_value: "KEEP_S" } },
  { key: "threads" value: { string_value: "THREADS" } }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

CALLER_MODEL = """
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from tiercache.triton.bls import StreamKeeper


class TritonPythonModel:
    def initialize(self, args):
        import json

        params = json.loads(args["model_config"])["parameters"]
        keep_s = float(params["keep_s"]["string_value"])
        self.keeper = StreamKeeper(keep_s) if keep_s > 0 else None
        self.pool = ThreadPoolExecutor(int(params["threads"]["string_value"]))

    def one_stream(self, _):
        request = pb_utils.InferenceRequest(
            model_name="source",
            inputs=[pb_utils.Tensor("N", np.array([3], dtype=np.int32))],
            requested_output_names=["TEXT", "COUNT"],
        )
        stream = request.exec(decoupled=True)
        read = 0
        try:
            for response in stream:
                if response.has_error():
                    raise RuntimeError(response.error().message())
                if pb_utils.get_output_tensor_by_name(response, "TEXT") is not None:
                    read += 1
        finally:
            if self.keeper is not None:
                self.keeper.keep(stream)
        return read

    def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "STREAMS").as_numpy()[0])
            read = sum(self.pool.map(self.one_stream, range(n)))
            out = pb_utils.Tensor("READ", np.array([read], dtype=np.int32))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses

    def finalize(self):
        self.pool.shutdown()
        if self.keeper is not None:
            self.keeper.clear()
"""


def write_repository(root: Path, keep_s: float, threads: int) -> Path:
    repo = root / "repository"
    for name, config, model in (
        ("source", SOURCE_CONFIG, SOURCE_MODEL),
        ("caller", CALLER_CONFIG, CALLER_MODEL),
    ):
        (repo / name / "1").mkdir(parents=True)
        config = config.replace("KEEP_S", str(keep_s)).replace("THREADS", str(threads))
        (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
        (repo / name / "1" / "model.py").write_text(textwrap.dedent(model))
    return repo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep-s", type=float, default=30.0, help="0: drop each stream at once")
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=8, help="BLS threads inside `caller`")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--streams-per-request", type=int, default=64)
    args = p.parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped

    work = Path(tempfile.mkdtemp(prefix="tiercache-bls-repro-"))
    server = triton(
        write_repository(work, args.keep_s, args.threads),
        work / "state",
        log_path=work / "tritonserver.log",
    )
    with running(server, ready_timeout_s=300):
        return exercise(server, args)


def exercise(server: TritonServer, args: argparse.Namespace) -> int:
    """Drive `caller` from --clients threads until --duration passes or a stub dies."""
    print(f"ready; keep_s={args.keep_s}; log {server.log_path}", flush=True)
    counts = {"streams": 0, "failed": 0}
    lock = threading.Lock()
    stop = threading.Event()
    deadline = time.monotonic() + args.duration

    def client_thread() -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
        streams = grpcclient.InferInput("STREAMS", [1], "INT32")
        streams.set_data_from_numpy(np.array([args.streams_per_request], dtype=np.int32))
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                result = client.infer("caller", [streams], client_timeout=60)
                read = int(result.as_numpy("READ")[0])
                with lock:
                    counts["streams"] += args.streams_per_request
                    counts["failed"] += args.streams_per_request * 3 - read
            except Exception:  # noqa: BLE001 - a dead stub fails every request: counted
                with lock:
                    counts["failed"] += args.streams_per_request * 3
                time.sleep(0.5)
        client.close()

    def status() -> str:
        with lock:
            return f"streams {counts['streams']:7d}  failed responses {counts['failed']:6d}"

    threads = [threading.Thread(target=client_thread) for _ in range(args.clients)]
    if drive(server, threads, stop, status, join_timeout_s=70.0):
        return 1
    print(f"no stub died in {args.duration:.0f} s ({counts['streams']} streams)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
