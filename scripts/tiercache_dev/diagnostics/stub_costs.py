"""What pb_utils calls cost inside a real Python-backend stub: the floor under every stage's hit.

Usage::

    python -m tiercache_dev.diagnostics.stub_costs [--out-dir .perf/stub_costs]

Starts a tritonserver with one fixture model (scripts/bench_fixtures/stub_costs) whose
`initialize` times, in its own stub, the operations a stage makes on every exact hit (building an
output tensor of each kind, a response, reading a BYTES input), then prints one row per
operation: microseconds of the stub thread's CPU per call, median of 5 rounds of 2,000 calls.
Hot loops: on the hit path the same calls run with cold caches between other processes, and
cost more; what this shows is their relative cost (a BYTES tensor against a numeric one), which
the in-process stand-in (tiercache_dev.pb_utils_stub) cannot: there a tensor costs nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from tiercache_dev.console import display_path, progress
from tiercache_dev.paths import BENCH_FIXTURES, PERF_DIR
from tiercache_dev.servers import running, triton

FIXTURE = BENCH_FIXTURES / "stub_costs"
LINE = re.compile(r"STUB_COST (.+)\t([0-9.]+)")


def parse(log: str) -> list[tuple[str, float]]:
    """(operation, microseconds per call) in the order the model logged them."""
    return [(m.group(1), float(m.group(2))) for m in LINE.finditer(log)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=PERF_DIR / "stub_costs")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.out_dir / "server.log"
    with tempfile.TemporaryDirectory(prefix="tiercache-stub-costs-") as state:
        server = triton(FIXTURE, Path(state), log_path=log_path)
        progress(f"starting tritonserver (log {display_path(log_path)})")
        with running(server, ready_timeout_s=300):
            pass  # initialize has run (and logged) once the model is ready
    rows = parse(log_path.read_text(errors="replace"))
    if not rows:
        print(f"error: no STUB_COST lines in {display_path(log_path)}", file=sys.stderr)
        return 1
    print("| operation in a real stub | us per call (thread CPU, median of 5 x 2,000) |")
    print("|---|---:|")
    for label, micros in rows:
        print(f"| {label} | {micros:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
