#!/usr/bin/env python3
"""`make perf`: perf_analyzer against the real tiercache `ensemble` with a mixed hit/miss workload.

Usage::

    python scripts/perf/run_perf.py --out .perf [--pairs PATH] [--count 200] [--repeat-share 0.5]
        [--max-tokens 8] [--concurrency 1:4:3] [--request-count N] [--tenant NAME]
    # perf_analyzer's stabilizing windows over the whole range, in one run, instead:
    python scripts/perf/run_perf.py --out .perf --request-count 0 \\
        [--measurement-mode count_windows] [--measurement-request-count 50] [--max-trials 10]

Steps: install perf_analyzer into OUT/pa (scripts/perf/install_perf_analyzer.sh, idempotent);
build OUT/perf_inputs.json with scripts/perf/make_inputs.py from the pairs file (default
`<repo>/../shared/eval/semantic_pairs_dev.jsonl`); start tritonserver on model_repository/ on free
ports (state dir `<repo>/.tiercache`, shared with `make serve`, so the converted weights are
reused); run perf_analyzer over gRPC with `--streaming` (the ensemble is decoupled) and
`--input-data`; write OUT/perf_report.txt (settings, a summary, perf_analyzer's full output,
cache-status counts from the server's metrics) and OUT/perf.csv (`perf_analyzer -f`, all levels).

How it measures, and what the figures mean:

* Default: one perf_analyzer run per concurrency level with `--request-count` requests (default
  `--count`: exactly one pass over the input list), measured as one window. perf_analyzer refuses
  `--request-count` over several levels in one run, and a mix of ~1 ms hits and ~1 s misses
  seldom passes its stability check (it then aborts after `--max-trials` windows, with no
  result), so `--request-count 0`, the windowed mode, is opt-in.
* perf_analyzer cycles through the input list round-robin, in order. The list holds `--count`
  entries of which about `--repeat-share` repeat an earlier prompt; once a run has sent more than
  `--count` requests, every later request repeats one already answered (an exact hit). The
  cache-status counts in the report say how many requests really hit.
* Each run uses a cache scope of its own (the `tenant` input: `perf-<unix time>`, plus `-c<N>`
  per level), so every level starts cold although the state dir, and with it L2, persists across
  runs. `--tenant ""` sends no tenant: the default scope, warm from earlier runs and `make serve`.
* Latency is the whole answer: perf_analyzer 2.60 prints that it uses the first response of a
  decoupled model, but its latency matched the last one when checked against its own
  `--profile-export-file` (scripts/perf_kv_prefix.py reads time to first token from that file).
  A hit is one response anyway.
* Misses run the real CPU LLM (about 0.5-1 s each at max_tokens 8 on 2 cores; one engine
  instance, so concurrent misses queue), hence the short defaults: about 2 minutes in all.

This module also holds the perf_analyzer helpers that scripts/bench_prompt_cache.py imports.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PERF_DIR = Path(__file__).resolve().parent
REPO_ROOT = PERF_DIR.parent.parent
INSTALL_SCRIPT = PERF_DIR / "install_perf_analyzer.sh"
MAKE_INPUTS = PERF_DIR / "make_inputs.py"
DEFAULT_PAIRS = REPO_ROOT.parent / "shared" / "eval" / "semantic_pairs_dev.jsonl"
DEFAULT_STATE_DIR = REPO_ROOT / ".tiercache"
MODEL_REPOSITORY = REPO_ROOT / "model_repository"

_T0 = time.monotonic()


def progress(message: str) -> None:
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


# ---- perf_analyzer ------------------------------------------------------------------------------


def install_perf_analyzer(dest: Path) -> Path:
    """Run install_perf_analyzer.sh (idempotent); returns the wrapper it prints last."""
    env = dict(os.environ)
    env.setdefault("PIP", f"{sys.executable} -m pip")
    env.setdefault("PYTHON", sys.executable)
    done = subprocess.run(
        ["bash", str(INSTALL_SCRIPT), str(dest)],
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


@contextlib.contextmanager
def running(server: Any) -> Iterator[Any]:
    """`with server`, then SIGKILL whatever is left of its process group: when tritonserver
    dies abruptly its Python-backend stubs outlive it (and ignore SIGTERM)."""
    try:
        with server:
            yield server
    finally:
        if server.process is not None:
            try:
                os.killpg(server.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


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


# ---- server metrics -----------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def scrape_metrics(port: int, wait_s: float = 10.0) -> list[tuple[str, dict[str, str], float]]:
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


def counts_by_label(
    samples: list[tuple[str, dict[str, str], float]], metric: str, label: str
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == metric and label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def status_counts(port: int, settle_s: float = 0.3, max_wait_s: float = 5.0) -> dict[str, float]:
    """tiercache's counters: requests by cache status (prompt_cache), plus the llm stage's
    `generations` and `coalesced` (misses that joined an identical in-flight generation).

    The stages flush their metrics from a thread every 0.25 s, so this scrapes until two scrapes
    `settle_s` apart agree (at most `max_wait_s`). {} when the metrics port does not answer."""

    def scrape() -> dict[str, float]:
        samples = scrape_metrics(port)
        counts = counts_by_label(samples, "tiercache_prompt_cache_requests_total", "status")
        for key, metric in (
            ("generations", "tiercache_llm_generations_total"),
            ("coalesced", "tiercache_llm_coalesced_total"),
        ):
            counts[key] = sum(v for name, _, v in samples if name == metric)
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
    if not before and not after:
        return {}
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in sorted(set(before) | set(after))}


def machine_summary() -> dict[str, str]:
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


# ---- make perf ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="perf_analyzer against the tiercache ensemble (mixed hit/miss workload).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / ".perf", help="output folder")
    p.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="JSONL file of prompt pairs")
    p.add_argument("--count", type=int, default=200, help="entries in the input list")
    p.add_argument(
        "--repeat-share",
        type=float,
        default=0.5,
        help="share of entries that repeat an earlier prompt",
    )
    p.add_argument("--seed", type=int, default=0, help="make_inputs.py seed")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of every request")
    p.add_argument("--fields", default="a,b", help="make_inputs.py --fields (a: no paraphrases)")
    p.add_argument("--concurrency", default="1:4:3", help="perf_analyzer --concurrency-range")
    p.add_argument(
        "--request-count",
        type=int,
        default=None,
        help="requests per concurrency level, measured as one window without a "
        "stability check, one perf_analyzer run per level, each level in a cold "
        "cache scope of its own (default: --count, one pass over the list); "
        "0: one perf_analyzer run over the whole range with stabilizing windows "
        "(--measurement-mode)",
    )
    p.add_argument(
        "--measurement-mode",
        choices=["count_windows", "time_windows"],
        default="count_windows",
        help="windows used when --request-count is 0",
    )
    p.add_argument(
        "--measurement-request-count",
        type=int,
        default=50,
        help="minimum requests per window (count_windows)",
    )
    p.add_argument(
        "--measurement-ms", type=int, default=5000, help="window length in ms (time_windows)"
    )
    p.add_argument(
        "--stability-percentage",
        type=float,
        default=10.0,
        help="perf_analyzer -s (windows only). A mix of ~1 ms hits and ~1 s misses "
        "rarely holds 10%%: perf_analyzer then gives up after --max-trials",
    )
    p.add_argument("--max-trials", type=int, default=10, help="perf_analyzer -r (windows only)")
    p.add_argument(
        "--tenant",
        default=None,
        help="cache scope (default perf-<unix time>, so the run starts cold; with "
        "--request-count each level adds -c<N>); '' sends no tenant: the "
        "default scope, warm from earlier runs and `make serve`",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="tiercache state dir (L2, secret, converted weights)",
    )
    p.add_argument("--timeout-s", type=float, default=1800, help="limit per perf_analyzer run")
    p.add_argument(
        "--perf-analyzer",
        type=Path,
        default=None,
        help="use this perf_analyzer instead of installing one into OUT/pa",
    )
    args = p.parse_args(argv)
    try:
        args.levels = concurrency_levels(args.concurrency)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(str(exc))
    if not args.pairs.is_file():
        p.error(
            f"pairs file {args.pairs} not found (the default is "
            "../shared/eval/semantic_pairs_dev.jsonl beside the repository); pass --pairs PATH"
        )
    if args.request_count is None:
        args.request_count = args.count
    if args.request_count < 0:
        p.error("--request-count must be >= 0")
    if args.tenant is None:
        args.tenant = f"perf-{int(time.time())}"
    return args


def write_inputs_json(path: Path, entries: list[dict]) -> None:
    """make_inputs.py's layout: valid JSON, one entry per line."""
    path.write_text(
        '{"data": [\n' + ",\n".join(json.dumps(e, ensure_ascii=False) for e in entries) + "\n]}\n",
        encoding="utf-8",
    )


def build_inputs(args: argparse.Namespace, out: Path) -> tuple[list[dict], str]:
    """make_inputs.py from the pairs file -> (its entries, its one-line summary)."""
    command = [
        sys.executable,
        str(MAKE_INPUTS),
        "--pairs",
        str(args.pairs),
        "--out",
        str(out),
        "--count",
        str(args.count),
        "--repeat-share",
        str(args.repeat_share),
        "--seed",
        str(args.seed),
        "--max-tokens",
        str(args.max_tokens),
        "--fields",
        args.fields,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"error: make_inputs.py failed (exit {done.returncode})")
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    summary = summary.split(" out=")[0]
    return json.loads(out.read_text(encoding="utf-8"))["data"], summary


def with_tenant(entries: list[dict], tenant: str) -> list[dict]:
    if not tenant:
        return entries
    return [{**e, "tenant": {"content": [tenant], "shape": [1]}} for e in entries]


def shown(command: Sequence[str]) -> str:
    """A command line with paths below the current directory made relative."""
    return shlex.join(display_path(Path(a)) if a.startswith("/") else a for a in command)


@dataclass(slots=True)
class LevelRun:
    label: str  # "concurrency 1" or "concurrency 1:4:3"
    tenant: str
    run: PerfRun
    csv_path: Path
    statuses: dict[str, int]


def merge_csv(parts: list[Path], dest: Path) -> None:
    header, rows = "", []
    for part in parts:
        if not part.is_file():
            continue
        lines = part.read_text().splitlines()
        if lines:
            header = header or lines[0]
            rows += lines[1:]
    if header:
        dest.write_text("\n".join([header, *rows]) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    # Imported here so that --help works without the package installed.
    from tiercache.server import Ports, ServerError, TritonServer

    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path, csv_path = out / "perf_report.txt", out / "perf.csv"
    inputs_path, server_log = out / "perf_inputs.json", out / "perf_server.log"

    progress("installing perf_analyzer")
    perf_analyzer = args.perf_analyzer or install_perf_analyzer(out / "pa")
    progress(f"perf_analyzer: {display_path(perf_analyzer)}")

    entries, inputs_summary = build_inputs(args, inputs_path)
    progress(f"inputs: {display_path(inputs_path)} ({inputs_summary})")

    # One perf_analyzer run per level (--request-count cannot span several levels), each in a
    # cache scope of its own; or one windowed run over the whole range.
    plans: list[tuple[str, str, str, list[str]]] = []  # (file suffix, label, tenant, args)
    if args.request_count > 0:
        for c in args.levels:
            tenant = f"{args.tenant}-c{c}" if args.tenant else ""
            plans.append(
                (
                    f"c{c}",
                    f"concurrency {c}",
                    tenant,
                    ["--concurrency-range", str(c), "--request-count", str(args.request_count)],
                )
            )
    else:
        windows = [
            "--measurement-mode",
            args.measurement_mode,
            "--stability-percentage",
            f"{args.stability_percentage:g}",
            "--max-trials",
            str(args.max_trials),
        ]
        if args.measurement_mode == "count_windows":
            windows += ["--measurement-request-count", str(args.measurement_request_count)]
        else:
            windows += ["--measurement-interval", str(args.measurement_ms)]
        plans.append(
            (
                "range",
                f"concurrency {args.concurrency}",
                args.tenant,
                ["--concurrency-range", args.concurrency, *windows],
            )
        )

    ports = Ports.free()
    server_log.write_bytes(b"")
    csv_path.unlink(missing_ok=True)
    progress(
        f"starting tritonserver on model_repository/ (state {display_path(args.state_dir)}, "
        f"grpc {ports.grpc}, log {display_path(server_log)})"
    )
    started = time.monotonic()
    runs: list[LevelRun] = []
    try:
        with running(
            TritonServer(
                model_repository=MODEL_REPOSITORY,
                state_dir=args.state_dir.resolve(),
                ports=ports,
                log_path=server_log,
            )
        ) as server:
            progress(f"server ready in {time.monotonic() - started:.1f} s")
            for suffix, label, tenant, level_args in plans:
                data_path = out / f"perf_inputs_{suffix}.json"
                write_inputs_json(data_path, with_tenant(entries, tenant))
                part_csv = out / f"perf_{suffix}.csv"
                pa_args = [
                    "-m",
                    "ensemble",
                    "-i",
                    "grpc",
                    "-u",
                    f"127.0.0.1:{ports.grpc}",
                    "--streaming",
                    "--input-data",
                    str(data_path),
                    *level_args,
                    "-f",
                    str(part_csv),
                ]
                before = status_counts(ports.metrics)
                progress(f"{label}: perf_analyzer {shown(pa_args)}")
                run = run_perf_analyzer(
                    perf_analyzer, pa_args, timeout_s=args.timeout_s, server=server
                )
                after = status_counts(ports.metrics)
                runs.append(LevelRun(label, tenant, run, part_csv, counter_delta(before, after)))
                progress(f"{label}: done in {run.wall_s:.1f} s (exit {run.returncode})")
                if server.process is not None and server.process.poll() is not None:
                    progress(f"tritonserver exited (code {server.process.returncode})")
                    break
    except ServerError as exc:
        raise SystemExit(f"error: {exc}; see {server_log}") from None
    merge_csv([r.csv_path for r in runs], csv_path)

    machine = machine_summary()
    mode = (
        f"--request-count {args.request_count} per level, one perf_analyzer run per level, "
        "each level in its own cache scope (cold)"
        if args.request_count > 0
        else f"{args.measurement_mode} windows, one perf_analyzer run"
    )
    lines = [
        "tiercache perf report (scripts/perf/run_perf.py)",
        f"command:   {shown([sys.executable, *sys.argv])}",
        f"date:      {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        f"machine:   {machine['nproc']} CPUs, {machine['cpu']}, load average {machine['loadavg']}",
        f"inputs:    {args.pairs.name} -> {inputs_summary}, max_tokens {args.max_tokens}",
        f"mode:      {mode}",
        "",
        "Notes:",
        "- perf_analyzer cycles through the input list round-robin: requests past the first "
        f"{args.count} of a run repeat earlier ones, which are then exact hits.",
        "- Latency is the whole answer: on this decoupled ensemble perf_analyzer's figure matches "
        "the last response (checked against its --profile-export-file), although it says it "
        "uses the first.",
        "- 'cache status' counts come from the server's metrics: prompt_cache's requests by "
        "status; generations = engine runs; coalesced = misses that joined an identical "
        "generation already in flight (a repeat sent before the first answer was stored).",
        "",
        "Summary:",
    ]
    for r in runs:
        for c, level in sorted(r.run.levels.items()):
            lines.append(
                f"  concurrency {c}: {level.throughput:.2f} infer/s, p50 "
                f"{level.p50_us / 1000:.2f} ms, p99 {level.p99_us / 1000:.2f} ms, avg "
                f"{level.avg_us / 1000:.2f} ms ({level.request_count} requests)"
            )
        lines.append(
            f"  {r.label}: cache status {status_text(r.statuses)}; "
            f"exit {r.run.returncode}"
            + ("" if r.run.returncode == 0 else f" ({failure_reason(r.run)})")
        )
    summary_lines = lines[lines.index("Summary:") + 1 :]
    for r in runs:
        lines += [
            "",
            "=" * 20 + f" {r.label} (tenant {r.tenant or '(none)'}) " + "=" * 20,
            f"$ perf_analyzer {shown(r.run.command[1:])}",
            f"# exit {r.run.returncode} after {r.run.wall_s:.1f} s; "
            f"cache status {status_text(r.statuses)}",
            r.run.stdout.rstrip(),
        ]
        if r.run.stderr.strip():
            lines += ["--- stderr ---", r.run.stderr.rstrip()]
    if csv_path.is_file():
        lines += ["", "=" * 20 + f" {csv_path.name} " + "=" * 20, csv_path.read_text().rstrip()]
    report_path.write_text("\n".join(lines) + "\n")

    print("\n".join(summary_lines))
    print(
        f"report: {display_path(report_path)}"
        + (f"  csv: {display_path(csv_path)}" if csv_path.is_file() else "")
    )
    failed = [r for r in runs if r.run.returncode != 0]
    for r in failed:
        print(
            f"perf_analyzer failed for {r.label} (exit {r.run.returncode}): "
            f"{failure_reason(r.run)}",
            file=sys.stderr,
        )
    return 1 if failed or len(runs) < len(plans) else 0


if __name__ == "__main__":
    sys.exit(main())
