"""Fixtures that run Triton model.py files in-process against the pb_utils stand-in."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tiercache_dev import pb_utils_stub

MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


@pytest.fixture
def pb_utils(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Install the stand-in as `triton_python_backend_utils` (always the same module object, so
    the boundary and stage modules imported against it stay valid across tests)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils_stub)
    return pb_utils_stub


@pytest.fixture
def load_model(pb_utils: ModuleType) -> Callable[[str], ModuleType]:
    """Import model_repository/<name>/1/model.py by path, as the Python backend does."""

    def load(name: str) -> ModuleType:
        path = MODEL_REPOSITORY / name / "1" / "model.py"
        spec = importlib.util.spec_from_file_location(f"tiercache_model_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        before = set(os.environ)
        spec.loader.exec_module(module)
        # A model.py may set defaults in this process's environment as it is imported (the
        # torch stages: OpenMP and tokenizers); they are dropped so no later test sees them.
        for key in set(os.environ) - before:
            del os.environ[key]
        return module

    return load
