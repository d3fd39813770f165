"""Engines behind the `llm` stage. `model_source` is torch-free; `torch_engine` imports torch."""
