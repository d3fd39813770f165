"""What the long runs print: timestamped progress lines, command lines with short paths, and the
machine line of a report header."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

_T0 = time.monotonic()


def progress(message: str) -> None:
    """One line on stdout, prefixed with the seconds since the run started, flushed."""
    print(f"[{time.monotonic() - _T0:6.1f}s] {message}", flush=True)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the servers' context managers stop them."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def display_path(path: Path) -> str:
    """`path` relative to the current directory when it lies below it (symlinks kept as they
    are: the venv's python stays .venv/bin/python)."""
    full, cwd = os.path.abspath(path), os.getcwd()
    if full.startswith(cwd + os.sep):
        return os.path.relpath(full, cwd)
    return str(path)


def shown(command: Sequence[str]) -> str:
    """A command line with paths below the current directory made relative."""
    return shlex.join(display_path(Path(a)) if a.startswith("/") else a for a in command)


def invocation(module: str, argv: Sequence[str] | None = None) -> str:
    """How to run this again: `<python> -m <module> <args>` (the arguments of this process when
    `argv` is None), for the command line a report states."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shown([sys.executable, "-m", module, *args])


def write_report(out_dir: Path, stem: str, markdown: str, summary: object) -> Path:
    """A benchmark's report: OUT_DIR/<stem>.md and its machine-readable summary <stem>.json
    (OUT_DIR made when missing); the Markdown is printed too. Returns the Markdown's path."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.md"
    path.write_text(markdown)
    path.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print(markdown)
    progress(f"wrote {display_path(path)}")
    return path


def machine_summary() -> dict[str, str]:
    """CPU count, CPU model and load average, for a report header."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return {"nproc": str(os.cpu_count()), "cpu": cpu, "loadavg": load}
