"""Where the CPU goes on the hit path, per process, thread, library and function, in tiercache
and in the floor side by side: `make bench` (`tiercache_dev.bench.prompt_cache`) run under a
system-wide sampling profile (Linux `perf record -a -g`).

    .venv/bin/python -m tiercache_dev.diagnostics.cpu_profile --out-dir .perf/cpu-profile \\
        -- --only tiercache --only floor --distinct 2048 --rounds 2 --concurrency 1

Everything after `--` goes to the benchmark (one concurrency level: a request's share of the
samples is counted over the windows in which each configuration was measured, at that level's
median throughput). The benchmark keeps every configuration's server up and measures them in
turn, and records when each measurement ran (`measured_windows` in its JSON, on the clock
`perf record -k CLOCK_MONOTONIC` stamps samples with): a sample is charged to the configuration
measured at that moment (the warm-up pass and the rest of the run are left out), and to its
process: the tritonserver, or the stage whose model.py its Python backend stub runs (the
benchmark's JSON names each configuration's processes, `processes`). The tables give CPU
microseconds
per request, by stage, by thread (a stub's serving thread as `main`; the threads tiercache names
for the kernel, `tiercache.threads`, by their names; the others ranked by samples), by shared
object and by function (C functions only: interpreted
Python shows as the interpreter's own functions, `_PyEval_EvalFrameDefault` first;
`tiercache_dev.bench.hit_path --opcodes` counts the Python side). `perf` must be installed and
allowed to profile the whole system (root, or kernel.perf_event_paranoid <= 0; to read an
earlier run's profile again, `--analyse-only`, installed is enough); without it the command
says so and stops.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tiercache_dev.console import display_path, progress
from tiercache_dev.paths import REPO_ROOT

Interval = tuple[float, float, str]  # (start s, end s, configuration), on the samples' clock


@dataclass(slots=True)
class Sample:
    pid: int
    tid: int
    time_s: float
    frames: list[tuple[str, str]] = field(default_factory=list)  # (function, object), leaf first
    comm: str = ""  # the thread's kernel name ("" from a script without it)


_HEAD = re.compile(r"^\s*(?:(?P<comm>\S.*?)\s+)?(?P<pid>\d+)/(?P<tid>\d+)\s+(?P<time>[\d.]+):\s*$")


def parse_perf_script(lines: Iterable[str]) -> Iterator[Sample]:
    """The samples of `perf script -F comm,pid,tid,time,ip,sym,dso` output (call chains
    included; a script without `comm` reads too, each sample's comm "")."""
    sample: Sample | None = None
    for line in lines:
        if not line.strip():
            if sample is not None:
                yield sample
                sample = None
            continue
        if not line.startswith("\t"):  # a sample's line (pids are padded with spaces)
            head = _HEAD.match(line.rstrip("\n"))
            sample = None  # a line of another format: skipped with its frames
            if head is not None:
                sample = Sample(
                    int(head["pid"]),
                    int(head["tid"]),
                    float(head["time"]),
                    comm=head["comm"] or "",
                )
            continue
        if sample is None:
            continue
        match = re.match(r"\s*[0-9a-f]+ (.*) \((.*)\)$", line.rstrip("\n"))
        if match:
            sample.frames.append((match.group(1), os.path.basename(match.group(2))))
    if sample is not None:
        yield sample


def names_of(summary: dict) -> dict[int, str]:
    """pid -> '<configuration>:<process>' ('tritonserver' or the stage; a model's second
    instance under its stage's name) from the benchmark's JSON (`processes`)."""
    return {
        int(pid): f"{config}:{label.split('#')[0]}"
        for config, labels in summary.get("processes", {}).items()
        for pid, label in labels.items()
    }


def intervals_of(summary: dict, level: str) -> list[Interval]:
    """The benchmark's measured windows at concurrency `level` (`measured_windows`)."""
    return [
        (w["start_s"], w["end_s"], w["config"])
        for w in summary.get("measured_windows", [])
        if str(w["level"]) == level
    ]


@dataclass(slots=True)
class Profile:
    """CPU microseconds per request, by configuration and by key."""

    per_request: dict[str, dict[str, float]]
    seconds: dict[str, float]  # each configuration's windows, in all


def charge(
    samples: Sequence[Sample],
    names: dict[int, str],
    intervals: Sequence[Interval],
    rates: dict[str, float],
    frequency: float,
    key: str,
    stage: str | None = None,
) -> Profile:
    """Per configuration, CPU us per request by `key`: 'process' (stage or tritonserver),
    'thread', 'object' (the leaf frame's shared object) or 'function' (the leaf's function and
    object); `stage` keeps one stage's samples only. A request's share is the configuration's
    samples over its windows' seconds times its throughput (`rates`, requests per second)."""
    intervals = sorted(intervals)
    starts = [start for start, _, _ in intervals]
    # a thread named for the kernel (tiercache.threads) is counted by its name; one that kept
    # its process's name (the main thread's) is ranked with the other unnamed ones
    main_comm = {s.pid: s.comm for s in samples if s.tid == s.pid and s.comm}
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for sample in samples:
        at = bisect.bisect_right(starts, sample.time_s) - 1
        config = None
        if at >= 0 and sample.time_s < intervals[at][1]:  # [start, end)
            config = intervals[at][2]
        name = names.get(sample.pid)
        if config is None or name is None or not name.startswith(config + ":"):
            continue
        process = name.split(":", 1)[1]
        if stage is not None and process != stage:
            continue
        leaf = sample.frames[0] if sample.frames else ("?", "?")
        if key == "process":
            counts[config][process] += 1
        elif key == "thread":  # ranked below: thread ids differ between configurations
            if sample.tid == sample.pid:
                thread = "main"
            elif sample.comm and sample.comm != main_comm.get(sample.pid):
                thread = f"={sample.comm}"
            else:
                thread = str(sample.tid)
            counts[config][f"{process}\0{thread}"] += 1
        elif key == "object":
            counts[config][leaf[1]] += 1
        else:
            counts[config][f"{leaf[0][:60]} ({leaf[1][:28]})"] += 1
    if key == "thread":
        counts = {config: ranked_threads(counter) for config, counter in counts.items()}
    seconds: dict[str, float] = collections.defaultdict(float)
    for start, end, config in intervals:
        seconds[config] += end - start
    per_request = {}
    for config, counter in counts.items():
        requests = seconds[config] * rates[config]
        per_request[config] = {k: n / frequency / requests * 1e6 for k, n in counter.items()}
    return Profile(per_request, dict(seconds))


def ranked_threads(counter: collections.Counter[str]) -> collections.Counter[str]:
    """'process\0tid' counts renamed 'process main' (the thread a stub serves requests on),
    'process NAME' for a thread named for the kernel ('process\0=NAME', threads of one name
    together) and 'process thread N' for the others, N by samples, most first, so
    configurations line up."""
    out: collections.Counter[str] = collections.Counter()
    ranks: collections.Counter[str] = collections.Counter()
    for name, count in counter.most_common():
        process, _, tid = name.partition("\0")
        if tid == "main":
            out[f"{process} main"] += count
            continue
        if tid.startswith("="):
            out[f"{process} {tid[1:]}"] += count
            continue
        ranks[process] += 1
        out[f"{process} thread {ranks[process]}"] += count
    return out


def table(profile: Profile, first: str, second: str, rows: int) -> list[str]:
    """Markdown rows: each key's us per request in both configurations and the difference,
    the largest difference first."""
    a, b = profile.per_request.get(first, {}), profile.per_request.get(second, {})
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0.0) - b.get(k, 0.0)))
    out = [f"| | {first} us/request | {second} us/request | difference |", "|---|---:|---:|---:|"]
    for k in keys[:rows]:
        out.append(f"| {k} | {a.get(k, 0.0):.1f} | {b.get(k, 0.0):.1f} | "
                   f"{a.get(k, 0.0) - b.get(k, 0.0):+.1f} |")  # fmt: skip
    out.append(
        f"| all | {sum(a.values()):.1f} | {sum(b.values()):.1f} | "
        f"{sum(a.values()) - sum(b.values()):+.1f} |"
    )
    return out


def check_perf(record: bool = True) -> str:
    """The perf binary; SystemExit when it is missing or (to `record`) not allowed to profile
    the whole system."""
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("error: `perf` (linux-tools / linux-perf) is not installed")
    if not record:
        return perf
    paranoid = Path("/proc/sys/kernel/perf_event_paranoid")
    level = int(paranoid.read_text()) if paranoid.exists() else 2
    if os.geteuid() != 0 and level > 0:
        raise SystemExit(
            f"error: profiling the whole system needs root or kernel.perf_event_paranoid <= 0 "
            f"(it is {level})"
        )
    return perf


def record(perf: str, bench: list[str], data: Path, frequency: int, out: Path) -> None:
    """Run `bench` under `perf record -a -g` into `data`."""
    progress(f"profiling `{' '.join(bench[1:])}` ({frequency} Hz, every CPU)")
    with open(out / "perf-record.log", "w") as log:
        recorder = subprocess.Popen(
            [
                perf,
                "record",
                "-a",
                "-g",
                "-k",
                "CLOCK_MONOTONIC",
                "-F",
                str(frequency),
                "-o",
                str(data),
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            code = subprocess.call(bench, cwd=REPO_ROOT)
        finally:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=120)
    if code != 0:
        raise SystemExit(f"error: the benchmark exited {code} (its output is above)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, bench_args = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / ".perf" / "cpu-profile")
    parser.add_argument("--frequency", type=int, default=499, help="samples per second per CPU")
    parser.add_argument("--rows", type=int, default=12, help="rows per table")
    parser.add_argument(
        "--stages",
        default="prompt_cache,embedding_cache,lora_cache,llm,tritonserver",
        help="the processes given a table by object and by function",
    )
    parser.add_argument(
        "--analyse-only",
        action="store_true",
        help="read the profile --out-dir holds from an earlier run again (no benchmark)",
    )
    args = parser.parse_args(argv)
    perf = check_perf(record=not args.analyse_only)
    levels = [a for i, a in enumerate(bench_args) if i and bench_args[i - 1] == "--concurrency"]
    if not levels or not re.fullmatch(r"\d+", levels[-1]):
        raise SystemExit("error: give the benchmark one level: `-- ... --concurrency N`")
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    data = out / "perf.data"
    bench = [sys.executable, "-m", "tiercache_dev.bench.prompt_cache", *bench_args,
             "--out-dir", str(out / "bench")]  # fmt: skip
    report_path = out / "bench" / "bench_prompt_cache.json"
    if not args.analyse_only:
        record(perf, bench, data, args.frequency, out)
    elif not data.exists() or not report_path.exists():
        raise SystemExit(f"error: {display_path(out)} holds no profile of an earlier run")
    summary = json.loads(report_path.read_text())
    names = names_of(summary)
    level = levels[-1]
    rates = {
        config: by_level[level]["infer_per_s"]
        for config, by_level in summary["levels"].items()
        if level in by_level
    }
    progress("reading the profile (perf script)")
    started = time.monotonic()
    script = subprocess.Popen(
        [perf, "script", "-i", str(data), "-F", "comm,pid,tid,time,ip,sym,dso"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        errors="replace",
    )
    assert script.stdout is not None
    samples = [s for s in parse_perf_script(script.stdout) if s.pid in names]
    script.wait()
    progress(
        f"  {len(samples)} samples of the run's processes in {time.monotonic() - started:.0f} s"
    )
    intervals = [iv for iv in intervals_of(summary, level) if iv[2] in rates]
    configs = sorted({c for _, _, c in intervals}, key=lambda c: c != "tiercache")
    if len(configs) < 2:
        raise SystemExit(
            f"error: the profile shows {configs or 'no'} configuration measured at "
            f"concurrency {level} (the benchmark's report says which it measured)"
        )
    first, second = configs[0], configs[1]
    report = [
        f"# CPU per request on the hit path: {first} against {second}",
        "",
        f"`{' '.join(['.venv/bin/python -m tiercache_dev.diagnostics.cpu_profile', *argv, '--', *bench_args])}`",  # noqa: E501
        "",
        f"perf record -a -g at {args.frequency} Hz; measured windows: "
        + ", ".join(f"{c} {s:.0f} s" for c, s in charge(
            samples, names, intervals, rates, args.frequency, "process").seconds.items())
        + "; throughput: " + ", ".join(f"{c} {rates[c]:.0f} infer/s" for c in configs),
        "",
        "## By process",
        "",
        *table(charge(samples, names, intervals, rates, args.frequency, "process"),
               first, second, args.rows),
        "",
        "## By thread",
        "",
        *table(charge(samples, names, intervals, rates, args.frequency, "thread"),
               first, second, args.rows),
    ]  # fmt: skip
    for stage in args.stages.split(","):
        for key in ("object", "function"):
            profile = charge(samples, names, intervals, rates, args.frequency, key, stage)
            report += ["", f"## {stage}, by {key}", "", *table(profile, first, second, args.rows)]
    path = out / "cpu_profile.md"
    path.write_text("\n".join(report) + "\n")
    print("\n".join(report))
    progress(f"wrote {display_path(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
