"""A stage's `initialize` ends by collecting the garbage its start made and freezing the rest
(`tiercache.triton.io.freeze_startup_objects`), so full collections while serving walk only
what requests made."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_a_started_stage_froze_its_objects_after_collecting_its_garbage(
    load_model: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    gc.unfreeze()
    gc.disable()  # no automatic collection between here and the stage's own
    try:
        garbage = _Node()
        gone = weakref.ref(garbage)
        del garbage
        kept = _Node()
        assert gone() is not None and gc.get_freeze_count() == 0
    finally:
        gc.enable()
    model = load_model("prompt_cache").TritonPythonModel()
    config = {"parameters": {"state_dir": {"string_value": str(tmp_path)}}}
    model.initialize({"model_config": json.dumps(config), "model_name": "prompt_cache"})
    try:
        assert gone() is None  # collected before the freeze, not frozen with the rest
        assert gc.get_freeze_count() > 0
        # what the process held is out of every generation's walk (the permanent one's)
        assert all(kept is not o for o in gc.get_objects())
    finally:
        model.finalize()
