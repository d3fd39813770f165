"""What pb_utils calls cost inside a real Python-backend stub: the floor under every stage's hit.

Usage::

    python -m tiercache_dev.diagnostics.stub_costs [--out-dir .perf/stub_costs]

Starts a tritonserver on a temporary copy of one fixture model (scripts/bench_fixtures/
stub_costs) whose `initialize` times, in its own stub, the `pb_utils` calls a stage makes to
answer a hit (building output tensors of each kind and a response), then prints one row per
call: microseconds of the stub thread's CPU per call, the median of the rounds the model states.
Hot loops: on the hit path the same calls run with cold caches between other processes, and
cost more; what this shows is their relative cost (a BYTES tensor against a numeric one), which
the in-process stand-in (tiercache_dev.pb_utils_stub) cannot: there a tensor costs nothing.
Exit code 1 when the model did not load (the rows it logged before are still printed).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from tiercache.server import copy_repository
from tiercache_dev.console import display_path, exit_on_sigterm, progress
from tiercache_dev.paths import BENCH_FIXTURES, PERF_DIR
from tiercache_dev.servers import ServerError, running, triton

FIXTURE = BENCH_FIXTURES / "stub_costs"
LINE = re.compile(r"STUB_COST (.+)\t([0-9.]+)")
RUNS = re.compile(r"STUB_COST_RUNS ([0-9]+) ([0-9]+)")


def parse(log: str) -> list[tuple[str, float]]:
    """(operation, microseconds per call) in the order the model logged them."""
    return [(m.group(1), float(m.group(2))) for m in LINE.finditer(log)]


def table(log: str) -> str:
    """The Markdown table of what the model logged (empty when it logged no row)."""
    rows = parse(log)
    if not rows:
        return ""
    runs = RUNS.search(log)
    how = f"median of {runs.group(1)} x {int(runs.group(2)):,} calls" if runs else "median"
    lines = [f"| `pb_utils` call in a real stub | us per call (thread CPU, {how}) |", "|---|---:|"]
    lines += [f"| {label} | {micros:.2f} |" for label, micros in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=PERF_DIR / "stub_costs")
    args = p.parse_args(argv)
    exit_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.out_dir / "server.log"
    failure = None
    with tempfile.TemporaryDirectory(prefix="tiercache-stub-costs-") as tmp:
        repository = copy_repository(FIXTURE, Path(tmp) / "repository")
        server = triton(repository, Path(tmp) / "state", log_path=log_path)
        progress(f"starting tritonserver (log {display_path(log_path)})")
        try:
            with running(server, ready_timeout_s=300):
                progress("ready: the model's initialize has timed every call")
        except ServerError as exc:
            failure = exc  # the rows logged before it failed are still printed
    text = table(log_path.read_text(errors="replace"))
    if text:
        print(text)
    if failure is not None or not text:
        print(
            f"error: {failure or 'no STUB_COST lines'}; see {display_path(log_path)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
