"""Soak and throughput comparison: perf_analyzer for minutes on a realistic mix (issues 7, 15).

Usage::

    python -m tiercache_dev.perf.soak [--duration 600] [--concurrency 8] [--out-dir .perf/soak]
        [--entries 8000] [--seed 0] [--max-tokens 8] [--redis] [--l1-max-bytes N]
        [--kv-pool-max-bytes N] [--no-speculate] [--background-load N [--background-duty F]]
    python -m tiercache_dev.perf.soak --compare [--compare-duration 120] [--rounds 3]
        [--concurrency 8] [--kv-pool-max-bytes N] [--background-load N [--background-duty F]]

The mix (seeded, written as perf_analyzer `--input-data`): prompts from
`../shared/eval/semantic_pairs_dev.jsonl` (beside the repository; `--pairs`), asked by four
tenants (the `tenant` input), each with a system preamble of its own in front of every question
(prefix KV reuse inside a tenant), with no adapter or one of the committed ones (`lora_name`),
`max_tokens` 8, greedy. Each entry is one of: a new question; an exact repeat of an earlier
(tenant, adapter, question), chosen with Zipf-like popularity (the k-th new question weighs
1/k^s); a rewording (side b of a paraphrase pair whose side a that tenant and adapter asked
earlier). perf_analyzer takes the entries in order, so the list is long enough that a run does
not wrap around into pure repeats (the report says how many requests were sent).

Soak (default): one tritonserver on a copy of model_repository/ (a fresh state dir under a
temporary folder, the converted weights linked from `--state-dir/models`, the committed adapters,
embedded tiers; `--redis` adds a redis-server and sets `redis_url` on the Redis-aware stages;
`--l1-max-bytes` goes to the stages that have an L1, prompt_cache and embedding_cache), then
perf_analyzer over gRPC `--streaming` (the ensemble is decoupled) at `--concurrency`, in
`time_windows` mode: three windows of duration/3 and a stability threshold of 1000 %, so it stops
after exactly three windows and reports the three merged. Every `--sample-s` a thread records the
RSS of tritonserver and of each Python-backend stub (psutil) and the tiers' bytes and entries
from /metrics. Reported: perf_analyzer's exit code and the server's error counters (the target is
zero), throughput, p50/p99 latency (the whole answer: see tiercache_dev.perf.run), requests by
cache status and exact hits by tier (metrics deltas), RSS first / after warm-up / last / max per
process, and each byte budget against the largest size seen.

Compare (`--compare`): the same mix and concurrency against three configurations, in `--rounds`
interleaved rounds (tiercache_dev.rounds.serpentine: a b c, then c b a, ...), each configuration
started cold in each round (its own copy of the repository and fresh state dir per round; the
same input list every round), `--compare-duration` (default 120 s) per configuration per round:
  a. tiercache as served (model_repository/ unchanged);
  b. caching off: the same stack, every request carrying `cache_control` "no-cache no-store
     no-semantic" (no exact or semantic lookup, nothing stored or indexed; prompt_cache, the
     embedder and lora_cache still run) and torch_llm's `kv_reuse` false;
  c. Triton's response cache: `llm_plain` (scripts/bench_fixtures/response_cache/llm_plain), a
     non-decoupled Python model with two instances (the depth of llm's `engine_streams`) that
     canonicalizes each request with the package's own code and runs the same torch_llm over
     BLS, returning the whole text, with `response_cache { enable: true }`, served with
     `--cache-config local,size=N` beside torch_llm; unary gRPC with `--async` (Triton refuses
     the response cache on decoupled models).
torch_llm's overrides (`--kv-pool-max-bytes`, `--engine-threads`, `--no-speculate`) apply to all
three (`--embedder-threads` to the embedder of the two that run it); `--redis` is refused with
`--compare` (only tiercache would have the Redis). For every run the report gives requests,
throughput, p50/p99, errors, cache statuses, the engine's generated tokens and engine tokens/s
(the delta of `tiercache_engine_generated_tokens_total` over the run divided by perf_analyzer's
wall time); then the medians per configuration; then the ratios tiercache/caching-off and
tiercache/response-cache (throughput, p50; engine tokens/s against the response cache), each taken
per round and shown as the median of the rounds with their range; then, per configuration (last
round), the CPU each server process used during the run (psutil at the start and the end of the
perf_analyzer run: user + system seconds, their share of the machine, threads, voluntary and
involuntary context switches) and the busiest thread groups (by the name in
/proc/<pid>/task/<tid>/comm); a process that started during the run counts from 0, one gone
before the end counts up to its last periodic sample. The report ends with the line
`ratio tiercache/response-cache throughput <median>`. `--background-load N` starts N CPU burners
for the whole run (each busy `--background-duty` of the time), to check a result on a machine the
run itself makes busy.

Outputs under OUT_DIR: soak.md / compare.md (the report), compare.json (every run, the ratios,
the command line, the rounds, the background load and the machine), soak_rss.csv, soak_tiers.csv
(compare-<config>-r<round>_rss.csv and _tiers.csv with --compare), inputs-*.json, perf-*.csv,
perf_analyzer logs and server logs under logs/ (with --compare the names carry the round:
perf-tiercache-r2.csv, logs/server-tiercache-r2.log), and the counters as *.counters.json. Exit
code 0 when every measurement was made (1 otherwise: a failed perf_analyzer run, errors, or a
budget exceeded).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import dataclasses
import datetime as dt
import json
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.config import CacheConfig, EngineConfig
from tiercache.engine.threads import TORCH_THREADS_PATTERN, pass_thread_count
from tiercache.errors import ConfigError
from tiercache.server import REDIS_STAGES, copy_repository
from tiercache_dev.console import (
    display_path,
    exit_on_sigterm,
    invocation,
    machine_summary,
    progress,
    shown,
)
from tiercache_dev.metrics import Sample, counter_delta, scrape_metrics
from tiercache_dev.paths import (
    ADAPTERS,
    BENCH_FIXTURES,
    DEFAULT_PAIRS,
    DEFAULT_STATE_DIR,
    MODEL_REPOSITORY,
    PERF_DIR,
)
from tiercache_dev.perf.analyzer import (
    LevelStats,
    failure_reason,
    install_perf_analyzer,
    perf_analyzer_version,
    run_perf_analyzer,
    write_inputs_json,
)
from tiercache_dev.rounds import (
    BackgroundLoad,
    Spread,
    add_background_load_arguments,
    check_background_load_arguments,
    paired_ratio,
    serpentine,
)
from tiercache_dev.servers import RedisServer, TritonServer, fresh_state, running, triton
from tiercache_dev.stats import median

FIXTURE = BENCH_FIXTURES / "response_cache" / "llm_plain"

TENANTS = {  # name -> (share of requests, system preamble)
    "acme": (
        0.4,
        "You are the support assistant of Acme Tools. Answer in plain words, for a customer "
        "who is not an engineer, and keep every answer short and polite.",
    ),
    "globex": (
        0.3,
        "You are Globex's internal knowledge assistant. Staff ask you general questions "
        "between meetings; answer directly and do not ask follow-up questions.",
    ),
    "initech": (
        0.2,
        "You are a tutor for Initech's evening classes. Explain like a patient teacher, "
        "with one concrete example when it helps.",
    ),
    "umbrella": (
        0.1,
        "You are Umbrella's research librarian. Give a factual, neutral answer and say "
        "when a question has no single answer.",
    ),
}
ADAPTER_SHARES = {"": 0.55, "brief": 0.15, "caps": 0.15, "french": 0.15}
NO_CACHE = "no-cache no-store no-semantic"
# The stage configs that have `l1_max_bytes` (tiercache.config: PromptCacheConfig,
# EmbeddingCacheConfig); llm and cache_admin open no L1, and an unknown parameter fails a stage.
L1_STAGES = ("prompt_cache", "embedding_cache")
RESPONSE_CACHE_BYTES = 64 << 20  # tiercache's default L1 budget
TIERCACHE, OFF, RESPONSE_CACHE = "tiercache", "caching-off", "response-cache"
LABELS = {
    TIERCACHE: "tiercache (as served)",
    OFF: "caching off (no-cache no-store no-semantic, kv_reuse false)",
    RESPONSE_CACHE: "Triton response cache (llm_plain over BLS to torch_llm)",
}
COMPARE_DEFAULT_ROUNDS = 4  # even: the serpentine cancels a steady drift only over pairs of rounds
ISSUE_MIN_DURATION_S = 90  # issue 15: at least this long per configuration per round
TOP_THREAD_GROUPS = 8  # thread groups listed per configuration in compare.md
# Each ratio of the comparison: (name, numerator, denominator, run metric); computed per round.
RATIOS = (
    ("tiercache/caching-off throughput", TIERCACHE, OFF, "throughput"),
    ("tiercache/caching-off p50", TIERCACHE, OFF, "p50_ms"),
    ("tiercache/response-cache throughput", TIERCACHE, RESPONSE_CACHE, "throughput"),
    ("tiercache/response-cache p50", TIERCACHE, RESPONSE_CACHE, "p50_ms"),
    ("tiercache/response-cache engine tokens/s", TIERCACHE, RESPONSE_CACHE, "engine_tokens_per_s"),
)
FINAL_RATIO = "tiercache/response-cache throughput"  # the last line of compare.md
ENGINE_TOKENS_DEFINITION = (
    "engine tokens/s = the rise of `tiercache_engine_generated_tokens_total` (torch_llm's "
    "generated tokens) from just before perf_analyzer started to after it ended (counters "
    "settled), divided by perf_analyzer's wall time of that run"
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out-dir", type=Path, default=PERF_DIR / "soak")
    p.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="JSONL of prompt pairs")
    p.add_argument("--duration", type=int, default=600, help="soak length in seconds")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--entries", type=int, default=8000, help="entries in the input list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--repeat-share", type=float, default=0.4, help="exact repeats")
    p.add_argument("--reword-share", type=float, default=0.15, help="rewordings")
    p.add_argument("--zipf-s", type=float, default=1.0, help="popularity exponent of repeats")
    p.add_argument("--sample-s", type=float, default=10.0, help="RSS and tier sampling period")
    p.add_argument("--redis", action="store_true", help="add a redis-server L3")
    p.add_argument(
        "--l1-max-bytes",
        type=int,
        default=None,
        help="L1 byte budget of the exact cache (default: the stages' own, 64 MiB); a small one "
        "makes L1 evict during the soak",
    )
    p.add_argument(
        "--kv-pool-max-bytes",
        type=int,
        default=None,
        help="torch_llm's prefix-KV pool budget (default: its own, 256 MiB, which a 10-minute "
        "CPU run only just fills); a small one fills early, so RSS can be seen flat after it",
    )
    p.add_argument(
        "--engine-threads",
        default=None,
        help="torch_llm's torch_threads (auto or a count) in every configuration (default: the "
        "committed config's)",
    )
    p.add_argument(
        "--no-speculate",
        action="store_true",
        help="torch_llm's speculate false in every configuration (speculative decoding off)",
    )
    p.add_argument(
        "--pass-threads",
        default=None,
        help="torch_llm's pass_threads in every configuration (torch threads for passes over "
        "several tokens: a count, 0: off, or auto: every CPU)",
    )
    p.add_argument(
        "--embedder-threads",
        default=None,
        help="the embedder's torch_threads (auto or a count) where it runs (default: the "
        "committed config's)",
    )
    p.add_argument("--compare", action="store_true", help="the three-server comparison instead")
    p.add_argument(
        "--compare-duration",
        type=int,
        default=120,
        help=f"--compare: seconds per configuration per round (issue 15 asks >= "
        f"{ISSUE_MIN_DURATION_S})",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"--compare: interleaved rounds of the configurations (default "
        f"{COMPARE_DEFAULT_ROUNDS})",
    )
    add_background_load_arguments(p)
    p.add_argument(
        "--only",
        action="append",
        choices=[TIERCACHE, OFF, RESPONSE_CACHE],
        help="--compare: only these servers (repeatable; default all three)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="where the converted weights live (linked into each server's fresh state)",
    )
    p.add_argument("--perf-analyzer", type=Path, default=None, help="skip the install step")
    args = p.parse_args(argv)
    if not args.pairs.is_file():
        p.error(f"pairs file {args.pairs} not found; pass --pairs PATH")
    if args.duration < 30 or args.compare_duration < 30 or args.concurrency < 1:
        p.error("durations must be >= 30 s and --concurrency >= 1")
    if not 0 <= args.repeat_share + args.reword_share < 1:
        p.error("--repeat-share + --reword-share must be in [0, 1)")
    if args.redis and args.compare:
        # Only tiercache would get the Redis: the comparison would not be like for like.
        p.error("--redis cannot be combined with --compare (only tiercache would have a Redis)")
    if args.rounds is not None and not args.compare:
        p.error("--rounds applies to --compare only (the soak is one run)")
    if args.rounds is None:
        args.rounds = COMPARE_DEFAULT_ROUNDS if args.compare else 1
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    check_background_load_arguments(p, args)
    if args.pass_threads is not None:
        try:
            pass_thread_count(args.pass_threads, 1)
        except ConfigError as exc:
            p.error(f"--pass-threads: {exc}")
    for flag, value in (("--engine-threads", args.engine_threads),
                        ("--embedder-threads", args.embedder_threads)):  # fmt: skip
        if value is not None and not re.fullmatch(TORCH_THREADS_PATTERN, value):
            p.error(f"{flag} must be auto or an integer >= 1, got {value!r}")
    return args


# ---- the mix ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    kind: str  # new | repeat | reword
    tenant: str
    adapter: str
    question: str


def load_pairs(path: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """(questions usable as new prompts, paraphrase pairs (a, b)), deduplicated, short ones."""
    seen: set[str] = set()
    singles: list[str] = []
    pairs: list[tuple[str, str]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        a, b = str(row["a"]).strip(), str(row["b"]).strip()
        if not a or not b or len(a) > 200 or len(b) > 200 or a in seen or b in seen:
            continue
        seen.update((a, b))
        if row.get("label") == 1:
            pairs.append((a, b))
        else:
            singles += [a, b]
    return singles, pairs


def build_mix(args: argparse.Namespace) -> list[Ask]:
    """The request stream: see the module docstring. Deterministic for a seed."""
    rng = random.Random(args.seed)
    singles, pairs = load_pairs(args.pairs)
    rng.shuffle(singles)
    rng.shuffle(pairs)
    tenants, tenant_w = list(TENANTS), [w for w, _ in TENANTS.values()]
    adapters, adapter_w = list(ADAPTER_SHARES), list(ADAPTER_SHARES.values())
    asked: list[Ask] = []  # first askings, in order (the popularity ranks)
    cum: list[float] = []  # cumulative Zipf weights of `asked`
    rewordable: list[tuple[Ask, str]] = []  # (first asking of side a, side b)
    out: list[Ask] = []
    next_single = next_pair = 0
    for _ in range(args.entries):
        x = rng.random()
        if asked and x < args.repeat_share:
            pick = asked[min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(asked) - 1)]
            out.append(Ask("repeat", pick.tenant, pick.adapter, pick.question))
            continue
        if rewordable and x < args.repeat_share + args.reword_share:
            first, b = rewordable.pop(rng.randrange(len(rewordable)))
            out.append(Ask("reword", first.tenant, first.adapter, b))
            continue
        tenant = rng.choices(tenants, tenant_w)[0]
        adapter = rng.choices(adapters, adapter_w)[0]
        if rng.random() < 0.5 and next_pair < len(pairs):
            a, b = pairs[next_pair]
            next_pair += 1
            ask = Ask("new", tenant, adapter, a)
            rewordable.append((ask, b))
        elif next_single < len(singles):
            ask = Ask("new", tenant, adapter, singles[next_single])
            next_single += 1
        else:
            raise SystemExit(f"the pairs file has too few questions for {args.entries} entries")
        out.append(ask)
        asked.append(ask)
        cum.append((cum[-1] if cum else 0.0) + 1.0 / len(asked) ** args.zipf_s)
    return out


def prompt_text(ask: Ask) -> str:
    return f"{TENANTS[ask.tenant][1]}\n\nQuestion: {ask.question}"


def entries_for(mix: list[Ask], max_tokens: int, cache_control: str | None) -> list[dict]:
    def tensor(value: Any) -> dict:
        return {"content": [value], "shape": [1]}

    out = []
    for ask in mix:
        entry = {
            "text_input": tensor(prompt_text(ask)),
            "max_tokens": tensor(max_tokens),
            "tenant": tensor(ask.tenant),
            "lora_name": tensor(ask.adapter),
        }
        if cache_control is not None:
            entry["cache_control"] = tensor(cache_control)
        out.append(entry)
    return out


def mix_summary(mix: list[Ask], upto: int | None = None) -> str:
    part = mix[: len(mix) if upto is None else min(upto, len(mix))]
    kinds = Counter(a.kind for a in part)
    tenants = Counter(a.tenant for a in part)
    adapters = Counter(a.adapter or "(base)" for a in part)
    distinct = len({(a.tenant, a.adapter, a.question) for a in part})
    return (
        f"{len(part)} entries: new {kinds['new']}, exact repeats {kinds['repeat']}, rewordings "
        f"{kinds['reword']}; {distinct} distinct requests; tenants "
        + ", ".join(f"{k} {v}" for k, v in sorted(tenants.items()))
        + "; adapters "
        + ", ".join(f"{k} {v}" for k, v in sorted(adapters.items()))
    )


# ---- servers ------------------------------------------------------------------------------------


def engine_params(args: argparse.Namespace) -> dict[str, str]:
    """torch_llm's parameter overrides from the command line; every configuration's torch_llm
    gets them (the response-cache one too: the same engine behind all three)."""
    params: dict[str, str] = {}
    if args.kv_pool_max_bytes is not None:
        params["kv_pool_max_bytes"] = str(args.kv_pool_max_bytes)
    if args.engine_threads is not None:
        params["torch_threads"] = args.engine_threads
    if args.no_speculate:
        params["speculate"] = "false"
    if args.pass_threads is not None:
        params["pass_threads"] = args.pass_threads
    return params


def tiercache_repository(root: Path, args: argparse.Namespace, config: str, redis_url: str) -> Path:
    params: dict[str, dict[str, str]] = {}
    if redis_url:
        for stage in REDIS_STAGES:
            params.setdefault(stage, {})["redis_url"] = redis_url
    if args.l1_max_bytes is not None:
        for stage in L1_STAGES:
            params.setdefault(stage, {})["l1_max_bytes"] = str(args.l1_max_bytes)
    params["torch_llm"] = engine_params(args)
    if args.embedder_threads is not None:
        params["embedder"] = {"torch_threads": args.embedder_threads}
    if config == OFF:
        params["torch_llm"]["kv_reuse"] = "false"
    return copy_repository(MODEL_REPOSITORY, root / "model_repository", params)


def response_cache_repository(root: Path, args: argparse.Namespace) -> Path:
    """torch_llm (with the same overrides as the other configurations, through the same
    copy_repository) and llm_plain; the repository's other models are left out."""
    dest = copy_repository(
        MODEL_REPOSITORY, root / "model_repository", {"torch_llm": engine_params(args)}
    )
    for model in dest.iterdir():
        if model.name != "torch_llm":
            if model.is_dir():
                shutil.rmtree(model)
            else:
                model.unlink()
    (dest / "llm_plain" / "1").mkdir(parents=True)
    shutil.copy2(FIXTURE / "config.pbtxt", dest / "llm_plain" / "config.pbtxt")
    shutil.copy2(FIXTURE / "model.py", dest / "llm_plain" / "1" / "model.py")
    return dest


# ---- sampling -----------------------------------------------------------------------------------


def process_name(proc: Any) -> str:
    """tritonserver, or the model name of a Python-backend stub."""
    try:
        cmd = proc.cmdline()
    except Exception:  # noqa: BLE001 - the process may have gone
        return f"pid{proc.pid}"
    if len(cmd) > 1 and cmd[1].endswith("model.py"):
        return Path(cmd[1]).parent.parent.name
    return Path(cmd[0]).name if cmd else f"pid{proc.pid}"


def labelled_processes(root_pid: int, labels: dict[int, str]) -> list[tuple[str, Any]]:
    """(label, psutil.Process) of tritonserver and every descendant; `labels` (pid -> label)
    keeps labels stable across samples (`embedding_cache#1` for a model's second instance)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in procs:
        if proc.pid not in labels:
            name = process_name(proc)
            n = sum(1 for v in labels.values() if v.split("#")[0] == name)
            labels[proc.pid] = name if n == 0 else f"{name}#{n}"
        out.append((labels[proc.pid], proc))
    return out


def rss_by_process(root_pid: int, labels: dict[int, str]) -> dict[str, int]:
    """Label -> RSS bytes of tritonserver and every descendant (see `labelled_processes`)."""
    import psutil

    out: dict[str, int] = {}
    for label, proc in labelled_processes(root_pid, labels):
        try:  # a stub that died and was not reaped (a zombie) reads as 0
            zombie = proc.status() == psutil.STATUS_ZOMBIE
            out[label] = 0 if zombie else proc.memory_info().rss
        except psutil.NoSuchProcess:
            out[label] = 0
    for label in set(labels.values()) - set(out):  # gone (reaped)
        out[label] = 0
    return out


# ---- CPU by process and thread -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CpuSample:
    """One process's CPU counters at one moment: user + system seconds (its own, not its
    reaped children's), thread count, context switches so far, and each thread's
    (name, user + system seconds) by thread id."""

    cpu_s: float
    threads: int
    ctx_voluntary: int
    ctx_involuntary: int
    thread_cpu_s: Mapping[int, tuple[str, float]] = field(default_factory=dict)


BUSIEST_THREADS = 4  # single threads reported per process
NO_CPU = CpuSample(0.0, 0, 0, 0)  # what a process that started during the run had at its start


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    """One process over one perf_analyzer run."""

    label: str
    cpu_s: float
    machine_share: float  # cpu_s / (wall_s * cpu_count): its share of the machine's capacity
    threads: int  # at the end (or at its last sample)
    ctx_voluntary: int
    ctx_involuntary: int
    thread_groups: tuple[tuple[str, float], ...]  # (thread name, CPU s), busiest first
    note: str = ""
    # The busiest single threads, CPU s each (a stub's threads all carry its name, so the groups
    # cannot tell torch's intra-op workers apart; their seconds side by side can).
    busiest_threads_s: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {
            "process": self.label,
            "cpu_s": self.cpu_s,
            "machine_share": self.machine_share,
            "threads": self.threads,
            "ctx_switches_voluntary": self.ctx_voluntary,
            "ctx_switches_involuntary": self.ctx_involuntary,
            "thread_groups": [{"name": n, "cpu_s": c} for n, c in self.thread_groups],
            "busiest_threads_cpu_s": list(self.busiest_threads_s),
            "note": self.note,
        }


def thread_name(pid: int, tid: int) -> str | None:
    """The kernel's name of a thread (/proc/<pid>/task/<tid>/comm); None once it has ended."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return None


def cpu_snapshot(processes: Sequence[tuple[str, Any]]) -> dict[str, CpuSample]:
    """Label -> CpuSample of each live process (a zombie or a process gone meanwhile is left
    out: the caller keeps its last sample)."""
    import psutil

    out: dict[str, CpuSample] = {}
    for label, proc in processes:
        try:
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                times = proc.cpu_times()
                ctx = proc.num_ctx_switches()
                count = proc.num_threads()
                threads = proc.threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        per_thread: dict[int, tuple[str, float]] = {}
        for t in threads:
            name = thread_name(proc.pid, t.id)
            if name is not None:
                per_thread[t.id] = (name, t.user_time + t.system_time)
        out[label] = CpuSample(
            times.user + times.system, count, ctx.voluntary, ctx.involuntary, per_thread
        )
    return out


def cpu_breakdown(
    start: Mapping[str, CpuSample],
    end: Mapping[str, CpuSample],
    wall_s: float,
    cpu_count: int,
    gone_at: Mapping[str, float] | None = None,
) -> list[ProcessCpu]:
    """What each process used between `start` and `end` (label -> sample), busiest first.

    A process missing from `start` started during the run and counts from 0; `gone_at` (label ->
    seconds into the run) marks an `end` sample that is the process's last periodic one, taken
    before it ended; a process only in `start` was never seen again and counts 0. Threads are
    matched by id (a reused id under another name counts from 0) and grouped by name."""
    if wall_s <= 0 or cpu_count < 1:
        raise ValueError(f"need wall_s > 0 and cpu_count >= 1, got {wall_s}, {cpu_count}")
    gone_at = gone_at or {}
    out = []
    for label in sorted(start.keys() | end.keys()):
        notes = []
        first, last = start.get(label), end.get(label)
        if first is None:
            first = NO_CPU
            notes.append("started during the run: counted from 0")
        if last is None:
            last = first
            notes.append("gone before any later sample: not counted")
        elif label in gone_at:
            notes.append(
                f"gone before the end: counted to its last sample, {gone_at[label]:.0f} s into "
                "the run"
            )
        groups: dict[str, float] = defaultdict(float)
        per_thread: list[float] = []
        for tid, (name, cpu_s) in last.thread_cpu_s.items():
            before = first.thread_cpu_s.get(tid)
            used = cpu_s - (before[1] if before is not None and before[0] == name else 0.0)
            groups[name] += used
            per_thread.append(used)
        cpu_s = last.cpu_s - first.cpu_s
        out.append(
            ProcessCpu(
                label=label,
                cpu_s=cpu_s,
                machine_share=cpu_s / (wall_s * cpu_count),
                threads=last.threads,
                ctx_voluntary=last.ctx_voluntary - first.ctx_voluntary,
                ctx_involuntary=last.ctx_involuntary - first.ctx_involuntary,
                thread_groups=tuple(sorted(groups.items(), key=lambda g: (-g[1], g[0]))),
                note="; ".join(notes),
                busiest_threads_s=tuple(sorted(per_thread, reverse=True)[:BUSIEST_THREADS]),
            )
        )
    return sorted(out, key=lambda p: (-p.cpu_s, p.label))


def top_thread_groups(cpu: Sequence[ProcessCpu], n: int) -> list[tuple[str, str, float]]:
    """The `n` busiest (process, thread name, CPU s) over every process."""
    rows = [(p.label, name, cpu_s) for p in cpu for name, cpu_s in p.thread_groups]
    return sorted(rows, key=lambda r: (-r[2], r[0], r[1]))[:n]


def tier_sizes(samples: list[Sample]) -> dict[str, tuple[float, float]]:
    """Tier -> (bytes, entries) from one scrape."""
    out: dict[str, list[float]] = {}
    for name, labels, value in samples:
        tier = labels.get("tier", "")
        if name in ("tiercache_cache_bytes", "tiercache_cache_entries") and tier:
            row = out.setdefault(f"exact {tier.upper()}", [0.0, 0.0])
            row[0 if name.endswith("bytes") else 1] = value
        elif name == "tiercache_engine_kv_pool_bytes":
            out.setdefault("engine KV pool", [0.0, 0.0])[0] += value
        elif name == "tiercache_embedding_cache_index_rows":
            out.setdefault("semantic index", [0.0, 0.0])[1] += value
        elif name == "tiercache_lora_resident" and tier:
            out.setdefault(f"adapters {tier}", [0.0, 0.0])[1] = value
    return {k: (v[0], v[1]) for k, v in out.items()}


class Sampler(threading.Thread):
    """Every `period_s`: RSS per process and tier sizes into two CSV files; between
    `mark_cpu_start()` and `mark_cpu_end()` (the perf_analyzer run) also each process's CPU
    counters, so a process gone before the end still has its last sample."""

    def __init__(
        self,
        server: TritonServer,
        out_dir: Path,
        period_s: float,
        duration_s: float,
        prefix: str = "soak",
    ) -> None:
        super().__init__(daemon=True)
        self.server, self.period_s, self.duration_s = server, period_s, duration_s
        self.rss_path = out_dir / f"{prefix}_rss.csv"
        self.desc = prefix
        self.tiers_path = out_dir / f"{prefix}_tiers.csv"
        self.died: dict[str, float] = {}  # process label -> seconds into the run it was gone
        self.rss: dict[str, list[tuple[float, int]]] = {}
        self.tiers: dict[str, list[tuple[float, float, float]]] = {}
        self.labels: dict[int, str] = {}
        self.stop_event = threading.Event()
        self.started = time.monotonic()
        self.status: dict[str, float] = {}
        self.lock = threading.Lock()  # `labels` and the CPU samples: this thread and the caller's
        self.cpu_start: dict[str, CpuSample] | None = None
        self.cpu_last: dict[str, tuple[float, CpuSample]] = {}  # label -> (t, latest sample)
        self.cpu_end: dict[str, CpuSample] | None = None
        self.cpu_gone_at: dict[str, float] = {}  # label -> t of its last sample, gone at the end

    def _now(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def _observe_cpu(self, t: float) -> dict[str, CpuSample]:
        """A CPU sample of every process, merged into `cpu_last` (a thread that has ended keeps
        its last value there, so its CPU still counts); returns the live ones. Holds `lock`."""
        now = cpu_snapshot(labelled_processes(self.server.process.pid, self.labels))
        for label, sample in now.items():
            previous = self.cpu_last.get(label)
            if previous is not None:
                threads = {**previous[1].thread_cpu_s, **sample.thread_cpu_s}
                sample = dataclasses.replace(sample, thread_cpu_s=threads)
            self.cpu_last[label] = (t, sample)
        return now

    def mark_cpu_start(self) -> None:
        """The CPU counters at the start of the measured run."""
        with self.lock:
            t = self._now()
            self.cpu_last = {}
            self.cpu_start = self._observe_cpu(t)
            self.cpu_end, self.cpu_gone_at = None, {}

    def mark_cpu_end(self) -> None:
        """The CPU counters at its end; a process no longer there keeps its last sample."""
        with self.lock:
            if self.cpu_start is None:
                raise RuntimeError("mark_cpu_end before mark_cpu_start")
            t = self._now()
            live = self._observe_cpu(t)
            self.cpu_end = {label: sample for label, (_, sample) in self.cpu_last.items()}
            self.cpu_gone_at = {
                label: seen for label, (seen, _) in self.cpu_last.items() if label not in live
            }

    def cpu(self, wall_s: float, cpu_count: int) -> list[ProcessCpu]:
        """Each process's CPU between the two marks ([] without both, or without a wall time)."""
        with self.lock:
            if self.cpu_start is None or self.cpu_end is None or wall_s <= 0:
                return []
            return cpu_breakdown(self.cpu_start, self.cpu_end, wall_s, cpu_count, self.cpu_gone_at)

    def sample(self) -> None:
        t = self._now()
        with self.lock:
            by_process = rss_by_process(self.server.process.pid, self.labels)
            if self.cpu_start is not None and self.cpu_end is None:
                self._observe_cpu(t)
        for label, rss in by_process.items():
            self.rss.setdefault(label, []).append((t, rss))
            self.rss_writer.writerow([t, label, rss])
            if rss == 0 and label not in self.died:
                self.died[label] = t
                progress(f"  process {label} died ({t:.0f} s into the run)")
        try:
            samples = scrape_metrics(self.server.ports.metrics)
        except OSError:
            return
        for tier, (nbytes, entries) in tier_sizes(samples).items():
            self.tiers.setdefault(tier, []).append((t, nbytes, entries))
            self.tiers_writer.writerow([t, tier, int(nbytes), int(entries)])
        self.status = status_counters(samples)
        self.rss_file.flush()
        self.tiers_file.flush()

    def run(self) -> None:
        bar = None
        try:
            from tqdm import tqdm

            bar = tqdm(total=int(self.duration_s), unit="s", desc=self.desc, file=sys.stdout)
        except ImportError:
            pass
        with open(self.rss_path, "w", newline="") as self.rss_file:
            with open(self.tiers_path, "w", newline="") as self.tiers_file:
                self.rss_writer = csv.writer(self.rss_file)
                self.tiers_writer = csv.writer(self.tiers_file)
                self.rss_writer.writerow(["t_s", "process", "rss_bytes"])
                self.tiers_writer.writerow(["t_s", "tier", "bytes", "entries"])
                last = 0.0
                while True:
                    self.sample()
                    elapsed = time.monotonic() - self.started
                    done = {k: int(v) for k, v in self.status.items() if k.startswith("status:")}
                    line = ", ".join(f"{k[7:]} {v}" for k, v in done.items() if v)
                    if bar is not None:
                        bar.update(int(min(elapsed, self.duration_s) - last))
                        bar.set_postfix_str(line)
                    else:
                        progress(f"  {elapsed:.0f}/{self.duration_s:.0f} s: {line}")
                    last = int(min(elapsed, self.duration_s))
                    if self.stop_event.wait(self.period_s):
                        self.sample()
                        break
        if bar is not None:
            bar.close()


class StubWatch:
    """What run_perf_analyzer polls instead of the server: it reads as exited when tritonserver
    exits or, `grace_s` after the sampler saw a stub die (tritonserver neither restarts a dead
    Python stub nor fails the streams it held: perf_analyzer would wait for them forever)."""

    def __init__(self, server: TritonServer, sampler: Sampler, grace_s: float = 20.0) -> None:
        self.server, self.sampler, self.grace_s = server, sampler, grace_s
        self.process = self  # run_perf_analyzer calls server.process.poll()
        self.first_seen: float | None = None

    def poll(self) -> int | None:
        code = self.server.process.poll()
        if code is not None or not self.sampler.died:
            return code
        if self.first_seen is None:
            self.first_seen = time.monotonic()
        return -1 if time.monotonic() - self.first_seen > self.grace_s else None


# ---- metrics ------------------------------------------------------------------------------------


def status_counters(samples: list[Sample]) -> dict[str, float]:
    """Flat counters: status:<cache status>, hit:<tier>, and error counts of every stage."""
    out: dict[str, float] = defaultdict(float)
    for name, labels, value in samples:
        if name == "tiercache_llm_requests_total":  # the final status (after semantic lookup)
            out[f"status:{labels.get('status')}"] += value
        elif name == "tiercache_prompt_cache_requests_total":  # the exact lookup's status
            out[f"lookup:{labels.get('status')}"] += value
        elif name == "tiercache_prompt_cache_hits_total":
            out[f"hit:{labels.get('tier')}"] += value
        elif name == "tiercache_embedding_cache_lookups_total" and labels.get("outcome"):
            out[f"semantic:{labels['outcome']}"] += value
        elif name == "tiercache_llm_generations_total":
            out["generations"] += value
        elif name == "tiercache_llm_coalesced_total":
            out["coalesced"] += value
        elif name == "tiercache_engine_generated_tokens_total":
            out["engine:generated_tokens"] += value
        elif name == "tiercache_llm_generation_seconds_sum":
            out["engine:generation_seconds"] += value
        elif name == "tiercache_engine_draft_tokens_total":
            out["engine:draft_tokens"] += value
        elif name == "tiercache_engine_draft_accepted_tokens_total":
            out["engine:speculated_tokens"] += value
        elif name == "tiercache_engine_finished_total":
            reason = labels.get("reason")
            if reason == "error":
                out["error:engine"] += value
            elif reason == "adapter_missing":  # refused, then asked again with the weights
                out["engine:adapter_missing"] += value
            else:
                out["engine:generations"] += value
        elif name == "tiercache_engine_kv_reused_tokens_total":
            out["kv:reused_tokens"] += value
        elif name == "tiercache_engine_kv_computed_tokens_total":
            out["kv:computed_tokens"] += value
        elif name == "tiercache_engine_kv_evictions_total":
            out["kv:evictions"] += value
        elif name == "tiercache_cache_evictions_total":
            out[f"evictions:{labels.get('tier')}"] += value
        elif name == "nv_inference_request_failure":
            out[f"triton_failure:{labels.get('model')}"] += value
        elif name == "nv_inference_request_success":
            out[f"triton_success:{labels.get('model')}"] += value
        elif name == "nv_cache_num_hits_per_model":
            out[f"response_cache_hits:{labels.get('model')}"] += value
        elif name == "nv_cache_num_misses_per_model":
            out[f"response_cache_misses:{labels.get('model')}"] += value
    return dict(out)


def settled_counters(port: int) -> dict[str, float]:
    """The counters once the stages' deferred updates (flushed every second) have landed: two
    scrapes further apart than that agree (0.6 s apart, they could agree between flushes)."""
    previous = status_counters(scrape_metrics(port))
    for _ in range(20):
        time.sleep(1.2)
        current = status_counters(scrape_metrics(port))
        if current == previous:
            break
        previous = current
    return previous


# ---- perf_analyzer ------------------------------------------------------------------------------


def perf_args(
    model: str,
    server: TritonServer,
    data: Path,
    concurrency: int,
    duration_s: int,
    transport: str,
    csv_: Path,
) -> list[str]:
    """Three time windows of duration/3 and -s 1000: perf_analyzer stops after exactly three
    windows (its stability check needs three) and reports them merged."""
    return [
        "-m",
        model,
        "-i",
        "grpc",
        "-u",
        f"127.0.0.1:{server.ports.grpc}",
        transport,
        "--input-data",
        str(data),
        "--concurrency-range",
        str(concurrency),
        "--measurement-mode",
        "time_windows",
        "--measurement-interval",
        str(duration_s * 1000 // 3),
        "--stability-percentage",
        "1000",
        "--max-trials",
        "3",
        "-f",
        str(csv_),
    ]


@dataclass(slots=True)
class Run:
    config: str
    level: LevelStats | None
    returncode: int
    statuses: dict[str, int]
    wall_s: float  # perf_analyzer's wall time
    command: str
    notes: list[str] = field(default_factory=list)
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    tiers: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    round: int = 1
    cpu: list[ProcessCpu] = field(default_factory=list)  # busiest first
    cpu_count: int = 0  # the machine's CPUs, the denominator of each process's share

    @property
    def engine_tokens(self) -> int | None:
        """Tokens the engine generated over the run (None when the counters were not read)."""
        if "engine:generated_tokens" not in self.statuses:
            return None
        return self.statuses["engine:generated_tokens"]

    @property
    def engine_tokens_per_s(self) -> float | None:
        """ENGINE_TOKENS_DEFINITION."""
        tokens = self.engine_tokens
        return None if tokens is None or self.wall_s <= 0 else tokens / self.wall_s

    def metric(self, name: str) -> float | None:
        """throughput (infer/s), p50_ms, p99_ms or engine_tokens_per_s; None when not measured."""
        if name == "engine_tokens_per_s":
            return self.engine_tokens_per_s
        if self.level is None:
            return None
        values = {
            "throughput": self.level.throughput,
            "p50_ms": self.level.p50_us / 1000,
            "p99_ms": self.level.p99_us / 1000,
        }
        return values[name]


def run_tag(config: str, round_no: int, compare: bool) -> str:
    """What a run's files are named by: `tiercache-r2` in a comparison, `tiercache` in a soak."""
    return f"{config}-r{round_no}" if compare else config


def measure(
    args: argparse.Namespace,
    pa: Path,
    config: str,
    duration_s: int,
    mix: list[Ask],
    work: Path,
    sample: bool,
    round_no: int = 1,
) -> Run:
    """One cold server (its own repository copy and fresh state dir) and one perf_analyzer run.
    `sample` True: the soak's names (soak_rss.csv, ...); False: a comparison run's, which carry
    the round."""
    tag = run_tag(config, round_no, not sample)
    root = work / tag
    root.mkdir(parents=True)
    state = fresh_state(root, args.state_dir)
    # The port is chosen now (the repository names it); the server starts inside the try.
    redis_server = RedisServer(root) if args.redis and config == TIERCACHE else None
    redis_url = redis_server.url if redis_server is not None else ""
    logs = args.out_dir / "logs"
    extra: list[str] = []
    if config == RESPONSE_CACHE:
        repository = response_cache_repository(root, args)
        extra = ["--cache-config", f"local,size={RESPONSE_CACHE_BYTES}"]
        model, transport, control = "llm_plain", "--async", None
    else:
        repository = tiercache_repository(root, args, config, redis_url)
        model, transport = "ensemble", "--streaming"
        control = NO_CACHE if config == OFF else None
    data = args.out_dir / f"inputs-{tag}.json"  # the same entries every round
    write_inputs_json(data, entries_for(mix, args.max_tokens, control))
    server = triton(
        repository,
        state,
        log_path=logs / f"server-{tag}.log",
        extra_args=extra,
        adapters_dir=ADAPTERS,
    )
    when = f", round {round_no}" if not sample else ""
    progress(f"{LABELS[config]}{when}: starting tritonserver (grpc {server.ports.grpc})")
    started = time.monotonic()
    try:
        if redis_server is not None:
            redis_server.start()
            progress(f"redis-server at {redis_url}")
        with running(server, ready_timeout_s=300):
            progress(f"  ready in {time.monotonic() - started:.1f} s")
            before = settled_counters(server.ports.metrics)
            prefix = "soak" if sample else f"compare-{tag}"
            sampler = Sampler(server, args.out_dir, args.sample_s, duration_s, prefix)
            sampler.start()
            pa_args = perf_args(
                model,
                server,
                data,
                args.concurrency,
                duration_s,
                transport,
                args.out_dir / f"perf-{tag}.csv",
            )
            progress(f"  perf_analyzer {shown(pa_args)}")
            sampler.mark_cpu_start()
            run = run_perf_analyzer(
                pa,
                pa_args,
                logs / f"perf-{tag}.txt",
                timeout_s=duration_s * 2 + 300,
                server=StubWatch(server, sampler),
            )
            sampler.mark_cpu_end()  # before the counters settle: the run's CPU only
            after = settled_counters(server.ports.metrics)
            sampler.stop_event.set()
            sampler.join(timeout=30)
    finally:
        if redis_server is not None:
            redis_server.stop()
    result = Run(
        config,
        run.levels.get(args.concurrency),
        run.returncode,
        counter_delta(before, after),
        run.wall_s,
        shown([str(pa), *pa_args]),
        round=round_no,
        cpu_count=os.cpu_count() or 1,
    )
    result.rss, result.tiers = sampler.rss, sampler.tiers
    result.cpu = sampler.cpu(run.wall_s, result.cpu_count)
    for label, t in sampler.died.items():
        result.notes.append(
            f"the {label} process died {t:.0f} s into the run (see the server log); the "
            "requests it held never finished"
        )
    if run.returncode != 0:
        result.notes.append(f"perf_analyzer exit {run.returncode}: {failure_reason(run)}")
        progress(f"  {result.notes[-1]}")
    if result.level is not None:
        lv = result.level
        progress(
            f"  {lv.request_count} requests, {lv.throughput:.2f} infer/s, p50 "
            f"{lv.p50_us / 1000:.1f} ms, p99 {lv.p99_us / 1000:.1f} ms; {status_line(result)}"
        )
    return result


# ---- report -------------------------------------------------------------------------------------


def status_line(run: Run) -> str:
    s = run.statuses
    parts = [f"{k[7:]} {v}" for k, v in s.items() if k.startswith("status:") and v]
    hits = [f"{k[4:]} {v}" for k, v in s.items() if k.startswith("hit:") and v]
    text = ", ".join(parts) or "no tiercache statuses"
    if hits:
        text += " (exact hits by tier: " + ", ".join(hits) + ")"
    server = run.level.server if run.level is not None else {}
    if "cache_hit_count" in server:  # Triton's response cache, in perf_analyzer's windows
        text = (
            f"response cache hits {server['cache_hit_count']:.0f}, misses "
            f"{server.get('cache_miss_count', 0):.0f} (perf_analyzer's server section)"
        )
    if s.get("engine:generations"):
        text += (
            f"; engine: {s['engine:generations']} generations, "
            f"{s.get('engine:generated_tokens', 0)} tokens"
        )
        if s.get("engine:generation_seconds"):
            text += f", {s['engine:generation_seconds']:.1f} s of generation (llm's)"
        if s.get("engine:draft_tokens"):
            text += (
                f", {s.get('engine:speculated_tokens', 0):.0f} of them from drafts "
                f"({s['engine:draft_tokens']:.0f} draft tokens verified)"
            )
    if s.get("engine:adapter_missing"):
        text += (
            f"; {s['engine:adapter_missing']:.0f} engine refusals for an adapter it did not hold "
            "(llm asked again with the weights)"
        )
    return text


def error_count(run: Run) -> int:
    s = run.statuses
    return (
        s.get("status:error", 0)
        + s.get("lookup:error", 0)
        + s.get("error:engine", 0)
        + sum(v for k, v in s.items() if k.startswith("triton_failure:"))
    )


def budgets(args: argparse.Namespace) -> dict[str, int]:
    cache, engine = CacheConfig(), EngineConfig()
    out = {
        "exact L1": args.l1_max_bytes if args.l1_max_bytes is not None else cache.l1_max_bytes,
        "exact L2": cache.l2_max_bytes,
        "engine KV pool": (
            args.kv_pool_max_bytes
            if args.kv_pool_max_bytes is not None
            else engine.kv_pool_max_bytes
        ),
    }
    return out


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def size(n: float) -> str:
    """Bytes, in the largest unit that keeps a whole number in front."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def header(args: argparse.Namespace, title: str, wall_s: float, pa_version: str) -> list[str]:
    machine = machine_summary()
    return [
        f"## {title}",
        "",
        f"- command: `{invocation('tiercache_dev.perf.soak')}`",
        f"- date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}, "
        f"wall time {wall_s:.0f} s",
        f"- machine: {machine['nproc']} CPUs ({machine['cpu']}), load average at the end "
        f"{machine['loadavg']} (shared with other work); Python {platform.python_version()}, "
        f"{pa_version}",
        f"- perf_analyzer: gRPC, concurrency {args.concurrency}, time_windows (3 windows, "
        f"-s 1000 -r 3: the three windows merged), max_tokens {args.max_tokens}, greedy",
    ]


def soak_report(
    args: argparse.Namespace, run: Run, mix: list[Ask], wall_s: float, pa: str, load: str = ""
) -> tuple[str, bool]:
    md = header(args, f"Soak: {args.duration} s at concurrency {args.concurrency}", wall_s, pa)
    lv = run.level
    sent = lv.request_count if lv else 0
    md += [
        "- server: model_repository/ copy, fresh state dir, "
        + (f"L1 budget {args.l1_max_bytes} bytes, " if args.l1_max_bytes is not None else "")
        + (
            f"KV pool budget {args.kv_pool_max_bytes} bytes, "
            if args.kv_pool_max_bytes is not None
            else ""
        )
        + ("Redis L3" if args.redis else "no Redis")
        + "; committed adapters",
        *([f"- background load: {load}"] if load else []),
        f"- input list: {mix_summary(mix)}",
        (
            f"- sent (perf_analyzer's measured requests): {sent}; the first {sent} entries hold "
            f"{mix_summary(mix, sent)}"
            if sent
            else "- sent: perf_analyzer gave no result (see the notes); the server's counts "
            "below say how many requests it answered"
        ),
        "",
        "### Result",
        "",
    ]
    errors = error_count(run)
    ok = run.returncode == 0 and lv is not None and errors == 0
    if lv is not None:
        md += [
            f"- perf_analyzer exit {run.returncode}; server-side errors {errors}",
            f"- throughput {lv.throughput:.2f} infer/s; latency p50 {lv.p50_us / 1000:.1f} ms, "
            f"p99 {lv.p99_us / 1000:.1f} ms, avg {lv.avg_us / 1000:.1f} ms",
        ]
    else:
        md.append(f"- no measurement: {'; '.join(run.notes)}")
    s = run.statuses
    total = sum(v for k, v in s.items() if k.startswith("status:"))
    md += ["", "Requests by cache status (server metrics, whole run):", ""]
    md += ["| status | requests | share |", "|---|---:|---:|"]
    rows = [(f"exact {k[4:].upper()}", v) for k, v in s.items() if k.startswith("hit:")]
    rows += [(k[7:], v) for k, v in s.items() if k.startswith("status:") and k != "status:exact"]
    for name, v in rows:
        md.append(f"| {name} | {v} | {v / total:.1%} |" if total else f"| {name} | {v} | - |")
    md.append(f"| all | {total} | |")
    extra = {
        k: v
        for k, v in s.items()
        if k.startswith(("semantic:", "kv:", "engine:", "evictions:", "generations", "coalesced"))
        and v
    }
    md += ["", "Other counters: " + ", ".join(f"{k} {v}" for k, v in extra.items())]
    md += ["", "### Memory (RSS, MiB)", ""]
    md += [
        "| process | first | at 25 % | last | max | last - at 25 % |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, rss_points in sorted(run.rss.items()):
        values = [r for _, r in rss_points]
        quarter = values[len(values) // 4]
        md.append(
            f"| {label} | {mib(values[0])} | {mib(quarter)} | {mib(values[-1])} | "
            f"{mib(max(values))} | {mib(values[-1] - quarter)} |"
        )
    md += ["", "### Byte budgets", ""]
    md += ["| tier | budget | max seen | entries at the end | held |", "|---|---:|---:|---:|---|"]
    for tier, budget in budgets(args).items():
        tier_points = run.tiers.get(tier)
        if not tier_points:
            md.append(f"| {tier} | {size(budget)} | n/a | n/a | n/a |")
            continue
        top = max(b for _, b, _ in tier_points)
        held = top <= budget
        ok &= held
        md.append(
            f"| {tier} | {size(budget)} | {size(top)} | {int(tier_points[-1][2]) or '-'} | "
            f"{'yes' if held else 'NO'} |"
        )
    others = [t for t in run.tiers if t not in budgets(args)]
    if others:
        md += [
            "",
            "Counted (no byte gauge): "
            + ", ".join(f"{t} {int(run.tiers[t][-1][2])}" for t in sorted(others)),
        ]
    md += [
        "",
        f"- perf_analyzer: `{run.command}`",
        *(f"- note: {n}" for n in run.notes),
        f"- samples every {args.sample_s:g} s: `soak_rss.csv`, `soak_tiers.csv`; logs in "
        f"`{display_path(args.out_dir / 'logs')}/`",
    ]
    return "\n".join(md) + "\n", ok


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def compare_configs(args: argparse.Namespace) -> list[str]:
    """The configurations to compare, in their fixed order (`--only` picks among them)."""
    wanted = set(args.only or (TIERCACHE, OFF, RESPONSE_CACHE))
    return [c for c in (TIERCACHE, OFF, RESPONSE_CACHE) if c in wanted]


def run_ok(run: Run) -> bool:
    return run.level is not None and run.returncode == 0 and error_count(run) == 0


def per_round(runs: Sequence[Run], config: str, metric: str) -> dict[int, float]:
    """{round: the run's `metric`} of one configuration, over the rounds that measured it
    without an error (`run_ok`: a run whose requests failed fast showed a higher throughput,
    and went into the ratios as it was)."""
    out = {}
    for r in runs:
        value = r.metric(metric) if r.config == config and run_ok(r) else None
        if value is not None:
            out[r.round] = value
    return out


def compare_ratios(runs: Sequence[Run]) -> dict[str, Spread | None]:
    """Each of RATIOS, taken per round (the two runs of a round minutes apart) and spread over
    the rounds; None where no round measured both."""
    return {
        name: paired_ratio(per_round(runs, a, metric), per_round(runs, b, metric))
        for name, a, b, metric in RATIOS
    }


def final_line(ratios: Mapping[str, Spread | None]) -> str:
    """The last line of compare.md: the median per-round tiercache/response-cache throughput."""
    spread = ratios.get(FINAL_RATIO)
    return f"ratio {FINAL_RATIO} {fmt(spread.median if spread else None, '.2f')}"


def medians(runs: Sequence[Run], config: str) -> dict[str, float | None]:
    """The median over the rounds of each metric of one configuration (None: never measured)."""
    out: dict[str, float | None] = {}
    for metric in ("throughput", "p50_ms", "p99_ms", "engine_tokens_per_s"):
        values = per_round(runs, config, metric).values()
        out[metric] = median(values) if values else None
    return out


def generation_share(run: Run) -> float | None:
    """Engine generations per completed request (None when either was not read)."""
    generations = run.statuses.get("engine:generations")
    if run.level is None or not run.level.request_count or generations is None:
        return None
    return generations / run.level.request_count


def new_share(run: Run, mix: Sequence[Ask]) -> float | None:
    """The share of new questions (never asked before in the list) among the first N entries
    of the input list, N = the run's completed requests: the least share of its requests any
    cache must generate (perf_analyzer sends the entries in order)."""
    if run.level is None or not run.level.request_count:
        return None
    part = mix[: run.level.request_count]
    return sum(1 for ask in part if ask.kind == "new") / len(part)


def generation_bounds(runs: Sequence[Run], mix: Sequence[Ask]) -> dict[int, dict[str, float]]:
    """Per round: tiercache's and the response cache's generations per request, the new
    questions' share of tiercache's requests, and the throughput ratio over the response cache
    that a cache generating only the new questions would reach at the same cost per generation
    (the response cache's share / the new share). An estimate, not a ceiling: it assumes one
    cost per generation behind both (drafts from cached answers make tiercache's cheaper), and
    the new share moves with how far into the list a run got. Only runs the ratios count
    (`run_ok`)."""
    out: dict[int, dict[str, float]] = {}
    good = [r for r in runs if run_ok(r)]
    for round_no in sorted({r.round for r in good}):
        mine = next((r for r in good if r.config == TIERCACHE and r.round == round_no), None)
        theirs = next((r for r in good if r.config == RESPONSE_CACHE and r.round == round_no), None)
        if mine is None or theirs is None:
            continue
        ours, rc, new = generation_share(mine), generation_share(theirs), new_share(mine, mix)
        if ours is None or rc is None or not new:
            continue
        out[round_no] = {
            "tiercache_generations_per_request": ours,
            "response_cache_generations_per_request": rc,
            "new_question_share": new,
            "bound_at_equal_generation_cost": rc / new,
            "ratio_at_equal_generation_cost": rc / ours,
        }
    return out


def bounds_section(bounds: Mapping[int, Mapping[str, float]]) -> list[str]:
    """What bounds tiercache/response-cache throughput on this mix, per round."""
    if not bounds:
        return []
    md = [
        "",
        "### What bounds the ratio",
        "",
        "With one engine at the same cost per generation, throughput goes as the inverse of the "
        "share of requests that need a generation. A cache that generated only the new "
        "questions (every repeat and every rewording a hit) would reach the response cache's "
        "generations per request / the new questions' share of the requests sent. An estimate "
        "under that assumption, not a ceiling: cheaper generations (drafts from cached answers) "
        "raise it, and the new share moves with how far into the list a run got.",
        "",
        "| round | tiercache generations / request | response cache generations / request | "
        "new questions / request | ratio at equal cost per generation | bound |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for round_no, b in bounds.items():
        md.append(
            f"| {round_no} | {b['tiercache_generations_per_request']:.3f} | "
            f"{b['response_cache_generations_per_request']:.3f} | "
            f"{b['new_question_share']:.3f} | {b['ratio_at_equal_generation_cost']:.2f} | "
            f"{b['bound_at_equal_generation_cost']:.2f} |"
        )
    return md


def cpu_section(runs: Sequence[Run], configs: Sequence[str]) -> list[str]:
    """Per configuration, its last round's CPU by process and its busiest thread groups."""
    md = [
        "",
        "### CPU by process during the run (the last round of each configuration)",
        "",
        "tritonserver and its Python-backend stubs (psutil, at the start and the end of the "
        "perf_analyzer run; perf_analyzer itself and other processes not counted): user + system "
        "CPU seconds, their share of the machine's capacity (CPU s / (perf_analyzer's wall s x "
        "CPUs)), threads at the end, voluntary / involuntary context switches during the run. "
        "Thread groups: the threads of one process with the same name "
        "(/proc/<pid>/task/<tid>/comm). Every round's figures are in compare.json.",
    ]
    for config in configs:
        measured = [r for r in runs if r.config == config and r.cpu]
        if not measured:
            md += ["", f"{LABELS[config]}: no CPU figures (no completed run)"]
            continue
        run = max(measured, key=lambda r: r.round)
        total = sum(p.cpu_s for p in run.cpu)
        md += [
            "",
            f"{LABELS[config]}, round {run.round}: {run.wall_s:.0f} s, {run.cpu_count} CPUs",
            "",
            "| process | CPU s | share of machine | threads | ctx switches vol. | invol. | "
            "busiest threads, CPU s |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        md += [
            f"| {p.label} | {p.cpu_s:.1f} | {p.machine_share:.1%} | {p.threads} | "
            f"{p.ctx_voluntary} | {p.ctx_involuntary} | "
            + ", ".join(f"{t:.1f}" for t in p.busiest_threads_s)
            + " |"
            for p in run.cpu
        ]
        md.append(
            f"| all server processes | {total:.1f} | "
            f"{total / (run.wall_s * run.cpu_count):.1%} | | | | |"
        )
        notes = [f"- {p.label}: {p.note}" for p in run.cpu if p.note]
        md += ["", *notes] if notes else []
        md += ["", "| process | thread group | CPU s |", "|---|---|---:|"]
        md += [
            f"| {label} | {name} | {cpu_s:.1f} |"
            for label, name, cpu_s in top_thread_groups(run.cpu, TOP_THREAD_GROUPS)
        ]
    return md


def compare_report(
    args: argparse.Namespace,
    runs: Sequence[Run],
    mix: list[Ask],
    wall_s: float,
    pa: str,
    load: str,
) -> str:
    """compare.md: runs per round, medians, per-round ratios, CPU; it ends with `final_line`."""
    configs = compare_configs(args)
    ratios = compare_ratios(runs)
    md = header(args, "Throughput: tiercache vs caching off vs Triton's response cache", wall_s, pa)
    md += [
        f"- {args.rounds} interleaved round{'s' if args.rounds > 1 else ''} in serpentine order "
        "(a b c, then c b a, ...), each configuration started cold in each round (its own "
        f"repository copy and fresh state dir); {args.compare_duration} s per configuration per "
        f"round; the same input list every round: {mix_summary(mix)}",
        "- torch_llm overrides, the same in every configuration: "
        + (", ".join(f"{k} {v}" for k, v in engine_params(args).items()) or "none")
        + f"; embedder torch_threads: {args.embedder_threads or 'as committed'}",
        f"- background load: {load}",
    ]
    if args.compare_duration < ISSUE_MIN_DURATION_S:
        md.append(
            f"- note: {args.compare_duration} s per configuration per round is below the "
            f"{ISSUE_MIN_DURATION_S} s issue 15 asks for: a short check, not a measurement"
        )
    md += [
        "",
        "### Runs",
        "",
        "| configuration | round | requests | infer/s | p50 ms | p99 ms | errors | statuses | "
        "engine generated tokens | engine tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in sorted(runs, key=lambda r: (configs.index(r.config), r.round)):
        lv = r.level
        cells = (
            [str(lv.request_count), f"{lv.throughput:.2f}"]
            + [f"{lv.p50_us / 1000:.1f}", f"{lv.p99_us / 1000:.1f}"]
            if lv is not None
            else ["n/a"] * 4
        )
        statuses = status_line(r) if lv is not None else "; ".join(r.notes) or "n/a"
        tokens = r.engine_tokens
        md.append(
            f"| {LABELS[r.config]} | {r.round} | " + " | ".join(cells) + f" | {error_count(r)} | "
            f"{statuses} | {'n/a' if tokens is None else tokens} | "
            f"{fmt(r.engine_tokens_per_s, '.1f')} |"
        )
    md += [
        "",
        "### Medians over the rounds",
        "",
        "| configuration | rounds measured | infer/s | p50 ms | p99 ms | engine tokens/s | "
        "errors (all rounds) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    left_out = [r for r in runs if r.level is not None and not run_ok(r)]
    if left_out:
        md.insert(
            md.index("### Medians over the rounds") + 1,
            "\nLeft out of the medians and ratios (a failed request, or perf_analyzer's exit "
            "status): " + ", ".join(f"{LABELS[r.config]} round {r.round}" for r in left_out) + ".",
        )
    for config in configs:
        m = medians(runs, config)
        measured = len(per_round(runs, config, "throughput"))
        errors = sum(error_count(r) for r in runs if r.config == config)
        md.append(
            f"| {LABELS[config]} | {measured} | {fmt(m['throughput'], '.2f')} | "
            f"{fmt(m['p50_ms'], '.1f')} | {fmt(m['p99_ms'], '.1f')} | "
            f"{fmt(m['engine_tokens_per_s'], '.1f')} | {errors} |"
        )
    md += [
        "",
        "### Ratios, per round",
        "",
        "Each ratio is taken within a round, between two runs minutes apart, and shown as the "
        "median of the rounds with their range (a ratio of medians would mix the load of "
        "different moments). Throughput and engine tokens/s: above 1 is tiercache ahead; p50: "
        "below 1 is tiercache faster.",
        "",
        "| ratio | median (range) |",
        "|---|---:|",
    ]
    md += [
        f"| {name} | {'n/a' if spread is None else spread.text()} |"
        for name, spread in ratios.items()
    ]
    md += ["", f"- {ENGINE_TOKENS_DEFINITION}."]
    md += bounds_section(generation_bounds(runs, mix))
    md += cpu_section(runs, configs)
    md += ["", *(f"- {r.config} r{r.round}: `{r.command}`" for r in runs if r.command)]
    md += [f"- note ({r.config} r{r.round}): {n}" for r in runs for n in r.notes]
    machine = machine_summary()
    md += [
        f"- machine: {machine['nproc']} CPUs ({machine['cpu']}), load average at the end "
        f"{machine['loadavg']}; background load: {load}",
        "",
        final_line(ratios),
    ]
    return "\n".join(md) + "\n"


def run_summary(run: Run) -> dict[str, object]:
    """One run for compare.json."""
    lv = run.level
    return {
        "config": run.config,
        "round": run.round,
        "returncode": run.returncode,
        "requests": lv.request_count if lv is not None else None,
        "throughput_infer_per_s": run.metric("throughput"),
        "p50_ms": run.metric("p50_ms"),
        "p99_ms": run.metric("p99_ms"),
        "errors": error_count(run),
        "statuses": run.statuses,
        "engine_generated_tokens": run.engine_tokens,
        "engine_tokens_per_s": run.engine_tokens_per_s,
        "wall_s": run.wall_s,
        "cpu_count": run.cpu_count,
        "cpu": [p.as_dict() for p in run.cpu],
        "notes": run.notes,
        "command": run.command,
    }


def compare_summary(
    args: argparse.Namespace,
    runs: Sequence[Run],
    mix: Sequence[Ask],
    wall_s: float,
    pa: str,
    load: str,
) -> dict[str, object]:
    """compare.json: every run, the per-round ratios, and how the comparison was made."""
    configs = compare_configs(args)
    return {
        "command": invocation("tiercache_dev.perf.soak"),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "rounds": args.rounds,
        "order": [{"round": n, "config": c} for n, c in serpentine(configs, args.rounds)],
        "duration_s": args.compare_duration,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "torch_llm_overrides": engine_params(args),
        "background_load": load,
        "machine": machine_summary(),
        "perf_analyzer": pa,
        "engine_tokens_per_s": ENGINE_TOKENS_DEFINITION,
        "runs": [run_summary(r) for r in runs],
        "ratios": {
            name: None if spread is None else spread.as_dict()
            for name, spread in compare_ratios(runs).items()
        },
        "generation_bounds": {
            str(round_no): b for round_no, b in generation_bounds(runs, mix).items()
        },
        "ok": all(run_ok(r) for r in runs),
    }


def compare(args: argparse.Namespace, pa: Path, mix: list[Ask], work: Path) -> list[Run]:
    """Every configuration in every round, in serpentine order; a failed run is recorded and
    the others go on."""
    runs = []
    for round_no, config in serpentine(compare_configs(args), args.rounds):
        progress(f"round {round_no}/{args.rounds}: {LABELS[config]}")
        try:
            runs.append(
                measure(args, pa, config, args.compare_duration, mix, work, False, round_no)
            )
        except Exception as exc:  # noqa: BLE001 - report it, go on with the others
            progress(f"  {LABELS[config]} failed: {type(exc).__name__}: {exc}")
            runs.append(Run(config, None, 1, {}, 0.0, "", [f"failed: {exc}"], round=round_no))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    started = time.monotonic()
    args.out_dir = args.out_dir.resolve()
    args.state_dir = args.state_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not (args.state_dir / "models").is_dir():
        raise SystemExit(
            f"no converted weights in {args.state_dir / 'models'}; run `make serve` once"
        )
    progress("installing perf_analyzer")
    pa = args.perf_analyzer or install_perf_analyzer(args.out_dir.parent / "pa")
    version = perf_analyzer_version(pa)
    mix = build_mix(args)
    progress(f"mix: {mix_summary(mix)}")
    load = BackgroundLoad(args.background_load, args.background_duty)
    with tempfile.TemporaryDirectory(prefix="tiercache-soak-") as tmp, load:
        work = Path(tmp)
        progress(f"background load: {load.describe()}")
        if args.compare:
            runs = compare(args, pa, mix, work)
        else:
            runs = [measure(args, pa, TIERCACHE, args.duration, mix, work, True)]
    wall_s = time.monotonic() - started
    if args.compare:
        md = compare_report(args, runs, mix, wall_s, version, load.describe())
        summary = compare_summary(args, runs, mix, wall_s, version, load.describe())
        ok = bool(summary["ok"])
        path = args.out_dir / "compare.md"
        path.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
        counters = {run_tag(r.config, r.round, True): r.statuses for r in runs}
    else:
        md, ok = soak_report(args, runs[0], mix, wall_s, version, load.describe())
        path = args.out_dir / "soak.md"
        counters = {r.config: r.statuses for r in runs}
    path.write_text(md)
    path.with_suffix(".counters.json").write_text(json.dumps(counters, indent=1) + "\n")
    print()
    print(md)
    progress(f"wrote {display_path(path)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
