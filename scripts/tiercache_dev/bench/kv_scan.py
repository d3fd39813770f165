"""A scan of one-off long prompts beside a popular set, through tritonserver: the KV pool's
eviction policies side by side (issue 19).

Usage::

    python -m tiercache_dev.bench.kv_scan [--rounds 48] [--warm-rounds 16] [--pool-blocks 32]
        [--scans 2] [--policies lru,gdsf,shadow] [--state-dir .tiercache] [--out-dir .perf]

One tritonserver per policy (torch_llm `kv_eviction`), started together on copies of
model_repository/ with the same small KV pool (`--pool-blocks` blocks of 32 tokens of
SmolLM2-135M's KV), each request sent to every server in turn, so they see the same load at the
same time. Every request carries cache_control `no-cache, no-store` (the engine answers each
one; the prompt and semantic caches stay out of it) and asks for one token. Each round is one
request from the popular set (four system prompts of about 4 blocks, asked in turn, each with a
new question) followed by `--scans` one-off prompts of about 8 blocks each (never seen again):
the popular set and one request in flight fit the pool together.
The popular set's block hit ratio is its requests' `kv_reused_tokens` over their prompt tokens,
after the first `--warm-rounds` (each popular prompt asked four times by then); one-off prompts
cannot be reused. Why a warm-up: a frequency-aware policy needs a few visits to tell the popular
prompts from the scans (the report also gives the ratio for every eight rounds, warm-up
included).

Under LRU each scan pushes the popular prompts out of a pool that could hold them; a policy that
knows they are asked for again keeps them. Ends with one line per policy:
`kv-scan <policy> popular_hit_ratio <x>`; writes OUT_DIR/bench_kv_scan.md and .json, server
logs under OUT_DIR/bench_kv_scan/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.server import copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.console import invocation, machine_summary, progress, write_report
from tiercache_dev.metrics import metric_total, scrape_metrics
from tiercache_dev.paths import DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.servers import fresh_state, running_all, triton

# SmolLM2-135M in float32: 2 (keys, values) x 30 layers x 3 KV heads x 64 dims x 4 bytes a token
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
TOKENS_PER_BLOCK = 32
CONTROL = "no-cache, no-store"
POPULAR = 4

TOPICS = ("billing", "shipping", "returns", "accounts", "warranty", "loyalty points")
VERBS = ("explain", "check", "confirm", "record", "escalate", "summarize")


def system_prompt(index: int, sentences: int) -> str:
    """A long, distinct system prompt (about 11 tokens a sentence)."""
    parts = [f"You are assistant number {index} of the support desk."]
    for s in range(sentences):
        topic = TOPICS[(index + s) % len(TOPICS)]
        verb = VERBS[(index * 7 + s) % len(VERBS)]
        parts.append(f"Rule {s + 1}: always {verb} the {topic} policy for case {index}-{s}.")
    return " ".join(parts)


def one_off(number: int, sentences: int) -> str:
    words = [f"Document {number} to review."]
    for s in range(sentences):
        words.append(f"Line {s} of report {number} lists item {number * 31 + s} in bin {s * 7}.")
    return " ".join(words) + " Summarize it."


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=48, help="popular requests (plus their scans)")
    p.add_argument(
        "--warm-rounds", type=int, default=16, help="first rounds not counted (4 visits of each)"
    )
    p.add_argument("--pool-blocks", type=int, default=32, help="KV pool budget in 32-token blocks")
    p.add_argument("--scans", type=int, default=2, help="one-off prompts after each popular one")
    p.add_argument(
        "--policies", default="lru,gdsf,shadow", help="comma-separated kv_eviction values"
    )
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="tiercache state")
    p.add_argument("--out-dir", type=Path, default=PERF_DIR, help="output folder")
    args = p.parse_args(argv)
    if not 0 <= args.warm_rounds < args.rounds:
        p.error("--warm-rounds must be 0 or more and fewer than --rounds")
    args.policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raw = args.out_dir / "bench_kv_scan"
    raw.mkdir(parents=True, exist_ok=True)
    pool_bytes = args.pool_blocks * TOKENS_PER_BLOCK * KV_BYTES_PER_TOKEN
    popular = [system_prompt(i, 6) for i in range(POPULAR)]  # about 135 tokens each
    counted: dict[str, list[tuple[int, int]]] = {name: [] for name in args.policies}
    evictions: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tiercache-kv-scan-") as tmp:
        work = Path(tmp)
        servers = []
        for name in args.policies:
            repository = copy_repository(
                MODEL_REPOSITORY,
                work / f"repository-{name}",
                {
                    "torch_llm": {
                        "kv_eviction": name,
                        "kv_pool_max_bytes": str(pool_bytes),
                        "tokens_per_block": str(TOKENS_PER_BLOCK),
                    }
                },
            )
            state = fresh_state(work, args.state_dir, f"state-{name}")
            servers.append(
                triton(repository, state, log_path=raw / f"{name}.log", exit_timeout_s=2)
            )
        progress(f"starting {len(servers)} tritonservers ({', '.join(args.policies)})")
        started = time.monotonic()
        with running_all(servers, ready_timeout_s=400):
            progress(f"  ready in {time.monotonic() - started:.1f} s")
            clients = [TierCacheClient(f"127.0.0.1:{s.ports.grpc}", timeout_s=300) for s in servers]
            try:
                scan_number = 0
                for round_index in range(args.rounds):
                    prompts = [
                        (popular[round_index % POPULAR], f"Question {round_index}: what now?")
                    ]
                    for _ in range(args.scans):
                        prompts.append((one_off(scan_number, 12), "Go."))  # about 270 tokens
                        scan_number += 1
                    for kind, (system, turn) in enumerate(prompts):
                        for name, client in zip(args.policies, clients, strict=True):
                            answer: Any = client.generate_text(
                                f"{system}\n\n{turn}", max_tokens=1, cache_control=CONTROL
                            )
                            if kind == 0:
                                counted[name].append(
                                    (answer.kv_reused_tokens or 0, answer.prompt_tokens or 0)
                                )
                    shown = ", ".join(
                        f"{name} {ratio(counted[name][-1:]):.2f}" for name in args.policies
                    )
                    progress(
                        f"  round {round_index + 1}/{args.rounds}: popular request reused {shown}"
                    )
                for name, server in zip(args.policies, servers, strict=True):
                    samples = scrape_metrics(server.ports.metrics)
                    evictions[name] = metric_total(samples, "tiercache_engine_kv_evictions_total")
            finally:
                for client in clients:
                    client.close()
    md, summary = report(args, counted, evictions, pool_bytes)
    write_report(args.out_dir, "bench_kv_scan", md, summary)
    print(md)
    for name in args.policies:
        print(f"kv-scan {name} popular_hit_ratio {ratio(counted[name][args.warm_rounds :]):.4f}")
    return 0


def ratio(pairs: list[tuple[int, int]]) -> float:
    reused = sum(r for r, _ in pairs)
    asked = sum(t for _, t in pairs)
    return reused / asked if asked else 0.0


def report(
    args: argparse.Namespace,
    counted: dict[str, list[tuple[int, int]]],
    evictions: dict[str, float],
    pool_bytes: int,
) -> tuple[str, dict[str, Any]]:
    """`counted`: per policy, each round's popular request (reused tokens, prompt tokens)."""
    machine = machine_summary()
    lines = [
        "## A scan beside a popular set, through tritonserver",
        "",
        f"- command: `{invocation('tiercache_dev.bench.kv_scan')}`",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; {machine['nproc']} "
        f"CPUs, load {machine['loadavg']}",
        f"- KV pool {pool_bytes} bytes ({args.pool_blocks} blocks of {TOKENS_PER_BLOCK} tokens); "
        f"{POPULAR} popular system prompts, {args.scans} one-off prompts after each popular "
        f"request, {args.rounds} rounds, the first {args.warm_rounds} not counted",
        "",
        "| kv_eviction | popular requests counted | reused / prompt tokens | popular hit ratio "
        "| evictions |",
        "|---|---:|---:|---:|---:|",
    ]
    summary: dict[str, Any] = {}
    for name, rounds in counted.items():
        pairs = rounds[args.warm_rounds :]
        reused = sum(r for r, _ in pairs)
        asked = sum(t for _, t in pairs)
        summary[name] = {
            "requests": len(pairs),
            "reused_tokens": reused,
            "prompt_tokens": asked,
            "popular_hit_ratio": ratio(pairs),
            "evictions": evictions.get(name, 0.0),
            "per_round": rounds,
        }
        lines.append(
            f"| {name} | {len(pairs)} | {reused} / {asked} | {ratio(pairs):.3f} | "
            f"{evictions.get(name, 0.0):.0f} |"
        )
    window = POPULAR * 2
    starts = range(0, args.rounds, window)
    lines += [
        "",
        f"Popular hit ratio by rounds ({window} rounds: each popular prompt twice):",
        "",
        "| kv_eviction | "
        + " | ".join(f"{a + 1}-{min(a + window, args.rounds)}" for a in starts)
        + " |",
        "|---|" + "---:|" * len(starts),
    ]
    for name, rounds in counted.items():
        cells = " | ".join(f"{ratio(rounds[a : a + window]):.2f}" for a in starts)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines) + "\n", summary


if __name__ == "__main__":
    sys.exit(main())
