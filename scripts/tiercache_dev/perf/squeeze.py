"""A memory squeeze through a real tritonserver inside a memory cgroup (issue 20): the caches'
budgets shrink while another process takes memory, the server keeps serving and nothing is
killed, and the budgets grow back when the memory returns.

Usage (root, on a machine whose memory cgroup controller this user may create groups in)::

    python -m tiercache_dev.perf.squeeze [--extra-gib 2.5] [--headroom-mib 1024]
        [--before-s 45] [--hold-s 45] [--after-s 45] [--adapters | --graphs | --hits]
        [--hit-objective-ms 0.1] [--out-dir .perf/squeeze]

1. Creates a memory cgroup (v1 `memory/tiercache-squeeze-<pid>` or v2 `tiercache-squeeze-<pid>`)
   and moves this process in: the server, its stubs and the squeezer are all in it.
2. Starts tritonserver on `make serve`'s repository with `memory_headroom_bytes`
   (`--headroom-mib`) on prompt_cache and torch_llm and `budget_interval_s` 0.5, then sets the
   group's limit to what the group uses once the server is ready plus `--extra-gib`.
3. A client sends requests without pause (new prompts of about 400 tokens, 4 tokens each: they
   fill the KV pool), recording each one's latency and whether it succeeded.
4. After `--before-s`, the squeezer (a child process in the group) takes memory in 64 MiB steps
   until the group has less than half the headroom left, holds it for `--hold-s`, then exits. With
   `--adapters`, the requests name the committed adapters and the base model in turn, and
   torch_llm's adapter slots get a byte budget (`lora_max_bytes` 8 MiB, `lora_min_bytes` 2 MiB:
   about four slots and one): a dropped adapter is sent again by llm (the engine's "not held"
   answer), so requests go on while the slots shrink. With `--graphs`, the requests are short new
   prompts (4 tokens answered each) from four tenants in turn, and embedding_cache searches any
   scope past 8 rows with an HNSW graph under a budget (`flat_max_rows` 8,
   `semantic_graph_max_bytes` 64 MiB, `semantic_graph_min_bytes` 0, and the same headroom): each
   tenant's scope gets its graph as its rows come, the squeeze drops them (searched flat meanwhile)
   and they come back after. `--graph-rows N` (with `--graphs`) makes them a deployment's size:
   once each tenant's scope has its first row, N random unit rows of the embedder's width are
   appended to it through the host's row log (this process, as another replica's llm would),
   `flat_max_rows` stays at its default (10,000), the graphs' ceiling is what four graphs of that
   size are charged (`estimated_graph_bytes`) with a quarter more, and the clock starts once the
   graphs held over the two embedding_cache instances add up to four scopes' worth (requests of
   each tenant until they do; each instance builds the graphs of the scopes it searches, so that
   need not be one of each scope), so the squeeze drops graphs of that size. With `--hits`, 3,000
   answers of about 1,660 characters are warmed in first (cache_admin's `warm`: into L2, about 5
   MiB, more than L1's floor and less than its 64 MiB) and each asked for once before the clock
   starts (so L1 holds them), the requests ask for them in turn (exact hits: from prompt_cache's L1
   while it holds them, else from L2), and prompt_cache has a hit latency objective
   (`hit_objective_s`, `--hit-objective-ms`); the report adds the objective's states, the lookups'
   p90 and the share of hits L1 answered per phase. The squeeze takes L1 to its floor whatever the
   objective says (the headroom wins).
5. After `--after-s` more, everything stops; every server process must still be alive and the
   group must have killed nothing (its OOM counter).

Every 0.5 s it samples the budgets and what the caches that free their bytes later hold (the
metrics port), what the group has available, the RSS of each server process and the
squeezer's size. Writes `squeeze.json` (the timeline),
`squeeze.png` (budgets, available memory, RSS and latency over time, the squeeze shaded) and
`squeeze.md` (the summary) to `--out-dir`; exit code 1 when a process died, the group killed
one, or a request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.machine import HostMemoryProbe
from tiercache.semantic.embedder import DEFAULT_EMBEDDER, KNOWN_EMBEDDERS
from tiercache.server import copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.console import invocation, progress
from tiercache_dev.metrics import Sample, scrape_metrics
from tiercache_dev.paths import ADAPTERS, DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.perf.soak import labelled_processes
from tiercache_dev.servers import admin_token, fresh_state, running, triton

MIB = 1 << 20
GIB = 1 << 30
STEP_BYTES = 64 * MIB
SAMPLE_S = 0.5

SQUEEZER = """
import sys, time
from tiercache.machine import HostMemoryProbe
floor, hold_s, step = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
probe, held = HostMemoryProbe(), []
while probe.read().available_bytes - step > floor:
    held.append(bytearray(b"\\x01") * step)  # written: the pages are really taken
    print(len(held) * step, flush=True)
    time.sleep(0.2)
print("holding", flush=True)
time.sleep(hold_s)
"""


class Group:
    """A memory cgroup this process lives in (v1 or v2), removed at `close`."""

    def __init__(self, name: str) -> None:
        root = Path("/sys/fs/cgroup")
        if (root / "memory").is_dir():
            self.version, self.path = "v1", root / "memory" / name
        elif (root / "cgroup.controllers").exists():
            self.version, self.path = "v2", root / name
        else:
            raise SystemExit("no memory cgroup controller is mounted at /sys/fs/cgroup")
        try:
            if self.version == "v2":  # the memory controller for children of the root
                (root / "cgroup.subtree_control").write_text("+memory")
            self.path.mkdir()
        except OSError as exc:
            raise SystemExit(f"cannot create the memory cgroup {self.path}: {exc}") from None
        (self.path / "cgroup.procs").write_text(str(os.getpid()))
        # no swapping: memory pressure must show as pressure (or an OOM kill), not as swap
        if self.version == "v1":
            (self.path / "memory.swappiness").write_text("0")
        else:
            (self.path / "memory.swap.max").write_text("0")

    def set_limit(self, nbytes: int) -> None:
        name = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
        (self.path / name).write_text(str(nbytes))

    def usage(self) -> int:
        name = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        """Processes the group's OOM killer killed (v1: memory.oom_control's oom_kill, since
        Linux 4.13; v2: memory.events). SystemExit where the kernel does not count them: a
        run that cannot tell would report none."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        raise SystemExit(f"{self.path}: this kernel does not count OOM kills; cannot check")

    def close(self) -> None:
        parent = self.path.parent
        (parent / "cgroup.procs").write_text(str(os.getpid()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.2)
        progress(f"WARNING: could not remove the cgroup {self.path} (processes left in it?)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra-gib", type=float, default=2.5, help="the limit over the server")
    parser.add_argument("--headroom-mib", type=int, default=1024, help="memory_headroom_bytes")
    parser.add_argument("--before-s", type=float, default=45.0)
    parser.add_argument("--hold-s", type=float, default=45.0)
    parser.add_argument("--after-s", type=float, default=45.0)
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument(
        "--adapters",
        action="store_true",
        help="requests name the committed adapters in turn; torch_llm's slots get a budget",
    )
    modes.add_argument(
        "--graphs",
        action="store_true",
        help="short prompts from four tenants; their scopes' graphs get a budget",
    )
    modes.add_argument(
        "--hits",
        action="store_true",
        help="exact hits of warmed answers; prompt_cache gets a hit latency objective",
    )
    parser.add_argument(
        "--hit-objective-ms", type=float, default=0.1, help="hit_objective_s, with --hits"
    )
    parser.add_argument(
        "--graph-rows",
        type=int,
        default=0,
        help="with --graphs: rows appended to each tenant's scope before the clock starts",
    )
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--out-dir", type=Path, default=PERF_DIR / "squeeze")
    args = parser.parse_args(argv)
    if args.graph_rows and not args.graphs:
        parser.error("--graph-rows goes with --graphs")
    if args.graph_rows < 0:
        parser.error("--graph-rows must be >= 0")
    return args


def prompt(number: int) -> str:
    """A new prompt of about 400 tokens (no two alike: each fills KV blocks of its own)."""
    words = " ".join(f"item{number}-{i}" for i in range(130))
    return f"Request {number}. Remember this list: {words}. Which item came first?"


def short_prompt(number: int) -> str:
    """A short new prompt (`--graphs`): a row of its tenant's scope at little engine cost."""
    return f"Question {number}: name a colour and a number under {number % 89 + 5}."


ADAPTER_TURNS = (None, "french", "caps", "brief")
ADAPTER_SLOTS = {"lora_max_bytes": str(8 * MIB), "lora_min_bytes": str(2 * MIB)}
TENANTS = ("tenant-a", "tenant-b", "tenant-c", "tenant-d")
GRAPHS = {
    "flat_max_rows": "8",
    "semantic_graph_max_bytes": str(64 * MIB),
    "semantic_graph_min_bytes": "0",
}


GRAPH_SCOPES = len(TENANTS)
EMBEDDING_DIMENSIONS = KNOWN_EMBEDDERS[DEFAULT_EMBEDDER].dimensions  # the shipped embedder's


def graph_params(rows: int) -> dict[str, str]:
    """embedding_cache's parameters for `--graphs`: toy graphs from the ninth row, or, with
    `--graph-rows`, graphs of that size under a ceiling that holds the four of them."""
    if not rows:
        return GRAPHS
    from tiercache.semantic.index import estimated_graph_bytes

    ceiling = GRAPH_SCOPES * estimated_graph_bytes(rows + 1_000, EMBEDDING_DIMENSIONS) * 5 // 4
    return {"semantic_graph_max_bytes": str(ceiling), "semantic_graph_min_bytes": "0"}


def seed_graph_rows(server: Any, state: Path, rows: int) -> None:
    """`--graph-rows`: each tenant's scope gets its first row through the server, then `rows`
    random unit rows appended through the host's row log; then requests of each tenant until
    the graphs held over embedding_cache's two instances add up to four scopes' worth (at most
    10 minutes)."""
    import numpy as np

    from tiercache.semantic.index import estimated_graph_bytes
    from tiercache.semantic.store import SemanticStore

    with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=120) as client:

        def each_tenant(round_: int) -> None:
            for i, tenant in enumerate(TENANTS):
                number = 1_000_000 + round_ * len(TENANTS) + i
                client.generate_text(short_prompt(number), max_tokens=4, tenant=tenant)

        each_tenant(0)
        store = SemanticStore(state / "semantic", 8 << 30, dimensions=EMBEDDING_DIMENSIONS)
        try:
            deadline = time.monotonic() + 60
            while len(scopes := [m.scope for _, m in store.manifests()]) < GRAPH_SCOPES:
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {len(scopes)} tenant scopes appeared in 60 s")
                time.sleep(0.5)
                each_tenant(1)
            rng = np.random.default_rng(0)
            for s_, scope in enumerate(scopes):
                for start in range(0, rows, 5_000):
                    count = min(5_000, rows - start)
                    vectors = rng.standard_normal((count, EMBEDDING_DIMENSIONS)).astype("float32")
                    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
                    store.append_many([
                        (scope, f"bulk-{s_}-{start + i}", f"bulk row {start + i}", v)
                        for i, v in enumerate(vectors)
                    ])  # fmt: skip
                progress(f"  {rows:,} rows appended to scope {s_ + 1} of {len(scopes)}")
        finally:
            store.close()
        # each instance builds the graphs of the scopes it searches (Triton picks each request's
        # instance): every scope's graph held once, over the two instances
        wanted = GRAPH_SCOPES * estimated_graph_bytes(rows, EMBEDDING_DIMENSIONS)
        deadline, round_ = time.monotonic() + 600, 2
        while True:
            each_tenant(round_)
            round_ += 1
            held = budgets(scrape_metrics(server.ports.metrics, wait_s=2.0))[2]
            graphs = held.get("semantic_graphs", 0.0)
            if graphs >= 0.9 * wanted:
                progress(f"  graphs held: {graphs / MIB:.0f} MiB over both instances")
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"graphs held {graphs / MIB:.0f} of {wanted / MIB:.0f} MiB")
            time.sleep(2.0)


HIT_PROMPTS = 3_000


def hit_prompt(number: int) -> str:
    return f"Warmed question {number % HIT_PROMPTS}: what does the cache answer?"


def warm_hits(grpc_port: int, token: str) -> None:
    """Store an answer of about 1,660 characters for each of the `--hits` prompts (through
    cache_admin: L2, no engine), then ask for each once, so prompt_cache's L1 holds them
    before the run's clock starts."""
    filler = " ".join(f"word{i}" for i in range(220))
    with TierCacheClient(f"127.0.0.1:{grpc_port}", timeout_s=120, admin_token=token) as client:
        for start in range(0, HIT_PROMPTS, 250):
            items = [
                {"text_input": hit_prompt(n), "max_tokens": 4, "answer": f"Answer {n}. {filler}"}
                for n in range(start, min(start + 250, HIT_PROMPTS))
            ]
            answer = client.warm(prompts=items)
            if answer.get("failed"):
                raise SystemExit(f"warming failed: {answer}")
        for number in range(HIT_PROMPTS):
            if client.generate_text(hit_prompt(number), max_tokens=4).cache_status != "exact":
                raise SystemExit(f"warmed prompt {number} is not an exact hit")


class Client(threading.Thread):
    def __init__(self, grpc_port: int, started: float, mode: str = "misses") -> None:
        super().__init__(daemon=True)
        self.port, self.started, self.mode = grpc_port, started, mode
        self.turns = ADAPTER_TURNS if mode == "adapters" else (None,)
        self.done = threading.Event()
        self.results: list[tuple[float, float, bool]] = []  # (time, latency, ok)

    def run(self) -> None:
        with TierCacheClient(f"127.0.0.1:{self.port}", timeout_s=120) as client:
            number = 0
            while not self.done.is_set():
                number += 1
                begun = time.monotonic()
                try:
                    lora = self.turns[number % len(self.turns)]
                    if self.mode == "graphs":
                        tenant = TENANTS[number % len(TENANTS)]
                        client.generate_text(short_prompt(number), max_tokens=4, tenant=tenant)
                    elif self.mode == "hits":
                        result = client.generate_text(hit_prompt(number), max_tokens=4)
                        if result.cache_status != "exact":
                            raise RuntimeError(f"not an exact hit: {result.cache_status}")
                    else:
                        client.generate_text(prompt(number), max_tokens=4, lora_name=lora)
                    ok = True
                except Exception:  # noqa: BLE001 - counted: the run fails on any
                    ok = False
                self.results.append((begun - self.started, time.monotonic() - begun, ok))


def gone(process: Any) -> bool:
    """Dead: exited, or a zombie not reaped yet (a stub that died)."""
    import psutil

    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return True


SLOT_BYTES = "tiercache_engine_adapter_slot_bytes"


OBJECTIVES = ("tiercache_hit_objective_state", "tiercache_ttft_objective_state")
STATE_NAMES = {0: "met with room", 1: "met", 2: "missed"}
LOOKUP_BUCKETS = "tiercache_prompt_cache_lookup_seconds_bucket"


def l1_share(first: dict[str, float], last: dict[str, float]) -> str:
    """The share of prompt_cache's exact hits L1 answered between two readings."""
    hits = {tier: last.get(tier, 0.0) - first.get(tier, 0.0) for tier in last}
    total = sum(hits.values())
    return f"{hits.get('l1', 0.0) / total:.0%}" if total > 0 else "-"


def lookup_p90(first: dict[str, float], last: dict[str, float]) -> str:
    """The 90th percentile of prompt_cache's lookups between two readings of its histogram,
    as the bucket it falls in ("<= 0.25 ms"); "-" without lookups."""
    bounds = sorted((float(le), le) for le in last if le != "+Inf")
    total = last.get("+Inf", 0.0) - first.get("+Inf", 0.0)
    if total <= 0:
        return "-"
    for bound, le in bounds:
        if last[le] - first.get(le, 0.0) >= 0.9 * total:
            return f"<= {bound * 1000:g} ms"
    return f"> {bounds[-1][0] * 1000:g} ms" if bounds else "-"


def budgets(
    samples: list[Sample],
) -> tuple[dict[str, float], float | None, dict[str, float], dict[str, int]]:
    """Each cache's budget, the engine's adapter slot bytes (None: not reported), and what
    the caches that free their bytes later hold (`tiercache_budget_held_bytes`; the adapter
    slots' is the slot bytes instead). Summed over a model's instances (embedding_cache runs
    two, each with its own budgets); a cache two models report (l1) is named with its model.
    And the latency objectives' states (0 met with room, 1 met, 2 missed), by objective."""
    found: dict[tuple[str, str], float] = {}
    held: dict[tuple[str, str], float] = {}
    states: dict[str, int] = {}
    slots = None
    for name, labels, value in samples:
        key = (labels.get("model", "?"), labels.get("cache", "?"))
        if name == "tiercache_budget_bytes":
            found[key] = found.get(key, 0.0) + value
        elif name == SLOT_BYTES:
            slots = value
        elif name == "tiercache_budget_held_bytes" and key[1] != "adapter_slots":
            held[key] = held.get(key, 0.0) + value
        elif name in OBJECTIVES:
            objective = name.removeprefix("tiercache_").removesuffix("_objective_state")
            states[objective] = max(states.get(objective, 0), int(value))
    return named(found), slots, named(held), states


def named(values: dict[tuple[str, str], float]) -> dict[str, float]:
    """{(model, cache): v} as {cache: v}, or {"cache (model)": v} where models share a name."""
    owners: dict[str, int] = {}
    for _, cache in values:
        owners[cache] = owners.get(cache, 0) + 1
    return {
        (cache if owners[cache] == 1 else f"{cache} ({model})"): value
        for (model, cache), value in values.items()
    }


def plot(
    timeline: list[dict[str, Any]],
    latencies: list[tuple[float, float, bool]],
    window: tuple[float, float],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [row["t"] for row in timeline]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for cache in sorted({c for row in timeline for c in row["budgets"]}):
        axes[0].plot(
            t, [row["budgets"].get(cache, float("nan")) / MIB for row in timeline], label=cache
        )
    held = [row.get("adapter_slots_held") for row in timeline]
    if any(held):  # MiB beside hundreds: a log scale shows both (torch_llm exports 0 without)
        axes[0].plot(
            t,
            [float("nan") if v is None else v / MIB for v in held],
            "--",
            label="adapter slots held",
        )
        axes[0].set_yscale("symlog", linthresh=1.0)
    for cache in sorted({c for row in timeline for c in row.get("held", {})}):
        axes[0].plot(
            t,
            [row.get("held", {}).get(cache, float("nan")) / MIB for row in timeline],
            ":",
            label=f"{cache} held",
        )
        axes[0].set_yscale("symlog", linthresh=1.0)  # MiB beside hundreds; 0 stays visible
    axes[0].set_ylabel("budget (MiB)")
    axes[1].plot(t, [row["available"] / MIB for row in timeline], label="group available")
    axes[1].plot(t, [row["squeezer"] / MIB for row in timeline], label="squeezer holds")
    axes[1].set_ylabel("MiB")
    for name in sorted({n for row in timeline for n in row["rss"]}):
        axes[2].plot(t, [row["rss"].get(name, float("nan")) / MIB for row in timeline], label=name)
    axes[2].set_ylabel("RSS (MiB)")
    axes[3].plot([x[0] for x in latencies], [x[1] for x in latencies], ".", markersize=3)
    axes[3].set_ylabel("request latency (s)")
    objectives = sorted({o for row in timeline for o in row.get("objectives", {})})
    if objectives:  # one axis for the objectives' states, a colour each
        states = axes[3].twinx()
        for objective, colour in zip(objectives, ("tab:red", "tab:purple"), strict=False):
            states.step(
                t,
                [row.get("objectives", {}).get(objective, float("nan")) for row in timeline],
                "-",
                color=colour,
                where="post",
                label=f"{objective} objective (0 met with room, 1 met, 2 missed)",
            )
        states.set_ylim(-0.2, 2.2)
        states.set_yticks([0, 1, 2])
        states.legend(fontsize=7, loc="upper left")
    axes[3].set_xlabel("seconds")
    for ax in axes:
        ax.axvspan(*window, color="0.9")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("memory squeeze inside a cgroup (shaded: the squeezer holds memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    group = Group(f"tiercache-squeeze-{os.getpid()}")
    headroom = args.headroom_mib * MIB
    try:
        with tempfile.TemporaryDirectory(prefix="tiercache-squeeze-") as tmp:
            work = Path(tmp)
            params = {"memory_headroom_bytes": str(headroom), "budget_interval_s": "0.5"}
            engine = {**params, **(ADAPTER_SLOTS if args.adapters else {})}
            stages = {"prompt_cache": dict(params), "torch_llm": engine}
            if args.graphs:
                stages["embedding_cache"] = {**params, **graph_params(args.graph_rows)}
            if args.hits:
                objective = str(args.hit_objective_ms / 1000)
                stages["prompt_cache"]["hit_objective_s"] = objective
            repository = copy_repository(MODEL_REPOSITORY, work / "repository", stages)
            state = fresh_state(work, args.state_dir)
            server = triton(
                repository, state, log_path=args.out_dir / "server.log", adapters_dir=ADAPTERS
            )
            progress(f"starting tritonserver in {group.path}")
            with running(server, ready_timeout_s=400):
                if args.hits:
                    progress(f"  warming {HIT_PROMPTS:,} answers")
                    warm_hits(server.ports.grpc, admin_token(server))
                if args.graph_rows:
                    progress(f"  {args.graph_rows:,} rows into each of {GRAPH_SCOPES} scopes")
                    seed_graph_rows(server, state, args.graph_rows)
                baseline = group.usage()
                limit = baseline + int(args.extra_gib * GIB)
                group.set_limit(limit)
                progress(
                    f"  ready; the group uses {baseline / MIB:.0f} MiB, limit now "
                    f"{limit / MIB:.0f} MiB, headroom {args.headroom_mib} MiB"
                )
                return run(args, server, group, headroom, limit, baseline)
    finally:
        group.close()


def run(
    args: argparse.Namespace, server: Any, group: Group, headroom: int, limit: int, baseline: int
) -> int:
    started = time.monotonic()
    mode = next((m for m in ("adapters", "graphs", "hits") if getattr(args, m)), "misses")
    client = Client(server.ports.grpc, started, mode)
    client.start()
    probe, labels = HostMemoryProbe(), {}
    timeline: list[dict[str, Any]] = []
    squeezer: subprocess.Popen[str] | None = None
    held = [0]
    window = [0.0, 0.0]  # the squeezer holds its memory from, until
    squeezing = [0.0]  # when it started taking memory
    total_s = args.before_s + args.hold_s + args.after_s
    pids = {p.pid for _, p in labelled_processes(server.process.pid, labels)}

    def read_squeezer() -> None:
        assert squeezer is not None and squeezer.stdout is not None
        for line in squeezer.stdout:
            line = line.strip()
            if line.isdigit():
                held[0] = int(line)
            elif line == "holding":
                window[0] = time.monotonic() - started
                progress(f"  squeezer holds {held[0] / MIB:.0f} MiB")

    try:
        while (now := time.monotonic() - started) < total_s + args.hold_s:
            if squeezer is None and now >= args.before_s:
                progress("  squeezing")
                squeezing[0] = now
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
                squeezer = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        SQUEEZER,
                        str(headroom // 2),
                        str(args.hold_s),
                        str(STEP_BYTES),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                threading.Thread(target=read_squeezer, daemon=True).start()
            if squeezer is not None and squeezer.poll() is not None and window[1] == 0.0:
                window[1] = now
                held[0] = 0
                progress("  squeezer gone: memory returned")
            if window[1] and now >= window[1] + args.after_s:
                break
            processes = labelled_processes(server.process.pid, labels)
            rss = {}
            for name, proc in processes:
                try:
                    rss[name] = proc.memory_info().rss
                except Exception:  # noqa: BLE001 - a process gone between listing and reading
                    continue
            samples = scrape_metrics(server.ports.metrics, wait_s=2.0)
            sizes, slot_bytes, held_bytes, states = budgets(samples)
            timeline.append(
                {
                    "t": round(now, 2),
                    "budgets": sizes,
                    "adapter_slots_held": slot_bytes,
                    "held": held_bytes,
                    "objectives": states,
                    "tiers": {  # prompt_cache's exact hits by the tier that answered
                        labels["tier"]: value
                        for name, labels, value in samples
                        if name == "tiercache_prompt_cache_hits_total" and "tier" in labels
                    },
                    "lookups": {  # prompt_cache's lookup time histogram (cumulative, by le)
                        labels["le"]: value
                        for name, labels, value in samples
                        if name == LOOKUP_BUCKETS and "le" in labels
                    },
                    "available": probe.read().available_bytes,
                    "usage": group.usage(),
                    "rss": rss,
                    "squeezer": held[0],
                }
            )
            time.sleep(SAMPLE_S)
    finally:  # never leave the squeezer holding memory (an error, Ctrl-C)
        if squeezer is not None and squeezer.poll() is None:
            squeezer.kill()
            squeezer.wait(timeout=30)
    client.done.set()
    client.join(timeout=150)
    alive = {p.pid for _, p in labelled_processes(server.process.pid, labels) if not gone(p)}
    lost = sorted(pids - alive)
    kills = group.oom_kills()
    failed = sum(1 for _, _, ok in client.results if not ok)
    end = time.monotonic() - started
    held_from = window[0] or squeezing[0]  # the squeezer never said it held: from its start
    held_until = window[1] or end  # it never left: until the end
    return report(
        args,
        timeline,
        client.results,
        (squeezing[0], held_from, held_until),
        lost,
        kills,
        failed,
        headroom,
        limit,
        baseline,
    )


def span(values: list[float]) -> str:
    """min-max of MiB values: whole MiB, or tenths under 10."""
    if not values:
        return "-"
    digits = 1 if max(values) < 10 else 0
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def report(
    args: argparse.Namespace,
    timeline: list[dict[str, Any]],
    results: list[tuple[float, float, bool]],
    times: tuple[float, float, float],
    lost: list[int],
    kills: int,
    failed: int,
    headroom: int,
    limit: int,
    baseline: int,
) -> int:
    out = args.out_dir
    squeezing, window = times[0], (times[1], times[2])
    (out / "squeeze.json").write_text(
        json.dumps(
            {
                "timeline": timeline,
                "requests": results,
                "squeezing": squeezing,
                "window": window,
                "limit": limit,
                "baseline": baseline,
                "headroom": headroom,
                "lost_pids": lost,
                "oom_kills": kills,
            },
            indent=1,
        )
    )
    plot(timeline, results, window, out / "squeeze.png")

    def phase(lo: float, hi: float) -> list[dict[str, Any]]:
        return [row for row in timeline if lo <= row["t"] < hi]

    def lat(lo: float, hi: float) -> str:
        values = [x[1] for x in results if lo <= x[0] < hi and x[2]]
        return f"{statistics.median(values):.2f} s ({len(values)})" if values else "-"

    caches = sorted({c for row in timeline for c in row["budgets"]})
    # before: once every budget is reported (the first scrapes may precede the first flush)
    ready = next((r["t"] for r in timeline if all(r["budgets"].get(c) for c in caches)), 0.0)
    phases = {
        "before": (ready, squeezing),
        "squeezing": (squeezing, window[0]),
        "held": window,
        "after": (window[1], float("inf")),
    }
    slots = any(r.get("adapter_slots_held") for r in timeline)
    holders = sorted({c for r in timeline for c in r.get("held", {})})
    objectives = sorted({o for r in timeline for o in r.get("objectives", {})})
    lines = [
        f"`{invocation('tiercache_dev.perf.squeeze', None)}`",
        "",
        f"group limit {limit / MIB:.0f} MiB (the server used {baseline / MIB:.0f} MiB when "
        f"ready), headroom {headroom / MIB:.0f} MiB; {len(results)} requests, {failed} failed; "
        f"server processes lost: {len(lost)}; the group's OOM kills: {kills}",
        "",
        "| phase | "
        + " | ".join(f"{c} budget MiB (min-max)" for c in caches)
        + (" | adapter slots held MiB (min-max)" if slots else "")
        + "".join(f" | {c} held MiB (min-max)" for c in holders)
        + "".join(f" | {o} objective (states seen)" for o in objectives)
        + (" | prompt_cache lookup p90 | hits from L1" if "hit" in objectives else "")
        + " | available MiB (min) | median latency (requests) |",
        "|---|"
        + "---:|" * (len(caches) + 2 + slots + len(holders) + len(objectives))
        + ("---:|---:|" if "hit" in objectives else ""),
    ]
    for name, (lo, hi) in phases.items():
        rows = phase(lo, hi)
        if not rows:
            continue
        cells = []
        for cache in caches:
            values = [r["budgets"][cache] / MIB for r in rows if cache in r["budgets"]]
            cells.append(span(values))
        if slots:
            held = [r["adapter_slots_held"] / MIB for r in rows if r.get("adapter_slots_held")]
            cells.append(span(held))
        for cache in holders:
            cells.append(span([r["held"][cache] / MIB for r in rows if cache in r.get("held", {})]))
        for objective in objectives:
            seen = sorted({r.get("objectives", {}).get(objective, -1) for r in rows} - {-1})
            cells.append(", ".join(STATE_NAMES[v] for v in seen) or "-")
        if "hit" in objectives:
            cells.append(lookup_p90(rows[0].get("lookups", {}), rows[-1].get("lookups", {})))
            cells.append(l1_share(rows[0].get("tiers", {}), rows[-1].get("tiers", {})))
        available = min(r["available"] for r in rows) / MIB
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {available:.0f} | {lat(lo, hi)} |")
    (out / "squeeze.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if lost or kills or failed else 0


if __name__ == "__main__":
    sys.exit(main())
