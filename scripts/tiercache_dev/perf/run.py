"""`make perf`: perf_analyzer against the real tiercache `ensemble` with a mixed hit/miss workload.

Usage::

    python -m tiercache_dev.perf.run --out .perf [--pairs PATH] [--count 200]
        [--repeat-share 0.5] [--max-tokens 8] [--concurrency 1:4:3] [--request-count N]
        [--tenant NAME]
    # perf_analyzer's stabilizing windows over the whole range, in one run, instead:
    python -m tiercache_dev.perf.run --out .perf --request-count 0 \\
        [--measurement-mode count_windows] [--measurement-request-count 50] [--max-trials 10]

Steps: install perf_analyzer into OUT/pa (scripts/perf/install_perf_analyzer.sh, idempotent);
build OUT/perf_inputs.json with tiercache_dev.perf.make_inputs from the pairs file (default
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
  `--profile-export-file` (tiercache_dev.perf.kv_prefix reads time to first token from that
  file).
  A hit is one response anyway.
* Misses run the real CPU LLM (about 0.5-1 s each at max_tokens 8 on 2 cores; one engine
  instance, so concurrent misses queue), hence the short defaults: about 2 minutes in all.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache_dev.console import (
    display_path,
    exit_on_sigterm,
    invocation,
    machine_summary,
    progress,
    shown,
)
from tiercache_dev.metrics import counter_delta, status_counts, status_text
from tiercache_dev.paths import DEFAULT_PAIRS, DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.perf.analyzer import (
    PerfRun,
    concurrency_levels,
    failure_reason,
    install_perf_analyzer,
    run_perf_analyzer,
    write_inputs_json,
)
from tiercache_dev.servers import ServerError, running, triton

# ---- make perf ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="perf_analyzer against the tiercache ensemble (mixed hit/miss workload).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=PERF_DIR, help="output folder")
    p.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="JSONL file of prompt pairs")
    p.add_argument("--count", type=int, default=200, help="entries in the input list")
    p.add_argument(
        "--repeat-share",
        type=float,
        default=0.5,
        help="share of entries that repeat an earlier prompt",
    )
    p.add_argument("--seed", type=int, default=0, help="make_inputs seed")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of every request")
    p.add_argument("--fields", default="a,b", help="make_inputs --fields (a: no paraphrases)")
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


def build_inputs(args: argparse.Namespace, out: Path) -> tuple[list[dict], str]:
    """tiercache_dev.perf.make_inputs from the pairs file -> (its entries, its one-line
    summary)."""
    command = [
        sys.executable,
        "-m",
        "tiercache_dev.perf.make_inputs",
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
        raise SystemExit(f"error: make_inputs failed (exit {done.returncode})")
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    summary = summary.split(" out=")[0]
    return json.loads(out.read_text(encoding="utf-8"))["data"], summary


def with_tenant(entries: list[dict], tenant: str) -> list[dict]:
    if not tenant:
        return entries
    return [{**e, "tenant": {"content": [tenant], "shape": [1]}} for e in entries]


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
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path, csv_path = out / "perf_report.txt", out / "perf.csv"
    inputs_path, server_log = out / "perf_inputs.json", out / "perf_server.log"

    if args.perf_analyzer is None:
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

    server = triton(MODEL_REPOSITORY, args.state_dir.resolve(), log_path=server_log)
    ports = server.ports
    csv_path.unlink(missing_ok=True)
    progress(
        f"starting tritonserver on model_repository/ (state {display_path(args.state_dir)}, "
        f"grpc {ports.grpc}, log {display_path(server_log)})"
    )
    started = time.monotonic()
    runs: list[LevelRun] = []
    try:
        with running(server, ready_timeout_s=300):
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
        "tiercache perf report (python -m tiercache_dev.perf.run)",
        f"command:   {invocation('tiercache_dev.perf.run', argv)}",
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
