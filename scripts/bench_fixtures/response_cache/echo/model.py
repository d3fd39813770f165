"""Trivial echo model (non-decoupled): text_output = text_input. With `response_cache` enabled
in its config, Triton answers repeats from its own cache and never calls execute()."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(
                        "text_output",
                        pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy(),
                    )
                ]
            )
            for request in requests
        ]
