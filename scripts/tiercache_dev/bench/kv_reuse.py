"""Time to first token with and without prefix KV reuse in the CPU engine, side by side.

Usage::

    python -m tiercache_dev.bench.kv_reuse [--prefixes 128,256,512,1024] [--rounds 3]
        [--max-tokens 16] [--tokens-per-block 32] [--kv-pool-max-bytes 268435456] [--threads 1]
        [--state-dir .tiercache] [--json FILE]

Loads SmolLM2-135M-Instruct as torch_llm does (tiercache.engine.torch_engine) and, in one process
and one run, for each shared prefix length (a "system prompt" built to give that many prompt
tokens in common, chat template included) and each round, on a fresh block pool:

1. off: reuse disabled, request B (system prompt + a short user turn): TTFT and its answer;
2. miss: reuse enabled, request A (the same system prompt, another user turn) on the empty pool:
   TTFT of a miss, which also pays for hashing and storing its blocks;
3. hit: reuse enabled, request B again: it reuses the system prompt's full blocks from A.

TTFT is the time from `generate()` to its first event (tokenize, look up, prefill, first token;
the number of tokens behind that first event is checked to be 1). The answers of B off and on
(greedy, `--max-tokens`) must be identical. Reported: medians per length, the speed-up (target:
>= 5x at 512 tokens, issue 5), KV bytes per token, the pool's bytes against its budget (largest
seen after any request). Runs on `--threads` torch threads (default 1: steadier on a shared
machine). Exit code 1 if any answer differs, else 0 (target PASS/MISS is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiercache_dev.paths import DEFAULT_STATE_DIR
from tiercache_dev.stats import median

TARGET_PREFIX = 512
TARGET_SPEEDUP = 5.0
TURN_A = "Question: when does the store open on Sundays?"
TURN_B = "Question: can I return a used drill?"

SUBJECTS = ("Staff", "Cashiers", "The manager", "Delivery drivers", "Support agents", "Guests")
ACTIONS = ("must check", "should confirm", "may refuse", "will record", "need to explain")
OBJECTS = (
    "the receipt",
    "the warranty card",
    "the delivery address",
    "the paint colour code",
    "the opening hours",
    "the return window",
    "the loyalty number",
)


def system_text(words: int) -> str:
    """Deterministic, varied policy text of `words` words (no repeated sentence)."""
    out: list[str] = []
    index = 0
    while len(out) < words:
        subject = SUBJECTS[index % len(SUBJECTS)]
        action = ACTIONS[(index // len(SUBJECTS)) % len(ACTIONS)]
        obj = OBJECTS[(index * 3) % len(OBJECTS)]
        out.extend(
            f"Rule {index + 1}: {subject} {action} {obj} within {index % 9 + 2} days.".split()
        )
        index += 1
    return " ".join(out[:words])


def prompt(system: str, turn: str) -> str:
    return f"{system} {turn}"


def shared_tokens(engine: Any, system: str) -> int:
    """Prompt tokens requests A and B have in common (chat template header + system text)."""
    from tiercache.exact.request import GenerationRequest

    a = engine.prompt_ids(GenerationRequest(prompt(system, TURN_A)))[0].tolist()
    b = engine.prompt_ids(GenerationRequest(prompt(system, TURN_B)))[0].tolist()
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def build_system(engine: Any, target: int) -> tuple[str, int]:
    """The shortest system text whose shared prefix reaches `target` tokens (binary search)."""
    low, high = 1, target * 2
    while low < high:
        middle = (low + high) // 2
        if shared_tokens(engine, system_text(middle)) >= target:
            high = middle
        else:
            low = middle + 1
    text = system_text(low)
    return text, shared_tokens(engine, text)


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_ms: float
    first_event_tokens: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    text: str


def run_request(engine: Any, text: str, max_tokens: int) -> Sample:
    from tiercache.exact.request import GenerationRequest

    request = GenerationRequest(text, max_tokens=max_tokens, tenant_scope="bench")
    started = time.perf_counter()
    events = engine.generate(request)
    first = next(events)
    ttft_ms = (time.perf_counter() - started) * 1e3
    rest = list(events)
    final = (rest or [first])[-1]
    return Sample(
        ttft_ms,
        first.generated_tokens,
        final.prompt_tokens,
        final.reused_tokens,
        final.computed_tokens,
        first.text + "".join(e.text for e in rest),
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--prefixes", default="128,256,512,1024", help="shared prefix token counts")
    p.add_argument("--rounds", type=int, default=3, help="measurements per length and mode")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length for the check")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--kv-pool-max-bytes", type=int, default=256 << 20)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("TIERCACHE_STATE_DIR") or DEFAULT_STATE_DIR),
        help="where converted weights live ($TIERCACHE_STATE_DIR, else .tiercache/)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from tiercache.engine.kv_cache import KvBlockPool
    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine

    torch.set_num_threads(args.threads)
    engine = TorchEngine(
        resolve_model(),
        args.state_dir / "models",
        "cpu",
        tokens_per_block=args.tokens_per_block,
        kv_pool_max_bytes=args.kv_pool_max_bytes,
    )
    run_request(engine, prompt(system_text(20), TURN_A), 2)  # warm up kernels, untimed
    rows: list[dict[str, Any]] = []
    largest_pool_bytes = 0
    all_same = True
    for target in (int(t) for t in args.prefixes.split(",")):
        system, shared = build_system(engine, target)
        samples: dict[str, list[Sample]] = {"off": [], "miss": [], "hit": []}
        for _ in range(args.rounds):
            engine.kv_pool = KvBlockPool(args.kv_pool_max_bytes, args.tokens_per_block)
            engine.kv_reuse = False
            samples["off"].append(run_request(engine, prompt(system, TURN_B), args.max_tokens))
            engine.kv_reuse = True
            samples["miss"].append(run_request(engine, prompt(system, TURN_A), args.max_tokens))
            largest_pool_bytes = max(largest_pool_bytes, engine.kv_stats().bytes)
            samples["hit"].append(run_request(engine, prompt(system, TURN_B), args.max_tokens))
            largest_pool_bytes = max(largest_pool_bytes, engine.kv_stats().bytes)
        same = all(h.text == o.text for h, o in zip(samples["hit"], samples["off"], strict=True))
        all_same &= same
        medians = {k: median(s.ttft_ms for s in v) for k, v in samples.items()}
        hit = samples["hit"][-1]
        rows.append(
            {
                "prefix_tokens": shared,
                "prompt_tokens": hit.prompt_tokens,
                "reused_tokens": hit.reused_tokens,
                "computed_tokens": hit.computed_tokens,
                "ttft_off_ms": round(medians["off"], 1),
                "ttft_miss_ms": round(medians["miss"], 1),
                "ttft_hit_ms": round(medians["hit"], 1),
                "speedup": round(medians["off"] / medians["hit"], 2),
                "same_output": same,
                "first_event_tokens": max(
                    s.first_event_tokens for v in samples.values() for s in v
                ),
                "answer": hit.text,
                "samples": {k: [asdict(s) | {"text": None} for s in v] for k, v in samples.items()},
            }
        )
        print(f"prefix {shared}: {rows[-1]['speedup']}x", file=sys.stderr, flush=True)

    at_target = [r for r in rows if r["prefix_tokens"] >= TARGET_PREFIX]
    verdict = ""
    if at_target:
        met = at_target[0]["speedup"] >= TARGET_SPEEDUP
        verdict = f"{'PASS' if met else 'MISS'} (>= {TARGET_SPEEDUP:g}x at {TARGET_PREFIX})"
    summary = {
        "threads": args.threads,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "tokens_per_block": args.tokens_per_block,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "kv_pool_max_bytes": args.kv_pool_max_bytes,
        "largest_pool_bytes": largest_pool_bytes,
        "pool_within_budget": largest_pool_bytes <= args.kv_pool_max_bytes,
        "all_same_output": all_same,
        "target": verdict,
        "rows": rows,
    }
    print(
        "| shared prefix tokens | prompt tokens | reused | computed | TTFT off ms | TTFT miss ms "
        "| TTFT hit ms | speed-up | same output |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['prefix_tokens']} | {r['prompt_tokens']} | {r['reused_tokens']} | "
            f"{r['computed_tokens']} | {r['ttft_off_ms']:.1f} | {r['ttft_miss_ms']:.1f} | "
            f"{r['ttft_hit_ms']:.1f} | {r['speedup']:.2f}x | "
            f"{'yes' if r['same_output'] else 'NO'} |"
        )
    print()
    print(
        f"KV bytes per token: {engine.kv_bytes_per_token:,}; block of {args.tokens_per_block} "
        f"tokens: {engine.kv_bytes_per_token * args.tokens_per_block:,} bytes; pool: largest "
        f"{largest_pool_bytes:,} of {args.kv_pool_max_bytes:,} bytes; threads {args.threads}, "
        f"medians of {args.rounds} rounds; target {verdict}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
