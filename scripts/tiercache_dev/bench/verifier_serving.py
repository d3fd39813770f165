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
`a`; `--neighbours N` stores after it the N texts of the file's `a` side nearest to its `b`
(by the embedder; other pairs' texts, none of the pair's own duplicate clusters), so that a
lookup has up to N + 1 candidates, as in a scope that holds many questions. Phase 1 asks every
stored text, `a` first (a miss: stored, indexed; a neighbour answered from the cache instead is
counted);
phase 2 asks every `b` with `no-store` (a semantic hit, or a miss that generates). The stage's
own lookup histogram (`tiercache_embedding_cache_lookup_seconds`, embedding included) is read
around phase 2: its mean per lookup is the lookup cost with and without the verifier; the
client's time of a semantic hit is what a caller sees (p50 and max), and the pairs the verifier
read per lookup (`tiercache_embedding_cache_verifier_pairs_total`) how many candidates it
judged. A hit is judged by the answer it serves: `a`'s on a label-1 pair is right, on a label-0
pair wrong, another answer (a neighbour's) wrong; where a neighbour's stored answer is the same
text as `a`'s, the hit cannot be told apart and is counted undetermined. Writes
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.exact.request import normalize_text
from tiercache.semantic.verifier import DTYPES
from tiercache.server import copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.console import invocation, machine_summary, progress, write_report
from tiercache_dev.metrics import scrape_metrics
from tiercache_dev.paths import DEFAULT_PAIRS, DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.servers import fresh_state, running, triton
from tiercache_dev.stats import summary

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
    p.add_argument("--threads", type=int, default=1, help="verifier_threads (>= 1)")
    p.add_argument(
        "--neighbours",
        type=int,
        default=0,
        help="store this many of the file's nearest other texts beside each pair's a",
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    p.add_argument("--out-dir", type=Path, default=PERF_DIR)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.neighbours < 0:
        p.error(f"--neighbours must be >= 0, got {args.neighbours}")
    if args.count < 1:
        p.error(f"--count must be >= 1, got {args.count}")
    return args


Row = dict[str, Any]


def read_rows(path: Path) -> list[Row]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def spread_pairs(rows: list[Row], count: int, label: int) -> list[Row]:
    """`count` rows of `label`, every k-th one of the file (spread over its sources)."""
    chosen = [r for r in rows if r["label"] == label]
    step = max(1, len(chosen) // max(1, count))
    return chosen[::step][:count]


def nearest_texts(
    rows: list[Row], pairs: list[Row], count: int, embed: Callable[[Sequence[str]], Any]
) -> list[list[str]]:
    """For each pair, the `count` texts of the rows' `a` side nearest to its `b` by `embed`'s
    cosine (unit vectors), leaving out texts that normalize to its own `a` or `b` and texts of
    either one's duplicate cluster (`cluster_a` / `cluster_b`, where the file has them), so
    that serving one of them is a wrong answer."""
    if count <= 0:
        return [[] for _ in pairs]
    clusters = {normalize_text(r["a"]): r.get("cluster_a") for r in rows}
    pool = sorted({str(r["a"]) for r in rows})
    progress(f"embedding {len(pool)} texts of the pairs' a side to find neighbours")
    vectors = np.asarray(embed(pool))
    queries = np.asarray(embed([pair["b"] for pair in pairs]))
    nearest = []
    for pair, query in zip(pairs, queries, strict=True):
        taken = {normalize_text(pair["a"]), normalize_text(pair["b"])}
        related = {pair.get("cluster_a"), pair.get("cluster_b")} - {None}
        chosen: list[str] = []
        for i in (vectors @ query).argsort()[::-1]:
            text = normalize_text(pool[i])
            if text in taken or clusters.get(text) in related:
                continue
            taken.add(text)  # one text once, however the file spells it
            chosen.append(pool[i])
            if len(chosen) == count:
                break
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


Stored = tuple[str | None, list[str]]  # a pair's tenant: a's answer (if stored), the others'


def count_hits(
    pairs: list[Row], asked: list[tuple[str, str, float]], stored: list[Stored]
) -> dict[str, int]:
    """Phase 2's semantic hits judged by the answer served: `asked` holds each pair's (cache
    status, answer text, seconds), `stored` what its tenant stored. `a`'s answer on a label-1
    pair is right, on a label-0 pair wrong; any other answer (a neighbour's) wrong; an answer
    that `a` and a neighbour share cannot be told apart: undetermined."""
    counts = dict.fromkeys(
        ("hits_label_1", "hits_label_0", "hits_neighbour", "hits_undetermined"), 0
    )
    for pair, (status, text, _), (answer_of_a, others) in zip(pairs, asked, stored, strict=True):
        if status != "semantic":
            continue
        if text == answer_of_a and text in others:
            counts["hits_undetermined"] += 1
        elif text == answer_of_a:
            counts["hits_label_1" if pair["label"] == 1 else "hits_label_0"] += 1
        else:
            counts["hits_neighbour"] += 1
    return counts


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
    pairs: list[Row],
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
                asked_to_store = answered_from_cache = 0
                stored_answers: list[Stored] = []
                for i, (pair, near, tenant) in enumerate(
                    zip(pairs, neighbours, tenants, strict=True)
                ):
                    answer_of_a, others = None, []
                    for text in [pair["a"], *near]:  # a first: the tenant is empty, a miss
                        got = client.generate_text(text, max_tokens=args.max_tokens, tenant=tenant)
                        asked_to_store += 1
                        if got.cache_status != "miss":  # answered from what the tenant holds
                            answered_from_cache += 1
                        elif text == pair["a"]:
                            answer_of_a = got.text
                        else:
                            others.append(got.text)
                    stored_answers.append((answer_of_a, others))
                    if (i + 1) % 10 == 0:
                        progress(f"  stored the texts of {i + 1}/{len(pairs)} pairs")
                before = settled_histogram(server.ports.metrics, asked_to_store)
                asked = []
                for i, (pair, tenant) in enumerate(zip(pairs, tenants, strict=True)):
                    started = time.perf_counter()
                    got = client.generate_text(
                        pair["b"],
                        max_tokens=args.max_tokens,
                        tenant=tenant,
                        cache_control="no-store",
                    )
                    elapsed = time.perf_counter() - started
                    asked.append((got.cache_status, got.text, elapsed))
                    if (i + 1) % 10 == 0:
                        progress(f"  asked {i + 1}/{len(pairs)}")
                after = settled_histogram(server.ports.metrics, before[0] + len(pairs))
    lookups = after[0] - before[0]
    counted = count_hits(pairs, asked, stored_answers)
    return {
        "verifier": "off"
        if verifier == "off"
        else f"{Path(verifier).name} ({dtype}) at "
        + (args.threshold if float(args.threshold) else "its operating point"),
        "lookups": lookups,
        "lookup_mean_ms": 1000.0 * (after[1] - before[1]) / lookups if lookups else None,
        **counted,
        "pairs_label_1": sum(1 for pair in pairs if pair["label"] == 1),
        "pairs_label_0": sum(1 for pair in pairs if pair["label"] == 0),
        "hit_ms": summary((1000.0 * s for status, _, s in asked if status == "semantic"), digits=1),
        "neighbours": args.neighbours,
        "texts_asked_to_store": asked_to_store,
        "answered_from_cache_when_stored": answered_from_cache,
        "verified_pairs_per_lookup": (after[2] - before[2]) / lookups if lookups else None,
        "verifier_calls": after[3] - before[3],
        "verifier_call_mean_ms": 1000.0 * (after[4] - before[4]) / (after[3] - before[3])
        if after[3] > before[3]
        else None,
        "threads": args.threads,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = read_rows(args.pairs)
    pairs = spread_pairs(rows, args.count, 1) + spread_pairs(rows, args.count, 0)
    raw = args.out_dir / "bench_verifier_serving"
    raw.mkdir(parents=True, exist_ok=True)
    # the server runs in a temporary folder: a folder is passed absolute, `builtin` as it is
    folder = args.verifier if args.verifier == "builtin" else str(Path(args.verifier).resolve())
    neighbours: list[list[str]] = [[] for _ in pairs]
    if args.neighbours:
        from tiercache.semantic.embedder import Embedder

        neighbours = nearest_texts(rows, pairs, args.neighbours, Embedder().embed)
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
        "| verifier call mean (calls) | semantic hits: n, p50 / max (client) "
        "| a served on label 1 | a served on label 0 (wrong) | a neighbour served (wrong) "
        "| undetermined |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r in results:
        per = r["verified_pairs_per_lookup"]
        calls = "-"
        if r["verifier_calls"]:
            calls = f"{ms(r['verifier_call_mean_ms'])} ms ({r['verifier_calls']:.0f})"
        hit = r["hit_ms"]
        hit_cell = "0" if not hit["n"] else f"{hit['n']}, {hit['p50_ms']} / {hit['max_ms']} ms"
        md.append(
            f"| {r['verifier']} | {ms(r['lookup_mean_ms'])} ms | "
            f"{'-' if per is None else f'{per:.2f}'} | {calls} | {hit_cell} | "
            f"{r['hits_label_1']}/{r['pairs_label_1']} | {r['hits_label_0']}/{r['pairs_label_0']} "
            f"| {r['hits_neighbour']} | {r['hits_undetermined']} |"
        )
    stored_hits = sum(r["answered_from_cache_when_stored"] for r in results)
    if stored_hits:
        md.append("")
        md.append(
            f"- {stored_hits} of the texts asked to be stored were answered from the cache instead "
            "(not stored), over all servers"
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
