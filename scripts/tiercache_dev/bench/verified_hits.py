"""Semantic hits the engine verifies (issue 18, `verify-semantic`) through a real tritonserver:
how often a reworded prompt's semantic hit is verified, and what a verified hit costs next to a
plain semantic hit and a generation.

Usage::

    python -m tiercache_dev.bench.verified_hits [--pairs ../shared/eval/semantic_pairs_dev.jsonl]
        [--count 24] [--max-tokens 32] [--state-dir .tiercache] [--out-dir .perf]

One tritonserver on a copy of model_repository/ (a temporary state dir, the converted weights
linked from `--state-dir/models`). Two sets of `--count` pairs each, every pair in a tenant of
its own, greedy: `reworded`, positive rewording pairs of the pairs file (label 1; every k-th
one, so the sources are spread), and `near-identical`, each of their `a` sides against itself
lowercased with its final punctuation dropped (what a verification can be expected to pass):

1. side `a` is asked (a miss: its answer is stored and indexed);
2. side `b` is asked three ways, in an order that rotates per pair so that no way always runs
   first: plain (`no-store`: a semantic hit is served as the guard accepted it), verified
   (`verify-semantic, no-store`), and generated (`no-cache, no-store`: the engine's own answer).

Counted over the pairs where the plain ask was a semantic hit: verified / refuted, and whether
the verified ask's text equals the generated one (it must, every time: precision 1.0 against the
engine's own output by construction); and how often the plain semantic hit's text was the
engine's own (the share of served hits that a generation would have given). Latency p50 of each
way, and the ratios verified / generated and verified / plain hit. Writes
OUT_DIR/bench_verified_hits.md and .json; the server log under OUT_DIR/bench_verified_hits/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.server import copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.bench.speculation import rewording_pairs
from tiercache_dev.console import invocation, machine_summary, progress, write_report
from tiercache_dev.paths import DEFAULT_PAIRS, DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.servers import fresh_state, running, triton
from tiercache_dev.stats import median

PLAIN = "no-store"
VERIFIED = "verify-semantic, no-store"
GENERATED = "no-cache, no-store"
WAYS = (PLAIN, VERIFIED, GENERATED)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="rewording pairs (JSONL)")
    p.add_argument("--count", type=int, default=24, help="positive pairs asked")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="tiercache state")
    p.add_argument("--out-dir", type=Path, default=PERF_DIR, help="output folder")
    args = p.parse_args(argv)
    if args.count < 1:
        p.error("--count must be >= 1")
    if not args.pairs.is_file():
        p.error(f"no pairs file at {args.pairs}")
    return args


@dataclass(frozen=True, slots=True)
class Asked:
    """One pair's `b`, asked the three ways."""

    plain_status: str
    verified_status: str
    plain_s: float
    verified_s: float
    generated_s: float
    verified_is_own: bool  # the verified ask's text == the generated one
    plain_is_own: bool  # the plain hit's text == the generated one
    completion_tokens: int


def ask_pair(client: TierCacheClient, a: str, b: str, max_tokens: int, turn: int) -> Asked:
    tenant = f"verify-{uuid.uuid4().hex[:10]}"
    client.generate_text(a, max_tokens=max_tokens, tenant=tenant)
    order = WAYS[turn % 3 :] + WAYS[: turn % 3]
    got: dict[str, Any] = {}
    for way in order:
        got[way] = client.generate_text(b, max_tokens=max_tokens, tenant=tenant, cache_control=way)
    plain, verified, generated = got[PLAIN], got[VERIFIED], got[GENERATED]
    return Asked(
        plain.cache_status,
        verified.cache_status,
        plain.latency_s,
        verified.latency_s,
        generated.latency_s,
        verified.text == generated.text,
        plain.text == generated.text,
        generated.completion_tokens or 0,
    )


def near_identical(text: str) -> str:
    """`text` lowercased, its final punctuation dropped."""
    return text.lower().rstrip("?.!").rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    reworded = rewording_pairs(args.pairs, args.count)
    sets = {
        "reworded": reworded,
        "near-identical": [(a, near_identical(a)) for a, _ in reworded],
    }
    raw = args.out_dir / "bench_verified_hits"
    raw.mkdir(parents=True, exist_ok=True)
    asked: dict[str, list[Asked]] = {name: [] for name in sets}
    with tempfile.TemporaryDirectory(prefix="tiercache-verify-") as tmp:
        work = Path(tmp)
        state = fresh_state(work, args.state_dir)
        repository = copy_repository(MODEL_REPOSITORY, work / "repository", {})
        server = triton(repository, state, log_path=raw / "server.log", exit_timeout_s=2)
        progress(f"starting tritonserver (grpc {server.ports.grpc})")
        started = time.monotonic()
        with running(server, ready_timeout_s=300):
            progress(f"  ready in {time.monotonic() - started:.1f} s")
            with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=600) as client:
                for name, i, (a, b) in (
                    (name, i, pair) for name, pairs in sets.items() for i, pair in enumerate(pairs)
                ):
                    got = ask_pair(client, a, b, args.max_tokens, i)
                    asked[name].append(got)
                    progress(
                        f"  {name} {i + 1}/{len(sets[name])}: plain {got.plain_status} "
                        f"{got.plain_s:.2f} s, "
                        f"verify {got.verified_status} {got.verified_s:.2f} s, generated "
                        f"{got.generated_s:.2f} s, "
                        f"{'own answer' if got.verified_is_own else 'NOT THE OWN ANSWER'}"
                    )
    machine = machine_summary()
    md = [
        "## Semantic hits the engine verifies, through tritonserver",
        "",
        f"- command: `{invocation('tiercache_dev.bench.verified_hits')}`",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; {machine['nproc']} "
        f"CPUs ({machine['cpu']}), load {machine['loadavg']}",
        f"- pairs from {args.pairs.name}, max_tokens {args.max_tokens}, greedy; each `b` asked "
        "plain (`no-store`), verified (`verify-semantic, no-store`) and generated (`no-cache, "
        "no-store`), the order rotating per pair",
    ]
    summary: dict[str, Any] = {}
    for name, got in asked.items():
        text, summary[name] = report(name, got)
        md += ["", text]
    write_report(args.out_dir, "bench_verified_hits", "\n".join(md) + "\n", summary)
    all_own = all(s["all_own"] for s in summary.values())
    print(f"verified-hits own-answer {'yes' if all_own else 'no'}")
    return 0 if all_own else 1


def report(name: str, asked: list[Asked]) -> tuple[str, dict[str, Any]]:
    hits = [a for a in asked if a.plain_status == "semantic"]
    verified = [a for a in hits if a.verified_status == "verified"]
    summary: dict[str, Any] = {
        "pairs": len(asked),
        "semantic_hits": len(hits),
        "verified": len(verified),
        "refuted": sum(a.verified_status == "miss" for a in hits),
        "plain_hit_was_own_answer": sum(a.plain_is_own for a in hits),
        "all_own": all(a.verified_is_own for a in asked),
        "statuses": sorted({(a.plain_status, a.verified_status) for a in asked}),
    }
    rows: list[tuple[str, list[Asked]]] = [("verified", verified), ("refuted", [
        a for a in hits if a.verified_status != "verified"
    ])]  # fmt: skip
    lines = [
        f"### {name}",
        "",
        f"Of {len(asked)} prompts, {len(hits)} were semantic hits; of those the engine "
        f"verified {len(verified)} and refuted {summary['refuted']}. The plain hit's answer was "
        f"the engine's own for {summary['plain_hit_was_own_answer']} of {len(hits)}. Every "
        f"verified ask's text equal to the generated one: "
        f"{'yes' if summary['all_own'] else 'NO'}.",
        "",
        "| outcome | n | plain hit p50 s | verified ask p50 s | generated p50 s | verified / "
        "generated | verified / plain hit |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, group in rows:
        if not group:
            lines.append(f"| {name} | 0 | - | - | - | - | - |")
            continue
        plain = median([a.plain_s for a in group])
        ver = median([a.verified_s for a in group])
        gen = median([a.generated_s for a in group])
        summary[name] = {"plain_p50_s": plain, "verified_p50_s": ver, "generated_p50_s": gen}
        lines.append(
            f"| {name} | {len(group)} | {plain:.3f} | {ver:.3f} | {gen:.3f} | "
            f"{ver / gen:.2f} | {ver / plain:.1f} |"
        )
    return "\n".join(lines), summary


if __name__ == "__main__":
    sys.exit(main())
