"""perf_analyzer for the measurements here: install it (scripts/perf/install_perf_analyzer.sh),
run it against a server (killed when the server dies or a timeout passes), and read its text
report into per-level figures."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache_dev.paths import INSTALL_PERF_ANALYZER


def install_perf_analyzer(dest: Path) -> Path:
    """Run install_perf_analyzer.sh (idempotent); returns the wrapper it prints last."""
    env = dict(os.environ)
    env.setdefault("PIP", f"{sys.executable} -m pip")
    env.setdefault("PYTHON", sys.executable)
    done = subprocess.run(
        ["bash", str(INSTALL_PERF_ANALYZER), str(dest)],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"error: install_perf_analyzer.sh failed (exit {done.returncode})")
    wrapper = Path(lines[-1])
    if not os.access(wrapper, os.X_OK):
        raise SystemExit(f"error: install_perf_analyzer.sh printed {wrapper}: not runnable")
    return wrapper


@dataclass(slots=True)
class LevelStats:
    """One concurrency level of a perf_analyzer run, as its text report gives it."""

    concurrency: int
    throughput: float = 0.0  # infer/s
    p50_us: float = 0.0
    p99_us: float = 0.0
    avg_us: float = 0.0
    request_count: int = 0
    server: dict[str, float] = field(default_factory=dict)
    composing: dict[str, dict[str, float]] = field(default_factory=dict)


_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_BREAKDOWN = re.compile(r"([a-z][a-z /]*?)\s+" + _NUMBER + r" usec")


def perf_analyzer_version(perf_analyzer: Path) -> str:
    """The first line perf_analyzer's --version prints (for reports)."""
    done = subprocess.run([str(perf_analyzer), "--version"], capture_output=True, text=True)
    first = (done.stdout or done.stderr).strip().splitlines()
    return first[0] if first else "perf_analyzer"


def _latency_parts(text: str, prefix: str, into: dict[str, float]) -> None:
    """ "Avg request latency: 460 usec (overhead 1 usec + queue 26 usec + ...)" -> into[...]."""
    head = re.match(r"\s*" + _NUMBER + r" usec", text)
    if head:
        into[f"{prefix}_us"] = float(head.group(1))
    inner = text[text.find("(") + 1 : text.rfind(")")] if "(" in text else ""
    for name, value in _BREAKDOWN.findall(inner):
        key = name.strip().replace(" ", "_").replace("/", "_")
        into[f"{prefix}.{key}_us"] = float(value)


def parse_perf_output(text: str) -> dict[int, LevelStats]:
    """Concurrency -> stats from perf_analyzer's stdout (Client, Server and Composing models)."""
    levels: dict[int, LevelStats] = {}
    level: LevelStats | None = None
    section = ""
    model = ""
    for raw in text.splitlines():
        line = raw.strip()
        m = re.match(r"Request concurrency: (\d+)$", line)
        if m:
            level = levels.setdefault(int(m.group(1)), LevelStats(int(m.group(1))))
            section, model = "", ""
            continue
        if level is None or not line:
            continue
        if line.startswith("Inferences/Second vs."):
            level = None
            continue
        if line in ("Client:", "Server:", "Composing models:"):
            section, model = line[:-1].lower(), ""
            continue
        m = re.match(r"(\S+), version: \S+$", line)
        if m and section == "composing models":
            model = m.group(1)
            level.composing[model] = {}
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if section == "client":
            number = re.match(_NUMBER, value)
            if key == "Throughput" and number:
                level.throughput = float(number.group(1))
            elif key == "Request count" and number:
                level.request_count = int(float(number.group(1)))
            elif key == "p50 latency" and number:
                level.p50_us = float(number.group(1))
            elif key == "p99 latency" and number:
                level.p99_us = float(number.group(1))
            elif key == "Avg latency" and number:
                level.avg_us = float(number.group(1))
            continue
        target = level.server if section == "server" else level.composing.get(model)
        if target is None:
            continue
        name = key.lower().replace(" ", "_")
        if "latency" in name:
            _latency_parts(value, name, target)
        else:
            number = re.match(_NUMBER, value)
            if number:
                target[name] = float(number.group(1))
    return {c: s for c, s in levels.items() if s.request_count > 0}


@dataclass(slots=True)
class PerfRun:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    levels: dict[int, LevelStats]
    wall_s: float


def run_perf_analyzer(
    perf_analyzer: Path,
    args: Sequence[str],
    log_path: Path | None = None,
    timeout_s: float = 900,
    server: Any = None,
) -> PerfRun:
    """Run perf_analyzer with `args`; its output also goes to `log_path`. perf_analyzer waits
    forever on a stream whose server died, so it is killed when `server` (a TritonServer) exits
    or `timeout_s` passes."""
    command = [str(perf_analyzer), *args]
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    problem = ""
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if server is not None and server.process is not None:
                    code = server.process.poll()
                    if code is not None:
                        problem = f"tritonserver exited (code {code}) during the run"
                if not problem and time.monotonic() - started > timeout_s:
                    problem = f"perf_analyzer timed out after {timeout_s:.0f} s"
                if problem:
                    proc.kill()
                    stdout, stderr = proc.communicate()
                    stderr = (stderr or "") + problem + "\n"
                    break
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    returncode = proc.returncode if not problem else 124
    wall_s = time.monotonic() - started
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(
            f"$ {shlex.join(command)}\n# exit {returncode}, {wall_s:.1f} s\n\n{stdout}"
            + (f"\n--- stderr ---\n{stderr}" if stderr.strip() else "")
        )
    return PerfRun(command, returncode, stdout, stderr, parse_perf_output(stdout), wall_s)


def failure_reason(run: PerfRun) -> str:
    lines = [ln.strip() for ln in (run.stdout + "\n" + run.stderr).splitlines() if ln.strip()]
    interesting = [ln for ln in lines if re.search(r"fail|error|unable|abort", ln, re.I)]
    return (interesting or lines or ["no output"])[-1]


def concurrency_levels(spec: str) -> list[int]:
    """ "1:4:3" -> [1, 4] (perf_analyzer's start:end:step, end inclusive)."""
    parts = [int(p) for p in spec.split(":")]
    if not 1 <= len(parts) <= 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"bad concurrency range {spec!r} (start[:end[:step]])")
    start = parts[0]
    end = parts[1] if len(parts) > 1 else start
    step = parts[2] if len(parts) > 2 else 1
    return list(range(start, end + 1, step))


def write_inputs_json(path: Path, entries: list[dict]) -> None:
    """make_inputs.py's layout: valid JSON, one entry per line."""
    path.write_text(
        '{"data": [\n' + ",\n".join(json.dumps(e, ensure_ascii=False) for e in entries) + "\n]}\n",
        encoding="utf-8",
    )
