"""perf_analyzer against the real `ensemble` with a shared system prompt: TTFT with torch_llm's
prefix KV reuse on and off.

Usage::

    python -m tiercache_dev.perf.kv_prefix [--out-dir .perf] [--state-dir .tiercache]
        [--prefix-tokens 512] [--requests 12] [--max-tokens 8] [--concurrency 1]

Builds a perf_analyzer `--input-data` file of `--requests` prompts that share one system prompt
of about `--prefix-tokens` tokens (chat template included; tiercache_dev.bench.kv_reuse's text) and
differ in a short user turn, each with `stream` true and `cache_control`
"no-cache no-store no-semantic" (every request reaches the engine; nothing is stored). Then, one
server after the other (never two at once), each on free ports with a temporary state directory
(the converted weights are linked from `--state-dir/models`) and a copy of model_repository/
whose torch_llm has `kv_reuse` true or false:

1. one warm-up request with the system prompt and a turn not in the data (for "on" it caches the
   system prompt's blocks, as a first user of a deployment would);
2. perf_analyzer over gRPC, `--streaming`, `--concurrency-range C --request-count N` (one pass),
   with `--profile-export-file`: TTFT per request is its first response's timestamp minus the
   request's (what genai-perf computes from the same file), the first streamed chunk through the
   whole ensemble; end to end is the last response's. perf_analyzer's own latency figure is
   reported beside them: although it says it uses the first response of a decoupled model, on
   this ensemble it tracks the last one (measured: 1,327 vs 1,292 ms end to end, 844 ms TTFT);
3. the engine's KV metrics (reused / computed prompt tokens, lookups, pool bytes) before and after.

Writes OUT/perf_kv_prefix.md (table, commands, metrics) and OUT/perf_kv_prefix.json; raw
perf_analyzer output and server logs under OUT/perf_kv_prefix/. Exit code 0 when both runs
produced a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.server import copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.bench.kv_reuse import build_system
from tiercache_dev.console import (
    display_path,
    exit_on_sigterm,
    invocation,
    machine_summary,
    progress,
    shown,
)
from tiercache_dev.metrics import scrape_metrics
from tiercache_dev.paths import DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.perf.analyzer import install_perf_analyzer, run_perf_analyzer
from tiercache_dev.servers import fresh_state, running, triton
from tiercache_dev.stats import mean, percentile

TENANT = "perf-kv-prefix"
CACHE_CONTROL = "no-cache no-store no-semantic"
TURNS = (
    "Can I return a used drill?",
    "Do you deliver on Sundays?",
    "How long is the warranty on paint?",
    "Where do I find the loyalty number?",
    "Can the manager refuse a return?",
    "What do I need for a delivery?",
    "Is the receipt required?",
    "How many days do I have to return screws?",
    "Can guests use the loyalty card?",
    "Who checks the colour code?",
    "Do drivers confirm the address?",
    "What if I lost the warranty card?",
    "Can I change the delivery address?",
    "Are the opening hours the same on holidays?",
    "Can support agents extend the return window?",
    "Do cashiers record the loyalty number?",
)
WARM_UP_TURN = "Hello, are you open today?"
KV_METRICS = {
    "reused_tokens": "tiercache_engine_kv_reused_tokens_total",
    "computed_tokens": "tiercache_engine_kv_computed_tokens_total",
    "evictions": "tiercache_engine_kv_evictions_total",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out-dir", type=Path, default=PERF_DIR)
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("TIERCACHE_STATE_DIR") or DEFAULT_STATE_DIR),
        help="where the converted weights live (linked into each server's temporary state)",
    )
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared prompt tokens")
    p.add_argument("--requests", type=int, default=12, help="prompts (perf_analyzer requests)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--perf-analyzer", type=Path, default=None, help="skip the install step")
    p.add_argument("--timeout-s", type=float, default=900)
    args = p.parse_args(argv)
    if not 1 <= args.requests <= len(TURNS):
        p.error(f"--requests must be in [1, {len(TURNS)}]")
    return args


def system_prompt(state_dir: Path, prefix_tokens: int) -> tuple[str, int]:
    """A system text whose chat-templated prompts share about `prefix_tokens` tokens."""
    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine

    engine = TorchEngine(resolve_model(), state_dir / "models", "cpu", kv_reuse=False)
    try:
        return build_system(engine, prefix_tokens)
    finally:
        del engine
        gc.collect()


def write_inputs(path: Path, system: str, args: argparse.Namespace) -> None:
    def entry(turn: str) -> dict[str, Any]:
        return {
            "text_input": {"content": [f"{system} Question: {turn}"], "shape": [1]},
            "max_tokens": {"content": [args.max_tokens], "shape": [1]},
            "stream": {"content": [True], "shape": [1]},
            "cache_control": {"content": [CACHE_CONTROL], "shape": [1]},
            "tenant": {"content": [TENANT], "shape": [1]},
        }

    data = {"data": [entry(turn) for turn in TURNS[: args.requests]]}
    path.write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")


def kv_counters(port: int) -> dict[str, float]:
    samples = scrape_metrics(port)
    out = {key: 0.0 for key in (*KV_METRICS, "hit", "miss", "pool_bytes")}
    for name, labels, value in samples:
        for key, metric in KV_METRICS.items():
            if name == metric:
                out[key] += value
        if name == "tiercache_engine_kv_lookups_total" and labels.get("result") in ("hit", "miss"):
            out[labels["result"]] += value
        if name == "tiercache_engine_kv_pool_bytes":
            out["pool_bytes"] += value
    return out


def settled_kv_counters(port: int) -> dict[str, float]:
    """The counters once the stages' deferred metric updates (every 0.25 s) are flushed."""
    previous = kv_counters(port)
    for _ in range(20):
        time.sleep(0.5)
        current = kv_counters(port)
        if current == previous:
            return current
        previous = current
    return previous


def run_mode(
    mode: str, args: argparse.Namespace, pa: Path, data: Path, system: str, work: Path
) -> dict[str, Any]:
    state = fresh_state(work, args.state_dir, f"state-{mode}")
    reuse = "true" if mode == "on" else "false"
    repository = copy_repository(
        MODEL_REPOSITORY, work / f"repository-{mode}", {"torch_llm": {"kv_reuse": reuse}}
    )
    raw = args.out_dir / "perf_kv_prefix"
    profile = raw / f"profile-{mode}.json"
    server = triton(repository, state, log_path=raw / f"server-{mode}.log", exit_timeout_s=2)
    ports = server.ports
    progress(f"kv_reuse {mode}: starting tritonserver (grpc {ports.grpc})")
    started = time.monotonic()
    with running(server, ready_timeout_s=300):
        progress(f"  ready in {time.monotonic() - started:.1f} s; warm-up request")
        with TierCacheClient(f"127.0.0.1:{ports.grpc}", timeout_s=600) as client:
            warm = client.generate_text(
                f"{system} Question: {WARM_UP_TURN}",
                max_tokens=args.max_tokens,
                tenant=TENANT,
                cache_control=CACHE_CONTROL,
            )
        progress(f"  warm-up: {warm.cache_status}, {warm.latency_s * 1000:.0f} ms")
        before = settled_kv_counters(ports.metrics)
        pa_args = [
            "-m",
            "ensemble",
            "-i",
            "grpc",
            "-u",
            f"127.0.0.1:{ports.grpc}",
            "--streaming",
            "--input-data",
            str(data),
            "--concurrency-range",
            str(args.concurrency),
            "--request-count",
            str(args.requests),
            "-f",
            str(raw / f"perf-{mode}.csv"),
            "--profile-export-file",
            str(profile),
        ]
        profile.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite it
        progress(f"  perf_analyzer {shown(pa_args)}")
        run = run_perf_analyzer(
            pa, pa_args, raw / f"perf-{mode}.txt", timeout_s=args.timeout_s, server=server
        )
        after = settled_kv_counters(ports.metrics)
    level = run.levels.get(args.concurrency)
    delta = {k: after[k] - before[k] for k in after if k != "pool_bytes"}
    result: dict[str, Any] = {
        "mode": mode,
        "command": shown(pa_args),
        "returncode": run.returncode,
        "kv": delta | {"pool_bytes": after["pool_bytes"]},
    }
    if level is None or not profile.exists():
        progress(f"  no measurement (perf_analyzer exit {run.returncode}); see {raw}")
        return result
    ttft_ms, e2e_ms = response_times_ms(profile)
    result |= {
        "requests": len(ttft_ms),
        "ttft_p50_ms": percentile(ttft_ms, 50),
        "ttft_p99_ms": percentile(ttft_ms, 99),
        "ttft_mean_ms": mean(ttft_ms),
        "e2e_p50_ms": percentile(e2e_ms, 50),
        "pa_p50_ms": level.p50_us / 1000,
        "throughput": level.throughput,
    }
    progress(
        f"  TTFT p50 {result['ttft_p50_ms']:.1f} ms, end to end p50 {result['e2e_p50_ms']:.1f} "
        f"ms; reused {delta['reused_tokens']:.0f}, computed {delta['computed_tokens']:.0f} tokens"
    )
    return result


def response_times_ms(profile: Path) -> tuple[list[float], list[float]]:
    """Per request, from perf_analyzer's profile export (the timestamps genai-perf reads): the
    first response (time to first token: the first streamed chunk) and the last (the whole
    answer), in ms after the request was sent."""
    document = json.loads(profile.read_text())
    ttft: list[float] = []
    e2e: list[float] = []
    for experiment in document["experiments"]:
        for request in experiment["requests"]:
            stamps = request["response_timestamps"]
            if stamps:
                ttft.append((stamps[0] - request["timestamp"]) / 1e6)
                e2e.append((stamps[-1] - request["timestamp"]) / 1e6)
    return ttft, e2e


def report(args: argparse.Namespace, shared: int, results: list[dict[str, Any]]) -> str:
    machine = machine_summary()
    by_mode = {r["mode"]: r for r in results}
    lines = [
        "# TTFT through the ensemble with a shared system prompt: KV reuse on and off",
        "",
        f"- command: `{invocation('tiercache_dev.perf.kv_prefix')}`",
        f"- {args.requests} prompts sharing {shared} tokens (chat template included), each a "
        f"different user turn; `max_tokens` {args.max_tokens}, `stream` true, `cache_control` "
        f'"{CACHE_CONTROL}", tenant "{TENANT}"; concurrency {args.concurrency}; one warm-up '
        "request with the system prompt before each run",
        "- perf_analyzer over gRPC, `--streaming`, `--profile-export-file`: TTFT = first "
        "response (first streamed chunk) minus send time per request, end to end = last "
        "response; `perf_analyzer p50` is its own latency figure; machine: "
        f"{machine['nproc']} CPUs, {machine['cpu']}, load {machine['loadavg']}",
        "",
        "| kv_reuse | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | end to end p50 ms | "
        "perf_analyzer p50 ms | requests | reused tokens | computed tokens | lookups hit / miss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        kv = r["kv"]
        if "ttft_p50_ms" not in r:
            lines.append(f"| {r['mode']} | failed (exit {r['returncode']}) | | | | | | | | |")
            continue
        lines.append(
            f"| {r['mode']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
            f"{r['ttft_mean_ms']:.1f} | {r['e2e_p50_ms']:.1f} | {r['pa_p50_ms']:.1f} | "
            f"{r['requests']} | {kv['reused_tokens']:.0f} | {kv['computed_tokens']:.0f} | "
            f"{kv['hit']:.0f} / {kv['miss']:.0f} |"
        )
    on, off = by_mode.get("on", {}), by_mode.get("off", {})
    if "ttft_p50_ms" in on and "ttft_p50_ms" in off:
        ratio = off["ttft_p50_ms"] / on["ttft_p50_ms"]
        lines += ["", f"TTFT p50 off / on: **{ratio:.2f}x**"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "perf_kv_prefix").mkdir(exist_ok=True)
    pa = args.perf_analyzer or install_perf_analyzer(args.out_dir / "pa")
    progress(f"perf_analyzer: {display_path(pa)}")
    system, shared = system_prompt(args.state_dir, args.prefix_tokens)
    progress(f"system prompt: {shared} shared tokens")
    results = []
    with tempfile.TemporaryDirectory(prefix="tiercache-perf-kv-") as tmp:
        work = Path(tmp)
        data = args.out_dir / "perf_kv_prefix" / "inputs.json"
        write_inputs(data, system, args)
        for mode in ("off", "on"):
            results.append(run_mode(mode, args, pa, data, system, work))
    text = report(args, shared, results)
    (args.out_dir / "perf_kv_prefix.md").write_text(text)
    (args.out_dir / "perf_kv_prefix.json").write_text(
        json.dumps({"shared_tokens": shared, "results": results}, indent=2) + "\n"
    )
    print(text)
    return 0 if all("ttft_p50_ms" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
