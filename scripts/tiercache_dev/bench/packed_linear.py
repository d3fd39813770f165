"""The CPU engine's forward passes with its linear layers through MKL (torch's default) and
through oneDNN's prepacked linear (`tiercache.packed_linear`), side by side in one run.

Usage::

    python -m tiercache_dev.bench.packed_linear [--rounds 7] [--threads 2] [--answers 64]

Loads the model twice (stock and packed) and times, in interleaved rounds (stock, packed,
stock, ...), the LM head alone over 1-16 rows, a prefill of 200 tokens, a one-token step after
200 tokens of context and passes over 2-32 new tokens after them; prints medians and the ratio
stock / packed per row. Then decodes every `make bench-spec` prompt greedily with both (plain
decoding, `--answers` tokens) and says how many answers are token for token the same: the
packed sums run in another order, so a token whose top two logits are that close can differ.
Ends with `packed step speedup <x> pass16 speedup <x> identical <n>/<m>`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiercache_dev.console import invocation, progress
from tiercache_dev.paths import REPO_ROOT

CONTEXT = 200
PASS_TOKENS = (2, 3, 4, 8, 16, 32)
HEAD_ROWS = (1, 2, 3, 4, 16)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--answers", type=int, default=64, help="tokens of each greedy answer compared (0: none)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=REPO_ROOT / ".tiercache",
        help="where the converted model is",
    )
    return parser.parse_args(argv)


def timed(call: Callable[[], Any]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def measure(model: Any, ids: Callable[[int], Any], context: Any) -> dict[str, float]:
    """One round's seconds for each measured call on `model` (inference mode)."""
    import torch.nn.functional as F

    head = model.get_output_embeddings()
    times: dict[str, float] = {}
    for rows in HEAD_ROWS:
        x = ids(rows).float().unsqueeze(-1).expand(1, rows, head.in_features).contiguous()
        times[f"LM head, {rows} row(s)"] = timed(
            lambda x=x: head(x) if hasattr(head, "packed") else F.linear(x, head.weight)
        )
    times[f"prefill {CONTEXT} tokens"] = timed(
        lambda: model(input_ids=ids(CONTEXT), use_cache=True, logits_to_keep=1)
    )
    for k in (1, *PASS_TOKENS):
        cache = copy.deepcopy(context)
        label = "one-token step" if k == 1 else f"pass over {k} tokens"
        times[label] = timed(
            lambda k=k, cache=cache: model(input_ids=ids(k), past_key_values=cache, use_cache=True)
        )
    return times


def greedy(model: Any, prompt_ids: list[int], tokens: int) -> list[int]:
    import torch

    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
    answer: list[int] = []
    while len(answer) < tokens:
        answer.append(int(out.logits[0, -1].argmax()))
        step = torch.tensor([[answer[-1]]])
        out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
    return answer


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.prompt import prompt_token_ids
    from tiercache.engine.torch_engine import load_model
    from tiercache.exact.request import GenerationRequest
    from tiercache.packed_linear import pack_linears
    from tiercache_dev.bench.speculation import AGAIN_PROMPTS, NEW_PROMPTS

    torch.set_num_threads(args.threads)
    progress(f"loading the model twice ({args.threads} threads)")
    source = resolve_model()
    tokenizer, stock = load_model(source, args.state_dir / "models", "cpu")
    _, packed = load_model(source, args.state_dir / "models", "cpu")
    report = pack_linears(packed)
    if not report.layers:
        print(f"nothing packed: {report.skipped}", file=sys.stderr)
        return 2
    models = {"stock (MKL)": stock, "packed (oneDNN)": packed}
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> Any:
        return torch.randint(100, 20_000, (1, n), generator=generator)

    rows: dict[str, dict[str, list[float]]] = {name: {} for name in models}
    with torch.inference_mode():
        context = stock(input_ids=ids(CONTEXT), use_cache=True).past_key_values
        for model in models.values():  # warm both
            measure(model, ids, context)
        for round_ in range(args.rounds):
            progress(f"round {round_ + 1}/{args.rounds}")
            for name, model in models.items():
                for label, seconds in measure(model, ids, context).items():
                    rows[name].setdefault(label, []).append(seconds)
        same = total = 0
        prompts = [*AGAIN_PROMPTS, *NEW_PROMPTS]
        for i, prompt in enumerate(prompts if args.answers else ()):
            progress(f"greedy answers {i + 1}/{len(prompts)}")
            request = GenerationRequest(prompt, max_tokens=args.answers)
            prompt_ids = prompt_token_ids(tokenizer, request)
            answers = [greedy(m, prompt_ids, args.answers) for m in models.values()]
            same += answers[0] == answers[1]
            total += 1
    names = list(models)
    print(
        f"# `{invocation('tiercache_dev.bench.packed_linear')}`: "
        f"{report.layers} linear layers packed, {args.threads} threads"
    )
    print(f"# median of {args.rounds} interleaved rounds, ms")
    print(f"| call | {names[0]} | {names[1]} | ratio |")
    print("|---|---:|---:|---:|")
    ratios: dict[str, float] = {}
    for label in rows[names[0]]:
        a, b = (statistics.median(rows[n][label]) * 1e3 for n in names)
        ratios[label] = a / b
        print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    if total:
        print(f"greedy answers of {args.answers} tokens identical: {same}/{total}")
    print(
        f"packed step speedup {ratios['one-token step']:.2f} "
        f"pass16 speedup {ratios['pass over 16 tokens']:.2f} identical {same}/{total}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
