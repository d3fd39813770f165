"""No-op `llm` (decoupled) for the benchmark floor: one final response per request carrying
TEXT_OUTPUT = EXACT_TEXT (prompt_cache's hit, handed on directly), CACHE_STATUS = LOOKUP_STATUS,
ANSWER_ID (a constant as long as a real answer id, tiercache.exact.answer_ids.ID_CHARS), the
token counts and FINISH_REASON, the outputs the real stage sends on a hit."""

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ANSWER_ID = np.array([[b"a3." + b"A" * 124]], dtype=np.object_)  # 127 characters, as ID_CHARS


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "EXACT_TEXT").as_numpy()
            status = pb_utils.get_input_tensor_by_name(request, "LOOKUP_STATUS").as_numpy()
            response = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("TEXT_OUTPUT", text.reshape(1, -1)),
                    pb_utils.Tensor("CACHE_STATUS", status.reshape(1, 1)),
                    pb_utils.Tensor("ANSWER_ID", ANSWER_ID),
                    pb_utils.Tensor("PROMPT_TOKENS", np.zeros((1, 1), dtype=np.int32)),
                    pb_utils.Tensor("COMPLETION_TOKENS", np.zeros((1, 1), dtype=np.int32)),
                    pb_utils.Tensor("FINISH_REASON", np.array([[b"stop"]], dtype=np.object_)),
                ]
            )
            request.get_response_sender().send(response, flags=FINAL)
        return None
