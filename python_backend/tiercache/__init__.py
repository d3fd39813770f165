"""tiercache: cache-first LLM serving on NVIDIA Triton.

The package is the pure core behind every `model_repository/<stage>/1/model.py`. Only
`tiercache.triton` touches `triton_python_backend_utils`; everything else runs without Triton.
"""

__version__ = "0.1.0"
