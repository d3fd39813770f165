"""The one place that touches `triton_python_backend_utils` (imported by model.py files only)."""
