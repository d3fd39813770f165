"""A ramp from one tenant to many, each with its own system prompt, through a real tritonserver
(issue 20): the same total of cache bytes split by fixed budgets, or moved between the KV pool
and the answers' L1 by the budget controller (`cache_memory_bytes`), side by side.

Usage::

    python -m tiercache_dev.perf.tenant_ramp [--total-mib 96] [--fixed-kv-shares 0.8,0.5]
        [--tenants 1,2,4,6,8,12] [--requests-per-phase 40] [--ttft-objective-ms 300]
        [--out-dir .perf/tenant_ramp]

One server after the other (never two at once; the controller's last, or first with
`--controller-first`), each cold, on free ports with a temporary state
directory (the converted weights linked from `--state-dir/models`), `make serve`'s repository
with these torch_llm and prompt_cache parameters:

- `fixed-<s>` for each share s of `--fixed-kv-shares`: `kv_pool_max_bytes` s x total,
  `l1_max_bytes` the rest (0.8 is the shipped defaults' proportion, 256 MiB to 64 MiB);
- `controller`: both ceilings the whole total, `cache_memory_bytes` the total (the first
  tick shares it by the budgets, half and half), `budget_interval_s` 0.5;
- `controller-ttft` (with `--ttft-controller`): the same, with torch_llm's `ttft_objective_s`
  the objective and both ceilings twice the total (the KV pool may take up to another total
  past it while the objective is missed).

The same requests go to each, one at a time (`--seed`): phase k has `--tenants`[k] tenants and
`--requests-per-phase` requests, each from a tenant drawn at random, its system prompt (about
`--system-words` words, distinct per tenant: KV blocks are never shared across tenants anyway)
then a question drawn from the tenant's `--questions` (a power law: repeats are exact hits),
`max_tokens` `--max-tokens`, `cache_control` "no-semantic" (rewordings are not under test).
TTFT is the client's: from sending to the first streamed chunk (an exact hit's whole answer).

Every 0.5 s the budgets and the KV pool's counters are read from the metrics port. Writes
`tenant_ramp.json` (every request and sample), `tenant_ramp.png` (budgets and TTFT over the
requests, phases marked) and `tenant_ramp.md` (per phase: TTFT p50/p90, the share of requests
within the objective, exact hits, KV tokens reused) to `--out-dir`; exit code 1 when a request
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.server import copy_repository
from tiercache_client import GenerationResult, TierCacheClient
from tiercache_dev.console import invocation, machine_summary, progress
from tiercache_dev.metrics import scrape_metrics
from tiercache_dev.paths import DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.servers import fresh_state, running, triton
from tiercache_dev.stats import percentile

MIB = 1 << 20
SAMPLE_S = 0.5
CACHE_CONTROL = "no-semantic"
WORDS = (
    "account adapter address agent answer archive audit balance batch billing branch budget "
    "carrier catalog channel charge checkout claim client colour contract coupon courier credit "
    "customer deadline delivery deposit desk discount dispatch document driver estimate "
    "exchange expense export freight guarantee holiday import inventory invoice label ledger "
    "licence locker loyalty manager manifest member notice order package parcel partner "
    "payment permit pickup policy pricing receipt refund region register reminder renewal "
    "report request reserve return route schedule season service shelf shipment signature "
    "store supplier support surcharge tariff ticket transfer voucher warehouse warranty"
).split()
QUESTIONS = (
    "Can I return a used item?",
    "Do you deliver on Sundays?",
    "How long is the warranty?",
    "Where do I find my member number?",
    "Can the manager refuse a refund?",
    "What do I need for a pickup?",
    "Is the receipt required?",
    "How many days do I have to return it?",
    "Can guests use the loyalty card?",
    "Who checks the invoice?",
    "Do drivers confirm the address?",
    "What if I lost the warranty card?",
    "Can I change the delivery address?",
    "Are the opening hours the same on holidays?",
    "Can support extend the return window?",
    "Do cashiers record the member number?",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out-dir", type=Path, default=PERF_DIR / "tenant_ramp")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("TIERCACHE_STATE_DIR") or DEFAULT_STATE_DIR),
        help="where the converted weights live (linked into each server's temporary state)",
    )
    p.add_argument("--total-mib", type=int, default=96, help="cache bytes: KV pool + L1")
    p.add_argument("--fixed-kv-shares", default="0.8,0.5", help="fixed splits to compare")
    p.add_argument("--tenants", default="1,2,4,6,8,12", help="tenants in each phase")
    p.add_argument("--requests-per-phase", type=int, default=40)
    p.add_argument("--questions", type=int, default=12, help="per tenant (power law)")
    p.add_argument("--system-words", type=int, default=170, help="about 1.4 tokens a word")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--ttft-objective-ms", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=20)
    p.add_argument(
        "--ttft-controller",
        action="store_true",
        help="also run `controller-ttft`: the controller with torch_llm's ttft_objective_s (the "
        "objective), the KV pool's ceiling twice the total",
    )
    p.add_argument(
        "--tail-s",
        type=float,
        default=0.0,
        help="after the requests, keep sampling controller-ttft's budgets this long (no "
        "traffic: what it took past the total goes back)",
    )
    p.add_argument(
        "--controller-first",
        action="store_true",
        help="run the controller's server first (the machine's drift lands on the others)",
    )
    args = p.parse_args(argv)
    args.tenant_counts = [int(x) for x in args.tenants.split(",")]
    args.kv_shares = [float(x) for x in args.fixed_kv_shares.split(",") if x]
    if not all(0.0 < s < 1.0 for s in args.kv_shares):
        p.error("--fixed-kv-shares must be fractions in (0, 1)")
    if not 1 <= args.questions <= len(QUESTIONS):
        p.error(f"--questions must be in [1, {len(QUESTIONS)}]")
    return args


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(f"system-{tenant}")
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the support assistant of company number {tenant}. Its glossary: {body}."


def requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ramp: (phase, tenant, prompt) for every request, the same for every server."""
    rng = random.Random(args.seed)
    weights = [1.0 / (rank + 1) for rank in range(args.questions)]
    out = []
    for phase, tenants in enumerate(args.tenant_counts):
        for _ in range(args.requests_per_phase):
            tenant = rng.randrange(tenants)
            question = rng.choices(QUESTIONS[: args.questions], weights)[0]
            prompt = f"{system_prompt(tenant, args.system_words)} Question: {question}"
            out.append({"phase": phase, "tenant": f"ramp-{tenant}", "prompt": prompt})
    return out


def configurations(args: argparse.Namespace) -> list[tuple[str, dict[str, dict[str, str]]]]:
    total = args.total_mib * MIB
    out = []
    for share in args.kv_shares:
        kv = int(total * share)
        out.append(
            (
                f"fixed-{share:g}",
                {
                    "torch_llm": {"kv_pool_max_bytes": str(kv)},
                    "prompt_cache": {"l1_max_bytes": str(total - kv)},
                },
            )
        )
    moving = {"cache_memory_bytes": str(total), "budget_interval_s": "0.5"}
    out.append(
        (
            "controller",
            {
                "torch_llm": {"kv_pool_max_bytes": str(total), **moving},
                "prompt_cache": {"l1_max_bytes": str(total), **moving},
            },
        )
    )
    if args.ttft_controller:
        objective = {"ttft_objective_s": str(args.ttft_objective_ms / 1000)}
        out.append(
            (
                "controller-ttft",
                {
                    "torch_llm": {"kv_pool_max_bytes": str(2 * total), **moving, **objective},
                    # the same ceilings: the first look cuts both to half the total, as above
                    "prompt_cache": {"l1_max_bytes": str(2 * total), **moving},
                },
            )
        )
    return out


class Sampler(threading.Thread):
    """The budgets and KV counters every SAMPLE_S from the metrics port."""

    def __init__(self, port: int, started: float) -> None:
        super().__init__(daemon=True)
        self.port, self.started = port, started
        self.done = threading.Event()
        self.rows: list[dict[str, Any]] = []

    def run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            row: dict[str, Any] = {"t": round(time.monotonic() - self.started, 2), "budgets": {}}
            try:
                samples = scrape_metrics(self.port, wait_s=2.0)
            except Exception:  # noqa: BLE001 - a missed sample is a gap in the plot
                continue
            for name, labels, value in samples:
                if name == "tiercache_budget_bytes":
                    row["budgets"][labels.get("cache", "?")] = value
                elif name == "tiercache_engine_kv_pool_bytes":
                    row["kv_pool_bytes"] = row.get("kv_pool_bytes", 0.0) + value
            self.rows.append(row)


def kv_tokens(port: int) -> tuple[float, float]:
    reused = computed = 0.0
    for name, _, value in scrape_metrics(port, wait_s=2.0):
        if name == "tiercache_engine_kv_reused_tokens_total":
            reused += value
        elif name == "tiercache_engine_kv_computed_tokens_total":
            computed += value
    return reused, computed


def run_one(
    name: str,
    params: dict[str, dict[str, str]],
    ramp: list[dict[str, Any]],
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    repository = copy_repository(MODEL_REPOSITORY, work / f"repository-{name}", params)
    state = fresh_state(work, args.state_dir, f"state-{name}")
    server = triton(repository, state, log_path=args.out_dir / f"server-{name}.log")
    progress(f"{name}: starting tritonserver")
    with running(server, ready_timeout_s=400):
        started = time.monotonic()
        sampler = Sampler(server.ports.metrics, started)
        sampler.start()
        results: list[dict[str, Any]] = []
        phase_kv: list[tuple[float, float]] = []
        with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=300) as client:
            for index, request in enumerate(ramp):
                if index == 0 or request["phase"] != ramp[index - 1]["phase"]:
                    phase_kv.append(kv_tokens(server.ports.metrics))
                    tenants = args.tenant_counts[request["phase"]]
                    progress(f"  phase {request['phase']}: {tenants} tenant(s)")
                results.append(ask(client, request, args, started))
            time.sleep(1.0)  # the stages' deferred metric updates
            phase_kv.append(kv_tokens(server.ports.metrics))
            if name == "controller-ttft" and args.tail_s > 0:
                progress(f"  no traffic for {args.tail_s:.0f} s")
                time.sleep(args.tail_s)
        sampler.done.set()
        sampler.join(timeout=10)
    failed = sum(1 for r in results if not r["ok"])
    progress(f"  {len(results)} requests, {failed} failed")
    return {"name": name, "params": params, "requests": results, "samples": sampler.rows,
            "phase_kv": phase_kv}  # fmt: skip


def ask(
    client: TierCacheClient, request: dict[str, Any], args: argparse.Namespace, started: float
) -> dict[str, Any]:
    begun = time.monotonic()
    first: float | None = None
    status, ok = "", True
    try:
        for item in client.generate(
            request["prompt"],
            max_tokens=args.max_tokens,
            tenant=request["tenant"],
            cache_control=CACHE_CONTROL,
        ):
            if first is None:
                first = time.monotonic() - begun
            if isinstance(item, GenerationResult):
                status = item.cache_status
    except Exception as exc:  # noqa: BLE001 - counted: the run fails on any
        ok, status = False, f"error: {exc}"
    return {
        "t": round(begun - started, 3),
        "phase": request["phase"],
        "tenant": request["tenant"],
        "ttft_ms": None if first is None else first * 1e3,
        "status": status,
        "ok": ok,
    }


def summarize(run: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for phase, tenants in enumerate(args.tenant_counts):
        done = [r for r in run["requests"] if r["phase"] == phase and r["ok"]]
        ttft = [r["ttft_ms"] for r in done if r["ttft_ms"] is not None]
        (r0, c0), (r1, c1) = run["phase_kv"][phase], run["phase_kv"][phase + 1]
        prompt = (r1 - r0) + (c1 - c0)
        rows.append(
            {
                "phase": phase,
                "tenants": tenants,
                "requests": len(done),
                "ttft_p50_ms": percentile(ttft, 50) if ttft else float("nan"),
                "ttft_p90_ms": percentile(ttft, 90) if ttft else float("nan"),
                "within": sum(t <= args.ttft_objective_ms for t in ttft) / len(ttft)
                if ttft
                else 0.0,
                "exact": sum(r["status"] == "exact" for r in done),
                "kv_reused": (r1 - r0) / prompt if prompt else 0.0,
            }
        )
    return rows


def plot(runs: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 8), sharex=False)
    for run in runs:
        if not run["name"].startswith("controller"):
            continue
        t = [row["t"] for row in run["samples"]]
        for cache in sorted({c for row in run["samples"] for c in row["budgets"]}):
            axes[0].plot(
                t,
                [row["budgets"].get(cache, float("nan")) / MIB for row in run["samples"]],
                label=f"{run['name']}: {cache} budget",
            )
        if run["name"] != "controller":
            continue  # the phases are drawn once, as the controller's run met them
        starts = [r["t"] for i, r in enumerate(run["requests"])
                  if i == 0 or r["phase"] != run["requests"][i - 1]["phase"]]  # fmt: skip
        for start, tenants in zip(starts, args.tenant_counts, strict=False):
            axes[0].axvline(start, color="0.8", linewidth=0.8)
            axes[0].text(start, 0, f" {tenants}", fontsize=7, va="bottom")
    colours = ("tab:green", "tab:red", "tab:purple", "tab:brown")
    for i, share in enumerate(args.kv_shares):
        axes[0].axhline(args.total_mib * share, linestyle=":", linewidth=1.0,
                        color=colours[i % len(colours)],
                        label=f"fixed-{share:g}: kv_pool budget")  # fmt: skip
    axes[0].set_ylabel("MiB")
    axes[0].set_xlabel("seconds into the controller's run (vertical lines: phases, tenants)")
    for run in runs:
        ttft = [r["ttft_ms"] for r in run["requests"] if r["ttft_ms"] is not None]
        axes[1].plot(range(len(ttft)), ttft, ".", markersize=3, label=run["name"])
    axes[1].axhline(args.ttft_objective_ms, color="red", linewidth=0.8, label="objective")
    for phase in range(1, len(args.tenant_counts)):
        axes[1].axvline(phase * args.requests_per_phase, color="0.8", linewidth=0.8)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].set_xlabel("request (the same sequence for every configuration)")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"tenant ramp, {args.total_mib} MiB of cache bytes: fixed splits vs controller")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    machine = machine_summary()
    lines = [
        f"`{invocation('tiercache_dev.perf.tenant_ramp', None)}`",
        "",
        f"{machine['nproc']} x {machine['cpu']}, load {machine['loadavg']}; total "
        f"{args.total_mib} MiB (KV pool + L1), TTFT objective "
        f"{args.ttft_objective_ms:g} ms, {args.requests_per_phase} requests a phase, one at a "
        f"time",
        "",
        "| tenants | " + " | ".join(r["name"] for r in runs)
        + " |\n|---:|" + "---|" * len(runs),
    ]  # fmt: skip
    tables = {run["name"]: summarize(run, args) for run in runs}
    for phase, tenants in enumerate(args.tenant_counts):
        cells = []
        for run in runs:
            row = tables[run["name"]][phase]
            cells.append(
                f"{row['within']:.0%} within; p50 {row['ttft_p50_ms']:.0f} / p90 "
                f"{row['ttft_p90_ms']:.0f} ms; {row['exact']} exact; KV {row['kv_reused']:.0%}"
            )
        lines.append(f"| {tenants} | " + " | ".join(cells) + " |")
    within = {}
    for run in runs:
        ttft = [r["ttft_ms"] for r in run["requests"] if r["ttft_ms"] is not None]
        within[run["name"]] = sum(t <= args.ttft_objective_ms for t in ttft) / max(len(ttft), 1)
    lines += ["", "Whole ramp, requests within the objective: "
              + ", ".join(f"{name} {share:.1%}" for name, share in within.items())]  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ramp = requests(args)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tiercache-ramp-") as tmp:
        order = configurations(args)
        if args.controller_first:
            first = [c for c in order if c[0].startswith("controller")]
            order = first + [c for c in order if not c[0].startswith("controller")]
        for name, params in order:
            runs.append(run_one(name, params, ramp, args, Path(tmp)))
    (args.out_dir / "tenant_ramp.json").write_text(json.dumps(runs, indent=1))
    plot(runs, args, args.out_dir / "tenant_ramp.png")
    lines = report(runs, args)
    (args.out_dir / "tenant_ramp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(not r["ok"] for run in runs for r in run["requests"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
