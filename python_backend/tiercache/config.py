"""Typed stage configuration, parsed from Triton stage parameters (strings) with defaults.

Each Triton model has one frozen dataclass listing exactly the parameters that stage reads
(`STAGE_CONFIGS`). Every field is declared with `param`, which carries its description and the
checks on its value (a range, a set of choices); `parse_config` converts the strings, runs every
check and the class's cross-field checks, and reports every problem in one `ConfigError`, so
`initialize` fails once with the whole list. A parameter is documented once, in `PARAMETERS`, and
a stage that reads it lists it with `shared(name)`; docs/configuration.md is generated from these
declarations (`python -m tiercache_dev.config_docs --write`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tiercache.engine.threads import (
    AUTO,
    EMBEDDER_CPU_SHARE,
    PASS_THREADS_PATTERN,
    TORCH_THREADS_PATTERN,
)
from tiercache.errors import ConfigError
from tiercache.exact.request import DEFAULT_LIMITS, Limits
from tiercache.semantic.verifier import DTYPES as VERIFIER_DTYPES
from tiercache.vocabulary import EngineKind, choices

T = TypeVar("T")

STATE_DIR_ENV = "TIERCACHE_STATE_DIR"
ADAPTERS_DIR_ENV = "TIERCACHE_ADAPTERS_DIR"
API_KEYS_FILE_ENV = "TIERCACHE_API_KEYS_FILE"


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


def api_keys_path(api_keys_file: str) -> Path | None:
    """The API key file: the stage parameter, else $TIERCACHE_API_KEYS_FILE, else None (the
    `tenant` input is trusted as sent)."""
    named = api_keys_file or os.environ.get(API_KEYS_FILE_ENV, "")
    return Path(named) if named else None


def name_list(text: str) -> tuple[str, ...]:
    """A comma-separated parameter as a tuple of non-empty, stripped names."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


# ---- declaring parameters ---------------------------------------------------------------------


MAX_SECONDS = 1e9  # about 31 years: any duration a stage takes, far under Python's TIMEOUT_MAX
MAX_MAP_BYTES = 1 << 44  # an LMDB map of 16 TiB: every map of a host shares the address space


def param(
    default: Any,
    doc: str,
    *,
    choices: Sequence[str] | None = None,
    min: float | None = None,  # noqa: A002 - the metadata key it fills
    max: float | None = None,  # noqa: A002
    min_open: bool = False,
    pattern: str | None = None,
) -> Any:
    """A config field: its default, its one-line description and the checks on its value
    (`choices` or a regex `pattern` the whole string must match, for a string; `min`/`max`
    bounds for a number, `min_open` excluding `min`)."""
    return dataclasses.field(
        default=default,
        metadata={
            "doc": doc,
            "choices": tuple(choices) if choices is not None else None,
            "min": min,
            "max": max,
            "min_open": min_open,
            "pattern": pattern,
        },
    )


@dataclass(frozen=True, slots=True)
class _Spec:
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None
    min_open: bool = False
    pattern: str | None = None


# Parameters that several stages read, documented once; a stage lists each it reads.
PARAMETERS: dict[str, _Spec] = {
    "state_dir": _Spec(
        "",
        "Folder of L2, the semantic rows, the server secret and converted weights; "
        "empty: $TIERCACHE_STATE_DIR, else ~/.cache/tiercache",
    ),
    "l1_max_bytes": _Spec(64 << 20, "Byte budget of this process's L1 (exact answers)", min=0),
    "l1_eviction": _Spec(
        "gdsf",
        "Which answers L1 gives up first: gdsf (GreedyDual-Size-Frequency over a TinyLFU sketch: "
        "answers asked for again and small ones outlive one-offs; docs/kv_reuse.md) or lru",
        choices=("gdsf", "lru"),
    ),
    "l2_eviction": _Spec(
        "gdsf",
        "Which answers the host's L2 gives up first: gdsf (GreedyDual-Size-Frequency over every "
        "process's writes and hits, kept in the state_dir beside L2; docs/kv_reuse.md) or "
        "oldest (first written, first gone); set the same on every stage of the host",
        choices=("gdsf", "oldest"),
    ),
    "l2_max_bytes": _Spec(
        1 << 30,
        "Byte budget of the host's L2 (LMDB map size; every process of the host shares it)",
        min=1 << 20,
        max=MAX_MAP_BYTES,
    ),
    "ttl_s": _Spec(
        0.0,
        "Age after which a cached answer is not served (0: never expires). Also the horizon "
        "after which invalidation watermarks may be forgotten: a finite value bounds the "
        "invalidation table and logs; with 0 every watermark is kept",
        min=0,
    ),
    "model": _Spec(
        "smollm2-135m-instruct",
        "The served model's name (its identity enters every "
        "key: prompt_cache and cache_admin must agree)",
    ),
    "adapters_dir": _Spec(
        "", "Folder of LoRA adapters; empty: $TIERCACHE_ADAPTERS_DIR, else <state_dir>/adapters"
    ),
    "adapters_manifest": _Spec(
        "",
        "Optional JSON manifest of adapters (names, paths, task ids, "
        "pins); empty: every folder under adapters_dir",
    ),
    "redis_url": _Spec(
        "",
        "Redis for L3, invalidations, leases and shared rows (e.g. "
        "redis://cache-redis:6379/0); empty: every tier stays on this host",
    ),
    "redis_prefix": _Spec(
        "tiercache:", "Every Redis key and channel of this deployment starts with it"
    ),
    "redis_timeout_s": _Spec(
        0.25, "Socket connect/read timeout of one Redis call", min=0, min_open=True
    ),
    "redis_retry_s": _Spec(
        1.0, "After a Redis failure, Redis is tried again at most this often", min=0.05
    ),
    "redis_max_ttl_s": _Spec(
        7 * 86400.0,
        "Expiry cap of L3 entries (0: none; an entry's own ttl_s still applies). With it (or "
        "ttl_s) every L3 entry has a Redis TTL, so a volatile-lru Redis can evict entries and "
        "never the control keys",
        min=0,
    ),
    "embedder": _Spec(
        "all-minilm-l6-v2",
        "The sentence embedder of the semantic cache (its identity enters every semantic scope)",
    ),
    "semantic_max_bytes": _Spec(
        2 << 30,
        "Byte budget of the semantic row log (LMDB map size)",
        min=1 << 20,
        max=MAX_MAP_BYTES,
    ),
    "semantic_max_scopes": _Spec(
        4096,
        "Most semantic scopes on the host (each is a table file every process searching it "
        "maps: about 65k exhaust vm.max_map_count); a row that would start one more is not "
        "indexed (counted and logged, never an error)",
        min=1,
        max=60_000,
    ),
    "semantic_max_scopes_per_tenant": _Spec(
        256,
        "Most semantic scopes one tenant scope may start on the host (scopes differ by model, "
        "adapter, sampling parameters and max_tokens: without it one tenant could take every "
        "place of semantic_max_scopes); a row that would start one more is not indexed "
        "(counted and logged, never an error)",
        min=1,
    ),
    "engine_model": _Spec("torch_llm", "The Triton model that generates (BLS target)"),
    "engine_kind": _Spec(
        EngineKind.TORCH_LLM.value,
        "torch_llm: canonical request in, text out; tensorrt_llm: "
        "Triton's TensorRT-LLM backend model, token ids in and out",
        choices=choices(EngineKind),
    ),
    "api_keys_file": _Spec(
        "",
        "JSON file of hashed API keys -> tenants (tiercache.exact.tenant_keys; "
        "`tiercache keys add` writes it); empty: $TIERCACHE_API_KEYS_FILE, else none and the "
        "`tenant` input is trusted as sent",
    ),
    "envelope_max_age_s": _Spec(
        300.0,
        "The oldest envelope (prompt_cache's sealed hand-over) a stage acts on, in seconds "
        "(plus 60: issue times are rounded down to a minute). Bounds how long a caller can replay "
        "its own kept envelopes after anything it was checked against changed; a revoked key's "
        "are refused at once (docs/security.md). Keep it above the longest time a request may "
        "queue between prompt_cache and llm",
        min=1,
    ),
    "disk_headroom_bytes": _Spec(
        512 << 20,
        "Free disk kept on the state directory's filesystem: under it L2 stops growing its "
        "file and turns over inside it, and the prompt vectors' L2 takes none; under half of "
        "it L2 keeps to half its file and llm logs no new semantic row; 0: off "
        "(docs/budgets.md)",
        min=0,
    ),
    "memory_headroom_bytes": _Spec(
        0,
        "Host memory this stage's caches keep free (tiercache.budgets): under it their budgets "
        "shrink, least valuable first, down to their floors; with a quarter more free they grow "
        "back to their fixed sizes (0: off, the budgets stay fixed; docs/budgets.md)",
        min=0,
    ),
    "cache_memory_bytes": _Spec(
        0,
        "What the cache budgets of the host's stages that set it may hold together (every "
        "budget of such a stage: answers' L1s, prompt vectors, semantic graphs, adapters in "
        "host memory, the engine's KV pool and adapter slots; set the same in each): bytes "
        "move to the cache where one more byte saves the most engine time, measured "
        "(tiercache.budgets; each stage's fixed sizes are then ceilings; 0: off, each budget "
        "stays its fixed size; docs/budgets.md)",
        min=0,
    ),
    "l1_min_bytes": _Spec(
        1 << 20, "Floor of L1's budget (memory_headroom_bytes, cache_memory_bytes)", min=1
    ),
    "budget_interval_s": _Spec(
        1.0,
        "How often the budgets are looked at (memory_headroom_bytes, cache_memory_bytes; at "
        "most 10 s: the host's other processes take a budget not published for 30 s as gone)",
        min=0.05,
        max=10,
    ),
    "confidence_floor": _Spec(
        0.0,
        "Answers whose confidence (geometric-mean token probability, tiercache.exact.confidence) "
        "is under this are unsure: never served as semantic hits, and kept at most "
        "unsure_ttl_s (0: no floor, the default for the shipped model, see docs/feedback.md; "
        "0.5 there keeps the answers that agree best with a rewording's own; answers of "
        "unknown confidence count as sure)",
        min=0,
        max=1,
    ),
    "lora_model": _Spec(
        "lora_cache", "The lora_cache model (BLS target for adapter weights and warm-ups)"
    ),
    "lora_timeout_s": _Spec(
        120.0,
        "How long a call to lora_model (an adapter's files the engine lost, for llm; a warm-up, "
        "for cache_admin) waits for its answer; past it the call fails as unavailable, and "
        "later calls do too, at once, until the late one answers (docs/faults.md). 0: wait as "
        "long as lora_cache takes",
        min=0,
        max=3600,
    ),
    "engine_timeout_s": _Spec(
        600.0,
        "How long a stream from engine_model (a generation, for llm; an adapter's load or the "
        "engine's list, for lora_cache) waits for its next response, the first counted from the "
        "call, queueing in the engine included; past it the request fails as unavailable, and "
        "while 4 such streams are still out later calls fail at once (docs/faults.md). 0: wait "
        "as long as the engine takes",
        min=0,
        max=86400,
    ),
    "device": _Spec(
        "auto",
        "Where the model runs: auto (a GPU if torch sees one), cpu, cuda or cuda:<index>",
        pattern=r"auto|cpu|cuda(:[0-9]+)?",
    ),
    "memory_trim_interval_s": _Spec(
        5.0,
        "Seconds between returns of freed heap memory to the system after a request "
        "(glibc malloc_trim; 0: never)",
        min=0,
    ),
}


def shared(name: str) -> Any:
    """A field for the shared parameter `name` (PARAMETERS), with its default and checks."""
    spec = PARAMETERS[name]
    return param(
        spec.default,
        spec.doc,
        choices=spec.choices,
        min=spec.min,
        max=spec.max,
        min_open=spec.min_open,
        pattern=spec.pattern,
    )


def torch_threads_param(embedder: bool) -> Any:
    """The `torch_threads` field of a stage that runs torch (the embedder or the engine); its
    `auto` is tiercache.engine.threads.auto_thread_count (set_torch_threads applies it)."""
    per = f"{EMBEDDER_CPU_SHARE} CPUs (at least 1)"
    share = (
        f"one per {per} in the process's affinity mask"
        if embedder
        else f"the CPUs in the process's affinity mask less the embedder's auto share (one per "
        f"{per}), at least 1"
    )
    return param(
        AUTO,
        "torch's intra-op threads in this process, set before the weights load: a count from 1 to "
        "256, "
        f"or auto: {share} (a CPU quota is not seen: set a count there). Why: docs/usage.md, "
        "CPU threads",
        pattern=TORCH_THREADS_PATTERN,
    )


# ---- groups of parameters several stages read (single inheritance: slotted dataclasses) ---------


@dataclass(frozen=True, slots=True)
class _StateConfig:
    state_dir: str = shared("state_dir")

    def __post_init__(self) -> None:
        raise_problems(type(self), check_values(self))

    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir()


@dataclass(frozen=True, slots=True)
class _RedisConfig(_StateConfig):
    redis_url: str = shared("redis_url")
    redis_prefix: str = shared("redis_prefix")
    redis_timeout_s: float = shared("redis_timeout_s")
    redis_retry_s: float = shared("redis_retry_s")


@dataclass(frozen=True, slots=True)
class _TiersConfig(_RedisConfig):
    """What opening the exact cache's tiers reads, but L1 (which not every stage opens)."""

    l2_max_bytes: int = shared("l2_max_bytes")
    l2_eviction: str = shared("l2_eviction")
    disk_headroom_bytes: int = shared("disk_headroom_bytes")
    ttl_s: float = shared("ttl_s")
    redis_max_ttl_s: float = shared("redis_max_ttl_s")

    def cache(self) -> CacheConfig:
        """The tiers this stage opens (an L1 only if the stage has `l1_max_bytes`)."""
        return CacheConfig(
            state_dir=self.state_dir,
            l1_max_bytes=getattr(self, "l1_max_bytes", 0),
            l1_eviction=getattr(self, "l1_eviction", "gdsf"),
            l2_max_bytes=self.l2_max_bytes,
            l2_eviction=self.l2_eviction,
            disk_headroom_bytes=self.disk_headroom_bytes,
            ttl_s=self.ttl_s,
            redis_url=self.redis_url,
            redis_prefix=self.redis_prefix,
            redis_timeout_s=self.redis_timeout_s,
            redis_retry_s=self.redis_retry_s,
            redis_max_ttl_s=self.redis_max_ttl_s,
        )


@dataclass(frozen=True, slots=True)
class CacheConfig(_TiersConfig):
    """What opening the exact cache's tiers needs (tiercache.stages.parts.open_exact_cache);
    each stage that opens them derives one from its own config (`cache()`)."""

    l1_max_bytes: int = param(64 << 20, "Byte budget of this process's L1 (0: no L1)", min=0)
    l1_eviction: str = shared("l1_eviction")

    def l2_path(self) -> Path:
        return self.state_path() / "l2"

    def l2_values_path(self) -> Path:
        return self.state_path() / "l2-values"

    def invalidations_path(self) -> Path:
        return self.state_path() / "invalidations"

    def secret_path(self) -> Path:
        return self.state_path() / "secret"


@dataclass(frozen=True, slots=True)
class _LookupConfig(_TiersConfig):
    """What computing a request's digest as prompt_cache does reads (prompt_cache, cache_admin)."""

    model: str = shared("model")
    adapters_dir: str = shared("adapters_dir")
    adapters_manifest: str = shared("adapters_manifest")
    max_prompt_chars: int = param(
        DEFAULT_LIMITS.max_prompt_chars,
        "Longest prompt accepted (characters after normalization)",
        min=1,
    )
    max_tokens: int = param(DEFAULT_LIMITS.max_tokens, "Largest max_tokens accepted", min=1)
    max_stop_words: int = param(DEFAULT_LIMITS.max_stop_words, "Most stop_words accepted", min=0)

    def adapters_path(self) -> Path:
        return adapters_path(self.adapters_dir, self.state_path())

    def limits(self) -> Limits:
        return Limits(
            max_prompt_chars=self.max_prompt_chars,
            max_tokens=self.max_tokens,
            max_stop_words=self.max_stop_words,
        )


# ---- the stages ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PromptCacheConfig(_LookupConfig):
    """`prompt_cache`: canonical request -> scoped digest -> L1 -> L2 -> L3."""

    l1_max_bytes: int = shared("l1_max_bytes")
    l1_eviction: str = shared("l1_eviction")
    memory_headroom_bytes: int = shared("memory_headroom_bytes")
    cache_memory_bytes: int = shared("cache_memory_bytes")
    l1_min_bytes: int = shared("l1_min_bytes")
    budget_interval_s: float = shared("budget_interval_s")
    hit_objective_s: float = param(
        0.0,
        "Latency objective of exact hits (the stage's lookup time of a hit; the 90th "
        "percentile of its last 64 in the last minute): while it is missed (hits coming from "
        "L2 or Redis instead of L1), L1 grows past cache_memory_bytes a step a look, if its "
        "shadow shows more bytes would help, up to l1_max_bytes, memory headroom allowing; met "
        "with 20 % to spare, it gives them back a step every 8 looks. Acts only under "
        "cache_memory_bytes (0: none; docs/budgets.md)",
        min=0,
    )
    embedder: str = param(
        "all-minilm-l6-v2",
        "The embedding cache's embedder; empty: no semantic scopes (embedding_cache not deployed)",
    )
    api_keys_file: str = shared("api_keys_file")

    def api_keys_path(self) -> Path | None:
        return api_keys_path(self.api_keys_file)


@dataclass(frozen=True, slots=True)
class CacheAdminConfig(_LookupConfig):
    """`cache_admin`: the same cache settings as prompt_cache (so its digests, tiers and secret
    are the ones the ensemble uses; it opens no L1), plus the lora_cache model it forwards
    adapter warm-ups to."""

    lora_model: str = shared("lora_model")
    lora_timeout_s: float = shared("lora_timeout_s")


@dataclass(frozen=True, slots=True)
class FeedbackConfig(_TiersConfig):
    """`feedback`: a caller's good/bad on an answer it was served (tiercache.feedback); the same
    tiers, Redis and secret as prompt_cache (a bad answer is invalidated on every replica) and
    the same API keys (feedback comes from the tenant the answer was served to)."""

    api_keys_file: str = shared("api_keys_file")

    def api_keys_path(self) -> Path | None:
        return api_keys_path(self.api_keys_file)


@dataclass(frozen=True, slots=True)
class EmbeddingCacheConfig(_TiersConfig):
    """`embedding_cache`: embed, search the caller's semantic scope, guard, serve or pass on."""

    l1_max_bytes: int = shared("l1_max_bytes")
    l1_eviction: str = shared("l1_eviction")
    memory_headroom_bytes: int = shared("memory_headroom_bytes")
    cache_memory_bytes: int = shared("cache_memory_bytes")
    l1_min_bytes: int = shared("l1_min_bytes")
    budget_interval_s: float = shared("budget_interval_s")
    embedder: str = shared("embedder")
    semantic_max_bytes: int = shared("semantic_max_bytes")
    semantic_max_scopes: int = shared("semantic_max_scopes")
    semantic_max_scopes_per_tenant: int = shared("semantic_max_scopes_per_tenant")
    api_keys_file: str = shared("api_keys_file")
    envelope_max_age_s: float = shared("envelope_max_age_s")
    embedder_model: str = param("embedder", "The Triton model that embeds (BLS target)")
    embedder_timeout_s: float = param(
        5.0,
        "How long a lookup waits for the embedder's answer; past it the lookup's requests go "
        "on as misses, and later lookups do too, at once, until the late call answers "
        "(docs/faults.md). 0: wait as long as the embedder takes",
        min=0,
        max=3600,
    )
    target_precision: float = param(
        0.0,
        "The guard's operating point: the precision it aims for on its calibration data "
        "(0: the guard model's default)",
        min=0,
        max=1,
    )
    top_k: int = param(5, "Neighbours the guard considers per lookup", min=1, max=1000)
    min_similarity: float = param(
        0.6, "Cosine similarity below which a neighbour is not considered", min=-1, max=1
    )
    verifier: str = param(
        "off",
        "The semantic pair verifier that reads the query and each candidate the guard's floor "
        "and vetoes let through, together with the guard's score, and decides the hit "
        "(docs/semantic_guard.md): builtin (the one this package ships, trained on Quora "
        "Question Pairs, whose terms allow non-commercial use only), a folder written by "
        "tiercache_dev.train.verifier (an absolute path: a relative one is read from "
        "tritonserver's working directory), or off (the guard's score decides)",
    )
    verifier_threshold: float = param(
        0.0,
        "The verifier's operating point: the probability of 'same question' a candidate needs "
        "(0: the verifier's default, chosen on the dev pairs)",
        min=0,
        max=1,
    )
    verifier_threads: int = param(
        1, "torch's intra-op threads for the verifier in this process", min=1, max=64
    )
    verifier_dtype: str = param(
        "auto",
        "The verifier's number format: float32 (as trained), bfloat16 (about 1.6x faster on CPUs "
        "with native bfloat16, avx512_bf16 or AMX; decides as float32 does on the dev pairs), "
        "int8 (torch's dynamic quantization, about 2.2x faster, up to 0.007 less precise) or "
        "auto (bfloat16 where the CPU has it natively, else float32); docs/semantic_guard.md",
        choices=VERIFIER_DTYPES,
    )
    confidence_floor: float = shared("confidence_floor")
    semantic_max_error: float = param(
        0.0,
        "The share of served semantic hits a deployment accepts as wrong: each candidate the "
        "guard (or verifier) chose is served, verified by the engine first, or missed, by what "
        "its entry's verifications and feedback taught so far (tiercache.semantic.entry_trust; "
        "docs/semantic_guard.md). 0: off, the guard's choice is served",
        min=0,
        max=0.5,
    )
    semantic_explore_band: float = param(
        0.25,
        "With semantic_max_error: how far under 1 - semantic_max_error an entry's predicted "
        "chance of being right may be and its hit still go to the engine to verify (greedy "
        "requests only; the answer is then the engine's own) rather than miss",
        min=0,
        max=1,
    )
    semantic_serve_quantile: float = param(
        0.0,
        "With semantic_max_error: serve a hit unverified only where the posterior is that sure "
        "of 1 - semantic_max_error (its quantile: 0.1 is 90 % sure; 0: on the predictive "
        "P(right)); the others within semantic_explore_band go to the engine to verify. 0.1 "
        "held both rates on dev and served almost nothing unverified on held-out QQP "
        "(docs/semantic_guard.md)",
        min=0,
        max=0.49,
    )
    semantic_audit_rate: float = param(
        0.05,
        "With semantic_max_error: the share of the semantic hits the gate would serve that go "
        "to the engine to verify anyway (greedy requests), so that what it learned keeps being "
        "checked (a served hit teaches nothing)",
        min=0,
        max=1,
    )
    draft_neighbours: int = param(
        2,
        "On a lookup that does not hit: how many of the nearest neighbours' answers (those the "
        "guard refused included) llm hands the engine as drafts for speculative decoding "
        "(0: none)",
        min=0,
        max=4,
    )
    draft_min_similarity: float = param(
        0.5, "Cosine similarity below which a neighbour's answer is not a draft", min=-1, max=1
    )
    flat_max_rows: int = param(
        10_000, "Rows per scope searched exactly; above it an HNSW graph (hnswlib)", min=1
    )
    vector_l1_max_bytes: int = param(
        16 << 20, "Byte budget of this process's cache of prompt vectors", min=0
    )
    vector_l1_min_bytes: int = param(
        1 << 20,
        "Floor of the prompt vectors' budget (memory_headroom_bytes, cache_memory_bytes)",
        min=1,
    )
    vector_l2_max_bytes: int = param(
        1 << 30,
        "Byte budget of the host's cache of prompt vectors (LMDB map size)",
        min=1 << 20,
        max=MAX_MAP_BYTES,
    )
    semantic_graph_max_bytes: int = param(
        0,
        "Byte budget of this process's HNSW graphs of large scopes (those past flat_max_rows): "
        "0 holds every graph; above 0 the graphs of the scopes searched longest ago are dropped "
        "to fit (searched flat meanwhile, loaded again when the budget allows), and the "
        "budget follows the machine (memory_headroom_bytes, cache_memory_bytes) down to "
        "semantic_graph_min_bytes",
        min=0,
    )
    semantic_graph_min_bytes: int = param(
        0, "Floor of the graphs' budget when it follows the machine", min=0
    )

    def semantic_path(self) -> Path:
        return self.state_path() / "semantic"

    def vectors_path(self) -> Path:
        return self.state_path() / "vectors"


@dataclass(frozen=True, slots=True)
class EmbedderConfig(_StateConfig):
    """`embedder`: one encode call per batch of requests; it takes only texts sealed by this
    server's stages (its state folder's secret)."""

    embedder: str = shared("embedder")
    device: str = shared("device")
    torch_threads: str = torch_threads_param(embedder=True)
    packed_linears: bool = param(
        True,
        "On the CPU, run the embedder's float32 linear layers through oneDNN's prepacked linear "
        "instead of MKL's sgemm (one short text 1.5x faster here, vectors equal to about 1e-7; "
        "docs/engine.md)",
    )
    # The dev package's embedder_rss diagnostic: one trim after 3,000 batches gave 217 MiB back.
    memory_trim_interval_s: float = shared("memory_trim_interval_s")


@dataclass(frozen=True, slots=True)
class LlmConfig(_TiersConfig):
    """`llm` (decoupled): hits stream at once; misses are coalesced, generated by the engine
    over BLS, streamed and written back."""

    confidence_floor: float = shared("confidence_floor")
    unsure_ttl_s: float = param(
        86400.0,
        "How long an unsure answer (confidence under confidence_floor) is kept at most, in "
        "seconds (0: as long as any other)",
        min=0,
    )
    embedder: str = shared("embedder")
    semantic_max_bytes: int = shared("semantic_max_bytes")
    semantic_max_scopes: int = shared("semantic_max_scopes")
    semantic_max_scopes_per_tenant: int = shared("semantic_max_scopes_per_tenant")
    api_keys_file: str = shared("api_keys_file")
    envelope_max_age_s: float = shared("envelope_max_age_s")
    engine_model: str = shared("engine_model")
    engine_kind: str = shared("engine_kind")
    engine_timeout_s: float = shared("engine_timeout_s")
    lora_model: str = shared("lora_model")
    lora_timeout_s: float = shared("lora_timeout_s")
    verify_semantic: bool = param(
        False,
        "Serve a semantic hit only once the engine verified it, in one forward pass over prompt "
        "plus answer (its first 256 tokens; drafted steps past them), as exactly its own "
        "output (status verified); otherwise decode on from the "
        "agreed prefix (a miss). Off: a semantic hit is served as the guard accepted it; a "
        "request asks for it with the cache_control word verify-semantic",
    )
    max_concurrency: int = param(
        64, "Worker threads: generations plus misses waiting for an identical one", min=1
    )
    engine_streams: int = param(
        2,
        "Engine calls (BLS streams) open at once; more wait in llm, not in the engine's "
        "queue. engine_kind torch_llm only (TensorRT-LLM batches in flight). 0: "
        "max_concurrency",
        min=0,
    )
    lease_ttl_s: float = param(
        10.0,
        "With redis_url: a dead replica's generation lease expires after this (renewed "
        "while alive, every third of it: under a second it would call Redis without pause)",
        min=1,
    )
    lease_wait_s: float = param(
        60.0,
        "With redis_url: the longest wait for another replica's answer before generating here",
        min=0,
    )
    redis_semantic_max_rows: int = param(
        1_000_000,
        "With redis_url: bound of the Redis stream sharing semantic rows (0: not shared)",
        min=0,
    )
    redis_semantic_warm_s: float = param(
        10.0, "With redis_url: longest wait at start for the shared rows' catch-up", min=0
    )
    tokenizer_dir: str = param(
        "", "engine_kind tensorrt_llm: the engine's tokenizer folder (required there)"
    )
    trtllm_max_input_len: int = param(
        0, "engine_kind tensorrt_llm: the engine's --max_input_len (0: not checked here)", min=0
    )
    trtllm_max_seq_len: int = param(
        0, "engine_kind tensorrt_llm: the engine's --max_seq_len (0: not checked here)", min=0
    )
    trtllm_build_draft_len: int = param(
        0,
        "engine_kind tensorrt_llm: the engine's own --max_draft_len (TensorRT-LLM takes that "
        "many tokens off every request's room in max_seq_len, drafts or not; a request that "
        "would not fit is refused here rather than cut short there); 0: none",
        min=0,
        max=4096,
    )
    trtllm_kv_reuse_tenant: str = param(
        "",
        "engine_kind tensorrt_llm with the engine's prefix KV reuse on for the one tenant of the "
        "API key file (assemble_repository.py --kv-reuse auto): that tenant's name. Requests of "
        "any other tenant are refused: added to the key file without a restart, they would share "
        "its cached prefixes (the engine takes no per-tenant salt). Empty: no check",
    )
    trtllm_max_draft_len: int = param(
        0,
        "engine_kind tensorrt_llm: speculative decoding of greedy requests with external draft "
        "tokens (drafts from the cached answers and the context), at most this many per step; "
        "the engine must be built with --speculative_decoding_mode draft_tokens_external and "
        "--max_draft_len of at least this (deploy/tensorrt_llm); 0: off",
        min=0,
        max=32,
    )
    hit_padding_ms: float = param(
        0.0,
        "No response to an untrusted tenant leaves llm before this many ms since llm "
        "received the request, so a hit is not told from a miss by time (0: off)",
        min=0,
    )
    hit_padding_jitter_ms: float = param(
        0.0, "A uniform jitter in [0, this] added to hit_padding_ms", min=0
    )
    trusted_tenants: str = param(
        "", "Comma-separated tenant names never padded (normalized like tenant)"
    )

    def extra_problems(self) -> list[str]:
        problems = []
        if self.engine_kind == EngineKind.TENSORRT_LLM and not self.tokenizer_dir:
            problems.append("engine_kind tensorrt_llm needs tokenizer_dir (the engine's)")
        if 0 < self.trtllm_build_draft_len < self.trtllm_max_draft_len:
            problems.append(
                f"trtllm_max_draft_len {self.trtllm_max_draft_len} is more than the engine's "
                f"trtllm_build_draft_len {self.trtllm_build_draft_len}"
            )
        if 0 < self.trtllm_max_seq_len < self.trtllm_max_input_len:
            problems.append(
                f"trtllm_max_input_len {self.trtllm_max_input_len} is more than "
                f"trtllm_max_seq_len {self.trtllm_max_seq_len}"
            )
        return problems

    def semantic_path(self) -> Path:
        return self.state_path() / "semantic"


@dataclass(frozen=True, slots=True)
class LoraCacheConfig(_RedisConfig):
    """`lora_cache`: where adapters live and how many stay resident in each tier."""

    adapters_dir: str = shared("adapters_dir")
    adapters_manifest: str = shared("adapters_manifest")
    api_keys_file: str = shared("api_keys_file")
    envelope_max_age_s: float = shared("envelope_max_age_s")
    engine_model: str = param("torch_llm", "The engine it keeps warm (BLS target of load/list)")
    engine_timeout_s: float = shared("engine_timeout_s")
    engine_kind: str = param(
        EngineKind.TORCH_LLM.value,
        "torch_llm: adapters go out as PEFT files; tensorrt_llm: also as TensorRT-LLM's "
        "lora_task_id / lora_weights / lora_config",
        choices=choices(EngineKind),
    )
    trtllm_dtype: str = param(
        "float16",
        "The TensorRT-LLM engine's dtype (lora_weights' dtype)",
        choices=("float16", "bfloat16", "float32"),
    )
    engine_slots: int = param(
        4, "Adapters loaded in the engine at once (vLLM's max_loras; torch_llm's lora_slots)", min=1
    )
    engine_max_bytes: int = param(
        0, "Byte bound of engine-resident adapters (0: slots only)", min=0
    )
    host_max_adapters: int = param(32, "Adapters whose weights lora_cache keeps in memory", min=0)
    host_max_bytes: int = param(256 << 20, "Byte bound of the adapters kept in memory", min=0)
    transport_cache_bytes: int = param(
        256 << 20,
        "Byte bound of the encrypted copies of adapter files lora_cache keeps, so that an "
        "adapter sent to the engine again is not encrypted again (least recently sent out "
        "first; 0: every send encrypted anew; docs/security.md)",
        min=0,
    )
    host_min_bytes: int = param(
        16 << 20,
        "Floor of the host tier's budget (memory_headroom_bytes, cache_memory_bytes)",
        min=1,
    )
    transport_cache_min_bytes: int = param(
        16 << 20,
        "Floor of the transport cache's budget (memory_headroom_bytes, cache_memory_bytes; "
        "transport_cache_bytes its ceiling)",
        min=0,
    )
    memory_headroom_bytes: int = shared("memory_headroom_bytes")
    cache_memory_bytes: int = shared("cache_memory_bytes")
    budget_interval_s: float = shared("budget_interval_s")
    adapter_eviction: str = param(
        "lru",
        "Which adapters the engine and host tiers give up first: lru, or gdsf "
        "(GreedyDual-Size-Frequency: the more requested outlive the rest; ahead of LRU when "
        "requests pick adapters independently, behind it with chat sessions' locality; "
        "docs/lora.md)",
        choices=("lru", "gdsf"),
    )
    pin: str = param("", "Comma-separated adapter names never evicted from the engine")
    prefetch: str = param("", "Comma-separated adapter names loaded into the engine at start")
    prefetch_fleet_top: int = param(
        0, "With redis_url: at start, warm the fleet's N most-used adapters (0: off)", min=0
    )
    fleet_sync_s: float = param(
        10.0,
        "With redis_url: publish this replica's adapters and usage counts this often",
        min=1.0,
    )

    def extra_problems(self) -> list[str]:
        prefetch = name_list(self.prefetch)
        if len(prefetch) > self.engine_slots:
            return [
                f"prefetch names {len(prefetch)} adapters but engine_slots is {self.engine_slots}"
            ]
        return []

    def adapters_path(self) -> Path:
        return adapters_path(self.adapters_dir, self.state_path())


@dataclass(frozen=True, slots=True)
class EngineConfig(_StateConfig):
    """`torch_llm` (decoupled): the CPU/GPU PyTorch engine with LoRA adapters and paged prefix
    KV reuse."""

    model: str = shared("model")
    device: str = shared("device")
    torch_threads: str = torch_threads_param(embedder=False)
    envelope_max_age_s: float = shared("envelope_max_age_s")
    adapters_dir: str = shared("adapters_dir")
    adapters_manifest: str = shared("adapters_manifest")
    lora_slots: int = param(
        4,
        "Hard bound on adapters loaded at once (lora_cache decides which; keep it equal to "
        "lora_cache's engine_slots)",
        min=0,
    )
    lora_prefetch: str = param(
        "",
        "Comma-separated adapter names loaded at start (the same list as lora_cache's prefetch)",
    )
    gpu_memory_headroom_bytes: int = param(
        0,
        "With the engine on a GPU: memory kept free on its card, read through NVML; under it "
        "the KV pool and the adapter slots shrink toward their floors, with a quarter more free "
        "they grow back to their fixed sizes (0: off, fixed; CPU engines: ignored; "
        "docs/budgets.md)",
        min=0,
    )
    lora_max_bytes: int = param(
        0,
        "Byte bound of the adapters' slots in the engine (0: lora_slots alone); with "
        "memory_headroom_bytes or cache_memory_bytes, the ceiling of a budget that follows the "
        "machine (CPU engines; docs/budgets.md)",
        min=0,
    )
    lora_min_bytes: int = param(
        4 << 20,
        "Floor of the adapter slots' budget (memory_headroom_bytes, cache_memory_bytes)",
        min=1,
    )
    queue_max_adapter_bytes: int = param(
        1 << 30,
        "Adapter files (LORA_CONFIG and LORA_WEIGHTS) that requests waiting for the engine may "
        "hold in memory together; a request that carries files past it is refused at once "
        "(unavailable, try again) unless nothing with files waits, so an adapter larger than "
        "the bound still loads alone (0: no bound but the queue's 256 requests)",
        min=0,
    )
    kv_reuse: bool = param(True, "Paged prefix KV reuse across requests")
    tokens_per_block: int = param(32, "KV block size in tokens; only full blocks are reused", min=1)
    kv_pool_max_bytes: int = param(256 << 20, "Byte budget of the KV block pool", min=0)
    memory_headroom_bytes: int = shared("memory_headroom_bytes")
    cache_memory_bytes: int = shared("cache_memory_bytes")
    kv_pool_min_bytes: int = param(
        16 << 20,
        "Floor of the KV pool's budget (memory_headroom_bytes, cache_memory_bytes)",
        min=0,
    )
    budget_interval_s: float = shared("budget_interval_s")
    ttft_objective_s: float = param(
        0.0,
        "Time-to-first-token objective of this engine's requests (from leaving the queue to the "
        "first token; the 90th percentile of its last 64 in the last minute): while it is "
        "missed, the KV pool, if its shadow shows more bytes would help, grows past "
        "cache_memory_bytes a step a look, up to kv_pool_max_bytes, memory headroom allowing; "
        "met with 20 % to spare, it gives them back a step every 8 looks (0: none; "
        "docs/budgets.md)",
        min=0,
    )
    kv_eviction: str = param(
        "shadow",
        "Which KV blocks the pool gives up first: shadow (gdsf's order or lru's, whichever a "
        "sampled shadow of each would have hit more lately), gdsf (GreedyDual-Size-Frequency "
        "over a TinyLFU sketch: blocks asked for again outlive new ones) or lru "
        "(docs/kv_reuse.md)",
        choices=("shadow", "gdsf", "lru"),
    )
    speculate: bool = param(
        True,
        "Speculative decoding of greedy requests: tokens drafted from the prompt, the cached "
        "answers llm sends and the engine's recent greedy answers in the request's scope are "
        "verified in one forward pass (the output is plain decoding's; a request opts out with "
        "the cache_control word no-speculate)",
    )
    speculate_sampled: bool = param(
        False,
        "Speculate sampled requests too, each drafted position picked with the request's own "
        "seeded draw. Off by default: a verification pass's logits differ from a single-token "
        "pass's in their last bits, and a draw that close to a boundary picks the neighbouring "
        "token, so a seeded answer could depend on what was drafted (seen on an H200: "
        "docs/speculation.md)",
    )
    pass_threads: str = param(
        "0",
        "torch's intra-op threads for a forward pass over several tokens (the prefill, a "
        "verification of draft tokens); one-token steps keep torch_threads. 0: torch_threads "
        "for every pass; a count up to 256; auto: every CPU in the process's affinity mask (a CPU "
        "quota is not seen: set a count there). On 2 CPUs a one-token "
        "step is no faster on 2 threads, a pass over many tokens is (docs/speculation.md)",
        pattern=PASS_THREADS_PATTERN,
    )
    packed_linears: bool = param(
        True,
        "On the CPU, run the model's float32 linear layers (the LM head included) through "
        "oneDNN's prepacked linear instead of MKL's sgemm: here passes over several tokens "
        "1.4-2.8x faster, one-token steps 1.45x on 2 threads (not on 1); +113 MB for the LM "
        "head's copy beside the tied embedding (docs/engine.md)",
    )
    draft_index_tokens: int = param(
        16_384,
        "Tokens of recent answers the engine keeps, per tenant scope and adapter, as drafts for "
        "speculative decoding (over all scopes; about 0.5 KB of memory each; 0: none)",
        min=0,
    )
    refuse_prompt_pattern: str = param(
        "",
        "A prompt this regex matches (re.search over the canonical prompt and every turn of its "
        "history) is answered with refusal_text and finish reason content_filter, never "
        "cached; empty: refuse nothing",
    )
    refusal_text: str = param("I can't help with that request.", "The refusal's text")
    memory_trim_interval_s: float = shared("memory_trim_interval_s")

    def extra_problems(self) -> list[str]:
        problems = []
        if self.refuse_prompt_pattern and not self.refusal_text:
            problems.append("refusal_text must not be empty when refuse_prompt_pattern is set")
        prefetch = name_list(self.lora_prefetch)
        if len(prefetch) > self.lora_slots:  # one was dropped at start, or none fit (0 slots)
            problems.append(
                f"lora_prefetch names {len(prefetch)} adapters but lora_slots is {self.lora_slots}"
            )
        return problems

    def models_path(self) -> Path:
        return self.state_path() / "models"

    def adapters_path(self) -> Path:
        return adapters_path(self.adapters_dir, self.state_path())


STAGE_CONFIGS: dict[str, type] = {
    "prompt_cache": PromptCacheConfig,
    "embedding_cache": EmbeddingCacheConfig,
    "lora_cache": LoraCacheConfig,
    "llm": LlmConfig,
    "torch_llm": EngineConfig,
    "embedder": EmbedderConfig,
    "cache_admin": CacheAdminConfig,
    "feedback": FeedbackConfig,
}
"""Each Triton model of model_repository/ -> the config its stage parses."""


# ---- parsing and checking -----------------------------------------------------------------------


def check_values(config: Any) -> list[str]:
    """Every field's range and choices (from its `param` metadata), then the class's own
    cross-field checks (`extra_problems`), as messages naming the parameter."""
    problems = []
    for f in dataclasses.fields(config):
        problem = _check_field(f, getattr(config, f.name))
        if problem:
            problems.append(problem)
    extra = getattr(config, "extra_problems", None)
    if not problems and extra is not None:
        problems.extend(extra())
    total = getattr(config, "semantic_max_scopes", None)
    per_tenant = getattr(config, "semantic_max_scopes_per_tenant", None)
    if not problems and total is not None and per_tenant is not None and per_tenant > total:
        problems.append(
            f"parameter 'semantic_max_scopes_per_tenant' ({per_tenant}) must be at most "
            f"semantic_max_scopes ({total}): above it one tenant could take every scope"
        )
    return problems


def _shown(value: float) -> str:
    """A number as a range error shows it: exact (a `:g` of 1048575 read 1.04858e+06, and of an
    integer past a float's range raised instead of reporting)."""
    if isinstance(value, int):
        text = str(value)
        return text if len(text) <= 40 else f"a number of {len(text)} digits"
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def implied_max(name: str) -> float | None:
    """The bound of a field that states none, by its unit: past these a value only overflows
    (a wait past Python's TIMEOUT_MAX killed the thread that waited; bytes past 2^62 are past
    any machine and a signed 64-bit count: a headroom of 2^60, more than any machine has, is
    how a squeeze is asked for in tests)."""
    if name.endswith("_ms"):
        return MAX_SECONDS * 1000
    if name.endswith("_s"):
        return MAX_SECONDS
    if name.endswith("_bytes"):
        return 1 << 62
    return None


def _check_field(f: dataclasses.Field[Any], value: Any) -> str | None:
    meta = f.metadata
    allowed = meta.get("choices")
    if allowed is not None and value not in allowed:
        return f"parameter {f.name!r} must be one of {', '.join(allowed)}, got {value!r}"
    pattern = meta.get("pattern")
    if pattern is not None and not re.fullmatch(pattern, str(value)):
        return f"parameter {f.name!r} must match {pattern}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"parameter {f.name!r} must be a finite number, got {value!r}"
    low, high, low_open = meta.get("min"), meta.get("max"), meta.get("min_open", False)
    if high is None:
        high = implied_max(f.name)
    if low is not None and (value < low or (low_open and value == low)):
        relation = ">" if low_open else ">="
        return f"parameter {f.name!r} must be {relation} {_shown(low)}, got {_shown(value)}"
    if high is not None and value > high:
        return f"parameter {f.name!r} must be <= {_shown(high)}, got {_shown(value)}"
    return None


def raise_problems(cls: type, problems: list[str]) -> None:
    if problems:
        known = ", ".join(sorted(f.name for f in dataclasses.fields(cls)))
        raise ConfigError(f"{'; '.join(problems)} (known parameters: {known})")


def parse_config(cls: type[T], values: dict[str, str]) -> T:
    """Build `cls` from string values; unknown keys, malformed values, values out of range and
    inconsistent combinations are all reported in one ConfigError."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems = [f"unknown parameter {k!r}" for k in sorted(values) if k not in fields]
    kwargs: dict[str, Any] = {}
    for key, text in values.items():
        if key not in fields:
            continue
        try:
            kwargs[key] = _convert(hints[key], text)
        except ValueError as exc:
            problems.append(f"parameter {key!r}: {exc}")
            continue
        problem = _check_field(fields[key], kwargs[key])
        if problem:
            problems.append(problem)
            del kwargs[key]
    raise_problems(cls, problems)
    return cls(**kwargs)  # __post_init__ runs the cross-field checks


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
