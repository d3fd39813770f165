"""The semantic pair verifier through a real tritonserver (issue 18): what it costs per lookup
and what it changes in the hits, against the guard alone, on the same pairs.

Usage::

    python -m tiercache_dev.bench.verifier_serving [--pairs ../shared/eval/semantic_pairs_dev.jsonl]
        --verifier FOLDER|builtin [--threshold P] [--dtype auto ...] [--threads 1] [--count 30]
        [--neighbours 0] [--max-tokens 8] [--state-dir .tiercache] [--out-dir .perf]

Tritonservers one after the other on copies of model_repository/ (temporary state dirs, the
converted weights linked from `--state-dir/models`): `embedding_cache`'s `verifier` off (the
guard decides), then `--verifier`, once per `--dtype` given (its `verifier_dtype`). The same
pairs on each: `--count` rewordings (label 1) and `--count` different questions (label 0) of
the pairs file, every pair in a tenant of its own, so the only candidate is the pair's own
`a`; `--neighbours N` stores beside it the N texts of the file's `a` side nearest to its `b`
(by the embedder, other pairs' texts), so that a lookup has up to N + 1 candidates, as in a
scope that holds many questions. Phase 1 asks every stored text (a miss: stored, indexed);
phase 2 asks every `b` with `no-store` (a semantic hit, or a miss that generates). The stage's
own lookup histogram (`tiercache_embedding_cache_lookup_seconds`, embedding included) is read
around phase 2: its mean per lookup is the lookup cost with and without the verifier; the
client's time of a semantic hit is what a caller sees (p50 and p99), and the pairs the verifier
read per lookup (`tiercache_embedding_cache_verifier_pairs_total`) how many candidates it
judged. Hits are counted by label (label-0 hits are wrong answers). Writes
OUT_DIR/bench_verifier_serving.md and .json; the server logs under OUT_DIR/bench_verifier_serving/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.semantic.verifier import DTYPES
from tiercache.server import copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.console import invocation, machine_summary, progress, write_report
from tiercache_dev.metrics import scrape_metrics
from tiercache_dev.paths import DEFAULT_PAIRS, DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.servers import fresh_state, running, triton
from tiercache_dev.stats import median

LOOKUP = "tiercache_embedding_cache_lookup_seconds"
VERIFIED_PAIRS = "tiercache_embedding_cache_verifier_pairs_total"
VERIFIER_CALLS = "tiercache_embedding_cache_verifier_seconds"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="pairs file (JSONL)")
    p.add_argument("--count", type=int, default=30, help="pairs of each label")
    p.add_argument(
        "--verifier", required=True, help="a verifier folder (train.verifier), or builtin"
    )
    p.add_argument("--threshold", default="0", help="verifier_threshold (0: the folder's own)")
    p.add_argument(
        "--dtype",
        action="append",
        choices=DTYPES,
        help="verifier_dtype, one server each (repeatable; default auto)",
    )
    p.add_argument("--threads", type=int, default=1, help="verifier_threads")
    p.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="store this many of the file's nearest other texts beside each pair's a",
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p.add_argument("--out-dir", type=Path, default=PERF_DIR)
    return p.parse_args(argv)


def spread_pairs(path: Path, count: int, label: int) -> list[tuple[str, str]]:
    """`count` pairs of `label`, every k-th one of the file (spread over its sources)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    chosen = [(r["a"], r["b"]) for r in rows if r["label"] == label]
    step = max(1, len(chosen) // max(1, count))
    return chosen[::step][:count]


def nearest_texts(path: Path, pairs: list[tuple[str, str, int]], count: int) -> list[list[str]]:
    """For each pair, the `count` texts of the file's `a` side nearest to its `b` by the
    embedder's cosine, the pair's own `a` and `b` left out."""
    if count <= 0:
        return [[] for _ in pairs]
    from tiercache.semantic.embedder import Embedder

    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    pool = sorted({str(r["a"]) for r in rows})
    embed = Embedder().embed
    progress(f"embedding the {len(pool)} texts of {path.name}'s a side to find neighbours")
    vectors = embed(pool)
    queries = embed([b for _, b, _ in pairs])
    nearest = []
    for (a, b, _), query in zip(pairs, queries, strict=True):
        order = (vectors @ query).argsort()[::-1]
        chosen = [pool[i] for i in order if pool[i] not in (a, b)][:count]
        nearest.append(chosen)
    return nearest


Histograms = tuple[float, float, float, float, float]


def lookup_histogram(port: int) -> Histograms:
    """Over every instance: (count, sum in seconds) of the stage's lookup histogram, the pairs
    the verifier read, and (count, sum in seconds) of its calls."""
    wanted = [f"{LOOKUP}_count", f"{LOOKUP}_sum", VERIFIED_PAIRS]
    wanted += [f"{VERIFIER_CALLS}_count", f"{VERIFIER_CALLS}_sum"]
    found = dict.fromkeys(wanted, 0.0)
    for name, _, value in scrape_metrics(port):
        if name in found:
            found[name] += value
    count, total, verified, calls, seconds = (found[name] for name in wanted)
    return count, total, verified, calls, seconds


def settled_histogram(port: int, expected_at_least: float) -> Histograms:
    """The histogram once the stages' periodic flush has caught up (they flush every 0.25 s)."""
    deadline = time.monotonic() + 10.0
    found = lookup_histogram(port)
    while found[0] < expected_at_least and time.monotonic() < deadline:
        time.sleep(0.3)
        found = lookup_histogram(port)
    time.sleep(0.6)
    return lookup_histogram(port)


def run_one(
    args: argparse.Namespace,
    verifier: str,
    dtype: str,
    pairs: list[tuple[str, str, int]],
    neighbours: list[list[str]],
    raw: Path,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tiercache-verifier-") as tmp:
        work = Path(tmp)
        state = fresh_state(work, args.state_dir)
        repository = copy_repository(
            MODEL_REPOSITORY,
            work / "repository",
            {
                "embedding_cache": {
                    "verifier": verifier,
                    "verifier_threshold": args.threshold,
                    "verifier_dtype": dtype,
                    "verifier_threads": str(args.threads),
                }
            },
        )
        what = "off" if verifier == "off" else f"{Path(verifier).name}-{dtype}"
        server = triton(repository, state, log_path=raw / f"server-{what}.log")
        progress(f"verifier {what}: starting tritonserver (grpc {server.ports.grpc})")
        with running(server, ready_timeout_s=300):
            tenants = [f"bench-{uuid.uuid4().hex[:12]}" for _ in pairs]
            with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=600) as client:
                stored = 0
                for i, ((a, _, _), near, tenant) in enumerate(
                    zip(pairs, neighbours, tenants, strict=True)
                ):
                    for text in [*near, a]:
                        client.generate_text(text, max_tokens=args.max_tokens, tenant=tenant)
                        stored += 1
                    if (i + 1) % 10 == 0:
                        progress(f"  stored the texts of {i + 1}/{len(pairs)} pairs")
                before = settled_histogram(server.ports.metrics, stored)
                asked = []
                for i, ((_, b, label), tenant) in enumerate(zip(pairs, tenants, strict=True)):
                    started = time.perf_counter()
                    got = client.generate_text(
                        b, max_tokens=args.max_tokens, tenant=tenant, cache_control="no-store"
                    )
                    asked.append((label, got.cache_status, time.perf_counter() - started))
                    if (i + 1) % 10 == 0:
                        progress(f"  asked {i + 1}/{len(pairs)}")
                after = settled_histogram(server.ports.metrics, before[0] + len(pairs))
    lookups = after[0] - before[0]
    hits = [(label, s) for label, status, s in asked if status == "semantic"]
    hit_s = sorted(s for _, s in hits)
    return {
        "verifier": "off"
        if verifier == "off"
        else f"{Path(verifier).name} ({dtype}) at "
        + (args.threshold if float(args.threshold) else "its operating point"),
        "lookups": lookups,
        "lookup_mean_ms": 1000.0 * (after[1] - before[1]) / lookups if lookups else None,
        "hits_label_1": sum(1 for label, _ in hits if label == 1),
        "hits_label_0": sum(1 for label, _ in hits if label == 0),
        "pairs_label_1": sum(1 for _, _, label in pairs if label == 1),
        "pairs_label_0": sum(1 for _, _, label in pairs if label == 0),
        "hit_p50_ms": 1000.0 * median(hit_s) if hits else None,
        "hit_p99_ms": 1000.0 * hit_s[min(len(hit_s) - 1, int(0.99 * len(hit_s)))] if hits else None,
        "verified_pairs_per_lookup": (after[2] - before[2]) / lookups if lookups else None,
        "verifier_calls": after[3] - before[3],
        "verifier_call_mean_ms": 1000.0 * (after[4] - before[4]) / (after[3] - before[3])
        if after[3] > before[3]
        else None,
        "threads": args.threads,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    pairs = [(a, b, 1) for a, b in spread_pairs(args.pairs, args.count, 1)]
    pairs += [(a, b, 0) for a, b in spread_pairs(args.pairs, args.count, 0)]
    raw = args.out_dir / "bench_verifier_serving"
    raw.mkdir(parents=True, exist_ok=True)
    # the server runs in a temporary folder: a folder is passed absolute, `builtin` as it is
    folder = args.verifier if args.verifier == "builtin" else str(Path(args.verifier).resolve())
    neighbours = nearest_texts(args.pairs, pairs, args.neighbours)
    results = [run_one(args, "off", "auto", pairs, neighbours, raw)]
    results += [
        run_one(args, folder, dtype, pairs, neighbours, raw) for dtype in args.dtype or ["auto"]
    ]
    machine = machine_summary()
    md = [
        "## The semantic pair verifier through tritonserver",
        "",
        f"- command: `{invocation('tiercache_dev.bench.verifier_serving')}`",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; {machine['nproc']} "
        f"CPUs ({machine['cpu']}), load {machine['loadavg']}",
        f"- {args.pairs.name}: {args.count} label-1 and {args.count} label-0 pairs, each in a "
        f"tenant of its own; `a` stored (with {args.neighbours} nearest other texts of the file), "
        f"then `b` asked with `no-store`; verifier_threads {args.threads}",
        "",
        "| verifier | lookup mean (stage histogram) | pairs verified per lookup "
        "| verifier call mean (calls) | semantic hit p50 / p99 (client) | hits on label 1 "
        "| hits on label 0 (wrong) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r in results:
        per = r["verified_pairs_per_lookup"]
        md.append(
            f"| {r['verifier']} | {ms(r['lookup_mean_ms'])} ms | "
            f"{'-' if per is None else f'{per:.2f}'} | "
            f"{ms(r['verifier_call_mean_ms'])} ms ({r['verifier_calls']:.0f}) | "
            f"{ms(r['hit_p50_ms'])} / {ms(r['hit_p99_ms'])} ms | "
            f"{r['hits_label_1']}/{r['pairs_label_1']} | {r['hits_label_0']}/{r['pairs_label_0']} |"
        )
    off = results[0]
    md.append("")
    for on in results[1:]:
        if off["lookup_mean_ms"] and on["lookup_mean_ms"]:
            ratio = on["lookup_mean_ms"] / off["lookup_mean_ms"]
            md.append(f"- lookup mean, {on['verifier']} / off: {ratio:.2f}x")
    write_report(args.out_dir, "bench_verifier_serving", "\n".join(md) + "\n", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
