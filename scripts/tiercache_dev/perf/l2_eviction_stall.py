"""What an L2 eviction costs the write that meets it (issue 20): the stages' L2 (`LmdbStore`
with its GreedyDual-Size-Frequency values, as `parts.open_tiers` opens it) evicting in the write
that reaches its mark (`evict_early` off) against evicting on its own thread ahead of the
writes (`evict_early`, what the stages open), side by side.

Usage::

    python -m tiercache_dev.perf.l2_eviction_stall [--map-mib 2048] [--answer-chars 16000]
        [--rate 1000] [--evictions 3] [--rounds 2] [--out-dir .perf/l2_eviction_stall]

For each mode, in each of `--rounds` rounds (the modes interleaved): a fresh L2 of `--map-mib`
is filled to 85 % of its eviction mark with answers of `--answer-chars` (SHA-256 hex keys,
as L2's own), as fast as it takes them (not timed); then answers are written at `--rate` a
second (a host's write-backs: one per stored miss) until `--evictions` evictions have run, each
write timed. Reports, per mode, the entries L2 held, the writes' median, 99th percentile and
slowest time, how many writes took over 20 ms, and how many evictions ran in a write and how
many ahead of them. Writes `l2_eviction_stall.md` and `.json` to `--out-dir`.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.exact.codec import CacheEntry
from tiercache.exact.l2_values import L2Values, l2_values_map_bytes
from tiercache.exact.stores import LmdbStore
from tiercache_dev.console import invocation, progress, write_report
from tiercache_dev.paths import PERF_DIR

MIB = 1 << 20
SLOW_S = 0.020
MODES = (("inline", False), ("early", True))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--map-mib", type=int, default=2048, help="l2_max_bytes")
    parser.add_argument("--answer-chars", type=int, default=16_000, help="each answer's length")
    parser.add_argument("--rate", type=float, default=1000.0, help="timed writes per second")
    parser.add_argument("--evictions", type=int, default=3, help="evictions per timed run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the modes interleaved")
    parser.add_argument("--out-dir", type=Path, default=PERF_DIR / "l2_eviction_stall")
    args = parser.parse_args(argv)
    if args.map_mib < 16 or args.answer_chars < 1 or args.rate <= 0 or args.evictions < 1:
        parser.error("--map-mib >= 16, --answer-chars >= 1, --rate > 0, --evictions >= 1")
    return args


def key(number: int) -> str:
    return hashlib.sha256(f"k{number}".encode()).hexdigest()  # as L2's keys are


def run(folder: Path, early: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's run in `folder` (see the module docstring)."""
    map_bytes = args.map_mib * MIB
    values = L2Values(folder / "values", l2_values_map_bytes(map_bytes))
    store = LmdbStore(folder / "l2", map_bytes, values=values, evict_early=early)
    answer = "x" * args.answer_chars
    # well under the early band (0.95 of the mark): a fill in batches of 256 must not reach it
    mark = int(map_bytes * 0.75 * 0.85)
    number = 0
    try:
        while store.stats().bytes < mark:  # not timed
            for _ in range(256):
                number += 1
                store.put(key(number), CacheEntry(text=answer, created_s=float(number)))
        entries = store.stats().entries
        progress(f"  {'early' if early else 'inline'}: filled with {entries} entries; timing")
        times: list[float] = []
        started = time.perf_counter()
        evicted = store.stats().evictions
        evictions_seen = 0
        while evictions_seen < args.evictions:
            number += 1
            due = started + len(times) / args.rate
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            begun = time.perf_counter()
            store.put(key(number), CacheEntry(text=answer, created_s=float(number)))
            times.append(time.perf_counter() - begun)
            if len(times) % 64 == 0:
                now = store.stats().evictions
                evictions_seen += now > evicted
                evicted = now
        held = store.stats().entries
    finally:
        store.close()  # joins an eviction still under way on the store's thread
    ahead = store.early_evictions  # counted as each one ends: after the join
    ordered = sorted(times)
    return {
        "mode": "early" if early else "inline",
        "entries": entries,
        "entries_after": held,
        "writes": len(times),
        "p50_ms": round(1000 * statistics.median(ordered), 3),
        "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 3),
        "max_ms": round(1000 * ordered[-1], 1),
        "slow_writes": sum(t > SLOW_S for t in times),
        "evictions_ahead": ahead,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    for round_number in range(1, args.rounds + 1):
        for name, early in MODES:
            progress(f"round {round_number}/{args.rounds}: {name}")
            with tempfile.TemporaryDirectory(prefix="tiercache-l2-stall-") as folder:
                row = run(Path(folder), early, args)
            row["round"] = round_number
            rows.append(row)
    lines = [
        f"`{invocation('tiercache_dev.perf.l2_eviction_stall', None)}`",
        "",
        f"{args.map_mib} MiB L2, answers of {args.answer_chars} characters, {args.rate:g} "
        f"writes/s, {args.evictions} evictions a run",
        "",
        "| round | eviction | entries | timed writes | write p50 / p99 / max ms "
        f"| writes over {SLOW_S * 1000:g} ms | evictions ahead of the writes |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['round']} | {row['mode']} | {row['entries']} | {row['writes']} "
            f"| {row['p50_ms']} / {row['p99_ms']} / {row['max_ms']} | {row['slow_writes']} "
            f"| {row['evictions_ahead']} |"
        )
    by_mode = {
        name: statistics.median(r["max_ms"] for r in rows if r["mode"] == name) for name, _ in MODES
    }
    ratio = by_mode["early"] / by_mode["inline"] if by_mode["inline"] else float("nan")
    lines += ["", f"ratio early/inline slowest write (median over rounds) {ratio:.3f}"]
    md = "\n".join(lines) + "\n"
    write_report(args.out_dir, "l2_eviction_stall", md, {"rows": rows, "max_ratio": ratio})
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
