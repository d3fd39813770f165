"""What the adapter registry, the `lora_cache` stage and the engines exchange.

An adapter *version* is its name plus the SHA-256 of its files (`digest`): a changed folder is a
new version. `task_id` is a stable small integer per name (TensorRT-LLM's `lora_task_id`); it does
not change when the files change, so an engine must key what it holds by (task_id, digest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ENGINE_TIER = "engine"  # loaded into the engine's adapter slots (GPU slots on a GPU engine)
HOST_TIER = "host"  # weights held in host memory by lora_cache
DISK_TIER = "disk"  # only in the adapters folder
TIERS = (ENGINE_TIER, HOST_TIER, DISK_TIER)


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


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One version's files, read once and checked against its digest."""

    ref: AdapterRef
    config_json: str  # adapter_config.json (PEFT)
    weights: bytes  # adapter_model.safetensors

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
