"""Engines behind the `llm` stage. `model_source` and `threads` are torch-free at import;
`torch_engine` imports torch."""
