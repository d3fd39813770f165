"""What the adapter registry, the `lora_cache` stage and the engines exchange.

The engine executes adapters (`tiercache.engine`) and lora_cache decides which ones are resident
where (`tiercache.lora`); the two packages never import each other (an import-linter
independence contract checks it). The values they pass between them live here, in a module that
imports neither: an adapter version, its files, the engines' "not held" answer, and an adapter in
TensorRT-LLM's per-request layout (converted by `tiercache.lora.trtllm`, sent by
`tiercache.engine.trtllm_client`).

An adapter *version* is its name plus the SHA-256 of its files (`digest`): a changed folder is a
new version. `task_id` is a stable small integer per name (TensorRT-LLM's `lora_task_id`); it does
not change when the files change, so an engine must key what it holds by (task_id, digest).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from tiercache.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class AdapterRef:
    name: str
    task_id: int
    digest: str  # hex SHA-256 over the adapter's files (see tiercache.lora.registry)

    @property
    def short(self) -> str:
        return f"{self.name}@{self.digest[:12]}"

    def to_json(self) -> str:
        return json.dumps(
            {"name": self.name, "task_id": self.task_id, "digest": self.digest},
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> AdapterRef:
        data = json.loads(text)
        return cls(str(data["name"]), int(data["task_id"]), str(data["digest"]))


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
DIGEST_DOMAIN = b"tiercache-lora-v1\x00"


def adapter_digest(config: bytes, weights: bytes) -> str:
    """The version digest of an adapter's two files: SHA-256 over a domain tag and, for each
    file in ADAPTER_FILES order, its name, its length and its bytes (the registry names versions
    by it; the engine recomputes it before loading)."""
    sha = hashlib.sha256(DIGEST_DOMAIN)
    for name, data in zip(ADAPTER_FILES, (config, weights), strict=True):
        sha.update(name.encode("ascii") + b"\x00" + len(data).to_bytes(8, "big"))
        sha.update(data)
    return sha.hexdigest()


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One version's files, read once and checked against its digest."""

    ref: AdapterRef
    config_json: str  # adapter_config.json (PEFT)
    weights: bytes  # adapter_model.safetensors

    def matches(self) -> bool:
        """Whether the files are the ones `ref.digest` names."""
        return adapter_digest(self.config_json.encode("utf-8"), self.weights) == self.ref.digest

    @property
    def nbytes(self) -> int:
        return len(self.weights) + len(self.config_json)


def not_in_engine_message(ref: AdapterRef) -> str:
    """The engine's answer for an adapter it does not hold, worded as TensorRT-LLM's backend
    words it, so one retry rule covers both engines."""
    return (
        f"LoRA task {ref.task_id} ({ref.short}) not found in cache. "
        "Please send LoRA weights with request"
    )


NOT_IN_ENGINE_MARK = "not found in cache"


TASK_ID_BITS = 32  # per-name task id in the high half of the engine's uint64 id


@dataclass(frozen=True, slots=True, eq=False)
class TrtllmLora:
    """One adapter in TensorRT-LLM's layout (described in `tiercache.lora.trtllm`). Both arrays
    are read-only."""

    weights: np.ndarray  # [rows, row_size], the engine's dtype
    config: np.ndarray  # int32 [rows, 3]: module_id, layer_idx, adapter_size

    @property
    def rows(self) -> int:
        return int(self.config.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.weights.nbytes + self.config.nbytes)


@dataclass(frozen=True, slots=True, eq=False)
class TrtllmRequestLora:
    """What one request sends to the `tensorrt_llm` model for its adapter."""

    task_id: int  # engine_task_id(ref)
    lora: TrtllmLora | None = None  # None: the engine holds task_id, send the id alone

    def tensors(self) -> dict[str, np.ndarray]:
        """The model's inputs by name, each with the request's batch dimension of 1."""
        out = {"lora_task_id": np.array([[self.task_id]], dtype=np.uint64)}
        if self.lora is not None:
            out["lora_weights"] = self.lora.weights[np.newaxis]
            out["lora_config"] = self.lora.config[np.newaxis]
        return out


def held_key(ref: AdapterRef) -> str:
    """How one adapter the engine holds is named in an eviction (lora_cache's LORA_EVICT) and
    in the engine's report of what it dropped: `<task id>:<digest>`. The engines hold adapters
    by both, so two names over identical files (an alias folder) are two adapters."""
    return held_key_of(ref.task_id, ref.digest)


def held_key_of(task_id: int, digest: str) -> str:
    """`held_key` from its parts (the engine keeps adapters by (task id, digest))."""
    return f"{task_id}:{digest}"


def split_held_key(text: str) -> tuple[int, str] | None:
    """The (task id, digest) a `held_key` names; None for a bare digest (an eviction of every
    name over those files). ValueError for anything else."""
    task_id, sep, digest = text.partition(":")
    if not sep:
        return None
    if not (task_id.isascii() and task_id.isdigit()) or not digest or ":" in digest:
        raise ValueError(f"{text[:80]!r} is not <task id>:<digest>")
    return int(task_id), digest


def engine_task_id(ref: AdapterRef) -> int:
    """A uint64 `lora_task_id` unique to the version: (ref.task_id << 32) | digest[:8]. Why
    the version and not the name: see "Task ids" in `tiercache.lora.trtllm`."""
    if not 1 <= ref.task_id < 1 << TASK_ID_BITS:
        raise InvalidRequest(f"adapter {ref.short}: task id {ref.task_id} is outside [1, 2**32)")
    try:
        low = int(ref.digest[:8], 16) if len(ref.digest) >= 8 else -1
    except ValueError:
        low = -1
    if low < 0:
        raise InvalidRequest(f"adapter {ref.name!r}: digest {ref.digest[:16]!r} is not hex")
    return (ref.task_id << TASK_ID_BITS) | low
