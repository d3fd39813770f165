"""Typed stage configuration (tiercache.config.parse_config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tiercache.config import (
    STATE_DIR_ENV,
    CacheConfig,
    EngineConfig,
    LlmConfig,
    PromptCacheConfig,
    parse_config,
)
from tiercache.errors import ConfigError
from tiercache.request import Limits


@dataclass(frozen=True)
class Sample:
    flag: bool = False
    count: int = 1
    ratio: float = 0.5
    name: str = "x"


@pytest.mark.parametrize("cls", [CacheConfig, PromptCacheConfig, LlmConfig, EngineConfig, Sample])
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
    assert config.l2_path() == Path("state") / "l2"
    assert config.secret_path() == Path("state") / "secret"
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
