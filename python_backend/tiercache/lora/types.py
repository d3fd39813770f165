"""The residency tiers lora_cache tracks for each adapter version, fastest first.

The adapter values lora_cache exchanges with the engines (`AdapterRef`, `AdapterWeights`) are in
`tiercache.adapter_types`, which the engine package imports too; these tiers are lora_cache's own.
"""

from __future__ import annotations

ENGINE_TIER = "engine"  # loaded into the engine's adapter slots (GPU slots on a GPU engine)
HOST_TIER = "host"  # weights held in host memory by lora_cache
DISK_TIER = "disk"  # only in the adapters folder
TIERS = (ENGINE_TIER, HOST_TIER, DISK_TIER)
