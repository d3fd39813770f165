"""The committed Grafana dashboard's queries, and the metric names they read (used by
tests/unit/test_dashboard.py and tests/integration/test_metrics_triton.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tiercache-dashboard.json"
# Our families and Triton's own; label names and values never start with these prefixes.
_METRIC = re.compile(r"\b(?:tiercache|nv)_[A-Za-z0-9_]*[A-Za-z0-9]")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every query of every panel."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def metric_names(expr: str) -> set[str]:
    """The sample names an expression reads, as a scrape spells them (a histogram's
    `x_bucket`; `nv_inference_count` is a counter of its own, not a histogram's `_count`)."""
    return set(_METRIC.findall(expr))


def scraped_families(text: str) -> tuple[set[str], dict[str, str]]:
    """A Prometheus text scrape's sample names and `# TYPE` of each family."""
    samples: set[str] = set()
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind.strip()
        elif line and not line.startswith("#"):
            samples.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return samples, types


def missing_from_scrape(names: set[str], text: str) -> list[str]:
    """Names the scrape lacks: a sample name that is not exported, or a histogram suffix on a
    family that is not a histogram."""
    samples, types = scraped_families(text)
    missing = []
    for name in sorted(names):
        if name not in samples:
            missing.append(name)
            continue
        for suffix in HISTOGRAM_SUFFIXES:
            base = name[: -len(suffix)]
            if name.endswith(suffix) and name not in types and types.get(base) != "histogram":
                missing.append(f"{name} (not a histogram's {suffix})")
    return missing
