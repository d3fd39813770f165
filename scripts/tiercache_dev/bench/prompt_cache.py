"""`make bench`: what an exact hit costs in tiercache, against two floors, in one run.

Usage::

    python -m tiercache_dev.bench.prompt_cache [--out-dir .perf] [--state-dir .tiercache]
        [--measurement-ms 3000] [--concurrency 1:4:3] [--lookups 2000] [--rounds 3]
        [--background-load N [--background-duty F]] [--l1-eviction gdsf|lru]

Every configuration's server is started once and stays up for the whole run (an idle server
costs next to nothing); perf_analyzer over gRPC measures one configuration at a time and one
concurrency level at a time, interleaved: in each round, for each level, every configuration in
turn (A B C, then C B A for the next level or round), so the two measurements a ratio pairs
are taken seconds apart, back to back, with no server start between them:

1. tiercache: the real model_repository/ (ensemble -> prompt_cache -> llm). The prompt is sent
   once with the client first, so every perf_analyzer request is an exact hit (checked with the
   server's cache-status counters). `--streaming`: the ensemble is decoupled.
2. floor: a temporary repository with the same ensemble and the same stage configs, but Python
   steps that do nothing but echo (scripts/bench_fixtures/floor/); no torch_llm. `--streaming`.
3. Triton's own response cache: a trivial, non-decoupled Python echo model with
   `response_cache { enable: true }` and `--cache-config local,size=1048576`
   (scripts/bench_fixtures/response_cache/). Unary gRPC, `--async`: perf_analyzer's streaming
   mode rejects this model ("response output count mismatch").
4. The prompt-cache stage's own time on a miss, in process: `PromptCache.lookup` of `--lookups`
   distinct, unseen prompts against a cache holding as many entries (no Triton, no server).

Then it prints a table and writes a Markdown summary to OUT_DIR/bench_prompt_cache.md (raw
perf_analyzer output, CSVs and server logs under OUT_DIR/bench/). Targets (issue 15's): tiercache
hit p50 at most 1.15x the floor's, throughput at least 0.85x the floor's; the stage's miss p50
under 1 ms. A verdict is n/a, not PASS or MISS, when not every request tiercache was sent was an
exact hit (or its metrics could not tell).
Only ratios measured side by side in one run mean anything on a shared machine: each ratio is
taken per round, between back-to-back measurements at one level, and reported as the median of
the rounds with its spread (the tables of latencies are medians of the rounds).
`--background-load N` starts N CPU burners for the whole run (each busy `--background-duty` of
the time), to check a result on a machine the run itself makes busy. A JSON summary is written
beside the Markdown. The exit code is 0 whether or not the targets are met (PASS/MISS is
printed), 1 if a measurement could not be made.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.server import copy_repository
from tiercache_dev.console import (
    display_path,
    exit_on_sigterm,
    invocation,
    machine_summary,
    progress,
    shown,
    write_report,
)
from tiercache_dev.metrics import (
    counter_delta,
    counts_by_label,
    scrape_metrics,
    status_counts,
    status_text,
)
from tiercache_dev.paths import BENCH_FIXTURES as FIXTURES
from tiercache_dev.paths import DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.perf.analyzer import (
    LevelStats,
    concurrency_levels,
    failure_reason,
    install_perf_analyzer,
    perf_analyzer_version,
    run_perf_analyzer,
)
from tiercache_dev.perf.soak import cpu_snapshot, labelled_processes
from tiercache_dev.rounds import (
    BackgroundLoad,
    Spread,
    add_background_load_arguments,
    check_background_load_arguments,
    level_pairs,
    paired_ratio,
)
from tiercache_dev.servers import TritonServer, fresh_state, running_all, triton
from tiercache_dev.stats import mean, median, percentile

PROMPT = "What is Triton Inference Server?"
RESPONSE_CACHE_BYTES = 1 << 20  # per distinct prompt: 4 KiB more past the first 256
MAX_DISTINCT = 100_000


def hit_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts the hits cycle through: `--prompt` alone, or `--distinct` variants of it."""
    if args.distinct == 1:
        return [args.prompt]
    return [f"{args.prompt} (variant {i})" for i in range(args.distinct)]


TIERCACHE, FLOOR, RESPONSE_CACHE = "tiercache", "floor", "response-cache"
LABELS = {
    TIERCACHE: "tiercache exact hit",
    FLOOR: "floor (no-op steps)",
    RESPONSE_CACHE: "Triton response cache",
}
# issue 15's: an exact hit's p50 at most 1.15x the floor's, its throughput at least 0.85x
P50_TARGET, THROUGHPUT_TARGET, MISS_P50_TARGET_US = 1.15, 0.85, 1000.0
READY_S = 300.0  # each server's start, the weights already converted in --state-dir


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out-dir", type=Path, default=PERF_DIR, help="output folder")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="tiercache state dir (the one `make serve` uses: the converted model is reused)",
    )
    p.add_argument("--measurement-ms", type=int, default=3000, help="perf_analyzer window")
    p.add_argument("--concurrency", default="1:4:3", help="perf_analyzer --concurrency-range")
    p.add_argument("--stability-percentage", type=float, default=10.0, help="perf_analyzer -s")
    p.add_argument("--max-trials", type=int, default=6, help="perf_analyzer -r (windows per level)")
    p.add_argument("--prompt", default=PROMPT, help="the one prompt every request sends")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--lookups", type=int, default=2000, help="in-process misses to time")
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="interleaved rounds of the configurations (even: each level's order turns from one "
        "round to the next, so a drift charges both alike)",
    )
    p.add_argument(
        "--distinct",
        type=int,
        default=1,
        help="distinct cached prompts the hits cycle through (1: the one prompt repeated, which "
        "the stages serve from their memos after its first time; up to 4,096, the memos' "
        "entries, the same once each was asked (the sealed envelopes and llm's decoded hits "
        "while their envelope's one-minute issue step lasts); more: a part of them (a memo "
        "keeps two generations of 4,096: about half of the hits at 6,000), the others do their "
        "whole work)",
    )
    add_background_load_arguments(p)
    p.add_argument(
        "--only",
        action="append",
        choices=[TIERCACHE, FLOOR, RESPONSE_CACHE, "stage"],
        help="run only these parts (repeatable; default all)",
    )
    p.add_argument("--perf-analyzer", type=Path, default=None, help="skip the install; use this")
    p.add_argument(
        "--l1-eviction",
        choices=["gdsf", "lru"],
        default=None,
        help="serve tiercache with this l1_eviction in prompt_cache and embedding_cache (default: "
        "the committed repository as it is)",
    )
    args = p.parse_args(argv)
    try:
        args.levels = concurrency_levels(args.concurrency)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(str(exc))
    if args.rounds < 1 or args.lookups < 10:
        p.error("--rounds must be >= 1 and --lookups >= 10")
    if not 1 <= args.distinct <= MAX_DISTINCT:
        p.error(f"--distinct must be within 1..{MAX_DISTINCT}")
    check_background_load_arguments(p, args)
    args.only = set(args.only or [TIERCACHE, FLOOR, RESPONSE_CACHE, "stage"])
    return args


# ---- 4. the prompt-cache stage in process -------------------------------------------------------


def synthetic_prompt(i: int, kind: str) -> str:
    return (
        f"{kind} question {i}: in two sentences, explain how a cache in front of a language "
        f"model can answer request number {i * 7919 % 100_003} without running the model."
    )


def bench_stage(n: int, max_tokens: int) -> dict[str, float]:
    """Time PromptCache.lookup: n misses (unseen prompts) and n L1 hits, in microseconds."""
    from tiercache.config import PromptCacheConfig
    from tiercache.engine.model_source import resolve_model
    from tiercache.exact.prompt_cache import PromptCache
    from tiercache.exact.request import RawInputs
    from tiercache.stages.parts import load_secret, open_exact_cache
    from tiercache.vocabulary import CacheStatus

    with tempfile.TemporaryDirectory(prefix="tiercache-bench-stage-") as tmp:
        config = PromptCacheConfig(state_dir=tmp)
        tiers = open_exact_cache(config.cache())
        tiered = tiers.cache
        try:
            cache = PromptCache(
                tiered,
                load_secret(config.cache(), tiers.link),
                resolve_model(config.model).identity,
                config.limits(),
            )
            stored = [
                RawInputs(synthetic_prompt(i, "stored"), max_tokens=max_tokens) for i in range(n)
            ]
            for raw in stored:
                digest = cache.lookup(raw).digest
                if digest is None:
                    raise RuntimeError(f"prompt {raw.text_input!r} is not cacheable")
                tiered.put(digest, f"An answer of a few words to {raw.text_input}")
            unseen = [
                RawInputs(synthetic_prompt(i, "unseen"), max_tokens=max_tokens) for i in range(n)
            ]

            def timed(inputs: list[RawInputs], expect: CacheStatus) -> list[float]:
                for raw in inputs[:50]:  # warm-up (not timed; misses stay misses)
                    cache.lookup(raw)
                gc.collect()
                times = []
                for raw in inputs:
                    start = time.perf_counter_ns()
                    result = cache.lookup(raw)
                    times.append((time.perf_counter_ns() - start) / 1000)
                    if result.status is not expect:
                        raise RuntimeError(f"expected {expect.value}, got {result.status.value}")
                return times

            misses = timed(unseen, CacheStatus.MISS)
            hits = timed(stored, CacheStatus.EXACT)
        finally:
            tiered.close()
    return {
        "miss_p50_us": percentile(misses, 50),
        "miss_p99_us": percentile(misses, 99),
        "miss_mean_us": mean(misses),
        "hit_p50_us": percentile(hits, 50),
        "hit_p99_us": percentile(hits, 99),
    }


def bench_seals(n: int, max_tokens: int) -> dict[str, float]:
    """The seals' own work on one exact hit, in microseconds (medians of n). `seals_us`, a
    request's first hit: prompt_cache seals the envelope with the hit's text; embedding_cache
    opens it and seals its answer; llm checks the answer's seal (lora_cache seals nothing on a
    hit). `repeat_us`, a repeated hit as the stages do it now: prompt_cache finds the sealed
    envelope in its memo (tiercache.exact.memo), embedding_cache checks the seal without
    decoding the envelope (an exact hit), seals its answer, llm checks it. `codec_us` is the
    envelope's encode and decode alone, which the stages paid before the seals."""
    import numpy as np

    from tiercache.exact.keys import Digest
    from tiercache.exact.memo import Memo
    from tiercache.exact.request import GenerationRequest
    from tiercache.stages.envelope import Envelope, Freshness, check_sealed, seal_of
    from tiercache.stages.seal import (
        ANSWER_LABEL,
        ANSWER_TENSORS,
        Sealer,
        answer_tensors,
        check_tensors,
        seal_tensors,
    )
    from tiercache.vocabulary import CacheStatus

    sealer = Sealer.from_secret(b"s" * 32)
    envelope = Envelope(
        request=GenerationRequest(
            synthetic_prompt(1, "stored"), max_tokens=max_tokens, tenant_scope="a" * 64
        ),
        status=CacheStatus.EXACT,
        digest=Digest("d" * 64),
        write_back=True,
    )
    text = f"An answer of a few words to {synthetic_prompt(1, 'stored')}"
    no_vector = np.zeros((1, 0), dtype=np.float32)

    def one_hit() -> None:
        data = envelope.seal(sealer, text)  # prompt_cache
        opened = Envelope.open(data, sealer, Freshness(), text)  # embedding_cache
        bound = seal_of(data)
        sent = answer_tensors(text, opened.status.value, 0.0, None)
        seal = seal_tensors(sealer, ANSWER_LABEL, ANSWER_TENSORS, sent, bound=bound)
        values = answer_tensors(text, "exact", 0.0, no_vector)  # llm, as it reads the tensors
        check_tensors(sealer, seal, ANSWER_LABEL, ANSWER_TENSORS, values, bound=bound, what="a")

    memo: Memo[bytes] = Memo()
    memo.put((envelope, text), envelope.seal(sealer, text))

    def repeat_hit() -> None:
        data = memo.get((envelope, text))  # prompt_cache
        assert data is not None
        check_sealed(data, sealer, text)  # embedding_cache: an exact hit, not decoded
        bound = seal_of(data)
        sent = answer_tensors(text, CacheStatus.EXACT.value, 0.0, None)
        seal = seal_tensors(sealer, ANSWER_LABEL, ANSWER_TENSORS, sent, bound=bound)
        values = answer_tensors(text, "exact", 0.0, no_vector)  # llm
        check_tensors(sealer, seal, ANSWER_LABEL, ANSWER_TENSORS, values, bound=bound, what="a")

    def codec() -> None:
        Envelope.decode(envelope.encode())

    def median_us(call: Callable[[], None]) -> float:
        for _ in range(200):
            call()
        gc.collect()
        times = []
        for _ in range(n):
            start = time.perf_counter_ns()
            call()
            times.append((time.perf_counter_ns() - start) / 1000)
        return percentile(times, 50)

    return {
        "seals_us": median_us(one_hit),
        "repeat_us": median_us(repeat_hit),
        "codec_us": median_us(codec),
    }


# ---- temporary model repositories ---------------------------------------------------------------


def ensemble_steps(config_text: str) -> list[str]:
    return re.findall(r'model_name:\s*"([^"]+)"', config_text)


def build_floor_repository(dest: Path) -> Path:
    """model_repository/'s ensemble and stage configs, with no-op model.py files."""
    ensemble_config = (MODEL_REPOSITORY / "ensemble" / "config.pbtxt").read_text()
    steps = ensemble_steps(ensemble_config)
    missing = [s for s in steps if not (FIXTURES / "floor" / s / "model.py").is_file()]
    if missing:
        raise SystemExit(
            f"error: the ensemble has steps {missing} without a no-op stand-in in "
            f"{display_path(FIXTURES / 'floor')}; add one per step to keep the floor the same shape"
        )
    (dest / "ensemble" / "1").mkdir(parents=True)
    (dest / "ensemble" / "config.pbtxt").write_text(ensemble_config)
    for step in steps:
        (dest / step / "1").mkdir(parents=True)
        shutil.copy2(MODEL_REPOSITORY / step / "config.pbtxt", dest / step / "config.pbtxt")
        shutil.copy2(FIXTURES / "floor" / step / "model.py", dest / step / "1" / "model.py")
    return dest


def build_response_cache_repository(dest: Path) -> Path:
    source = FIXTURES / "response_cache" / "echo"
    (dest / "echo" / "1").mkdir(parents=True)
    shutil.copy2(source / "config.pbtxt", dest / "echo" / "config.pbtxt")
    shutil.copy2(source / "model.py", dest / "echo" / "1" / "model.py")
    return dest


def write_input_data(path: Path, prompts: Sequence[str], max_tokens: int | None) -> Path:
    """perf_analyzer's input data: one entry per prompt, which it sends in turn."""
    if isinstance(prompts, str):  # a string is a sequence of one-character prompts
        raise TypeError("write_input_data takes a list of prompts, not one string")
    entries: list[dict[str, dict]] = []
    for prompt in prompts:
        entry: dict[str, dict] = {"text_input": {"content": [prompt], "shape": [1]}}
        if max_tokens is not None:
            entry["max_tokens"] = {"content": [max_tokens], "shape": [1]}
        entries.append(entry)
    path.write_text(json.dumps({"data": entries}, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


# ---- perf_analyzer against one server -----------------------------------------------------------


@dataclass(slots=True)
class Measurement:
    config: str
    round: int
    levels: dict[int, LevelStats]
    commands: list[str]
    notes: list[str]
    # per level: the server's CPU (tritonserver and every stub, user + system) per request it
    # completed, over the whole perf_analyzer run at that level (ms), and by process
    cpu_ms: dict[int, float] = field(default_factory=dict)
    cpu_ms_by_process: dict[int, dict[str, float]] = field(default_factory=dict)


class ServerCpu:
    """CPU seconds of a server's process tree and its completed requests of one model, read
    before and after a measurement: CPU per request does not depend on how busy the rest of
    the machine is the way latency does (the other work only slows it, it does not add to it),
    so its ratio between two configurations is the steadier one on a shared machine."""

    def __init__(self, server: TritonServer, model: str) -> None:
        self.server, self.model = server, model
        self.labels: dict[int, str] = {}
        self.before = self._read()

    def _read(self) -> tuple[dict[str, float], float]:
        processes = labelled_processes(self.server.process.pid, self.labels)
        cpu = {label: sample.cpu_s for label, sample in cpu_snapshot(processes).items()}
        done = counts_by_label(
            scrape_metrics(self.server.ports.metrics), "nv_inference_request_success", "model"
        )
        return cpu, done.get(self.model, 0.0)

    def per_request_ms(self) -> tuple[float, dict[str, float]] | None:
        """(total CPU ms per completed request, the same by process) since construction; None
        when no request completed."""
        (cpu0, done0), (cpu1, done1) = self.before, self._read()
        requests = done1 - done0
        if requests <= 0:
            return None
        by_process = {
            label: (cpu1[label] - cpu0.get(label, 0.0)) * 1e3 / requests for label in cpu1
        }
        return sum(by_process.values()), by_process


SETTLE_CORES = 0.1  # a run's servers are idle once their processes use under this much CPU
SETTLE_WINDOW_S = 1.0  # over each of two windows this long in a row
SETTLE_TIMEOUT_S = 180.0


def settle(servers: dict[str, TritonServer], timeout_s: float = SETTLE_TIMEOUT_S) -> str:
    """Wait until every server's processes are idle (under SETTLE_CORES of CPU over two
    SETTLE_WINDOW_S windows in a row), so that the first round shares the machine with no
    configuration's start-up or warm-up work (tiercache's warmed variants written to its
    tiers, indexed by meaning); what was waited for, for the report."""
    labels: dict[str, dict[int, str]] = {name: {} for name in servers}

    def cpu_s() -> dict[str, float]:
        out: dict[str, float] = {}
        for name, server in servers.items():
            if server.process is None:
                continue
            processes = labelled_processes(server.process.pid, labels[name])
            for label, sample in cpu_snapshot(processes).items():
                out[f"{name} {label}"] = sample.cpu_s
        return out

    started = time.monotonic()
    before, quiet, busy = cpu_s(), 0, {}
    while quiet < 2:
        if time.monotonic() - started > timeout_s:
            return f"still busy after {timeout_s:.0f} s ({shown_busy(busy)}); measured anyway"
        time.sleep(SETTLE_WINDOW_S)
        now = cpu_s()
        used = {k: v - before.get(k, v) for k, v in now.items()}
        if sum(used.values()) < SETTLE_CORES * SETTLE_WINDOW_S:
            quiet += 1
        else:
            quiet, busy = 0, used
        before = now
    waited = time.monotonic() - started
    return f"idle after {waited:.0f} s" + (f" (last busy: {shown_busy(busy)})" if busy else "")


def shown_busy(used: dict[str, float]) -> str:
    top = sorted(used.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{label} {seconds / SETTLE_WINDOW_S:.0%} of a core" for label, seconds in top)


def pa_base(
    model: str,
    server: TritonServer,
    transport: Sequence[str],
    input_data: Path,
    window_ms: int,
    trials: int,
) -> list[str]:
    """perf_analyzer's arguments for one model of `server` over `input_data`, in windows of
    `window_ms`, at most `trials` of them (the level and stability left to the caller)."""
    return [
        "-m", model, "-i", "grpc", "-u", f"127.0.0.1:{server.ports.grpc}", *transport,
        "--input-data", str(input_data),
        "--measurement-interval", str(window_ms), "--max-trials", str(trials),
    ]  # fmt: skip


def measure(
    args: argparse.Namespace,
    perf_analyzer: Path,
    config: str,
    round_no: int,
    model: str,
    server: TritonServer,
    input_data: Path,
    transport: list[str],
    level: int,
) -> Measurement:
    """perf_analyzer at one concurrency `level`; when it does not settle within --max-trials
    windows it is measured again with twice the stability percentage."""
    bench_dir = args.out_dir / "bench"
    stem = f"{config}-r{round_no}-c{level}"
    base = pa_base(model, server, transport, input_data, args.measurement_ms, args.max_trials)
    pa_args = [
        *base,
        "--concurrency-range",
        str(level),
        "--stability-percentage",
        f"{args.stability_percentage:g}",
        "-f",
        str(bench_dir / f"{stem}.csv"),
    ]
    progress(f"  perf_analyzer {shown(pa_args)}")
    run = run_perf_analyzer(perf_analyzer, pa_args, bench_dir / f"{stem}.txt", server=server)
    result = Measurement(config, round_no, dict(run.levels), [shown(pa_args)], [])
    if run.returncode != 0:
        result.notes.append(f"perf_analyzer exit {run.returncode}: {failure_reason(run)}")
        progress(f"  {result.notes[-1]}")
    for c in (level,):
        if c in result.levels or server.process.poll() is not None:
            continue
        loose = f"{args.stability_percentage * 2:g}"
        retry = [
            *base,
            "--concurrency-range",
            str(c),
            "--stability-percentage",
            loose,
            "-f",
            str(bench_dir / f"{stem}-again.csv"),
        ]
        progress(f"  concurrency {c} again, -s {loose}: perf_analyzer {shown(retry)}")
        again = run_perf_analyzer(
            perf_analyzer, retry, bench_dir / f"{stem}-again.txt", server=server
        )
        result.commands.append(shown(retry))
        if c in again.levels:
            result.levels[c] = again.levels[c]
            result.notes.append(f"concurrency {c} measured with -s {loose}")
        else:
            result.notes.append(f"concurrency {c} failed: {failure_reason(again)}")
            progress(f"  {result.notes[-1]}")
    for c, level in sorted(result.levels.items()):
        progress(
            f"  {LABELS[config]}, concurrency {c}: p50 {level.p50_us / 1000:.3f} ms, "
            f"p99 {level.p99_us / 1000:.3f} ms, {level.throughput:.0f} infer/s"
        )
    return result


WARM_RATE = 200  # requests per second a warm-up window is sized for (the slowest seen: 239)


def warm_pass(args: argparse.Namespace, perf_analyzer: Path, config: Configuration) -> str:
    """One untimed perf_analyzer window at concurrency 1 over the whole input list, for every
    configuration alike before the first round: tiercache's memos of prepared requests,
    sealed envelopes and decoded hits fill on each prompt's first hit, which the first round
    would otherwise pay inside its windows, and the floor has nothing to fill."""
    # three windows (perf_analyzer's fewest for a measurement) that together cover the list
    # half again at WARM_RATE; any three pass at -s 100
    window_ms = max(1000, int(1500 * max(args.distinct, 1) / WARM_RATE / 3))
    pa_args = [
        *pa_base(
            config.model, config.server, config.transport, config.input_data, window_ms, 3
        ),
        "--stability-percentage", "100", "--concurrency-range", "1",
    ]  # fmt: skip
    run = run_perf_analyzer(
        perf_analyzer, pa_args, args.out_dir / "bench" / f"{config.name}-warm.txt",
        server=config.server,
    )  # fmt: skip
    level = run.levels.get(1)
    if level is None:
        return f"{LABELS[config.name]}: warm-up failed ({failure_reason(run)})"
    sent = level.throughput * 3 * window_ms / 1000
    return (
        f"{LABELS[config.name]}: about {sent:.0f} requests in 3 windows of {window_ms / 1000:.1f} s"
    )


def serve(
    args: argparse.Namespace, name: str, repository: Path, extra: Sequence[str] = ()
) -> TritonServer:
    """A tritonserver for one configuration, not started (enter it with servers.running), on
    a state dir of its own for this run (`args.run_states`; the converted weights linked from
    --state-dir): a state dir shared with earlier runs held their answers and their semantic
    index, so a prompt cached by one run was answered by another's variants."""
    log_path = args.out_dir / "bench" / f"{name}-server.log"
    state = fresh_state(args.run_states, args.state_dir, name)
    server = triton(repository, state, log_path=log_path, extra_args=extra, exit_timeout_s=2)
    if name == TIERCACHE:
        args.tiercache_state = state
    progress(
        f"starting tritonserver: {LABELS[name]} ({display_path(repository)}, grpc "
        f"{server.ports.grpc}, log {display_path(log_path)})"
    )
    return server


@dataclass(slots=True)
class Configuration:
    """One configuration's server, kept up for the whole run, and how to measure it."""

    name: str
    server: TritonServer
    model: str
    input_data: Path
    transport: list[str]


def configurations(args: argparse.Namespace, tmp: Path) -> list[Configuration]:
    """The wanted configurations' servers (not started) and their inputs."""
    prompts = hit_prompts(args)
    hit = write_input_data(tmp / "hit.json", prompts, args.max_tokens)
    out = []
    if TIERCACHE in args.only:
        repository = MODEL_REPOSITORY
        if args.l1_eviction is not None:
            chosen = {"l1_eviction": args.l1_eviction}
            repository = copy_repository(
                MODEL_REPOSITORY,
                tmp / "tiercache-repository",
                {"prompt_cache": chosen, "embedding_cache": chosen},
            )
        out.append(
            Configuration(
                TIERCACHE,
                serve(args, TIERCACHE, repository),
                "ensemble",
                hit,
                ["--streaming"],
            )
        )
    if FLOOR in args.only:
        repository = build_floor_repository(tmp / "floor-repository")
        out.append(
            Configuration(FLOOR, serve(args, FLOOR, repository), "ensemble", hit, ["--streaming"])
        )
    if RESPONSE_CACHE in args.only:
        repository = build_response_cache_repository(tmp / "response-cache-repository")
        size = RESPONSE_CACHE_BYTES + max(len(prompts) - 256, 0) * 4096
        extra = ["--cache-config", f"local,size={size}"]
        out.append(
            Configuration(
                RESPONSE_CACHE,
                serve(args, RESPONSE_CACHE, repository, extra),
                "echo",
                write_input_data(tmp / "echo.json", prompts, None),
                ["--async"],
            )
        )
    return out


def cache_the_prompt(args: argparse.Namespace, server: TritonServer) -> None:
    """Send the prompt twice with the client; the second must be an exact hit. With
    `--distinct`, the other variants get the same answer through the admin API's `warm` (no
    generation each), and the last one must be an exact hit too."""
    from tiercache.admin import admin_token_path
    from tiercache_client import TierCacheClient, read_admin_token

    prompts = hit_prompts(args)
    state = args.tiercache_state
    token = read_admin_token(admin_token_path(state)) if len(prompts) > 1 else None
    url = f"127.0.0.1:{server.ports.grpc}"
    with TierCacheClient(url, timeout_s=600, admin_token=token) as client:
        first = client.generate_text(prompts[0], max_tokens=args.max_tokens)
        second = client.generate_text(prompts[0], max_tokens=args.max_tokens)
        checks = [second]
        if len(prompts) > 1:
            for start in range(1, len(prompts), 500):
                items = [
                    {"text_input": p, "max_tokens": args.max_tokens, "answer": first.text}
                    for p in prompts[start : start + 500]
                ]
                warmed = client.warm(items)
                if warmed.get("failed"):
                    raise RuntimeError(f"warming the variants failed: {warmed}")
            checks.append(client.generate_text(prompts[-1], max_tokens=args.max_tokens))
    progress(
        f"  tiercache: first request {first.cache_status} in {first.latency_s * 1000:.1f} ms, "
        f"second {second.cache_status} in {second.latency_s * 1000:.1f} ms"
        + (f"; {len(prompts) - 1} more variants warmed" if len(prompts) > 1 else "")
    )
    if any(check.cache_status != "exact" for check in checks):
        raise RuntimeError(
            f"a cached prompt was not an exact hit ({[c.cache_status for c in checks]}); "
            f"see {display_path(server.log_path or Path('server log'))}"
        )


def measure_round(
    args: argparse.Namespace, pa: Path, config: Configuration, round_no: int, level: int
) -> Measurement:
    """One configuration at one concurrency level in one round, on its running server, with
    the checks it needs."""
    if config.server.process.poll() is not None:
        raise RuntimeError(
            f"its tritonserver exited (see {display_path(config.server.log_path or Path('log'))})"
        )
    before = status_counts(config.server.ports.metrics) if config.name == TIERCACHE else None
    cpu = ServerCpu(config.server, config.model)
    start_s = time.monotonic()
    result = measure(
        args, pa, config.name, round_no, config.model, config.server, config.input_data,
        config.transport, level,
    )  # fmt: skip
    # when each measurement ran (CLOCK_MONOTONIC, as `perf record -k CLOCK_MONOTONIC` stamps its
    # samples: tiercache_dev.diagnostics.cpu_profile charges only these)
    args.measured_windows.append(
        {"config": config.name, "level": level, "start_s": start_s, "end_s": time.monotonic()}
    )
    args.processes.setdefault(config.name, {}).update(cpu.labels)  # pid -> process label
    per_request = cpu.per_request_ms()
    if per_request is not None and level in result.levels:
        result.cpu_ms[level], result.cpu_ms_by_process[level] = per_request
        progress(f"  server CPU per request: {per_request[0]:.3f} ms")
    if config.name == TIERCACHE:
        after = status_counts(config.server.ports.metrics)
        statuses = counter_delta(before, after) if before and after else {}
        not_hits = {k: v for k, v in statuses.items() if k != "exact" and v}
        result.notes.append(f"server cache status during perf_analyzer: {status_text(statuses)}")
        if not_hits or not statuses.get("exact"):
            args.unchecked_hits = True  # the verdicts say n/a: the ratios may not be a hit's
            progress(
                "  WARNING: not every request was an exact hit: "
                f"{not_hits or 'the metrics did not say (unreadable)'}"
            )
    if config.name == RESPONSE_CACHE:
        for c, level in sorted(result.levels.items()):
            hits, misses = level.server.get("cache_hit_count"), level.server.get("cache_miss_count")
            if hits is not None:
                result.notes.append(
                    f"concurrency {c}: response cache hits {hits:.0f}, misses {misses or 0:.0f}"
                )
    return result


# ---- report -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    p50_ms: float
    p99_ms: float
    throughput: float


def median_rows(measurements: list[Measurement]) -> dict[str, dict[int, Row]]:
    table: dict[str, dict[int, Row]] = {}
    configs = {m.config for m in measurements}
    for config in configs:
        levels = sorted({c for m in measurements if m.config == config for c in m.levels})
        for c in levels:
            got = [m.levels[c] for m in measurements if m.config == config and c in m.levels]
            table.setdefault(config, {})[c] = Row(
                median(x.p50_us for x in got) / 1000,
                median(x.p99_us for x in got) / 1000,
                median(x.throughput for x in got),
            )
    return table


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def per_round(measurements: list[Measurement], config: str, c: int, field: str) -> dict[int, float]:
    """{round: the level's `field`} of one configuration at concurrency c."""
    return {
        m.round: float(getattr(m.levels[c], field))
        for m in measurements
        if m.config == config and c in m.levels
    }


def cpu_per_round(measurements: list[Measurement], config: str, c: int) -> dict[int, float]:
    """{round: server CPU ms per request} of one configuration at concurrency c."""
    return {m.round: m.cpu_ms[c] for m in measurements if m.config == config and c in m.cpu_ms}


def round_ratio(
    measurements: list[Measurement], a: str, b: str, c: int, field: str
) -> Spread | None:
    """a/b per round (each round's two measurements at a level taken back to back), over the
    rounds; `field` "cpu_ms": the server CPU per request."""
    if field == "cpu_ms":
        return paired_ratio(cpu_per_round(measurements, a, c), cpu_per_round(measurements, b, c))
    return paired_ratio(per_round(measurements, a, c, field), per_round(measurements, b, c, field))


def cpu_by_config(
    measurements: list[Measurement], order: Sequence[str], levels: Sequence[int]
) -> dict[str, dict[int, float]]:
    """Configuration -> concurrency -> the median over the rounds of server CPU ms per
    request."""
    out: dict[str, dict[int, float]] = {}
    for config in order:
        for c in levels:
            values = list(cpu_per_round(measurements, config, c).values())
            if values:
                out.setdefault(config, {})[c] = median(values)
    return out


def cpu_table(
    measurements: list[Measurement], order: Sequence[str], levels: Sequence[int]
) -> list[str]:
    """Markdown lines: server CPU per request by configuration and level (medians of the
    rounds), and by process in the last round of each."""
    by_config = cpu_by_config(measurements, order, levels)
    if not by_config:
        return []
    lines = [
        "",
        "Server CPU per completed request (tritonserver and its stubs, user + system, over each "
        "perf_analyzer run; median of the rounds, ms):",
        "",
        "| configuration | concurrency | CPU ms / request | by process (last round) |",
        "|---|---:|---:|---|",
    ]
    for config, per_level in by_config.items():
        last = max((m for m in measurements if m.config == config), key=lambda m: m.round)
        for c, ms in per_level.items():
            parts = sorted(last.cpu_ms_by_process.get(c, {}).items(), key=lambda kv: -kv[1])
            shown_parts = ", ".join(f"{label} {value:.3f}" for label, value in parts if value)
            lines.append(f"| {LABELS[config]} | {c} | {ms:.3f} | {shown_parts} |")
    return lines


def verdict(ok: bool | None, checked: bool = True) -> str:
    """PASS or MISS; n/a without a figure, or when the hits were not all checked as hits."""
    if ok is None or not checked:
        return "n/a"
    return "PASS" if ok else "MISS"


def build_report(
    args: argparse.Namespace,
    measurements: list[Measurement],
    stage: dict[str, float] | None,
    wall_s: float,
    perf_version: str,
    load: str,
    settled: str = "",
) -> tuple[str, str, bool, dict]:
    """(plain-text table for the terminal, Markdown, whether every wanted figure was measured,
    the JSON summary)."""
    table = median_rows(measurements)
    complete = True
    order = [c for c in (TIERCACHE, FLOOR, RESPONSE_CACHE) if c in args.only]
    # a round a configuration lost at a level: its ratios are over fewer rounds than the order
    # was balanced for, so the run is not complete (exit 1), and the report says which
    lost = [
        f"{config} c={c} round {r}"
        for config in order
        for c in args.levels
        for r in range(1, args.rounds + 1)
        if r not in per_round(measurements, config, c, "p50_us")
    ]
    complete = not lost
    machine = machine_summary()
    md: list[str] = [
        "## Prompt-cache exact-hit benchmark",
        "",
        f"- command: `{invocation('tiercache_dev.bench.prompt_cache')}` (`make bench`)",
        f"- date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}, "
        f"wall time {wall_s:.0f} s",
        f"- machine: {machine['nproc']} CPUs ({machine['cpu']}), load average at the end "
        f"{machine['loadavg']}; Python {platform.python_version()}, tritonserver 2.51 "
        f"(nvidia-pytriton), {perf_version}",
        f"- perf_analyzer: gRPC, `--concurrency-range {args.concurrency}`, "
        f"`--measurement-interval {args.measurement_ms}`, `-s {args.stability_percentage:g}`, "
        f"`-r {args.max_trials}`; "
        + (
            f"one prompt ({len(args.prompt)} chars), "
            if args.distinct == 1
            else f"{args.distinct} distinct cached prompts in turn (`--distinct`), "
        )
        + f"max_tokens {args.max_tokens}; "
        + (
            f"{args.rounds} interleaved rounds, the configurations back to back at each level "
            "(latencies: medians of the rounds; ratios: per round, median and range)"
            if args.rounds > 1
            else "one round"
        ),
        f"- background load: {load}",
        f"- before the first round (`warm_pass`, `settle`): {settled or 'nothing'}",
        f"- rounds lost (not measured; their ratios are over the others): {', '.join(lost)}"
        if lost
        else "- rounds lost: none",
        "",
        "| configuration | concurrency | p50 ms | p99 ms | infer/s |",
        "|---|---:|---:|---:|---:|",
    ]
    text: list[str] = [
        f"{'configuration':<24} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'infer/s':>9}"
    ]
    for config in order:
        for c in args.levels:
            row = table.get(config, {}).get(c)
            complete &= row is not None
            cells = (
                [f"{row.p50_ms:.3f}", f"{row.p99_ms:.3f}", f"{row.throughput:.0f}"]
                if row is not None
                else ["n/a"] * 3
            )
            md.append(f"| {LABELS[config]} | {c} | " + " | ".join(cells) + " |")
            text.append(f"{LABELS[config]:<24} {c:>4} {cells[0]:>8} {cells[1]:>8} {cells[2]:>9}")

    def ratio(a: str, b: str, c: int, field: str) -> Spread | None:
        return round_ratio(measurements, a, b, c, field)

    def shown_ratio(r: Spread | None) -> str:
        return "n/a" if r is None else r.text()

    summary: dict = {
        "command": invocation("tiercache_dev.bench.prompt_cache"),
        "rounds": args.rounds,
        "background_load": load,
        "levels": {
            config: {
                str(c): {"p50_ms": row.p50_ms, "p99_ms": row.p99_ms, "infer_per_s": row.throughput}
                for c, row in sorted(levels.items())
            }
            for config, levels in table.items()
        },
        "ratios": {},
        "targets": {"p50_ratio_max": P50_TARGET, "throughput_ratio_min": THROUGHPUT_TARGET},
    }
    ratio_lines: list[tuple[str, str, str, str]] = []  # (what, concurrency, value, verdict)
    hits_checked = not getattr(args, "unchecked_hits", False)
    summary["every_request_an_exact_hit"] = hits_checked
    for c in args.levels:
        if TIERCACHE in table and FLOOR in table:
            r = ratio(TIERCACHE, FLOOR, c, "p50_us")
            summary["ratios"][f"tiercache/floor p50 c={c}"] = r and r.as_dict()
            ratio_lines.append(
                (
                    f"tiercache p50 / floor p50 (target <= {P50_TARGET})",
                    str(c),
                    shown_ratio(r),
                    verdict(None if r is None else r.median <= P50_TARGET, hits_checked),
                )
            )
            r = ratio(TIERCACHE, FLOOR, c, "throughput")
            summary["ratios"][f"tiercache/floor infer/s c={c}"] = r and r.as_dict()
            ratio_lines.append(
                (
                    f"tiercache infer/s / floor infer/s (target >= {THROUGHPUT_TARGET})",
                    str(c),
                    shown_ratio(r),
                    verdict(None if r is None else r.median >= THROUGHPUT_TARGET, hits_checked),
                )
            )
            r = ratio(TIERCACHE, FLOOR, c, "cpu_ms")
            summary["ratios"][f"tiercache/floor server CPU per request c={c}"] = r and r.as_dict()
            ratio_lines.append(
                ("tiercache / floor server CPU per request", str(c), shown_ratio(r), "")
            )
        for config in (TIERCACHE, FLOOR):
            if config in table and RESPONSE_CACHE in table:
                name = "tiercache" if config == TIERCACHE else "floor"
                r = ratio(config, RESPONSE_CACHE, c, "p50_us")
                summary["ratios"][f"{name}/response-cache p50 c={c}"] = r and r.as_dict()
                ratio_lines.append((f"{name} p50 / response-cache p50", str(c), shown_ratio(r), ""))
                r = ratio(config, RESPONSE_CACHE, c, "throughput")
                summary["ratios"][f"{name}/response-cache infer/s c={c}"] = r and r.as_dict()
                ratio_lines.append(
                    (f"{name} infer/s / response-cache infer/s", str(c), shown_ratio(r), "")
                )
    if stage is not None:
        ok = stage["miss_p50_us"] < MISS_P50_TARGET_US
        ratio_lines.append(
            (
                "prompt_cache lookup on a miss, p50 us (target < 1000)",
                "-",
                f"{stage['miss_p50_us']:.1f}",
                verdict(ok),
            )
        )
    if ratio_lines:
        md += ["", "| ratio | concurrency | value | target |", "|---|---:|---:|---|"]
        md += [f"| {w} | {c} | {v} | {t} |" for w, c, v, t in ratio_lines]
        text += [""] + [f"{w:<58} c={c:<2} {v:>24}  {t}" for w, c, v, t in ratio_lines]

    if stage is not None:
        summary["stage"] = stage
        md += [
            "",
            f"prompt_cache stage in process (`PromptCache.lookup`, L1 + LMDB L2 holding "
            f"{args.lookups} entries, {args.lookups} timed calls each): miss p50 "
            f"{stage['miss_p50_us']:.1f} us, p99 {stage['miss_p99_us']:.1f} us, mean "
            f"{stage['miss_mean_us']:.1f} us; L1 hit p50 {stage['hit_p50_us']:.1f} us, "
            f"p99 {stage['hit_p99_us']:.1f} us. The seals' work on one exact hit, every "
            f"stage, in process: {stage['seals_us']:.1f} us on a request's first hit, "
            f"{stage['repeat_us']:.1f} us on a repeated one (medians; the envelope's encode and "
            f"decode alone: {stage['codec_us']:.1f} us).",
        ]
        text += ["", md[-1]]

    cpu_rows = cpu_table(measurements, order, args.levels)
    if cpu_rows:
        summary["server_cpu_ms_per_request"] = {
            config: {str(c): ms for c, ms in levels.items()}
            for config, levels in cpu_by_config(measurements, order, args.levels).items()
        }
        md += cpu_rows
        text += cpu_rows

    # perf_analyzer's per-composing-model breakdown (server side, microseconds).
    breakdown = [
        "",
        "Server-side time per composing model (perf_analyzer, averages in us, last round):",
        "",
        "| configuration | concurrency | model | request | queue | compute infer |",
        "|---|---:|---|---:|---:|---:|",
    ]
    found = False
    for m in measurements:
        if m.round != args.rounds or m.config not in (TIERCACHE, FLOOR):
            continue
        for c, level in sorted(m.levels.items()):
            for model, stats in sorted(level.composing.items()):
                found = True
                breakdown.append(
                    f"| {LABELS[m.config]} | {c} | {model} | "
                    f"{stats.get('avg_request_latency_us', 0):.0f} | "
                    f"{stats.get('avg_request_latency.queue_us', 0):.0f} | "
                    f"{stats.get('avg_request_latency.compute_infer_us', 0):.0f} |"
                )
    if found:
        md += breakdown
        md.append("")
        md.append(
            "(On these runs prompt_cache answers hits: its miss cost is the in-process "
            "figure above.)"
        )
    notes = [f"- {LABELS[m.config]} (round {m.round}): {n}" for m in measurements for n in m.notes]
    md += [
        "",
        "Notes:",
        "- Latency is perf_analyzer's client-side time to the first response; a hit is a single "
        "final response, so it is the whole answer.",
        "- tiercache and the floor are measured over the gRPC stream (`--streaming`, decoupled "
        "ensemble); Triton's response cache over unary gRPC with `--async` (perf_analyzer's "
        'streaming mode rejects a non-decoupled model with "response output count mismatch").',
        *notes,
        f"- raw perf_analyzer output, CSVs and server logs: "
        f"`{display_path(args.out_dir / 'bench')}/`",
    ]
    return "\n".join(text), "\n".join(md) + "\n", complete, summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    started = time.monotonic()
    args.out_dir = args.out_dir.resolve()
    args.state_dir = args.state_dir.resolve()
    (args.out_dir / "bench").mkdir(parents=True, exist_ok=True)

    if args.perf_analyzer is None:
        progress(f"installing perf_analyzer into {display_path(args.out_dir / 'pa')}")
    pa = args.perf_analyzer or install_perf_analyzer(args.out_dir / "pa")
    version = perf_analyzer_version(pa)

    stage = None
    if "stage" in args.only:
        progress(f"prompt_cache stage in process: {args.lookups} misses, {args.lookups} hits")
        stage = bench_stage(args.lookups, args.max_tokens)
        stage.update(bench_seals(args.lookups, args.max_tokens))
        progress(
            f"  miss p50 {stage['miss_p50_us']:.1f} us, p99 {stage['miss_p99_us']:.1f} us; "
            f"hit p50 {stage['hit_p50_us']:.1f} us"
        )

    measurements: list[Measurement] = []
    args.measured_windows = []
    args.processes = {}  # configuration -> its server's processes measured (pid -> label)
    settled = ""  # what the run waited for before its first round (`settle`)
    load = BackgroundLoad(args.background_load, args.background_duty)
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-") as tmp_name:
        args.run_states = Path(tmp_name) / "states"
        configs = configurations(args, Path(tmp_name))
        if configs:
            progress("starting every configuration's tritonserver (up for the whole run)")
            started_s = time.monotonic()
            with running_all([c.server for c in configs], READY_S), load:
                progress(f"  ready in {time.monotonic() - started_s:.1f} s")
                for c in configs:
                    if c.name == TIERCACHE:
                        cache_the_prompt(args, c.server)
                warmed = []
                for c in configs:  # every one alike, untimed
                    progress(f"warm-up pass: {LABELS[c.name]}")
                    warmed.append(warm_pass(args, pa, c))
                    progress(f"  {warmed[-1]}")
                progress("waiting for every server to be idle")
                settled = "; ".join(warmed) + "; " + settle({c.name: c.server for c in configs})
                progress(f"  {settled}")
                progress(f"background load: {load.describe()}")
                by_round: dict[tuple[str, int], Measurement] = {}
                for round_no, level, config in level_pairs(configs, args.rounds, args.levels):
                    label = LABELS[config.name]
                    progress(f"round {round_no}/{args.rounds}, concurrency {level}: {label}")
                    try:
                        got = measure_round(args, pa, config, round_no, level)
                    except Exception as exc:  # noqa: BLE001 - report it, go on with the others
                        progress(f"  {label} failed: {type(exc).__name__}: {exc}")
                        got = Measurement(config.name, round_no, {}, [], [f"failed: {exc}"])
                    kept = by_round.setdefault((config.name, round_no), got)
                    if kept is not got:  # the round's other levels, in one measurement
                        kept.levels.update(got.levels)
                        kept.cpu_ms.update(got.cpu_ms)
                        kept.cpu_ms_by_process.update(got.cpu_ms_by_process)
                        kept.commands += got.commands
                        kept.notes += got.notes
                measurements = list(by_round.values())

    text, md, complete, summary = build_report(
        args, measurements, stage, time.monotonic() - started, version, load.describe(), settled
    )
    print()
    print(text)
    summary["measured_windows"] = args.measured_windows
    summary["processes"] = {
        config: {str(pid): label for pid, label in labels.items()}
        for config, labels in args.processes.items()
    }
    write_report(args.out_dir, "bench_prompt_cache", md, summary)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
