"""An exact hit through the OpenAI gateway, against the same hit over the ensemble's gRPC stream
and against Triton's own response cache, side by side in one run (issue 16).

Usage::

    python -m tiercache_dev.bench.gateway [--rounds 3] [--concurrency 1:8:7]
        [--measurement-ms 3000] [--out-dir .perf] [--state-dir .tiercache]

One tiercache server (model_repository/) with two `tiercache gateway`s in front of it (uvicorn
on threads of this process; one with its edge layer, one without), and one server with
Triton's response cache on an echo model (scripts/bench_fixtures/response_cache/), all up for
the whole run. The prompt is cached first, so every request is an exact hit. perf_analyzer
measures all four, one concurrency level at a time, back to back
(tiercache_dev.rounds.level_pairs):

- gateway, edge: `--service-kind openai --endpoint v1/chat/completions --async`
  (perf_analyzer's OpenAI client, the standard OpenAI-endpoint load tool here), one chat
  request; the edge layer answers it from the host's tiers, the plain gateway through Triton;
- ensemble: gRPC `--streaming`, the same request as the ensemble's inputs;
- response cache: gRPC `--async`, unary.

Writes OUT_DIR/bench_gateway.md and .json; raw output under OUT_DIR/bench_gateway/. Targets
(issue 16): a gateway hit's p50 below the ensemble hit's, and within 2x of the response
cache's (the edge layer is what is meant to meet them).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache_dev.bench.prompt_cache import (
    PROMPT,
    READY_S,
    RESPONSE_CACHE_BYTES,
    build_response_cache_repository,
    write_input_data,
)
from tiercache_dev.console import exit_on_sigterm, invocation, progress, write_report
from tiercache_dev.paths import DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.perf.analyzer import (
    LevelStats,
    concurrency_levels,
    failure_reason,
    install_perf_analyzer,
    perf_analyzer_version,
    run_perf_analyzer,
)
from tiercache_dev.rounds import Spread, level_pairs, paired_ratio
from tiercache_dev.servers import TritonServer, running_all, triton
from tiercache_dev.stats import median

GATEWAY, EDGE, ENSEMBLE, RESPONSE_CACHE = "gateway", "edge", "ensemble", "response-cache"
LABELS = {
    GATEWAY: "gateway hit through Triton (OpenAI chat)",
    EDGE: "gateway edge hit (OpenAI chat)",
    ENSEMBLE: "ensemble hit (gRPC stream)",
    RESPONSE_CACHE: "Triton response cache",
}
MODEL_ID = "tiercache"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out-dir", type=Path, default=PERF_DIR, help="output folder")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="tiercache state")
    p.add_argument("--measurement-ms", type=int, default=3000, help="perf_analyzer window")
    p.add_argument("--concurrency", default="1:8:7", help="perf_analyzer --concurrency-range")
    p.add_argument("--stability-percentage", type=float, default=20.0, help="perf_analyzer -s")
    p.add_argument("--max-trials", type=int, default=6, help="perf_analyzer -r")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (even: see rounds.py)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--perf-analyzer", type=Path, default=None, help="skip the install; use this")
    p.add_argument(
        "--only",
        action="append",
        choices=list(LABELS),
        help="measure only these configurations (repeatable; default: all four)",
    )
    args = p.parse_args(argv)
    try:
        args.levels = concurrency_levels(args.concurrency)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(str(exc))
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


@dataclass(frozen=True, slots=True)
class Target:
    """One configuration: how perf_analyzer reaches it."""

    name: str
    pa_args: list[str]
    server: TritonServer


@contextlib.contextmanager
def gateway_on(server: TritonServer, state_dir: Path | None = None) -> Iterator[int]:
    """`tiercache gateway` in front of `server`, on a thread of this process; its port. With
    `state_dir`, its edge layer on the server's repository and that state."""
    from tiercache.gateway.app import GatewaySettings, running_in_thread
    from tiercache.server import free_port

    port = free_port()
    settings = GatewaySettings(
        triton_url=f"127.0.0.1:{server.ports.grpc}",
        base_model=MODEL_ID,
        model_repository=None if state_dir is None else MODEL_REPOSITORY,
        state_dir=state_dir,
    )
    with running_in_thread(settings, port):
        yield port


def chat_body(args: argparse.Namespace) -> dict:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
    }


def cache_the_prompt(args: argparse.Namespace, port: int) -> str:
    """The chat request twice through the gateway; the second must be an exact hit."""
    import httpx2

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    statuses = [
        httpx2.post(url, json=chat_body(args), timeout=600).headers["x-tiercache-cache-status"]
        for _ in range(2)
    ]
    if statuses[-1] != "exact":
        raise RuntimeError(f"the repeated request was not an exact hit: {statuses}")
    return " then ".join(statuses)


def measure(
    args: argparse.Namespace, pa: Path, target: Target, round_no: int, level: int
) -> LevelStats | None:
    stem = args.out_dir / "bench_gateway" / f"{target.name}-r{round_no}-c{level}"
    pa_args = [
        *target.pa_args,
        "--concurrency-range",
        str(level),
        "--measurement-interval",
        str(args.measurement_ms),
        "--max-trials",
        str(args.max_trials),
        "--stability-percentage",
        f"{args.stability_percentage:g}",
    ]
    run = run_perf_analyzer(pa, pa_args, stem.with_suffix(".txt"), server=target.server)
    stats = run.levels.get(level)
    if stats is None:
        progress(f"  {LABELS[target.name]}, c={level}: no result ({failure_reason(run)})")
    else:
        progress(
            f"  {LABELS[target.name]}, c={level}: p50 {stats.p50_us / 1000:.3f} ms, "
            f"p99 {stats.p99_us / 1000:.3f} ms, {stats.throughput:.0f} req/s"
        )
    return stats


def report(
    args: argparse.Namespace, results: dict[tuple[str, int, int], LevelStats], version: str
) -> tuple[str, dict]:
    def spread(a: str, b: str, level: int, field: str) -> Spread | None:
        per_round = {
            name: {
                r: float(getattr(s, field))
                for (n, r, c), s in results.items()
                if n == name and c == level
            }
            for name in (a, b)
        }
        return paired_ratio(per_round[a], per_round[b])

    def median_of(name: str, level: int, field: str) -> float | None:
        values = [
            float(getattr(s, field)) for (n, _, c), s in results.items() if n == name and c == level
        ]
        return median(values) if values else None

    lines = [
        "## Exact hit through the OpenAI gateway",
        "",
        f"- command: `{invocation('tiercache_dev.bench.gateway')}`",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; {version}",
        f"- {args.rounds} rounds, the four back to back at each level; windows of "
        f"{args.measurement_ms} ms, `-s {args.stability_percentage:g}`; one prompt "
        f"({len(args.prompt)} chars), max_tokens {args.max_tokens}",
        "",
        "| configuration | concurrency | p50 ms | p99 ms | req/s |",
        "|---|---:|---:|---:|---:|",
    ]
    summary: dict = {"levels": {}, "ratios": {}}
    for name in (GATEWAY, EDGE, ENSEMBLE, RESPONSE_CACHE):
        for level in args.levels:
            p50, p99 = median_of(name, level, "p50_us"), median_of(name, level, "p99_us")
            rate = median_of(name, level, "throughput")
            cells = [
                "n/a" if v is None else f"{v / d:.{k}f}"
                for v, d, k in ((p50, 1000, 3), (p99, 1000, 3), (rate, 1, 0))
            ]
            lines.append(f"| {LABELS[name]} | {level} | {' | '.join(cells)} |")
            summary["levels"][f"{name} c={level}"] = {"p50_us": p50, "p99_us": p99, "rps": rate}
    lines += [
        "",
        "| ratio (median of rounds, range) | concurrency | value | target |",
        "|---|---:|---:|---|",
    ]
    for a, b, target in (
        (GATEWAY, ENSEMBLE, "(no edge layer)"),
        (EDGE, ENSEMBLE, "< 1 (below the ensemble hit)"),
        (EDGE, RESPONSE_CACHE, "<= 2"),
    ):
        for level in args.levels:
            s = spread(a, b, level, "p50_us")
            shown = "n/a" if s is None else s.text()
            lines.append(f"| {a} p50 / {b} p50 | {level} | {shown} | {target} |")
            summary["ratios"][f"{a}/{b} p50 c={level}"] = None if s is None else s.as_dict()
    return "\n".join(lines) + "\n", summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    args.out_dir = args.out_dir.resolve()
    args.state_dir = args.state_dir.resolve()
    (args.out_dir / "bench_gateway").mkdir(parents=True, exist_ok=True)
    pa = args.perf_analyzer or install_perf_analyzer(args.out_dir / "pa")
    version = perf_analyzer_version(pa)
    results: dict[tuple[str, int, int], LevelStats] = {}
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-gateway-") as tmp_name:
        tmp = Path(tmp_name)
        logs = args.out_dir / "bench_gateway"
        tiercache = triton(
            MODEL_REPOSITORY, args.state_dir, log_path=logs / "tiercache-server.log",
            exit_timeout_s=2,
        )  # fmt: skip
        cache = triton(
            build_response_cache_repository(tmp / "rc"), args.state_dir,
            log_path=logs / "response-cache-server.log", exit_timeout_s=2,
            extra_args=["--cache-config", f"local,size={RESPONSE_CACHE_BYTES}"],
        )  # fmt: skip
        progress("starting tiercache and the response cache's tritonserver")
        with (
            running_all([tiercache, cache], READY_S),
            gateway_on(tiercache) as port,
            gateway_on(tiercache, args.state_dir) as edge_port,
        ):
            progress(f"  tiercache gateway on 127.0.0.1:{port}: {cache_the_prompt(args, port)}")
            progress(f"  with the edge layer on 127.0.0.1:{edge_port}: "
                     f"{cache_the_prompt(args, edge_port)}")  # fmt: skip
            payload = tmp / "chat.json"
            payload.write_text(json.dumps({"data": [{"payload": [chat_body(args)]}]}))
            targets = [
                Target(
                    name,
                    ["-m", MODEL_ID, "--service-kind", "openai", "--endpoint",
                     "v1/chat/completions", "-i", "http", "-u", f"127.0.0.1:{p}", "--async",
                     "--input-data", str(payload)],
                    tiercache,
                )
                for name, p in ((GATEWAY, port), (EDGE, edge_port))
            ] + [
                Target(
                    ENSEMBLE,
                    ["-m", "ensemble", "-i", "grpc", "-u", f"127.0.0.1:{tiercache.ports.grpc}",
                     "--streaming", "--input-data",
                     str(write_input_data(tmp / "hit.json", [args.prompt], args.max_tokens))],
                    tiercache,
                ),
                Target(
                    RESPONSE_CACHE,
                    ["-m", "echo", "-i", "grpc", "-u", f"127.0.0.1:{cache.ports.grpc}", "--async",
                     "--input-data", str(write_input_data(tmp / "echo.json", [args.prompt], None))],
                    cache,
                ),
            ]  # fmt: skip
            if args.only:
                targets = [t for t in targets if t.name in args.only]
            for round_no, level, target in level_pairs(targets, args.rounds, args.levels):
                progress(f"round {round_no}/{args.rounds}, c={level}: {LABELS[target.name]}")
                stats = measure(args, pa, target, round_no, level)
                if stats is not None:
                    results[(target.name, round_no, level)] = stats
    md, summary = report(args, results, version)
    write_report(args.out_dir, "bench_gateway", md, summary)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
