"""A pair verifier folder as tiercache_dev.train.verifier writes it, with an untrained adapter
(random classifier, LoRA at its initialisation): for tests of loading and wiring, not quality."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def untrained_verifier(
    folder: Path, revision: str | None = None, operating_point: float | None = None
) -> tuple[Path, dict[str, Any]]:
    """The folder and its verifier.json; `revision` None: the packaged embedder's weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertForSequenceClassification

    from tiercache.semantic.embedder import resolve_embedder
    from tiercache.semantic.verifier import FORMAT, INFO_FILE

    base, identity = resolve_embedder()
    model = BertForSequenceClassification.from_pretrained(str(base), num_labels=1)
    config = LoraConfig(r=2, target_modules=["query", "value"], modules_to_save=["classifier"])
    get_peft_model(model, config).save_pretrained(str(folder))
    info: dict[str, Any] = {
        "format": FORMAT,
        "base": {"revision": identity.revision if revision is None else revision},
        "hyper": {"max_length": 32},
    }
    if operating_point is not None:
        info["operating_point"] = {"threshold": operating_point}
    (folder / INFO_FILE).write_text(json.dumps(info))
    return folder, info
