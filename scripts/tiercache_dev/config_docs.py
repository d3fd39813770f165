"""Render docs/configuration.md from the stage config dataclasses, so the page cannot drift.

`tiercache.config.STAGE_CONFIGS` maps each Triton model name to its frozen config dataclass, and
every field of those is declared with `tiercache.config.param`, which keeps the description,
allowed values and range in the field's metadata ("doc", "choices", "min", "max"). This module
turns them into one table per stage. A field without a "doc" is an error naming the field, not a
blank cell.

    python -m tiercache_dev.config_docs --write   # regenerate docs/configuration.md
    python -m tiercache_dev.config_docs --check   # exit 1 when the committed page differs
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiercache.config import implied_max
from tiercache_dev.paths import REPO_ROOT

DOC_PATH = REPO_ROOT / "docs" / "configuration.md"
COMMAND = "python -m tiercache_dev.config_docs --write"

_INTRO = """\
# Stage configuration

<!-- Generated from tiercache.config by `{command}`; do not edit by hand. -->

Every model of `model_repository/` takes its settings as Triton stage parameters in its
`model_repository/<stage>/config.pbtxt`, each one a string:

```
parameters {{ key: "l1_max_bytes" value: {{ string_value: "33554432" }} }}
```

All parameters are optional; the defaults below are the config classes' defaults, and a
committed `config.pbtxt` may set other values. `initialize` parses the parameters into the
stage's frozen config dataclass (named under each stage) and fails the model load when anything
is wrong: an unknown key is refused, and every problem (unknown keys, malformed values, values
out of range or not among the allowed ones) is reported at once, in one message.

This page is generated from `tiercache.config` (each field's `param(default, "doc", choices=...,
min=..., max=...)`), so it cannot drift from the code. After changing a stage's config, run
`{command}`;
`tests/unit/test_config_docs.py` fails while this page is out of date.

Stages: {stages}.
"""

_BYTE_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


class ConfigDocError(ValueError):
    """The config module does not follow the convention this page is generated from."""


def _stage_configs() -> Mapping[str, type]:
    from tiercache import config

    stages = getattr(config, "STAGE_CONFIGS", None)
    if not isinstance(stages, Mapping):
        raise ConfigDocError(
            "tiercache.config has no STAGE_CONFIGS dict (Triton model name -> config class)"
        )
    return stages


def render(stages: Mapping[str, type] | None = None) -> str:
    """The whole of docs/configuration.md, one section per stage of `stages` (by default
    `tiercache.config.STAGE_CONFIGS`), in that mapping's order. Raises ConfigDocError naming
    the class and field when a field has no "doc" in its metadata."""
    if stages is None:
        stages = _stage_configs()
    links = ", ".join(f"[`{name}`](#{name})" for name in stages)
    parts = [_INTRO.format(command=COMMAND, stages=links)]
    for name, cls in stages.items():
        parts.append(_render_stage(name, cls))
    return "\n".join(parts)


def _render_stage(stage: str, cls: type) -> str:
    if not dataclasses.is_dataclass(cls):
        raise ConfigDocError(f"stage {stage!r}: {cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    lines = [
        f"## {stage}",
        "",
        f"`model_repository/{stage}/config.pbtxt`, parsed into `{cls.__qualname__}`.",
        "",
        "| parameter | type | default | allowed | description |",
        "|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        meta = field.metadata
        doc = meta.get("doc")
        if not isinstance(doc, str) or not doc.strip():
            raise ConfigDocError(
                f"{cls.__qualname__}.{field.name} (stage {stage!r}) has no 'doc' in its field "
                f'metadata: declare it as `{field.name}: ... = param(default, "what it does")`'
            )
        kind = hints.get(field.name, field.type)
        cells = (
            f"`{field.name}`",
            _type_name(kind),
            _default(field),
            _allowed(meta, kind, unit=field.name.endswith("_bytes"), name=field.name),
            _cell(doc),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _type_name(kind: Any) -> str:
    if isinstance(kind, str):
        return f"`{kind}`"
    if isinstance(kind, type):
        return f"`{kind.__name__}`"
    return f"`{str(kind).replace('typing.', '')}`"


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    text = f"`{_value(value)}`"
    unit = _number(value, field.name.endswith("_bytes"))
    return text + unit[len(_value(value)) :]


def _value(value: Any) -> str:
    """A value as it would be written in config.pbtxt's string_value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    if isinstance(value, str):
        return value if value else '""'
    return str(value)


def _allowed(meta: Mapping[str, Any], kind: Any, unit: bool, name: str = "") -> str:
    choices: Sequence[Any] | None = meta.get("choices")
    if choices:
        return ", ".join(f"`{_value(c)}`" for c in choices)
    if meta.get("pattern"):
        return f"matching `{meta['pattern']}`"
    low, high = meta.get("min"), meta.get("max")
    if high is None and kind in (int, float):
        high = implied_max(name)  # the bound a unit implies (`tiercache.config`)
        if high is not None and kind is int:
            high = int(high)
    opening = "(" if meta.get("min_open") else "["
    if low is not None and high is not None:
        return f"{opening}{_number(low, unit)}, {_number(high, unit)}]"
    if low is not None:
        return f"{'>' if meta.get('min_open') else '>='} {_number(low, unit)}"
    if high is not None:
        return f"<= {_number(high, unit)}"
    if kind is bool:
        return "`true`, `false` (or 1, yes, on; 0, no, off; any case)"
    return ""


def _number(value: Any, unit: bool) -> str:
    """A bound or default, with its binary unit for a byte count (`1048576 (1 MiB)`)."""
    text = _value(value)
    if unit and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        for name, size in _BYTE_UNITS:
            if value >= size and value % size == 0:
                return f"{text} ({value // size} {name})"
    return text


def _cell(text: str) -> str:
    """One table cell: one line, `|` escaped, and `<` escaped outside code spans (a bare
    `<state_dir>` would be read as an HTML tag and vanish)."""
    spans = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(s if i % 2 else s.replace("<", "&lt;") for i, s in enumerate(spans))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tiercache_dev.config_docs",
        description="Generate docs/configuration.md from tiercache.config's stage configs.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when the page differs")
    mode.add_argument("--write", action="store_true", help="regenerate the page")
    parser.add_argument("--path", type=Path, default=DOC_PATH, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shown = _shown(args.path)
    try:
        text = render()
    except ConfigDocError as exc:
        print(f"config_docs: {exc}", file=sys.stderr)
        return 1
    if args.write:
        args.path.write_text(text, encoding="utf-8")
        print(f"wrote {shown}")
        return 0
    current = args.path.read_text(encoding="utf-8") if args.path.exists() else None
    if current != text:
        state = "is missing" if current is None else "differs from tiercache.config"
        print(f"{shown} {state}; regenerate it with: {COMMAND}", file=sys.stderr)
        return 1
    print(f"{shown} is up to date")
    return 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
