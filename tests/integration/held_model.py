"""Test fixture, installed as a model of a repository copy (the embedder, torch_llm): the
committed model (its model.py, copied beside this file as real_model.py), whose execute waits
while a file named HOLD exists beside it (at most HOLD_MAX_S). A held stub stays healthy to
Triton, its health thread runs on, but answers nothing: a model that deadlocked or runs away."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOLD = HERE / "HOLD"
HOLD_MAX_S = 120.0

_spec = importlib.util.spec_from_file_location("tiercache_held_model_real", HERE / "real_model.py")
assert _spec is not None and _spec.loader is not None
real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real)


class TritonPythonModel(real.TritonPythonModel):  # type: ignore[name-defined,misc]
    def execute(self, requests: list) -> list | None:
        ends = time.monotonic() + HOLD_MAX_S
        while HOLD.exists() and time.monotonic() < ends:
            time.sleep(0.05)
        return super().execute(requests)  # type: ignore[no-any-return]  # None: decoupled
