"""Times the pb_utils operations a stage's hit path makes, inside a real stub, and logs
`STUB_COST_RUNS <rounds> <calls>` then one `STUB_COST <operation>\t<microseconds>` line per
operation (the thread's CPU time per call, median of ROUNDS rounds of CALLS calls). Read by
tiercache_dev.diagnostics.stub_costs."""

import statistics
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils

CALLS = 2000
ROUNDS = 5


def one_value(value):
    array = np.empty((1, 1), dtype=np.object_)
    array.flat[0] = value
    return array


def timed(label, call):
    call()
    rounds = []
    for _ in range(ROUNDS):
        started = time.thread_time_ns()
        for _ in range(CALLS):
            call()
        rounds.append((time.thread_time_ns() - started) / CALLS / 1e3)
    print(f"STUB_COST {label}\t{statistics.median(rounds):.2f}", file=sys.stderr, flush=True)


class TritonPythonModel:
    def initialize(self, args):
        print(f"STUB_COST_RUNS {ROUNDS} {CALLS}", file=sys.stderr, flush=True)
        envelope = one_value(b"x" * 669)  # an envelope's size on an exact hit
        status = one_value(b"exact")
        empty = one_value(b"")
        raw = np.frombuffer(b"x" * 669, dtype=np.uint8).reshape(1, -1)
        number = np.zeros((1, 1), dtype=np.float32)
        tokens = np.zeros((1, 3), dtype=np.int32)
        timed("Tensor, BYTES, one 669-byte value", lambda: pb_utils.Tensor("A", envelope))
        timed("Tensor, BYTES, one 5-byte value", lambda: pb_utils.Tensor("A", status))
        timed("Tensor, BYTES, one empty value", lambda: pb_utils.Tensor("A", empty))
        timed("Tensor, BYTES, a new array each call", lambda: pb_utils.Tensor("A", one_value(b"x")))
        timed("Tensor, UINT8, 669 bytes", lambda: pb_utils.Tensor("A", raw))
        timed("Tensor, FP32, one value", lambda: pb_utils.Tensor("A", number))
        timed("Tensor, INT32, three values", lambda: pb_utils.Tensor("A", tokens))
        eight = [pb_utils.Tensor(f"A{i}", status) for i in range(8)]
        timed("InferenceResponse, 8 tensors", lambda: pb_utils.InferenceResponse(eight))
        built = pb_utils.Tensor("A", envelope)
        timed("as_numpy of a BYTES tensor built here (not a request's input)", built.as_numpy)
        timed(
            "serialize_byte_tensor, one 669-byte value (inside every BYTES Tensor above)",
            lambda: pb_utils.serialize_byte_tensor(envelope),
        )

    def execute(self, requests):
        out = np.array([b"ok"], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]) for _ in requests]
