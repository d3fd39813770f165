"""Build a perf_analyzer ``--input-data`` JSON file for the Triton model ``ensemble``.

Usage::

    # mixed workload: N prompts, ~repeat-share of them exact repeats of earlier ones
    python -m tiercache_dev.perf.make_inputs --pairs PAIRS.jsonl --out inputs.json \\
        [--count 200] [--repeat-share 0.5] [--seed 0] [--max-tokens 16]

    # one prompt only (every request is the same -> exact-hit benchmark)
    python -m tiercache_dev.perf.make_inputs --single "What is Triton?" --out hit.json

    perf_analyzer -m ensemble -i grpc -u localhost:8001 --input-data inputs.json ...

PAIRS.jsonl holds one JSON object per line: {"a": str, "b": str, "label": 0|1,
"source": str}. The distinct ``a`` and ``b`` texts (see --fields) form the pool of
unique prompts. Of the N entries, round(N * repeat-share) are exact repeats of a
prompt that already appeared earlier in the list; the rest are new prompts drawn
from the shuffled pool. Repeats pick among the prompts seen so far with a Zipf-like
popularity (weight 1 / rank**s, ranks assigned at random), so a few prompts repeat
many times and most repeat rarely or never. The first entry is always new.

Output format (one entry per request; the model has max_batch_size > 0, so the
shapes exclude the batch dimension, which perf_analyzer adds itself)::

    {"data": [{"text_input": {"content": ["..."], "shape": [1]},
               "max_tokens": {"content": [16], "shape": [1]}}, ...]}

Caveat: perf_analyzer cycles through the "data" list round-robin, so once a run
has sent more than N requests, every later request repeats an earlier prompt.
Use a --count larger than the number of requests a measurement sends (or a
request-count based measurement) if the configured repeat share must hold.

Note: the pool holds both sides of paraphrase pairs, so a "new" prompt can be a
semantic (not exact) match of an earlier one; use --fields a to avoid that.

The output is deterministic for a given input file and --seed. Stdlib only.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import sys
from collections import Counter
from collections.abc import Iterable, Sequence


def load_prompt_pool(path: str, fields: Sequence[str]) -> list[str]:
    """Distinct, non-empty texts of the given fields, in first-seen file order."""
    seen = set()
    pool: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{lineno}: invalid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{lineno}: expected a JSON object")
            for field in fields:
                text = row.get(field)
                if isinstance(text, str) and text.strip() and text not in seen:
                    seen.add(text)
                    pool.append(text)
    return pool


def build_sequence(
    pool: Sequence[str], count: int, repeat_share: float, seed: int, zipf_s: float
) -> list[str]:
    """Return `count` prompts, about `repeat_share` of them repeats of earlier ones."""
    if count <= 0:
        return []
    rng = random.Random(seed)
    n_repeat = int(round(count * repeat_share))
    n_new = count - n_repeat
    if n_new < 1:  # the first entry cannot be a repeat
        n_new, n_repeat = 1, count - 1
    if n_new > len(pool):
        print(
            f"warning: only {len(pool)} unique prompts available for {n_new} new "
            f"entries; using more repeats",
            file=sys.stderr,
        )
        n_new = len(pool)
        n_repeat = count - n_new
    if n_new < 1:
        raise SystemExit("error: the prompt pool is empty")

    new_prompts = list(pool)
    rng.shuffle(new_prompts)
    new_prompts = new_prompts[:n_new]

    # Positions of new prompts: index 0 plus n_new-1 random positions among the rest.
    is_new = [False] * count
    is_new[0] = True
    for pos in rng.sample(range(1, count), n_new - 1):
        is_new[pos] = True

    # Zipf-like popularity: each unique prompt gets a random rank 1..n_new.
    ranks = list(range(1, n_new + 1))
    rng.shuffle(ranks)
    weights = [1.0 / (r**zipf_s) for r in ranks]

    out: list[str] = []
    seen: list[str] = []
    cum: list[float] = []  # cumulative popularity of the prompts seen so far
    next_new = 0
    for pos in range(count):
        if is_new[pos]:
            prompt = new_prompts[next_new]
            seen.append(prompt)
            cum.append((cum[-1] if cum else 0.0) + weights[next_new])
            next_new += 1
        else:
            x = rng.random() * cum[-1]
            prompt = seen[min(bisect.bisect_right(cum, x), len(seen) - 1)]
        out.append(prompt)
    return out


def make_entry(prompt: str, max_tokens: int, text_name: str, max_tokens_name: str) -> dict:
    return {
        text_name: {"content": [prompt], "shape": [1]},
        max_tokens_name: {"content": [max_tokens], "shape": [1]},
    }


def summarize(prompts: Iterable[str]) -> str:
    prompts = list(prompts)
    counts = Counter(prompts)
    n = len(prompts)
    n_unique = len(counts)
    repeats = n - n_unique
    share = repeats / n if n else 0.0
    top = counts.most_common(1)[0][1] if counts else 0
    return (
        f"entries={n} unique_prompts={n_unique} repeats={repeats} "
        f"repeat_share={share:.3f} max_occurrences_of_one_prompt={top}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Build a perf_analyzer --input-data JSON file for the 'ensemble' model.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pairs", help="JSONL file with {a, b, label, source} rows")
    src.add_argument("--single", metavar="PROMPT", help="emit exactly one entry with this prompt")
    p.add_argument("--out", required=True, help="output JSON path ('-' for stdout)")
    p.add_argument("--count", type=int, default=200, help="number of entries (default 200)")
    p.add_argument(
        "--repeat-share",
        type=float,
        default=0.5,
        help="fraction of entries that repeat an earlier prompt (default 0.5)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens value (default 16)")
    p.add_argument(
        "--fields", default="a,b", help="comma-separated JSONL fields used as prompts (default a,b)"
    )
    p.add_argument(
        "--zipf-s",
        type=float,
        default=1.1,
        help="Zipf exponent of prompt popularity for repeats (default 1.1)",
    )
    p.add_argument("--text-name", default="text_input", help="prompt tensor name")
    p.add_argument("--max-tokens-name", default="max_tokens", help="max-tokens tensor name")
    args = p.parse_args(argv)
    if args.count < 1:
        p.error("--count must be >= 1")
    if not 0.0 <= args.repeat_share <= 1.0:
        p.error("--repeat-share must be in [0, 1]")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if args.zipf_s < 0:
        p.error("--zipf-s must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.single is not None:
        prompts = [args.single]
        pool_size = 1
    else:
        fields = [f.strip() for f in args.fields.split(",") if f.strip()]
        pool = load_prompt_pool(args.pairs, fields)
        pool_size = len(pool)
        prompts = build_sequence(pool, args.count, args.repeat_share, args.seed, args.zipf_s)

    entries = [
        make_entry(p, args.max_tokens, args.text_name, args.max_tokens_name) for p in prompts
    ]
    # {"data": [...]} with one entry per line (valid JSON, easy to diff/grep).
    text = (
        '{"data": [\n' + ",\n".join(json.dumps(e, ensure_ascii=False) for e in entries) + "\n]}\n"
    )
    if args.out == "-":
        sys.stdout.write(text)
        stream = sys.stderr
    else:
        out_dir = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(out_dir, exist_ok=True)
        tmp = f"{args.out}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, args.out)
        stream = sys.stdout
    print(f"{summarize(prompts)} pool={pool_size} out={args.out}", file=stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
