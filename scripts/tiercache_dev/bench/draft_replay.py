"""Replay speculative drafting against recorded greedy answers (issue 17): what a change to the
drafter (tiercache.engine.drafts) does to the speedup, in seconds rather than the minutes of
`make bench-spec`, on more prompts than it runs, with a held-out half.

Usage::

    python -m tiercache_dev.bench.draft_replay record [--dev-prompts 24] [--pairs 24]
        [--recording .perf/draft_replay_recording.json] [--costs-only]
    python -m tiercache_dev.bench.draft_replay replay [--recording ...] [--out-dir .perf]

`record` runs the real CPU engine plainly (greedy, speculation and KV reuse off), once per
prompt, keeps each answer's token ids, and measures what one forward pass costs on this machine:
a step over k new tokens after a context (k = 1 to 33) and a prefill over n tokens, keeping one
position's logits and every position's (the cost model; medians of interleaved repeats;
`--costs-only` measures it again into an existing recording). Prompts: `make bench-spec`'s
own (its `again` and `new` lists; the `tune` split) and questions of the dev pairs file, every
other one held out (`held-out`: a drafter change is tuned on `tune` and must hold there too);
rewording pairs (label 1) likewise, `a` answered for the neighbour draft and `b` for the
answer to replay.

`replay` runs the drafter as torch_llm's engine does (tiercache.engine.torch_engine.generate:
the greedy prefill draft verified in the prompt's pass, then a proposal after every picked
token, each verified in one pass) against the recorded answers, and charges every pass its
measured cost. Greedy verification keeps exactly a draft's longest prefix that agrees with
plain decoding's answer, so the steps are the engine's own (tested against the engine:
tests/unit/test_engine_speculation.py); only the seconds are modelled. Workloads as in
`make bench-spec`: `again` (an answer of --max-tokens cached, asked with twice as many),
`again-near` (asked with 1.25 times), `reworded` (the neighbour's answer), `new` (nothing
cached). Each row also gives `ceiling`: the same passes with perfect drafts (the true
continuation, MAX_DRAFT_TOKENS a pass): about what no drafter can beat on this cost model.
Ends with one line per workload and split: `replay <workload> <split> speedup <x> ceiling <x>`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache_dev.console import invocation, machine_summary, progress, write_report
from tiercache_dev.paths import DEFAULT_STATE_DIR, PERF_DIR

STEP_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33)
PREFILL_TOKENS = (32, 64, 128, 192, 256, 320, 400)
STEP_CONTEXT = 200  # tokens before a measured step: a prompt and half an answer
SCOPE = b"replay"  # every replayed request in one scope, as the benchmark's are


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("command", choices=("record", "replay"))
    p.add_argument(
        "--recording",
        type=Path,
        default=PERF_DIR / "draft_replay_recording.json",
        help="the recorded answers and cost model (written by record, read by replay)",
    )
    p.add_argument("--max-tokens", type=int, default=96, help="the cached answer's max_tokens")
    p.add_argument("--dev-prompts", type=int, default=24, help="dev-file questions to record")
    p.add_argument("--pairs", type=int, default=24, help="rewording pairs to record")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per pass size")
    p.add_argument("--threads", type=int, default=2, help="torch threads (record)")
    p.add_argument(
        "--costs-only",
        action="store_true",
        help="record: measure the cost model again into an existing recording, its answers kept",
    )
    p.add_argument(
        "--pairs-file",
        type=Path,
        default=Path("../shared/eval/semantic_pairs_dev.jsonl"),
        help="dev pairs: questions and label-1 rewording pairs",
    )
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="tiercache state")
    p.add_argument("--out-dir", type=Path, default=PERF_DIR, help="report folder (replay)")
    args = p.parse_args(argv)
    for name in ("max_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("dev_prompts", "pairs"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    return args


# --- the cost model ---------------------------------------------------------------------------


def _interpolate(points: dict[int, float], k: int) -> float:
    """Piecewise linear through (tokens, seconds); the smallest size's cost below it, in
    proportion to the tokens past the largest."""
    xs = sorted(points)
    if k <= xs[0]:
        return points[xs[0]]
    if k >= xs[-1]:
        return points[xs[-1]] * k / xs[-1]
    for lo, hi in zip(xs, xs[1:], strict=False):
        if lo <= k <= hi:
            return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per forward pass: `step[k]` for k new tokens after a context; `prefill[n]` for a
    prompt of n tokens keeping the last position's logits (a plain prefill), `prefill_rows[n]`
    keeping every position's (empty: as `prefill`). A prefill that verifies a draft keeps a row
    per draft token and one more: charged in between, in proportion to its rows."""

    step: dict[int, float]
    prefill: dict[int, float]
    prefill_rows: dict[int, float] = field(default_factory=dict)

    def step_s(self, tokens: int) -> float:
        return _interpolate(self.step, tokens)

    def prefill_s(self, tokens: int, rows: int = 1) -> float:
        one = _interpolate(self.prefill, tokens)
        if not self.prefill_rows or tokens <= 1:
            return one
        every = _interpolate(self.prefill_rows, tokens)
        return one + (every - one) * (min(rows, tokens) - 1) / (tokens - 1)

    def to_json(self) -> dict[str, dict[str, float]]:
        return {
            "step": {str(k): v for k, v in self.step.items()},
            "prefill": {str(k): v for k, v in self.prefill.items()},
            "prefill_rows": {str(k): v for k, v in self.prefill_rows.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, dict[str, float]]) -> CostModel:
        def table(name: str) -> dict[int, float]:
            return {int(k): float(v) for k, v in data.get(name, {}).items()}

        return cls(table("step"), table("prefill"), table("prefill_rows"))


# --- the replay ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Case:
    """One request to replay: its prompt's token ids, the cached answers it is handed ((source,
    text)), `max_tokens`, and plain decoding's answer (token ids; `ended`: with an end token
    before max_tokens)."""

    name: str
    prompt_ids: list[int]
    drafts: list[tuple[str, str]]
    max_tokens: int
    answer: list[int]
    ended: bool


@dataclass(slots=True)
class Replayed:
    plain_s: float
    spec_s: float
    ceiling_s: float
    passes: int  # the speculative run's forward passes
    plain_passes: int
    steps: list[tuple[str, int, int]] = field(default_factory=list)


def truncated(answer: Sequence[int], ended: bool, max_tokens: int) -> tuple[list[int], bool]:
    """A recorded answer as plain decoding gives it under a smaller `max_tokens`."""
    if len(answer) >= max_tokens:
        return list(answer[:max_tokens]), False
    return list(answer), ended


def common_prefix(draft: Sequence[int], answer: Sequence[int]) -> int:
    """How many leading tokens of `draft` greedy verification keeps against `answer`."""
    kept = 0
    while kept < len(draft) and kept < len(answer) and draft[kept] == answer[kept]:
        kept += 1
    return kept


def replay(
    case: Case,
    cost: CostModel,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
    index: Any = None,
) -> Replayed:
    """The engine's speculative loop for `case` (tiercache.engine.torch_engine.generate,
    greedy), against its recorded answer; `index` is the scope's AnswerIndex view."""
    from tiercache.engine.drafts import Codec, Drafter, prefill_draft

    end_token = -1  # stands for the model's end token (never a drafted id)
    truth = case.answer + ([end_token] if case.ended else [])
    texts = [text for _, text in case.drafts]
    answers = [(source, encode(text)) for source, text in case.drafts]
    drafter = Drafter(
        answers, case.prompt_ids, index=index, texts=texts, codec=Codec(decode, encode)
    )
    source, verify = prefill_draft(answers, greedy=True)
    verify = verify[: case.max_tokens]
    generated: list[int] = []

    def take(tokens: Iterable[int]) -> int | None:
        """Take tokens into the answer as the engine's `take` does; the number taken when the
        answer ended among them, else None."""
        before = len(generated)
        for token in tokens:
            if token == end_token:
                return len(generated) - before
            generated.append(token)
            if len(generated) >= case.max_tokens:
                return len(generated) - before
        return None

    def agreed(draft: Sequence[int]) -> int:
        return common_prefix(draft, truth[len(generated) :])

    spec_s = cost.prefill_s(len(case.prompt_ids) + len(verify), len(verify) + 1)
    passes = 1
    done = False
    if verify:
        kept = agreed(verify)
        drafter.source = source
        drafter.accepted(len(verify), kept)
        taken = take(verify[:kept])
        if taken is not None:
            drafter.unused(kept - taken)
            done = True
    while not done:
        if take([truth[len(generated)]]) is not None:
            break
        draft = drafter.propose(generated, case.max_tokens - len(generated))
        passes += 1
        spec_s += cost.step_s(1 + len(draft))
        if not draft:
            continue
        kept = agreed(draft)
        drafter.accepted(len(draft), kept)
        taken = take(draft[:kept])
        if taken is not None:
            drafter.unused(kept - taken)
            break
    if generated != case.answer:
        raise AssertionError(f"{case.name}: the replay did not rebuild the recorded answer")
    picks = len(truth)  # each picked token, the end token included, after a pass
    plain_s = cost.prefill_s(len(case.prompt_ids)) + cost.step_s(1) * (picks - 1)
    ceiling_s = ceiling(case, verify, truth, cost)
    return Replayed(plain_s, spec_s, ceiling_s, passes, picks, drafter.steps)


def ceiling(case: Case, verify: Sequence[int], truth: Sequence[int], cost: CostModel) -> float:
    """The same request with perfect drafts: the prefill pass verifies `verify` as the engine
    does, then every pass picks a token and drafts the next MAX_DRAFT_TOKENS right. Not a
    strict bound: the measured cost curve is not monotonic, so another split of the passes
    could save a fraction of a step per request."""
    from tiercache.engine.drafts import MAX_DRAFT_TOKENS

    kept = common_prefix(verify, truth)
    seconds = cost.prefill_s(len(case.prompt_ids) + len(verify), len(verify) + 1)
    left = len(truth) - kept - 1  # picks still to make after the prefill's
    while left > 0:
        draft = min(MAX_DRAFT_TOKENS, left - 1)
        seconds += cost.step_s(1 + draft)
        left -= draft + 1
    return seconds


# --- record -------------------------------------------------------------------------------------


def dev_questions(path: Path, count: int) -> list[str]:
    """`count` distinct `a` texts spread over the dev pairs file (deterministic)."""
    if count == 0 or not path.is_file():
        return []
    texts: list[str] = []
    with path.open() as handle:
        for line in handle:
            a = json.loads(line)["a"]
            if a not in texts:
                texts.append(a)
    step = max(1, len(texts) // count)
    return texts[::step][:count]


def measure_costs(model: Any, repeats: int) -> CostModel:
    """Median seconds of steps over k new tokens after STEP_CONTEXT tokens, and of prefills over
    n tokens keeping one position's logits and every position's, each size timed once per
    round, the rounds interleaving the sizes."""
    import copy

    import torch

    step: dict[int, list[float]] = {k: [] for k in STEP_TOKENS}
    prefill: dict[int, list[float]] = {n: [] for n in PREFILL_TOKENS}
    rows: dict[int, list[float]] = {n: [] for n in PREFILL_TOKENS}
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> Any:
        return torch.randint(100, 20_000, (1, n), generator=generator)

    with torch.inference_mode():
        context = model(input_ids=ids(STEP_CONTEXT), use_cache=True).past_key_values
        model(input_ids=ids(8), past_key_values=copy.deepcopy(context), use_cache=True)  # warm
        for round_ in range(repeats):
            progress(f"  cost model: round {round_ + 1}/{repeats}")
            for k in STEP_TOKENS:
                cache = copy.deepcopy(context)
                began = time.perf_counter()
                model(input_ids=ids(k), past_key_values=cache, use_cache=True)
                step[k].append(time.perf_counter() - began)
            for n in PREFILL_TOKENS:
                for keep, times in ((1, prefill), (n, rows)):
                    began = time.perf_counter()
                    model(input_ids=ids(n), use_cache=True, logits_to_keep=keep)
                    times[n].append(time.perf_counter() - began)
    return CostModel(
        {k: statistics.median(v) for k, v in step.items()},
        {n: statistics.median(v) for n, v in prefill.items()},
        {n: statistics.median(v) for n, v in rows.items()},
    )


def record(args: argparse.Namespace) -> int:
    import torch

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine
    from tiercache.exact.request import GenerationRequest
    from tiercache_dev.bench.speculation import AGAIN_PROMPTS, NEW_PROMPTS, rewording_pairs

    if args.costs_only and not args.recording.is_file():
        print(f"no recording at {args.recording} to measure the costs into", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    progress(f"loading the engine ({args.threads} threads)")
    engine = TorchEngine(
        resolve_model(), args.state_dir / "models", "cpu", 2, kv_reuse=False, speculate=False
    )
    progress("measuring the cost of forward passes")
    costs = measure_costs(engine.model, args.repeats)
    if args.costs_only:
        data = json.loads(args.recording.read_text())
        if data["revision"] != engine.identity.revision:
            print("the recording is of another model revision", file=sys.stderr)
            return 2
        data["costs"] = costs.to_json()
        data["costs_measured"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        data["threads"] = args.threads
        args.recording.write_text(json.dumps(data) + "\n")
        progress(f"wrote the cost model into {args.recording}")
        return 0
    long = 2 * args.max_tokens
    questions = dev_questions(args.pairs_file, args.dev_prompts)
    prompts = [("again", "tune", p, long) for p in AGAIN_PROMPTS]
    prompts += [("new", "tune", p, args.max_tokens) for p in NEW_PROMPTS]
    prompts += [
        ("dev", "tune" if i % 2 == 0 else "held-out", p, long) for i, p in enumerate(questions)
    ]
    pairs = rewording_pairs(args.pairs_file, args.pairs) if args.pairs else []

    def answer(prompt: str, max_tokens: int) -> dict[str, Any]:
        request = GenerationRequest(prompt, max_tokens=max_tokens)
        events = list(engine.generate(request))
        return {
            "prompt_ids": engine.prompt_ids(request)[0].tolist(),
            "answer": list(events[-1].token_ids),
            "ended": events[-1].finish_reason == "stop",
            "text": "".join(e.text for e in events),
        }

    rows: list[dict[str, Any]] = []
    total = len(prompts) + len(pairs)
    for i, (kind, split, prompt, max_tokens) in enumerate(prompts, 1):
        rows.append({"kind": kind, "split": split, "prompt": prompt, **answer(prompt, max_tokens)})
        progress(f"  {i}/{total} {kind}: {len(rows[-1]['answer'])} tokens")
    for i, (a, b) in enumerate(pairs):
        neighbour = answer(a, args.max_tokens)["text"]
        row = {"kind": "reworded", "split": "tune" if i % 2 == 0 else "held-out", "prompt": b}
        rows.append({**row, **answer(b, args.max_tokens), "neighbour": neighbour})
        progress(f"  {len(prompts) + i + 1}/{total} reworded: {len(rows[-1]['answer'])} tokens")
    args.recording.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "recorded": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": invocation("tiercache_dev.bench.draft_replay"),
        "machine": machine_summary(),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "model": engine.identity.model_id,
        "revision": engine.identity.revision,
        "costs": costs.to_json(),
        "rows": rows,
    }
    args.recording.write_text(json.dumps(data) + "\n")
    progress(f"wrote {args.recording} ({len(rows)} answers)")
    return 0


# --- replay -------------------------------------------------------------------------------------


def cases(
    data: dict[str, Any], decode: Callable[[Sequence[int]], str]
) -> dict[tuple[str, str], list[Case]]:
    """The recording's requests by (workload, split), in recording order. A prompt's cached
    answer is its recorded answer's first max_tokens ids as text (what llm hands the engine),
    without an unfinished character at its end (the detokenizer holds one back)."""
    m = int(data["max_tokens"])
    out: dict[tuple[str, str], list[Case]] = {}

    def add(workload: str, split: str, case: Case) -> None:
        out.setdefault((workload, split), []).append(case)

    for row in data["rows"]:
        name, prompt_ids, ids, ended = row["prompt"], row["prompt_ids"], row["answer"], row["ended"]
        if row["kind"] == "reworded":
            drafts = [("neighbour", row["neighbour"])]
            add("reworded", row["split"], Case(name, prompt_ids, drafts, m, ids, ended))
            continue
        if row["kind"] == "new":
            add("new", row["split"], Case(name, prompt_ids, [], m, ids, ended))
            continue
        cached = [("answer", decode(ids[:m]).removesuffix("\ufffd"))]
        for workload, asked in (("again", 2 * m), ("again-near", m * 5 // 4)):
            answer, answer_ended = truncated(ids, ended, asked)
            add(workload, row["split"], Case(name, prompt_ids, cached, asked, answer, answer_ended))
        if row["kind"] == "dev":  # the same prompts with nothing cached
            answer, answer_ended = truncated(ids, ended, m)
            add("new", row["split"], Case(name, prompt_ids, [], m, answer, answer_ended))
    return out


def run_replay(
    data: dict[str, Any],
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
) -> dict[str, dict[str, Any]]:
    """Every workload and split replayed, each workload's requests in order with one answer
    index (as `make bench-spec` empties the engine's per workload, and adds each speculative
    answer to it)."""
    from tiercache.engine.drafts import AnswerIndex

    cost = CostModel.from_json(data["costs"])
    results: dict[str, dict[str, Any]] = {}
    for (workload, split), group in sorted(cases(data, decode).items()):
        index = AnswerIndex()
        runs = []
        for case in group:
            runs.append(replay(case, cost, encode, decode, index.view(SCOPE)))
            index.add(SCOPE, case.answer)
        plain = sum(r.plain_s for r in runs)
        steps = [s for r in runs for s in r.steps]
        results[f"{workload} {split}"] = {
            "workload": workload,
            "split": split,
            "requests": len(runs),
            "tokens": sum(len(c.answer) for c in group),
            "plain_s": plain,
            "spec_s": sum(r.spec_s for r in runs),
            "speedup": plain / sum(r.spec_s for r in runs),
            "ceiling": plain / sum(r.ceiling_s for r in runs),
            "passes": sum(r.passes for r in runs),
            "plain_passes": sum(r.plain_passes for r in runs),
            "draft_steps": len(steps),
            "proposed": sum(p for _, p, _ in steps),
            "accepted": sum(a for _, _, a in steps),
        }
    return results


def report(data: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    cost = CostModel.from_json(data["costs"])
    one = cost.step_s(1)
    lines = [
        "## Drafting replayed against recorded answers",
        "",
        f"- command: `{invocation('tiercache_dev.bench.draft_replay')}`",
        f"- recording: {data['recorded']}, `{data['command']}`, {data['threads']} torch "
        f"threads, {data['machine'].get('nproc')} CPUs, cached answers of "
        f"{data['max_tokens']} tokens; cost model measured "
        f"{data.get('costs_measured', data['recorded'])}",
        "- cost model (a step over k tokens, in single-token steps): "
        + ", ".join(f"{k}: {cost.step_s(k) / one:.2f}" for k in sorted(cost.step))
        + f" (one step {1000 * one:.1f} ms)",
        "",
        "| workload | split | requests | tokens | passes plain / spec | drafted steps | "
        "accepted / proposed | speedup (modelled) | ceiling: perfect drafts |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['workload']} | {r['split']} | {r['requests']} | {r['tokens']} | "
            f"{r['plain_passes']} / {r['passes']} | {r['draft_steps']} | "
            f"{r['accepted']} / {r['proposed']} | {r['speedup']:.2f} | {r['ceiling']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "record":
        return record(args)
    if not args.recording.is_file():
        print(f"no recording at {args.recording}: run `record` first", file=sys.stderr)
        return 2
    data = json.loads(args.recording.read_text())
    from transformers import AutoTokenizer

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import converted_dir

    source = resolve_model()
    converted = converted_dir(source, args.state_dir / "models")
    if source.identity.revision != data["revision"] or not (converted / "COMPLETE").exists():
        print(
            f"the recording is of revision {data['revision'][:16]}; this engine's model is "
            f"{source.identity.revision[:16]} (or not converted yet: start the engine once)",
            file=sys.stderr,
        )
        return 2
    tokenizer = AutoTokenizer.from_pretrained(converted)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    results = run_replay(data, encode, decode)
    write_report(args.out_dir, "draft_replay", report(data, results), results)
    for r in results.values():
        print(
            f"replay {r['workload']} {r['split']} speedup {r['speedup']:.2f} "
            f"ceiling {r['ceiling']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
