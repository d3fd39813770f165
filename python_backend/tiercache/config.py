"""Typed stage configuration, parsed from Triton stage parameters (strings) with defaults.

Each stage declares a frozen dataclass; `parse_config` fills it from `parameters` in config.pbtxt,
rejects unknown keys and malformed values in one message, so `initialize` fails fast.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tiercache.errors import ConfigError
from tiercache.request import DEFAULT_LIMITS, Limits

T = TypeVar("T")

STATE_DIR_ENV = "TIERCACHE_STATE_DIR"
ADAPTERS_DIR_ENV = "TIERCACHE_ADAPTERS_DIR"


def default_state_dir() -> Path:
    """Where L2, the server secret and converted weights live: $TIERCACHE_STATE_DIR, else
    ~/.cache/tiercache."""
    env = os.environ.get(STATE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "tiercache"


def adapters_path(adapters_dir: str, state_dir: Path) -> Path:
    """The adapters folder: the stage parameter, else $TIERCACHE_ADAPTERS_DIR, else
    `<state dir>/adapters` (which may not exist: then only the base model is served)."""
    if adapters_dir:
        return Path(adapters_dir)
    env = os.environ.get(ADAPTERS_DIR_ENV)
    return Path(env) if env else state_dir / "adapters"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Settings every stage that touches the exact cache shares (prompt_cache, llm)."""

    state_dir: str = ""  # empty: default_state_dir()
    l1_max_bytes: int = 64 << 20
    l2_max_bytes: int = 1 << 30
    ttl_s: float = 0.0  # 0: entries never expire
    model: str = "smollm2-135m-instruct"
    adapters_dir: str = ""  # empty: adapters_path()'s default
    adapters_manifest: str = ""  # optional JSON manifest (tiercache.lora.registry)
    # L3 on Redis, shared by replicas (tiercache.redis_tier); "" keeps every tier on this host.
    redis_url: str = ""  # e.g. redis://cache-redis:6379/0
    redis_prefix: str = "tiercache:"  # every key and channel of this deployment starts with it
    redis_timeout_s: float = 0.25  # socket connect/read timeout of one call
    redis_retry_s: float = 1.0  # after a failure, Redis is tried again at most this often
    redis_max_ttl_s: float = 7 * 86400.0  # L3 expiry cap (0: none; entries' own ttl_s applies)

    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir()

    def adapters_path(self) -> Path:
        return adapters_path(self.adapters_dir, self.state_path())

    def l2_path(self) -> Path:
        return self.state_path() / "l2"

    def invalidations_path(self) -> Path:
        return self.state_path() / "invalidations"

    def secret_path(self) -> Path:
        return self.state_path() / "secret"


@dataclass(frozen=True, slots=True)
class PromptCacheConfig(CacheConfig):
    embedder: str = "all-minilm-l6-v2"  # "": no semantic scopes (embedding_cache not deployed)
    max_prompt_chars: int = DEFAULT_LIMITS.max_prompt_chars
    max_tokens: int = DEFAULT_LIMITS.max_tokens
    max_stop_words: int = DEFAULT_LIMITS.max_stop_words

    def limits(self) -> Limits:
        return Limits(
            max_prompt_chars=self.max_prompt_chars,
            max_tokens=self.max_tokens,
            max_stop_words=self.max_stop_words,
        )


@dataclass(frozen=True, slots=True)
class SemanticConfig(CacheConfig):
    """Settings shared by the stages that touch the semantic index (embedding_cache, llm)."""

    embedder: str = "all-minilm-l6-v2"
    semantic_max_bytes: int = 2 << 30  # the index's row log (LMDB map size)

    def semantic_path(self) -> Path:
        return self.state_path() / "semantic"

    def vectors_path(self) -> Path:
        return self.state_path() / "vectors"


@dataclass(frozen=True, slots=True)
class EmbeddingCacheConfig(SemanticConfig):
    embedder_model: str = "embedder"  # the Triton model that embeds (BLS target)
    target_precision: float = 0.0  # 0: the guard model's default operating point
    top_k: int = 5
    min_similarity: float = 0.6
    flat_max_rows: int = 10_000  # per scope; an HNSW graph (hnswlib) above this
    vector_l1_max_bytes: int = 16 << 20
    vector_l2_max_bytes: int = 1 << 30


@dataclass(frozen=True, slots=True)
class EmbedderConfig:
    embedder: str = "all-minilm-l6-v2"
    device: str = "auto"
    # Seconds between returns of freed heap memory to the system after a batch (tiercache.memory;
    # 0: never). scripts/embedder_rss.py: one trim after 3,000 batches gave back 217 MiB.
    memory_trim_interval_s: float = 5.0


@dataclass(frozen=True, slots=True)
class LlmConfig(SemanticConfig):
    engine_model: str = "torch_llm"  # the Triton model that generates (BLS target)
    # torch_llm: canonical request JSON in, text out; tensorrt_llm: Triton's TensorRT-LLM backend
    # model, token ids in and out (tiercache.engine.trtllm_client).
    engine_kind: str = "torch_llm"
    lora_model: str = "lora_cache"  # asked again for adapter weights the engine lost (BLS)
    max_concurrency: int = 64  # worker threads: generations plus waiting followers
    # Engine calls (BLS streams) open at once; more wait in llm, not in the engine's queue (the
    # CPU engine generates one request at a time anyway). engine_kind torch_llm only (TensorRT-LLM
    # batches requests in flight). 0: no limit (max_concurrency). It was first added against the
    # stub crash of docs/faults.md, whose cause turned out to be another (tb.StreamKeeper).
    engine_streams: int = 2
    # With redis_url: a miss another replica is generating waits for its answer (tiercache.leases)
    lease_ttl_s: float = 10.0  # a dead replica's lease expires after this (renewed while alive)
    lease_wait_s: float = 60.0  # the longest wait for another replica before generating here
    # With redis_url: semantic rows shared through a Redis stream (tiercache.semantic.redis_rows)
    redis_semantic_max_rows: int = 1_000_000  # the stream's approximate bound; 0: not shared
    redis_semantic_warm_s: float = 10.0  # initialize waits this long at most for the catch-up
    # engine_kind tensorrt_llm only: the engine's tokenizer folder (required), and the limits it
    # was built with (trtllm-build --max_input_len / --max_seq_len; 0: not checked here).
    tokenizer_dir: str = ""
    trtllm_max_input_len: int = 0
    trtllm_max_seq_len: int = 0
    # Response-time padding (tiercache.padding, docs/isolation.md): no response of a request from
    # a tenant not in trusted_tenants leaves llm before hit_padding_ms plus a uniform jitter in
    # [0, hit_padding_jitter_ms] since llm received it, so a hit is not told from a miss by time.
    hit_padding_ms: float = 0.0  # 0: off
    hit_padding_jitter_ms: float = 0.0
    trusted_tenants: str = ""  # comma-separated tenant names never padded (normalized like tenant)


@dataclass(frozen=True, slots=True)
class LoraCacheConfig(CacheConfig):
    """The `lora_cache` stage: where adapters live and how many stay resident in each tier."""

    engine_model: str = "torch_llm"  # the engine it keeps warm (BLS target of warm and list)
    # torch_llm: adapters go out as PEFT files (LORA_CONFIG, LORA_WEIGHTS); tensorrt_llm: also
    # as TensorRT-LLM's lora_task_id / lora_weights / lora_config (tiercache.lora.trtllm).
    engine_kind: str = "torch_llm"
    trtllm_dtype: str = "float16"  # the TensorRT-LLM engine's dtype (lora_weights' dtype)
    engine_slots: int = 4  # adapters loaded in the engine at once (vLLM's max_loras)
    engine_max_bytes: int = 0  # 0: bounded by engine_slots only
    host_max_adapters: int = 32  # adapters whose weights lora_cache keeps in memory
    host_max_bytes: int = 256 << 20
    pin: str = ""  # comma-separated names never evicted from the engine
    prefetch: str = ""  # comma-separated names loaded into the engine at start
    # With redis_url: adapter metadata and usage shared by the fleet (tiercache.lora.fleet)
    prefetch_fleet_top: int = 0  # at start, warm the fleet's N most-used adapters; 0: off
    fleet_sync_s: float = 10.0  # publish this replica's adapters and usage counts this often


@dataclass(frozen=True, slots=True)
class EngineConfig:
    state_dir: str = ""
    model: str = "smollm2-135m-instruct"
    device: str = "auto"  # auto | cpu | cuda
    adapters_dir: str = ""
    adapters_manifest: str = ""
    lora_slots: int = 4  # hard bound on adapters loaded at once; lora_cache decides which
    lora_prefetch: str = ""  # comma-separated names loaded at start (same list as lora_cache's)
    kv_reuse: bool = True  # paged prefix KV reuse (tiercache.engine.kv_cache)
    tokens_per_block: int = 32  # KV block size; only full blocks are reused
    kv_pool_max_bytes: int = 256 << 20  # the KV block pool's byte budget
    # Input policy (tiercache.engine.policy): a prompt this regex matches (re.search over the
    # canonical prompt; "" refuses nothing) is answered with `refusal_text` and finish reason
    # content_filter without generating; the llm stage never caches such an answer.
    refuse_prompt_pattern: str = ""
    refusal_text: str = "I can't help with that request."
    # Seconds between returns of freed heap memory to the system (glibc malloc_trim, after a
    # request; tiercache.memory); 0 never trims. Without it the engine's RSS keeps climbing.
    memory_trim_interval_s: float = 5.0

    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir()

    def models_path(self) -> Path:
        return self.state_path() / "models"

    def adapters_path(self) -> Path:
        return adapters_path(self.adapters_dir, self.state_path())


def name_list(text: str) -> tuple[str, ...]:
    """A comma-separated parameter as a tuple of non-empty, stripped names."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def parse_config(cls: type[T], values: dict[str, str]) -> T:
    """Build `cls` from string values; unknown keys and bad values raise one ConfigError."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    problems = [f"unknown parameter {k!r}" for k in sorted(values) if k not in fields]
    kwargs: dict[str, Any] = {}
    for key, text in values.items():
        if key not in fields:
            continue
        kind = hints[key]
        try:
            kwargs[key] = _convert(kind, text)
        except ValueError as exc:
            problems.append(f"parameter {key!r}: {exc}")
    if problems:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{'; '.join(problems)} (known parameters: {known})")
    return cls(**kwargs)


def _convert(kind: Any, text: str) -> Any:
    text = text.strip()
    if kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {text!r}")
    if kind is int:
        return int(text.replace("_", ""))
    if kind is float:
        return float(text)
    if kind is str:
        return text
    raise ValueError(f"unsupported parameter type {kind!r}")


@dataclass(frozen=True, slots=True)
class CacheAdminConfig(PromptCacheConfig):
    """The `cache_admin` model: the same cache settings as prompt_cache (so its digests, tiers
    and secret are the ones the ensemble uses), plus the lora_cache model it forwards adapter
    warm-ups to (BLS). `embedder` is accepted for symmetry and not used."""

    lora_model: str = "lora_cache"
