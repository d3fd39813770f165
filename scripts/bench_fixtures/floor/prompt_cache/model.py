"""No-op `prompt_cache` for the benchmark floor: every request is an exact hit whose cached text
is the prompt itself. Same output tensors as the real stage; no decoding, no lookup."""

import numpy as np
import triton_python_backend_utils as pb_utils


def _bytes(name, value):
    return pb_utils.Tensor(name, np.array([[value]], dtype=np.object_))


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        _bytes("ENVELOPE", b"{}"),
                        pb_utils.Tensor("CACHED_TEXT", text.reshape(1, 1)),
                        pb_utils.Tensor("CACHED_TOKENS", np.zeros((1, 3), dtype=np.int32)),
                    ]
                )
            )
        return responses
