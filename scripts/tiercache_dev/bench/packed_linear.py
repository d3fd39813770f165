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
Then the memory of a `TorchEngine`, stock and packed, each in a process of its own (RSS after
loading and after one generation, and the peak), and the embedder: one text and a batch of 16
encoded by a stock and a packed instance in alternation (1 thread, as the embedder stage runs).
Ends with `packed step speedup <x> pass16 speedup <x> identical <n>/<m>`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
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
    parser.add_argument("--memory-child", choices=("stock", "packed"), help=argparse.SUPPRESS)
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


def memory_child(args: argparse.Namespace) -> int:
    """In a process of its own: a TorchEngine stock or packed, its RSS in MiB after loading and
    after one generation, and the process's peak, as one JSON line."""
    import resource

    import torch

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine
    from tiercache.exact.request import GenerationRequest

    def rss() -> float:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20

    torch.set_num_threads(args.threads)
    before = rss()
    engine = TorchEngine(
        resolve_model(),
        args.state_dir / "models",
        "cpu",
        1,
        kv_reuse=False,
        speculate=False,
        packed_linears=args.memory_child == "packed",
    )
    loaded = rss() - before
    request = GenerationRequest("Explain what a hash table is.", max_tokens=32)
    for _ in engine.generate(request, lambda: False):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"loaded": loaded, "generated": rss() - before, "peak": peak - before}))
    return 0


def memory_rows(args: argparse.Namespace) -> list[str]:
    rows = []
    for kind in ("stock", "packed"):
        progress(f"engine memory, {kind}, in a process of its own")
        command = [sys.executable, "-m", "tiercache_dev.bench.packed_linear"]
        command += ["--memory-child", kind, "--threads", str(args.threads)]
        command += ["--state-dir", str(args.state_dir)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(
            f"| {kind} | {got['loaded']:.0f} | {got['generated']:.0f} | {got['peak']:.0f} |"
        )
    return rows


def embedder_rows(rounds: int) -> list[str]:
    import torch

    from tiercache.semantic.embedder import Embedder

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    progress("the embedder, stock and packed")
    embedders = {"stock": Embedder(packed_linears=False), "packed": Embedder()}
    inputs = {
        "one text": ["What is the capital of France and why is it famous?"],
        "16 texts": [f"How do I reset my password on account number {i}?" for i in range(16)],
    }
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, embedder in embedders.items():
            for label, texts in inputs.items():
                embedder.embed(texts)
                for _ in range(10):
                    times.setdefault((label, name), []).append(
                        timed(lambda e=embedder, t=texts: e.embed(t))
                    )
    torch.set_num_threads(threads)
    texts = inputs["16 texts"]
    apart = float(abs(embedders["stock"].embed(texts) - embedders["packed"].embed(texts)).max())
    rows = []
    for label in inputs:
        a, b = (statistics.median(times[(label, n)]) * 1e3 for n in embedders)
        rows.append(f"| {label} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    rows.append(f"vectors of the 16 texts: largest difference {apart:.2g}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        return memory_child(args)
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
    del models, stock, packed, context
    memory, embedder = memory_rows(args), embedder_rows(args.rounds)
    print("\n# a TorchEngine's RSS, MiB above the process's before loading, each in a process")
    print("# of its own (peak: the process's highest)")
    print("| engine | after loading | after one generation | peak |")
    print("|---|---:|---:|---:|")
    print("\n".join(memory))
    print("\n# the embedder, 1 thread, ms (median of 10 encodes per round, rounds alternating)")
    print("| input | stock (MKL) | packed (oneDNN) | ratio |")
    print("|---|---:|---:|---:|")
    print("\n".join(embedder))
    print(
        f"packed step speedup {ratios['one-token step']:.2f} "
        f"pass16 speedup {ratios['pass over 16 tokens']:.2f} identical {same}/{total}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
