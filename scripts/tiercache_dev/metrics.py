"""A server's Prometheus samples, read from its metrics port, and the tiercache counters the perf
runs report."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

Sample = tuple[str, dict[str, str], float]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def scrape_metrics(port: int, wait_s: float = 10.0) -> list[Sample]:
    """The server's Prometheus samples: (name, labels, value). A refused connection is retried
    for up to `wait_s`: Triton reports ready a moment before its metrics port listens."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                text = response.read().decode("utf-8", "replace")
            break
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        try:
            samples.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return samples


def metric_total(samples: list[Sample], metric: str) -> float:
    """The sum of one metric's samples over all its label sets."""
    return sum(value for name, _, value in samples if name == metric)


def counts_by_label(samples: list[Sample], metric: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == metric and label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def status_counts(port: int, settle_s: float = 1.2, max_wait_s: float = 8.0) -> dict[str, float]:
    """tiercache's counters: requests by cache status (prompt_cache), plus the llm stage's
    `generations` and `coalesced` (misses that joined an identical in-flight generation).

    The stages flush their metrics from a thread every second (tiercache.triton.metrics's
    DEFAULT_FLUSH_S), so this scrapes until two scrapes `settle_s` apart, longer than that,
    agree (at most `max_wait_s`; 0.3 s apart, two scrapes between flushes agreed while the last
    updates were still unsent). {} when the metrics port does not answer."""

    def scrape() -> dict[str, float]:
        samples = scrape_metrics(port)
        counts = counts_by_label(samples, "tiercache_prompt_cache_requests_total", "status")
        for key, metric in (
            ("generations", "tiercache_llm_generations_total"),
            ("coalesced", "tiercache_llm_coalesced_total"),
        ):
            counts[key] = metric_total(samples, metric)
        return counts

    deadline = time.monotonic() + max_wait_s
    try:
        counts = scrape()
        while time.monotonic() < deadline:
            time.sleep(settle_s)
            again = scrape()
            if again == counts:
                break
            counts = again
        return counts
    except OSError:
        return {}


def status_text(delta: dict[str, int]) -> str:
    """ "exact 90, miss 110 (generations 100, coalesced 10)"."""
    if not delta:
        return "unknown (metrics unavailable)"
    delta = dict(delta)
    extra = {k: delta.pop(k) for k in ("generations", "coalesced") if k in delta}
    text = ", ".join(f"{k} {v}" for k, v in delta.items() if v) or "no requests"
    if any(extra.values()):
        text += " (" + ", ".join(f"{k} {v}" for k, v in extra.items()) + ")"
    return text


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """after - before per counter (whole numbers); {} when neither was read."""
    if not before and not after:
        return {}
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in sorted(set(before) | set(after))}
