"""Soak and throughput comparison: perf_analyzer for minutes on a realistic mix (issue 7).

Usage::

    python -m tiercache_dev.perf.soak [--duration 600] [--concurrency 8] [--out-dir .perf/soak]
        [--entries 8000] [--seed 0] [--max-tokens 8] [--redis] [--l1-max-bytes N]
    python -m tiercache_dev.perf.soak --compare [--compare-duration 120] [--concurrency 8]

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
embedded tiers; `--redis` adds a redis-server and sets `redis_url` on the Redis-aware stages), then
perf_analyzer over gRPC `--streaming` (the ensemble is decoupled) at `--concurrency`, in
`time_windows` mode: three windows of duration/3 and a stability threshold of 1000 %, so it stops
after exactly three windows and reports the three merged. Every `--sample-s` a thread records the
RSS of tritonserver and of each Python-backend stub (psutil) and the tiers' bytes and entries
from /metrics. Reported: perf_analyzer's exit code and the server's error counters (the target is
zero), throughput, p50/p99 latency (the whole answer: see tiercache_dev.perf.run), requests by
cache status and exact hits by tier (metrics deltas), RSS first / after warm-up / last / max per
process, and each byte budget against the largest size seen.

Compare (`--compare`): the same mix and concurrency against three servers, one after the other,
each cold, `--compare-duration` each:
  a. tiercache as served (model_repository/ unchanged);
  b. caching off: the same stack, every request carrying `cache_control` "no-cache no-store
     no-semantic" (no exact or semantic lookup, nothing stored or indexed; prompt_cache, the
     embedder and lora_cache still run) and torch_llm's `kv_reuse` false;
  c. Triton's response cache: `llm_plain` (scripts/bench_fixtures/response_cache/llm_plain), a
     non-decoupled Python model that runs the same torch_llm over BLS and returns the whole text,
     with `response_cache { enable: true }`, served with `--cache-config local,size=N` beside
     torch_llm; unary gRPC with `--async` (Triton refuses the response cache on decoupled models).
It reports throughput and p50 ratios tiercache/off and tiercache/response-cache.

Outputs under OUT_DIR: soak.md / compare.md (the report), soak_rss.csv, soak_tiers.csv,
inputs*.json, perf_analyzer logs and server logs. Exit code 0 when every measurement was made
(1 otherwise: a failed perf_analyzer run, errors, or a budget exceeded).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import datetime as dt
import json
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.config import CacheConfig, EngineConfig
from tiercache.server import copy_repository
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
from tiercache_dev.servers import RedisServer, TritonServer, running, triton

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
REDIS_STAGES = ("prompt_cache", "embedding_cache", "llm", "cache_admin")
L1_STAGES = ("prompt_cache", "llm", "cache_admin")  # stages that open the exact tiers
RESPONSE_CACHE_BYTES = 64 << 20  # tiercache's default L1 budget
TIERCACHE, OFF, RESPONSE_CACHE = "tiercache", "caching-off", "response-cache"
LABELS = {
    TIERCACHE: "tiercache (as served)",
    OFF: "caching off (no-cache no-store no-semantic, kv_reuse false)",
    RESPONSE_CACHE: "Triton response cache (llm_plain over BLS to torch_llm)",
}


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
    p.add_argument("--compare", action="store_true", help="the three-server comparison instead")
    p.add_argument("--compare-duration", type=int, default=120, help="seconds per server")
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


def fresh_state(root: Path, weights_from: Path) -> Path:
    state = root / "state"
    state.mkdir(parents=True)
    (state / "models").symlink_to((weights_from / "models").resolve(), target_is_directory=True)
    return state


def tiercache_repository(root: Path, args: argparse.Namespace, config: str, redis_url: str) -> Path:
    params: dict[str, dict[str, str]] = {}
    if redis_url:
        for stage in REDIS_STAGES:
            params.setdefault(stage, {})["redis_url"] = redis_url
    if args.l1_max_bytes is not None:
        for stage in L1_STAGES:
            params.setdefault(stage, {})["l1_max_bytes"] = str(args.l1_max_bytes)
    if args.kv_pool_max_bytes is not None:
        params.setdefault("torch_llm", {})["kv_pool_max_bytes"] = str(args.kv_pool_max_bytes)
    if config == OFF:
        params.setdefault("torch_llm", {})["kv_reuse"] = "false"
    return copy_repository(MODEL_REPOSITORY, root / "model_repository", params)


def response_cache_repository(root: Path) -> Path:
    dest = root / "model_repository"
    shutil.copytree(MODEL_REPOSITORY / "torch_llm", dest / "torch_llm")
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


def rss_by_process(root_pid: int, labels: dict[int, str]) -> dict[str, int]:
    """Label -> RSS bytes of tritonserver and every descendant; `labels` (pid -> label) keeps
    labels stable across samples (`embedding_cache#1` for a model's second instance)."""
    import psutil

    out: dict[str, int] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        if proc.pid not in labels:
            name = process_name(proc)
            n = sum(1 for v in labels.values() if v.split("#")[0] == name)
            labels[proc.pid] = name if n == 0 else f"{name}#{n}"
        try:  # a stub that died and was not reaped (a zombie) reads as 0
            zombie = proc.status() == psutil.STATUS_ZOMBIE
            out[labels[proc.pid]] = 0 if zombie else proc.memory_info().rss
        except psutil.NoSuchProcess:
            out[labels[proc.pid]] = 0
    for label in set(labels.values()) - set(out):  # gone (reaped)
        out[label] = 0
    return out


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
    """Every `period_s`: RSS per process and tier sizes into two CSV files."""

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
        self.tiers_path = out_dir / f"{prefix}_tiers.csv"
        self.died: dict[str, float] = {}  # process label -> seconds into the run it was gone
        self.rss: dict[str, list[tuple[float, int]]] = {}
        self.tiers: dict[str, list[tuple[float, float, float]]] = {}
        self.labels: dict[int, str] = {}
        self.stop_event = threading.Event()
        self.started = time.monotonic()
        self.status: dict[str, float] = {}

    def sample(self) -> None:
        t = round(time.monotonic() - self.started, 1)
        for label, rss in rss_by_process(self.server.process.pid, self.labels).items():
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

            bar = tqdm(total=int(self.duration_s), unit="s", desc="soak", file=sys.stdout)
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
    out: dict[str, float] = Counter()
    for name, labels, value in samples:
        if name == "tiercache_llm_requests_total":  # the final status (after semantic lookup)
            out[f"status:{labels.get('status')}"] += value
        elif name == "tiercache_prompt_cache_requests_total":  # the exact lookup's status
            out[f"lookup:{labels.get('status')}"] += value
        elif name == "tiercache_prompt_cache_hits_total":
            out[f"hit:{labels.get('tier')}"] += value
        elif name == "tiercache_engine_finished_total" and labels.get("reason") == "error":
            out["error:engine"] += value
        elif name == "tiercache_embedding_cache_lookups_total" and labels.get("outcome"):
            out[f"semantic:{labels['outcome']}"] += value
        elif name == "tiercache_llm_generations_total":
            out["generations"] += value
        elif name == "tiercache_llm_coalesced_total":
            out["coalesced"] += value
        elif name == "tiercache_engine_generated_tokens_total":
            out["engine:generated_tokens"] += value
        elif name == "tiercache_engine_finished_total" and labels.get("reason") != "error":
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
    """The counters once the stages' deferred updates (flushed every 0.25 s) have landed."""
    previous = status_counters(scrape_metrics(port))
    for _ in range(20):
        time.sleep(0.6)
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
    wall_s: float
    command: str
    notes: list[str] = field(default_factory=list)
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    tiers: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)


def measure(
    args: argparse.Namespace,
    pa: Path,
    config: str,
    duration_s: int,
    mix: list[Ask],
    work: Path,
    sample: bool,
) -> Run:
    root = work / config
    root.mkdir(parents=True)
    state = fresh_state(root, args.state_dir)
    # The port is chosen now (the repository names it); the server starts inside the try.
    redis_server = RedisServer(root) if args.redis and config == TIERCACHE else None
    redis_url = redis_server.url if redis_server is not None else ""
    logs = args.out_dir / "logs"
    extra: list[str] = []
    if config == RESPONSE_CACHE:
        repository = response_cache_repository(root)
        extra = ["--cache-config", f"local,size={RESPONSE_CACHE_BYTES}"]
        model, transport, control = "llm_plain", "--async", None
    else:
        repository = tiercache_repository(root, args, config, redis_url)
        model, transport = "ensemble", "--streaming"
        control = NO_CACHE if config == OFF else None
    data = args.out_dir / f"inputs-{config}.json"
    write_inputs_json(data, entries_for(mix, args.max_tokens, control))
    server = triton(
        repository,
        state,
        log_path=logs / f"server-{config}.log",
        extra_args=extra,
        adapters_dir=ADAPTERS,
    )
    progress(f"{LABELS[config]}: starting tritonserver (grpc {server.ports.grpc})")
    started = time.monotonic()
    try:
        if redis_server is not None:
            redis_server.start()
            progress(f"redis-server at {redis_url}")
        with running(server, ready_timeout_s=300):
            progress(f"  ready in {time.monotonic() - started:.1f} s")
            before = settled_counters(server.ports.metrics)
            prefix = "soak" if sample else f"compare-{config}"
            sampler = Sampler(server, args.out_dir, args.sample_s, duration_s, prefix)
            sampler.start()
            pa_args = perf_args(
                model,
                server,
                data,
                args.concurrency,
                duration_s,
                transport,
                args.out_dir / f"perf-{config}.csv",
            )
            progress(f"  perf_analyzer {shown(pa_args)}")
            run = run_perf_analyzer(
                pa,
                pa_args,
                logs / f"perf-{config}.txt",
                timeout_s=duration_s * 2 + 300,
                server=StubWatch(server, sampler),
            )
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
    )
    result.rss, result.tiers = sampler.rss, sampler.tiers
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
    args: argparse.Namespace, run: Run, mix: list[Ask], wall_s: float, pa: str
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
    for label, points in sorted(run.rss.items()):
        values = [r for _, r in points]
        quarter = values[len(values) // 4]
        md.append(
            f"| {label} | {mib(values[0])} | {mib(quarter)} | {mib(values[-1])} | "
            f"{mib(max(values))} | {mib(values[-1] - quarter)} |"
        )
    md += ["", "### Byte budgets", ""]
    md += ["| tier | budget | max seen | entries at the end | held |", "|---|---:|---:|---:|---|"]
    for tier, budget in budgets(args).items():
        points = run.tiers.get(tier)
        if not points:
            md.append(f"| {tier} | {size(budget)} | n/a | n/a | n/a |")
            continue
        top = max(b for _, b, _ in points)
        held = top <= budget
        ok &= held
        md.append(
            f"| {tier} | {size(budget)} | {size(top)} | {int(points[-1][2]) or '-'} | "
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


def compare_report(
    args: argparse.Namespace, runs: list[Run], mix: list[Ask], wall_s: float, pa: str
) -> tuple[str, bool]:
    md = header(args, "Throughput: tiercache vs caching off vs Triton's response cache", wall_s, pa)
    md += [
        f"- {args.compare_duration} s per server, one after the other, each cold (fresh state "
        f"dir); same input list: {mix_summary(mix)}",
        "",
        "| configuration | requests | infer/s | p50 ms | p99 ms | errors | cache statuses |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    ok = True
    by = {r.config: r for r in runs}
    for r in runs:
        lv = r.level
        ok &= lv is not None and r.returncode == 0 and error_count(r) == 0
        if lv is None:
            md.append(
                f"| {LABELS[r.config]} | n/a | n/a | n/a | n/a | {error_count(r)} | "
                f"{'; '.join(r.notes)} |"
            )
            continue
        md.append(
            f"| {LABELS[r.config]} | {lv.request_count} | {lv.throughput:.2f} | "
            f"{lv.p50_us / 1000:.1f} | {lv.p99_us / 1000:.1f} | {error_count(r)} | "
            f"{status_line(r)} |"
        )
    md += ["", "| ratio | throughput | p50 latency |", "|---|---:|---:|"]
    t = by.get(TIERCACHE)
    for other in (OFF, RESPONSE_CACHE):
        o = by.get(other)
        if t is None or o is None or t.level is None or o.level is None:
            md.append(f"| tiercache / {other} | n/a | n/a |")
            continue
        thr = t.level.throughput / o.level.throughput if o.level.throughput else float("nan")
        p50 = t.level.p50_us / o.level.p50_us if o.level.p50_us else float("nan")
        md.append(f"| tiercache / {other} | {thr:.2f} | {p50:.2f} |")
    md += ["", *(f"- {LABELS[r.config]}: `{r.command}`" for r in runs)]
    md += [f"- note ({r.config}): {n}" for r in runs for n in r.notes]
    return "\n".join(md) + "\n", ok


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
    with tempfile.TemporaryDirectory(prefix="tiercache-soak-") as tmp:
        work = Path(tmp)
        if args.compare:
            runs = []
            for config in args.only or (TIERCACHE, OFF, RESPONSE_CACHE):
                try:
                    runs.append(measure(args, pa, config, args.compare_duration, mix, work, False))
                except Exception as exc:  # noqa: BLE001 - report it, go on with the others
                    progress(f"  {LABELS[config]} failed: {type(exc).__name__}: {exc}")
                    runs.append(Run(config, None, 1, {}, 0.0, "", [f"failed: {exc}"]))
            md, ok = compare_report(args, runs, mix, time.monotonic() - started, version)
            path = args.out_dir / "compare.md"
        else:
            run = measure(args, pa, TIERCACHE, args.duration, mix, work, True)
            runs = [run]
            md, ok = soak_report(args, run, mix, time.monotonic() - started, version)
            path = args.out_dir / "soak.md"
    path.write_text(md)
    counters = {r.config: r.statuses for r in runs}
    path.with_suffix(".counters.json").write_text(json.dumps(counters, indent=1) + "\n")
    print()
    print(md)
    progress(f"wrote {display_path(path)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
