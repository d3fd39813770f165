"""`tiercache gateway`: the OpenAI-compatible HTTP endpoint over the ensemble (issue 16)."""
