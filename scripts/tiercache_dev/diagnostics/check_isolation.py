"""Tenant isolation over many mixed requests, and the cost of hit-latency padding.

Usage::

    .venv/bin/python -m tiercache_dev.diagnostics.check_isolation [--requests 10000]
        [--tenants 5] [--concurrency 8] [--url HOST:PORT] [--collapse-tenants] [--json OUT.json]
    .venv/bin/python -m tiercache_dev.diagnostics.check_isolation --padding-bench
        [--hit-padding-ms 250]
        [--hit-padding-jitter-ms 50] [--bench-prompts 40] [--bench-hits 400]

Isolation (the default): starts a tritonserver on a copy of model_repository with a fresh state
dir and the committed adapters (or uses the one at --url), then sends `--requests` requests over
gRPC from `--concurrency` threads on behalf of `--tenants` tenants, interleaved, mixing:

- repeats of a pool of prompts every tenant draws from (exact hits for the tenant that asked
  before; a miss for a tenant that had not, whoever else had),
- one side, then the other, of rewording pairs (semantic hits, within a tenant),
- user turns after long system prompts: one per tenant and three that every tenant uses, since
  the engine's prefix KV pool must not serve one tenant's blocks to another,
- new prompts, some with a LoRA adapter (brief, caps, french), max_tokens 1 to 4.

Every outcome goes to tiercache_client.isolation.IsolationOracle (with the engine's tokenizer,
for the KV rule). Prints a table per tenant and kind, exits 1 on any leak, 2 on request errors.
`--collapse-tenants` is the live positive control: every request is sent as one tenant while the
oracle is told the intended ones, so it must report leaks (and exit 1).

Padding (`--padding-bench`): one server whose llm pads every tenant but `bench-trusted`; the same
prompts are generated (misses) and then asked again (hits) as the trusted tenant and as a padded
one, at the same concurrency. Prints miss and hit latency p50/p99 and hit throughput for both
side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tiercache.server import copy_repository
from tiercache_client import GenerationResult, TierCacheClient, TierCacheClientError
from tiercache_client.isolation import IsolationOracle, Outcome, Report, Sent, Tokenize
from tiercache_dev import paths, stats
from tiercache_dev.console import exit_on_sigterm
from tiercache_dev.paths import DEFAULT_PAIRS, MODEL_REPOSITORY
from tiercache_dev.servers import TritonServer, running, triton

ADAPTERS = ("brief", "caps", "french")
TRUSTED = "bench-trusted"

# Rewordings the semantic guard accepts (tests/integration/test_semantic.py and similar); used
# when the dev pairs file is absent.
BUILTIN_PAIRS = [
    ("What is the capital of France?", "What's the capital of France?"),
    ("How tall is Mount Everest?", "How high is Mount Everest?"),
    ("Name the largest ocean on Earth.", "Which is the largest ocean on Earth?"),
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the boiling point of water?", "At what temperature does water boil?"),
    ("Who wrote Romeo and Juliet?", "Who is the author of Romeo and Juliet?"),
    ("How many legs does a spider have?", "How many legs do spiders have?"),
    ("What is the speed of light?", "How fast does light travel?"),
]
TOPICS = [
    "photosynthesis", "the moon", "volcanoes", "tea", "bicycles", "the Roman empire", "rainbows",
    "honey bees", "glaciers", "jazz", "the printing press", "octopuses", "chess", "deserts",
    "electric cars", "coral reefs", "the violin", "penguins", "bread", "lighthouses",
]  # fmt: skip
FORMS = [
    "Tell me one fact about {t}.",
    "Explain {t} to a child.",
    "Why does {t} matter?",
    "Give a one-line summary of {t}.",
    "What is surprising about {t}?",
]
SYSTEM = (
    "You are the support assistant of {org}. Answer politely and briefly, never share internal "
    "notes, refer billing questions to the billing team, refer legal questions to counsel, and "
    "always end with a short offer of further help. Customer tier: {tier}. Region: {region}."
)
TURNS = [
    "My invoice number {n} looks wrong, what should I do?",
    "Can I change the delivery address of order {n}?",
    "How do I cancel subscription {n}?",
    "Is ticket {n} still open?",
    "Please summarize case {n} in one line.",
]


def load_pairs(path: Path | None, limit: int, rng: random.Random) -> list[tuple[str, str]]:
    if path is None or not path.exists():
        return list(BUILTIN_PAIRS)
    pairs = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("label") == 1 and len(row["a"]) < 300 and len(row["b"]) < 300:
            pairs.append((row["a"], row["b"]))
    rng.shuffle(pairs)
    return pairs[:limit] + list(BUILTIN_PAIRS)


def build_workload(
    requests: int,
    tenants: Sequence[str],
    pairs: Sequence[tuple[str, str]],
    seed: int = 0,
    adapters: Sequence[str] = ADAPTERS,
    variety: float = 1.0,
) -> list[Sent]:
    """`requests` requests, tenants interleaved at random, kinds mixed (see the module doc);
    `adapters` are the lora_names used (() for a server without adapters). `variety` (0, 1]
    scales how many distinct prompts there are, and so how many requests are misses (which is
    what costs time on a CPU engine)."""
    rng = random.Random(seed)
    adapters = tuple(adapters)

    def part(items: Sequence[Any]) -> Sequence[Any]:
        return items[: max(1, math.ceil(len(items) * variety))]

    pool = [
        Sent("", form.format(t=topic), rng.randint(1, 4), rng.choice(("",) * 5 + adapters))
        for topic in part(TOPICS)
        for form in FORMS
    ]
    pairs = part(pairs)
    turns = part(TURNS)
    turn_numbers = max(1, math.ceil(6 * variety))
    new_share = 0.05 * variety
    shared_systems = [
        SYSTEM.format(org=org, tier="gold", region="EU") for org in ("Acme", "Globex", "Initech")
    ]
    own_system = {t: SYSTEM.format(org=f"tenant {t}", tier="silver", region="US") for t in tenants}
    pair_side: dict[tuple[str, int], int] = {}
    sent: list[Sent] = []
    for i in range(requests):
        tenant = rng.choice(tenants)
        kind = rng.random()
        if kind < 0.5 - new_share:  # a prompt from the pool every tenant draws from
            p = rng.choice(pool)
            sent.append(Sent(tenant, p.prompt, p.max_tokens, p.lora_name))
        elif kind < 0.67 - new_share:  # a rewording pair, one side then the other
            g = rng.randrange(len(pairs))
            side = pair_side.get((tenant, g), rng.randrange(2))
            pair_side[(tenant, g)] = 1 - side
            sent.append(Sent(tenant, pairs[g][side], 4, group=f"pair-{g}"))
        elif (
            kind < 1 - new_share
        ):  # a user turn after a long system prompt, shared or the tenant's own
            system = rng.choice([*shared_systems, own_system[tenant]])
            turn = rng.choice(turns).format(n=rng.randrange(turn_numbers))
            sent.append(Sent(tenant, f"{system}\n\n{turn}", rng.randint(1, 2)))
        else:  # a new prompt
            lora = rng.choice(("",) * 3 + adapters)
            sent.append(Sent(tenant, f"Request {i}: name a color ({seed}).", 2, lora))
    return sent


def engine_tokenizer(model: str = "smollm2-135m-instruct") -> Tokenize:
    """The engine's tokenizer with its chat template (what torch_llm prefills)."""
    from transformers import AutoTokenizer

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.prompt import prompt_token_ids
    from tiercache.exact.request import GenerationRequest

    source = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(
        str(source.gguf_path.parent), gguf_file=source.gguf_path.name
    )

    def tokenize(prompt: str) -> list[int]:
        return prompt_token_ids(tok, GenerationRequest(prompt))

    return tokenize


def drive(
    client: TierCacheClient,
    sent: Sequence[Sent],
    concurrency: int,
    collapse_tenants: bool = False,
    progress: Callable[[int, Outcome], None] | None = None,
) -> list[Outcome]:
    """Send every request (in order, `concurrency` at a time) and collect the outcomes in
    completion order. With `collapse_tenants` every request goes out as one tenant."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    wire_tenant = f"collapsed-{uuid.uuid4().hex[:6]}"

    def one(s: Sent) -> None:
        started = time.perf_counter()
        try:
            r = client.generate_text(
                s.prompt,
                max_tokens=s.max_tokens,
                tenant=wire_tenant if collapse_tenants else s.tenant,
                lora_name=s.lora_name or None,
                stream=False,
            )
            outcome = Outcome(
                s,
                started,
                time.perf_counter(),
                r.cache_status,
                r.text,
                r.similarity,
                r.kv_reused_tokens,
            )
        except TierCacheClientError as exc:
            outcome = Outcome(s, started, time.perf_counter(), "", error=str(exc))
        with lock:
            outcomes.append(outcome)
            if progress is not None:
                progress(len(outcomes), outcome)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(one, s) for s in sent]:
            future.result()
    return outcomes


def isolation_server(
    root: Path, llm_parameters: dict[str, str] | None = None, log_name: str = "triton.log"
) -> TritonServer:
    """A tritonserver (not started) on a copy of model_repository under `root` whose llm has
    `llm_parameters`, with a fresh state dir and the committed adapters."""
    repo = copy_repository(
        MODEL_REPOSITORY, root / "model_repository", {"llm": llm_parameters or {}}
    )
    state = root / "state"
    state.mkdir()
    return triton(repo, state, log_path=root / log_name, adapters_dir=paths.ADAPTERS)


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    return stats.summary((v * 1e3 for v in values_s), digits=1)


def check_isolation(args: argparse.Namespace, url: str) -> tuple[Report, dict[str, Any]]:
    run = uuid.uuid4().hex[:6]
    rng = random.Random(args.seed)
    pairs = load_pairs(args.pairs, args.max_pairs, rng)
    tenants = [f"iso-{run}-{i}" for i in range(args.tenants)]
    sent = build_workload(args.requests, tenants, pairs, args.seed, variety=args.variety)
    started = time.perf_counter()
    last = [started]
    log = args.outcomes.open("w") if args.outcomes else None

    def progress(done: int, outcome: Outcome) -> None:
        if log is not None:  # kept as they come, so a run cut short can still be judged
            log.write(json.dumps(asdict(outcome)) + "\n")
            log.flush()
        now = time.perf_counter()
        if now - last[0] > 30 or done == len(sent):
            last[0] = now
            print(f"  {done}/{len(sent)} in {now - started:.0f} s", file=sys.stderr)

    with TierCacheClient(url, timeout_s=600) as client:
        outcomes = drive(client, sent, args.concurrency, args.collapse_tenants, progress)
    elapsed = time.perf_counter() - started
    if log is not None:
        log.close()
    report, summary = judge(args, outcomes)
    summary.update(
        tenants=args.tenants,
        concurrency=args.concurrency,
        collapse_tenants=args.collapse_tenants,
        elapsed_s=round(elapsed, 1),
        requests_per_s=round(len(outcomes) / elapsed, 1),
    )
    return report, summary


def load_outcomes(path: Path) -> list[Outcome]:
    outcomes = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        outcomes.append(Outcome(**{**row, "sent": Sent(**row["sent"])}))
    return outcomes


def judge(args: argparse.Namespace, outcomes: list[Outcome]) -> tuple[Report, dict[str, Any]]:
    tokenize = engine_tokenizer() if not args.no_tokenizer else None
    report = IsolationOracle(tokenize, tokens_per_block=args.tokens_per_block).check(outcomes)
    statuses: dict[str, int] = {}
    for o in outcomes:
        key = "error" if o.error else o.cache_status
        statuses[key] = statuses.get(key, 0) + 1
    summary = {
        "requests": len(outcomes),
        "statuses": statuses,
        "kv_reuse_responses": sum((o.kv_reused_tokens or 0) > 0 for o in outcomes),
        "leaks": len(report.leaks),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }
    return report, summary


def timed_requests(
    client: TierCacheClient, prompts: Sequence[str], tenant: str, max_tokens: int, concurrency: int
) -> list[GenerationResult]:
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [
            pool.submit(client.generate_text, p, max_tokens=max_tokens, tenant=tenant)
            for p in prompts
        ]
        return [f.result() for f in futures]


def padding_bench(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Misses then hits of the same prompts, as the trusted tenant and as a padded one."""
    run = uuid.uuid4().hex[:6]
    prompts = [
        f"Give one short fact about {topic} ({run}, {i})."
        for i, topic in enumerate(TOPICS * (args.bench_prompts // len(TOPICS) + 1))
    ][: args.bench_prompts]
    results: dict[str, Any] = {}
    with TierCacheClient(url, timeout_s=600) as client:
        for label, tenant in (("trusted", TRUSTED), ("padded", f"bench-padded-{run}")):
            misses = [
                client.generate_text(p, max_tokens=args.bench_max_tokens, tenant=tenant)
                for p in prompts
            ]
            assert all(r.cache_status == "miss" for r in misses), "warm-up prompts must be new"
            asks = [prompts[i % len(prompts)] for i in range(args.bench_hits)]
            started = time.perf_counter()
            hits = timed_requests(client, asks, tenant, args.bench_max_tokens, args.concurrency)
            elapsed = time.perf_counter() - started
            statuses: dict[str, int] = {}
            for r in hits:
                statuses[r.cache_status] = statuses.get(r.cache_status, 0) + 1
            latencies = [r.latency_s for r in hits]
            results[label] = {
                "tenant": tenant,
                "miss_latency": summary_ms([r.latency_s for r in misses]),
                "hit_latency": summary_ms(latencies),
                "hit_statuses": statuses,
                "hits_per_s": round(len(asks) / elapsed, 1),
            }
    return results


def print_padding(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"hit_padding_ms={args.hit_padding_ms:g} hit_padding_jitter_ms="
        f"{args.hit_padding_jitter_ms:g} concurrency={args.concurrency} "
        f"prompts={args.bench_prompts} hits={args.bench_hits} max_tokens={args.bench_max_tokens}"
    )
    print(f"{'':<28}{'trusted (no padding)':>22}{'padded':>22}")
    rows = [
        ("miss p50 / p99 (ms)", "miss_latency"),
        ("hit p50 / p99 (ms)", "hit_latency"),
    ]
    for title, key in rows:
        cells = [
            f"{results[side][key]['p50_ms']:.1f} / {results[side][key]['p99_ms']:.1f}"
            for side in ("trusted", "padded")
        ]
        print(f"{title:<28}{cells[0]:>22}{cells[1]:>22}")
    cells = [f"{results[side]['hits_per_s']:.1f}" for side in ("trusted", "padded")]
    print(f"{'hit throughput (req/s)':<28}{cells[0]:>22}{cells[1]:>22}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server's gRPC host:port (default: start one)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--tenants", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="rewording pairs JSONL")
    parser.add_argument("--max-pairs", type=int, default=60, help="pairs drawn from --pairs")
    parser.add_argument("--variety", type=float, default=1.0, help="(0, 1]: fewer distinct prompts")
    parser.add_argument("--tokens-per-block", type=int, default=32, help="torch_llm's KV block")
    parser.add_argument("--no-tokenizer", action="store_true", help="strict KV rule, no tokenizer")
    parser.add_argument("--collapse-tenants", action="store_true", help="positive control")
    parser.add_argument("--padding-bench", action="store_true")
    parser.add_argument("--hit-padding-ms", type=float, default=250.0)
    parser.add_argument("--hit-padding-jitter-ms", type=float, default=50.0)
    parser.add_argument("--bench-prompts", type=int, default=40)
    parser.add_argument("--bench-hits", type=int, default=400)
    parser.add_argument("--bench-max-tokens", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--outcomes", type=Path, help="write each outcome here (JSON lines)")
    parser.add_argument("--judge", type=Path, help="only judge an --outcomes file, no requests")
    parser.add_argument("--keep", action="store_true", help="keep the server's temp dir")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped

    root = Path(tempfile.mkdtemp(prefix="tiercache-isolation-"))
    try:
        with contextlib.ExitStack() as stack:
            return run(args, root, stack)
    finally:
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path, stack: contextlib.ExitStack) -> int:
    """The run `main` parsed: a server of its own (entered on `stack`) unless --url or --judge."""
    url = args.url
    if args.judge is not None:
        report, summary = judge(args, load_outcomes(args.judge))
        return report_and_exit(args, report, summary)
    if url is None:
        params = {}
        if args.padding_bench:
            params = {
                "hit_padding_ms": f"{args.hit_padding_ms:g}",
                "hit_padding_jitter_ms": f"{args.hit_padding_jitter_ms:g}",
                "trusted_tenants": TRUSTED,
            }
        t0 = time.perf_counter()
        server = stack.enter_context(running(isolation_server(root, params), ready_timeout_s=600))
        print(f"server ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        url = f"127.0.0.1:{server.ports.grpc}"
    if args.padding_bench:
        results = padding_bench(args, url)
        print_padding(results, args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return 0
    report, summary = check_isolation(args, url)
    return report_and_exit(args, report, summary)


def report_and_exit(args: argparse.Namespace, report: Report, summary: dict[str, Any]) -> int:
    print(report.table())
    print(json.dumps(summary))
    for verdict in report.leaks[:20]:
        o = verdict.outcome
        print(
            f"LEAK {verdict.kind}: tenant {o.sent.tenant} {o.cache_status} "
            f"{o.sent.prompt[:60]!r} -> {o.text!r} ({verdict.reason})"
        )
    if args.json:
        leaks = [
            {"kind": v.kind, "reason": v.reason, "sent": asdict(v.outcome.sent)}
            for v in report.leaks[:200]
        ]
        args.json.write_text(json.dumps({**summary, "leak_samples": leaks}, indent=2))
    if report.leaks:
        return 1
    return 2 if summary["statuses"].get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
