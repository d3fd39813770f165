"""How often does speculation change a seeded sampled answer? (issue 17, `speculate_sampled`)

Usage::

    python -m tiercache_dev.diagnostics.sampled_speculation [--pairs FILE] [--count 40]
        [--temperature 0.8] [--max-tokens 48] [--threads 1] [--out-dir .perf]

For `--count` distinct prompts (the `a` side of the evaluation pairs, in file order), the CPU
engine (SmolLM2, the real weights) answers greedily, then the same prompt sampled with a seed
(`--temperature`, seed 1000 + its number) twice: plain, and speculative with
`speculate_sampled` on and the greedy answer as the draft (source `answer`, as llm sends it).
A verification pass picks each drafted position with that position's own seeded draw, but from
logits computed several positions at a time, which round differently from a single-token
pass's; where a draw falls that close to the boundary between two tokens' shares the pick
differs, and so does the rest of the answer. Reported: how many of the seeded answers differ
from plain decoding's, the sampled tokens, and the draft tokens accepted. Writes
OUT_DIR/sampled_speculation.md and .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache_dev.console import invocation, progress, write_report
from tiercache_dev.paths import DEFAULT_PAIRS, DEFAULT_STATE_DIR, PERF_DIR


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--count", type=int, default=40, help="prompts")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--out-dir", type=Path, default=PERF_DIR)
    args = parser.parse_args(argv)
    if args.count < 1 or args.max_tokens < 1 or not 0 < args.temperature <= 2:
        parser.error("--count and --max-tokens must be >= 1, --temperature in (0, 2]")
    return args


def prompts_of(pairs: Path, count: int) -> list[str]:
    """The first `count` distinct `a` prompts of the pairs file."""
    seen: dict[str, None] = {}
    with pairs.open(encoding="utf-8") as rows:
        for line in rows:
            seen.setdefault(json.loads(line)["a"], None)
            if len(seen) == count:
                break
    return list(seen)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine
    from tiercache.exact.request import GenerationRequest

    torch.set_num_threads(args.threads)
    engine = TorchEngine(
        resolve_model(), args.state_dir / "models", "cpu", 2, kv_reuse=False,
        speculate_sampled=True,
    )  # fmt: skip

    def answer(request: Any, drafts: tuple[tuple[str, str], ...], speculate: bool) -> Any:
        engine.speculate = speculate
        events = list(engine.generate(dataclasses.replace(request, drafts=drafts)))
        return "".join(e.text for e in events), events[-1].generated_tokens

    prompts = prompts_of(args.pairs, args.count)
    differ: list[int] = []
    tokens = accepted = 0
    for number, prompt in enumerate(prompts):
        greedy = GenerationRequest(prompt, max_tokens=args.max_tokens)
        drafted, _ = answer(greedy, (), False)
        sampled = dataclasses.replace(greedy, temperature=args.temperature, seed=1000 + number)
        plain, generated = answer(sampled, (), False)
        speculative, _ = answer(sampled, (("answer", drafted),), True)
        tokens += generated
        accepted += engine.last_drafter.accepted_total if engine.last_drafter else 0
        if speculative != plain:
            differ.append(number)
        progress(f"{number + 1}/{len(prompts)}: {len(differ)} differ so far")
    summary = {
        "prompts": len(prompts),
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "differ": len(differ),
        "differing_prompts": differ,
        "sampled_tokens": tokens,
        "accepted_draft_tokens": accepted,
    }
    markdown = (
        f"# Seeded sampled answers with speculate_sampled on\n\n`{invocation(__spec__.name)}`\n\n"
        f"{len(differ)} of {len(prompts)} seeded answers (temperature {args.temperature}, "
        f"{args.max_tokens} tokens) differ from plain decoding's (prompts {differ}); "
        f"{tokens} sampled tokens, {accepted} draft tokens accepted.\n"
    )
    write_report(args.out_dir, "sampled_speculation", markdown, summary)
    print(f"sampled speculation: {len(differ)} of {len(prompts)} answers differ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
