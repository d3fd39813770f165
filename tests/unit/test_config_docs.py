"""docs/configuration.md is generated from tiercache.config and must match it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tiercache_dev import config_docs

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = f"regenerate it: .venv/bin/{config_docs.COMMAND}"


def test_configuration_page_matches_the_stage_configs() -> None:
    page = ROOT / "docs" / "configuration.md"
    assert page.exists(), f"docs/configuration.md is missing; {REGENERATE}"
    assert page.read_text(encoding="utf-8") == config_docs.render(), (
        f"docs/configuration.md differs from tiercache.config; {REGENERATE}"
    )


def test_every_stage_has_a_section() -> None:
    from tiercache.config import STAGE_CONFIGS

    text = config_docs.render()
    for stage in STAGE_CONFIGS:
        assert f"\n## {stage}\n" in text


def _param(default: object, doc: str | None, **extra: object) -> Any:
    meta = {"choices": None, "min": None, "max": None, **extra}
    if doc is not None:
        meta["doc"] = doc
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class _Documented:
    size_bytes: int = _param(64 << 20, "the | budget")
    mode: str = _param("auto", "how", choices=("auto", "cpu"))
    ratio: float = _param(0.5, "a share", min=0, max=1)
    share: float = _param(1.0, "a <part> of `<all>`", min=0, min_open=True)
    floor_bytes: int = _param(2 << 20, "a floor", min=1 << 20)
    on: bool = _param(True, "a switch")


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    fine: int = _param(1, "documented")
    bare: int = _param(2, None)


def test_a_row_carries_type_default_allowed_values_and_doc() -> None:
    text = config_docs.render({"demo": _Documented})
    # a byte count states no bound: its unit implies one (tiercache.config.implied_max)
    assert (
        "| `size_bytes` | `int` | `67108864` (64 MiB) | <= 4611686018427387904 (4194304 TiB) | "
        "the \\| budget |" in text
    )
    assert "| `mode` | `str` | `auto` | `auto`, `cpu` | how |" in text
    assert "| `ratio` | `float` | `0.5` | [0, 1] | a share |" in text
    assert "| `share` | `float` | `1` | > 0 | a &lt;part> of `<all>` |" in text
    assert (
        "| `floor_bytes` | `int` | `2097152` (2 MiB) | [1048576 (1 MiB), 4611686018427387904 "
        "(4194304 TiB)] | a floor |" in text
    )
    booleans = "`true`, `false` (or 1, yes, on; 0, no, off; any case)"
    assert f"| `on` | `bool` | `true` | {booleans} | a switch |" in text


def test_a_field_without_doc_is_named() -> None:
    with pytest.raises(config_docs.ConfigDocError, match=r"_Undocumented\.bare .*'demo'"):
        config_docs.render({"demo": _Undocumented})


def test_check_fails_on_a_stale_page_and_passes_after_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(config_docs, "_stage_configs", lambda: {"demo": _Documented})
    page = tmp_path / "configuration.md"
    page.write_text("stale\n", encoding="utf-8")
    assert config_docs.main(["--check", "--path", str(page)]) == 1
    assert "--write" in capsys.readouterr().err
    assert config_docs.main(["--write", "--path", str(page)]) == 0
    assert config_docs.main(["--check", "--path", str(page)]) == 0
