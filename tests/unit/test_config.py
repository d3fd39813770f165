"""Typed stage configuration (tiercache.config.parse_config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiercache.config import (
    STAGE_CONFIGS,
    STATE_DIR_ENV,
    CacheAdminConfig,
    CacheConfig,
    EngineConfig,
    LlmConfig,
    LoraCacheConfig,
    PromptCacheConfig,
    parse_config,
)
from tiercache.errors import ConfigError
from tiercache.exact.request import Limits


@dataclass(frozen=True)
class Sample:
    flag: bool = False
    count: int = 1
    ratio: float = 0.5
    name: str = "x"


@pytest.mark.parametrize("cls", [CacheConfig, *STAGE_CONFIGS.values(), Sample])
def test_defaults(cls: type) -> None:
    assert parse_config(cls, {}) == cls()


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"count": "42"}, Sample(count=42)),
        ({"count": "1_000_000"}, Sample(count=1_000_000)),
        ({"count": " -3 "}, Sample(count=-3)),
        ({"ratio": "2.5"}, Sample(ratio=2.5)),
        ({"ratio": "1e-3"}, Sample(ratio=0.001)),
        ({"name": "  padded  "}, Sample(name="padded")),
        ({"name": ""}, Sample(name="")),
        *[({"flag": w}, Sample(flag=True)) for w in ("1", "true", "TRUE", "yes", "On")],
        *[({"flag": w}, Sample(flag=False)) for w in ("0", "false", "No", "off")],
    ],
)
def test_typed_conversion(values: dict[str, str], expected: Sample) -> None:
    assert parse_config(Sample, values) == expected


def test_real_config_conversion() -> None:
    config = parse_config(
        PromptCacheConfig,
        {"l1_max_bytes": "64_000", "ttl_s": "1.5", "state_dir": "state", "max_tokens": "256"},
    )
    assert (config.l1_max_bytes, config.ttl_s, config.max_tokens) == (64_000, 1.5, 256)
    assert config.cache().l2_path() == Path("state") / "l2"
    assert config.cache().secret_path() == Path("state") / "secret"
    assert config.cache().l1_max_bytes == 64_000
    assert config.limits() == Limits(max_tokens=256)


def test_unknown_key_lists_known_parameters() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(Sample, {"colour": "red"})
    message = info.value.message
    assert "unknown parameter 'colour'" in message
    assert "known parameters: count, flag, name, ratio" in message


@pytest.mark.parametrize(
    ("key", "text"),
    [("count", "many"), ("count", "1.5"), ("ratio", "half"), ("flag", "maybe")],
)
def test_bad_value_names_the_key(key: str, text: str) -> None:
    with pytest.raises(ConfigError, match=f"parameter '{key}'"):
        parse_config(Sample, {key: text})


def test_all_problems_in_one_message() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(Sample, {"count": "x", "ratio": "y", "bogus": "1"})
    message = info.value.message
    assert all(p in message for p in ("'count'", "'ratio'", "'bogus'"))
    assert info.value.client_message().startswith("config: ")


def test_not_a_dataclass() -> None:
    with pytest.raises(TypeError):
        parse_config(dict, {})


def test_state_dir_default_from_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    assert CacheConfig().state_path() == tmp_path
    assert EngineConfig().models_path() == tmp_path / "models"
    assert CacheConfig(state_dir="elsewhere").state_path() == Path("elsewhere")
    monkeypatch.delenv(STATE_DIR_ENV)
    assert CacheConfig().state_path() == Path.home() / ".cache" / "tiercache"


# ---- each stage's own parameters, checked all at once ------------------------------------------


@pytest.mark.parametrize("model", sorted(STAGE_CONFIGS))
def test_every_stage_parameter_is_documented(model: str) -> None:
    for f in dataclasses.fields(STAGE_CONFIGS[model]):
        assert f.metadata.get("doc"), f"{model}.{f.name} has no description"


@pytest.mark.parametrize(
    ("cls", "foreign"),
    [
        (LoraCacheConfig, "l2_max_bytes"),  # lora_cache opens no exact-cache tier
        (LoraCacheConfig, "model"),
        (LlmConfig, "l1_max_bytes"),  # llm writes through L2/L3 only
        (LlmConfig, "adapters_dir"),
        (CacheAdminConfig, "embedder"),  # it computes no semantic scope
        (CacheAdminConfig, "l1_max_bytes"),
        (EngineConfig, "redis_url"),
    ],
)
def test_a_stage_refuses_keys_it_does_not_read(cls: type, foreign: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown parameter '{foreign}'"):
        parse_config(cls, {foreign: "1"})


def test_every_problem_in_one_message() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            LlmConfig,
            {
                "engine_kind": "vllm",  # not a choice
                "max_concurrency": "0",  # below its minimum
                "hit_padding_ms": "-5",  # below its minimum
                "lease_ttl_s": "0",  # must be >= 1
                "redis_timeout_s": "inf",  # not finite
                "engine_streams": "two",  # not an integer
                "l1_max_bytes": "1",  # not llm's
            },
        )
    message = info.value.message
    for fragment in (
        "parameter 'engine_kind' must be one of torch_llm, tensorrt_llm, got 'vllm'",
        "parameter 'max_concurrency' must be >= 1, got 0",
        "parameter 'hit_padding_ms' must be >= 0, got -5",
        "parameter 'lease_ttl_s' must be >= 1, got 0",
        "parameter 'redis_timeout_s' must be a finite number",
        "parameter 'engine_streams':",
        "unknown parameter 'l1_max_bytes'",
    ):
        assert fragment in message


@pytest.mark.parametrize(
    ("cls", "values", "fragment"),
    [
        (LlmConfig, {"engine_kind": "tensorrt_llm"}, "needs tokenizer_dir"),
        (LoraCacheConfig, {"prefetch": "a,b,c", "engine_slots": "2"}, "engine_slots is 2"),
        (EngineConfig, {"refuse_prompt_pattern": "x", "refusal_text": ""}, "refusal_text"),
        (EngineConfig, {"device": "gpu"}, "parameter 'device' must match"),
        (EngineConfig, {"lora_prefetch": "a,b,c", "lora_slots": "2"}, "lora_slots is 2"),
        (
            LlmConfig,
            {"trtllm_build_draft_len": "4", "trtllm_max_draft_len": "8"},
            "more than the engine's trtllm_build_draft_len 4",
        ),
        (
            LlmConfig,
            {"trtllm_max_input_len": "4096", "trtllm_max_seq_len": "2048"},
            "trtllm_max_input_len 4096 is more than trtllm_max_seq_len 2048",
        ),
    ],
)
def test_cross_field_and_pattern_checks(cls: type, values: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_config(cls, values)


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="hit_padding_ms"):
        LlmConfig(hit_padding_ms=-1)
    assert EngineConfig(device="cuda:1").device == "cuda:1"


@pytest.mark.parametrize(
    ("cls", "values", "fragment"),
    [
        (LlmConfig, {"semantic_max_scopes": "100"}, "semantic_max_scopes_per_tenant' \\(256\\)"),
        (LlmConfig, {"semantic_max_scopes": "100000"}, "semantic_max_scopes"),
        (EngineConfig, {"torch_threads": "100000"}, "torch_threads"),
        (LlmConfig, {"redis_retry_s": "0.000001"}, "redis_retry_s"),
        (LoraCacheConfig, {"fleet_sync_s": "0.000001"}, "fleet_sync_s"),
    ],
)
def test_values_that_disable_a_protection_are_refused(
    cls: type, values: dict[str, str], fragment: str
) -> None:
    """A per-tenant scope cap above the host's lets one tenant take every scope; 100,000 scopes
    exhaust vm.max_map_count; 100,000 torch threads; a Redis retry or fleet sync every
    microsecond is a busy loop."""
    with pytest.raises(ConfigError, match=fragment):
        parse_config(cls, values)
    ok = {"semantic_max_scopes": "100", "semantic_max_scopes_per_tenant": "100"}
    assert parse_config(LlmConfig, ok).semantic_max_scopes_per_tenant == 100


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        # exact numbers in range errors: a `:g` read 1048575 as 1.04858e+06 on both sides
        ({"l2_max_bytes": "1048575"}, "must be >= 1048576, got 1048575"),
        ({"max_concurrency": "-" + "9" * 400}, "got a number of 401 digits"),  # it raised
        ({"lease_wait_s": "10.000001e9"}, "must be <= 1000000000, got 10000001000"),
        ({"redis_timeout_s": "1000000000.5"}, "must be <= 1000000000, got 1000000000.5"),
        # a wait past Python's TIMEOUT_MAX killed the thread that waited: a bound by unit
        ({"hit_padding_ms": "1e13"}, "'hit_padding_ms' must be <= 1000000000000"),
        ({"redis_timeout_s": "1e10"}, "'redis_timeout_s' must be <= 1000000000"),
        # an LMDB map past the address space failed at open without naming the parameter
        ({"l2_max_bytes": str(1 << 48)}, "'l2_max_bytes' must be <= 17592186044416"),
        ({"lease_ttl_s": "0.001"}, "'lease_ttl_s' must be >= 1"),
    ],
)
def test_range_errors_name_exact_bounds_and_units_bound_what_states_none(
    values: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(LlmConfig, values)
    assert fragment in info.value.message
