"""No-op `lora_cache` for the benchmark floor: what the real stage answers on a hit or for the
base model (no adapter to load, nothing to evict), with the same output tensors (the seal a
constant here)."""

import numpy as np
import triton_python_backend_utils as pb_utils

OUTPUTS = (
    "LORA",
    "LORA_CONFIG",
    "LORA_WEIGHTS",
    "LORA_EVICT",
    "LORA_TIER",
    "ADMIN_RESULT",
    "LORA_SEAL",
)


class TritonPythonModel:
    def execute(self, requests):
        empty = np.array([[b""]], dtype=np.object_)
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, empty) for n in OUTPUTS])
            for _ in requests
        ]
