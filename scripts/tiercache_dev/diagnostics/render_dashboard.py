"""Render deploy/grafana/tiercache-dashboard.json from a real run into docs/dashboard.png.

Usage::

    .venv/bin/python -m tiercache_dev.diagnostics.render_dashboard [--duration 240] [--redis]
        [--out docs/dashboard.png]

Grafana's server is not installable where this was written (not in Debian bookworm, PyPI or
npm), so the picture is not Grafana's: this script runs the dashboard's own PromQL on a real
Prometheus that scraped a real tritonserver, and draws each panel with matplotlib in the
dashboard's grid layout. Steps:

1. Starts tritonserver on model_repository/ (free loopback ports, a state dir under a temp dir)
   and, with `--redis`, a redis-server too, with prompt_cache, embedding_cache, llm and
   cache_admin on it (a copy of the repository with `redis_url` and `redis_prefix`).
2. Starts Prometheus (Debian's `prometheus`, installed with apt-get when missing and running as
   root) on a free loopback port, scraping Triton's metrics port every 2 s into a temp dir.
3. Sends a mix for `--duration` seconds from `--workers` threads: repeats of earlier prompts
   (exact hits), rewordings from ../shared/eval/semantic_pairs_dev.jsonl (semantic hits or
   misses), new prompts, two tenants, the committed adapters via lora_name, a few tagged
   answers; every `--invalidate-every-s` one invalidation through cache_admin (tag, tenant,
   key in turn).
4. Evaluates every panel target through Prometheus's HTTP API (`query_range` over the run, with
   `$__rate_interval` replaced by `--rate-interval`; the datasource variable is ignored) and
   draws the panels (titles, legends, units) into `--out`.

Every process it starts is stopped by its own pid at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiercache.server import REDIS_STAGES, copy_repository
from tiercache_client import TierCacheClient, TierCacheClientError
from tiercache_dev import paths
from tiercache_dev.console import exit_on_sigterm
from tiercache_dev.paths import DEFAULT_PAIRS as PAIRS
from tiercache_dev.paths import MODEL_REPOSITORY, REPO_ROOT
from tiercache_dev.servers import admin_token, free_port, redis_running, running, triton

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "tiercache-dashboard.json"
ADAPTERS = ("french", "caps", "brief")
TENANTS = ("acme", "globex")
# Two engine slots for three adapters, so the mix shows loads, swaps and evictions (as
# tests/integration/test_lora.py does).
ADAPTER_SLOTS = {"lora_cache": {"engine_slots": "2"}, "torch_llm": {"lora_slots": "2"}}
SCRAPE_INTERVAL_S = 2
READY_TIMEOUT_S = 60.0


# ---- processes --------------------------------------------------------------------------------


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} was not ready within {timeout_s:.0f} s")
        time.sleep(0.2)


def stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def prometheus_binary() -> str:
    """Debian's prometheus (apt-get install when missing and running as root)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0:
        raise SystemExit("prometheus is not installed: apt-get install -y prometheus (as root)")
    print("installing prometheus with apt-get ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "prometheus"], check=True, env=env)
    found = shutil.which("prometheus")
    if found is None:
        raise SystemExit("apt-get installed prometheus but it is not on PATH")
    return found


class Prometheus:
    """One Prometheus scraping `target` every SCRAPE_INTERVAL_S into `workdir`."""

    def __init__(self, workdir: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
            f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
            "scrape_configs:\n"
            "  - job_name: triton\n"
            "    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        log = open(workdir / "prometheus.log", "ab")  # noqa: SIM115 - owned by Popen
        self.process = subprocess.Popen(
            [prometheus_binary(), f"--config.file={config}",
             f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        wait_for(self._ready, READY_TIMEOUT_S, "prometheus")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise SystemExit(f"prometheus exited with code {self.process.returncode}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body}")
        return body["data"]

    def scraped_once(self) -> bool:
        return bool(self.api("query", query='up{job="triton"} == 1')["result"])

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[Any]:
        data = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s}s"
        )
        result: list[Any] = data["result"]
        return result


# ---- traffic ----------------------------------------------------------------------------------


def load_pairs(path: Path) -> list[tuple[str, str]]:
    """Rewordings (label 1 pairs) from the shared evaluation set, or none if it is absent."""
    if not path.exists():
        print(f"({path.name} not found: no rewordings in the mix)", flush=True)
        return []
    pairs = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("label") == 1 and row["a"] != row["b"]:
            pairs.append((row["a"], row["b"]))
    return pairs


TOPICS = (
    "the tides", "photosynthesis", "a rainbow", "compound interest", "the moon's phases",
    "a volcano", "DNA", "gravity", "an eclipse", "the water cycle", "inflation", "a comet",
)  # fmt: skip
ASKS = ("Explain {} in one sentence.", "What is {}?", "Give one fact about {}.")


@dataclass(slots=True)
class Mix:
    """What the workers send: each request picks one kind by weight."""

    pairs: list[tuple[str, str]]
    rng: random.Random
    asked: list[tuple[str, str, str | None]] = field(default_factory=list)  # prompt, tenant, lora
    reworded: list[tuple[str, str]] = field(default_factory=list)  # (rewording, tenant) to ask
    lock: threading.Lock = field(default_factory=threading.Lock)
    counter: int = 0

    def fresh_prompt(self) -> str:
        with self.lock:
            self.counter += 1
            n = self.counter
            if self.pairs:
                a, b = self.pairs[n % len(self.pairs)]
                if n <= len(self.pairs):
                    return a
            topic = TOPICS[n % len(TOPICS)]
            return f"{self.rng.choice(ASKS).format(topic)} (case {n})"

    def next_request(self) -> tuple[str, dict[str, Any]]:
        """(kind, generate kwargs)."""
        with self.lock:
            roll = self.rng.random()
            tenant = self.rng.choice(TENANTS)
            if roll < 0.40 and self.asked:
                prompt, tenant, lora = self.rng.choice(self.asked)
                kind, kwargs = "repeat", {"lora_name": lora}
            elif roll < 0.60 and self.reworded:
                prompt, tenant = self.reworded.pop(self.rng.randrange(len(self.reworded)))
                kind, kwargs = "rewording", {}
            else:
                prompt, kind, kwargs = "", "new", {}
        if kind == "new":
            prompt = self.fresh_prompt()
            roll = self.rng.random()
            if roll < 0.2:
                kwargs = {"lora_name": self.rng.choice(ADAPTERS)}
                kind = "adapter"
            elif roll < 0.3:
                kwargs = {"cache_control": f"tag=topic-{self.rng.randrange(3)}"}
                kind = "tagged"
            with self.lock:
                self.asked.append((prompt, tenant, kwargs.get("lora_name")))
                for a, b in self.pairs:
                    if a == prompt:
                        self.reworded.append((b, tenant))
        return kind, {"prompt": prompt, "tenant": tenant, **kwargs}


@dataclass(slots=True)
class Tally:
    statuses: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    first_errors: dict[str, str] = field(default_factory=dict)  # kind -> its first message
    invalidations: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, table: dict[str, int], key: str) -> None:
        with self.lock:
            table[key] = table.get(key, 0) + 1

    def error(self, kind: str, exc: BaseException) -> None:
        self.count(self.errors, kind)
        with self.lock:
            self.first_errors.setdefault(kind, str(exc))


def progress(total_s: int) -> Any:
    """tqdm when installed, else plain lines every 10 s."""
    try:
        from tqdm import tqdm

        return tqdm(total=total_s, unit="s", desc="traffic")
    except ImportError:

        class Lines:
            def __init__(self) -> None:
                self.n = 0

            def update(self, n: int) -> None:
                self.n += n
                if self.n % 10 == 0:
                    print(f"traffic: {self.n}/{total_s} s", flush=True)

            def set_postfix_str(self, text: str) -> None:
                if self.n % 10 == 0:
                    print(f"  {text}", flush=True)

            def close(self) -> None:
                pass

        return Lines()


def drive(
    grpc_url: str, args: argparse.Namespace, mix: Mix, tally: Tally, token: str | None = None
) -> None:
    """Generation workers, and an invalidator that uses the admin `token`."""
    stop_at = time.monotonic() + args.duration

    def worker() -> None:
        with TierCacheClient(grpc_url, timeout_s=300) as client:
            while time.monotonic() < stop_at:
                kind, request = mix.next_request()
                tally.count(tally.kinds, kind)
                prompt = request.pop("prompt")
                try:
                    result = client.generate_text(prompt, max_tokens=args.max_tokens, **request)
                    tally.count(tally.statuses, result.cache_status or "?")
                except TierCacheClientError as exc:
                    tally.error(type(exc).__name__, exc)

    def invalidator() -> None:
        kinds = ("tag", "tenant", "key")
        n = 0
        with TierCacheClient(grpc_url, timeout_s=300, admin_token=token) as client:
            while not finished.wait(args.invalidate_every_s):
                what = kinds[n % len(kinds)]
                n += 1
                try:
                    if what == "tag":
                        report = client.invalidate(tag=f"topic-{n % 3}")
                    elif what == "tenant":
                        report = client.invalidate(tenant=TENANTS[n % 2])
                    else:
                        with mix.lock:
                            asked = list(mix.asked)
                        if not asked:
                            continue
                        prompt, tenant, lora = mix.rng.choice(asked)
                        found = client.warm(
                            prompts=[{"text_input": prompt, "tenant": tenant, "answer": "warm",
                                      "max_tokens": args.max_tokens,
                                      **({"lora_name": lora} if lora else {})}]
                        )  # fmt: skip
                        digest = found["prompts"][0].get("digest")
                        if not digest:
                            continue
                        report = client.invalidate(key=digest)
                    tally.invalidations.append(f"{what}: dropped {report.get('dropped_l2', 0)}")
                except TierCacheClientError as exc:
                    tally.error(f"invalidate {type(exc).__name__}", exc)

    finished = threading.Event()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
    threads.append(threading.Thread(target=invalidator, daemon=True))
    for thread in threads:
        thread.start()
    bar = progress(args.duration)
    for _ in range(args.duration):
        time.sleep(1)
        bar.update(1)
        with tally.lock:
            bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in sorted(tally.statuses.items())))
    bar.close()
    finished.set()
    for thread in threads:
        thread.join(timeout=600)


# ---- drawing ----------------------------------------------------------------------------------


def targets_of(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def promql(expr: str, rate_interval: str) -> str:
    return expr.replace("$__rate_interval", rate_interval)


def legend(template: str, metric: dict[str, str]) -> str:
    if not template:
        return ", ".join(f"{k}={v}" for k, v in metric.items()) or "value"
    text = template
    for key, value in metric.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def unit_formatter(unit: str) -> Callable[[float, Any], str]:
    def seconds(v: float) -> str:
        a = abs(v)
        if a == 0:
            return "0"
        if a < 1e-3:
            return f"{v * 1e6:.0f} µs"
        if a < 1:
            return f"{v * 1e3:.3g} ms"
        return f"{v:.3g} s"

    def size(v: float) -> str:
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(v) >= scale:
                return f"{v / scale:.3g} {name}"
        return f"{v:.0f} B"

    table: dict[str, Callable[[float], str]] = {
        "percentunit": lambda v: f"{v * 100:.0f}%",
        "s": seconds,
        "µs": lambda v: seconds(v / 1e6),
        "ms": lambda v: seconds(v / 1e3),
        "bytes": size,
        "reqps": lambda v: f"{v:.3g} req/s",
        "ops": lambda v: f"{v:.3g}/s",
        "short": lambda v: f"{v:.3g}",
    }
    fmt = table.get(unit, lambda v: f"{v:.3g}")
    return lambda v, _pos: fmt(v)


@dataclass(slots=True)
class Series:
    label: str
    times_s: list[float]
    values: list[float]


def evaluate(
    prom: Prometheus, panel: dict[str, Any], start: float, end: float, step_s: float, rate: str
) -> tuple[list[Series], list[str]]:
    series: list[Series] = []
    problems: list[str] = []
    for target in panel.get("targets", []):
        try:
            result = prom.query_range(promql(target["expr"], rate), start, end, step_s)
        except (OSError, RuntimeError) as exc:
            problems.append(f"{target['refId']}: {exc}")
            continue
        steps = int((end - start) // step_s) + 1
        times_s = [i * step_s for i in range(steps)]
        for item in result:
            # A step without a value (no sample, or NaN: a quantile of nothing) is a gap, as
            # Grafana draws it, not a line to the next value.
            values = [math.nan] * steps
            for t, v in item["values"]:
                i = round((float(t) - start) / step_s)
                if 0 <= i < steps:
                    values[i] = float(v)
            if any(math.isfinite(v) for v in values):
                label = legend(target.get("legendFormat", ""), item["metric"])
                series.append(Series(label, times_s, values))
    return series, problems


def draw(
    dashboard: dict[str, Any],
    prom: Prometheus,
    start: float,
    end: float,
    rate: str,
    out: Path,
    subtitle: str,
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec
    from matplotlib.ticker import FuncFormatter

    panels = list(targets_of(dashboard))
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    step_s = max(SCRAPE_INTERVAL_S, (end - start) / 240)
    height_in = rows * 0.5 + 1.2
    fig = plt.figure(figsize=(24, height_in), dpi=90)
    fig.patch.set_facecolor("#111217")
    grid = GridSpec(rows, 24, figure=fig, left=0.035, right=0.99, top=1 - 1.0 / height_in,
                    bottom=0.015, wspace=1.6, hspace=1.8)  # fmt: skip
    fig.suptitle(
        f"{dashboard['title']}  —  {subtitle}", color="#d8d9da", fontsize=16, x=0.01, ha="left"
    )
    notes: list[str] = []
    for panel in panels:
        pos = panel["gridPos"]
        cells = grid[pos["y"] : pos["y"] + pos["h"], pos["x"] : pos["x"] + pos["w"]]
        if panel["type"] == "row":
            ax = fig.add_subplot(cells)
            ax.axis("off")
            ax.text(0, 0.1, panel["title"], color="#d8d9da", fontsize=14, weight="bold",
                    transform=ax.transAxes)  # fmt: skip
            continue
        ax = fig.add_subplot(cells)
        ax.set_facecolor("#181b1f")
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.tick_params(colors="#9fa7b3", labelsize=7)
        ax.grid(color="#2c3235", linewidth=0.5)
        ax.set_title(panel["title"], color="#d8d9da", fontsize=10, loc="left")
        series, problems = evaluate(prom, panel, start, end, step_s, rate)
        notes.extend(f"{panel['title']}: {p}" for p in problems)
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        unit = defaults.get("unit", "short")
        stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
        if not series:
            ax.text(0.5, 0.5, "No data", color="#9fa7b3", ha="center", va="center",
                    transform=ax.transAxes)  # fmt: skip
            notes.append(f"{panel['title']}: no data")
        elif stacked and len({tuple(s.times_s) for s in series}) == 1:
            ax.stackplot(series[0].times_s,
                         [[v if math.isfinite(v) else 0.0 for v in s.values] for s in series],
                         labels=[s.label for s in series], alpha=0.7)  # fmt: skip
        else:
            for s in series:
                ax.plot(s.times_s, s.values, label=s.label, linewidth=1.2)
        if "min" in defaults:
            ax.set_ylim(bottom=defaults["min"])
        if "max" in defaults and unit == "percentunit":
            ax.set_ylim(top=defaults["max"] * 1.02)
        ax.set_xlim(0, end - start)
        ax.yaxis.set_major_formatter(FuncFormatter(unit_formatter(unit)))
        ax.xaxis.set_major_formatter(
            FuncFormatter(lambda v, _p: f"{int(v) // 60}:{int(v) % 60:02d}")
        )
        if series:
            ax.legend(fontsize=6.5, loc="upper left", ncol=2 if len(series) > 4 else 1,
                      facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#d8d9da",
                      framealpha=0.8)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, facecolor=fig.get_facecolor())
    plt.close(fig)
    return notes


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=240, help="seconds of traffic")
    parser.add_argument("--redis", action="store_true", help="stages on a redis-server (L3)")
    parser.add_argument("--workers", type=int, default=2, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--invalidate-every-s", type=float, default=20.0)
    parser.add_argument("--rate-interval", default="30s", help="stands in for $__rate_interval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "dashboard.png")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, tsdb)")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped
    dashboard = json.loads(args.dashboard.read_text())

    workdir = Path(tempfile.mkdtemp(prefix="tiercache-dashboard-"))
    print(f"work dir: {workdir}", flush=True)
    try:
        with contextlib.ExitStack() as stack:  # stops Prometheus, then Triton, then Redis
            parameters = {k: dict(v) for k, v in ADAPTER_SLOTS.items()}
            if args.redis:
                redis_server = stack.enter_context(redis_running(workdir))
                shared = {
                    "redis_url": redis_server.url,
                    "redis_prefix": f"d{uuid.uuid4().hex[:8]}:",
                }
                for stage in REDIS_STAGES:
                    parameters.setdefault(stage, {}).update(shared)
            repository = copy_repository(MODEL_REPOSITORY, workdir / "model_repository", parameters)
            server = triton(
                repository,
                workdir / "state",
                log_path=workdir / "triton.log",
                adapters_dir=paths.ADAPTERS,
            )
            print("starting tritonserver (loads the LLM; a minute or two) ...", flush=True)
            stack.enter_context(running(server, ready_timeout_s=900))
            prom = Prometheus(workdir, f"127.0.0.1:{server.ports.metrics}")
            stack.callback(stop, prom.process)
            wait_for(prom.scraped_once, READY_TIMEOUT_S, "the first scrape")
            mix = Mix(load_pairs(PAIRS), random.Random(args.seed))
            tally = Tally()
            start = time.time()
            drive(server.grpc_url, args, mix, tally, admin_token(server))
            time.sleep(3 * SCRAPE_INTERVAL_S)  # the last flush and scrape
            end = time.time()
            when = datetime.fromtimestamp(start, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            subtitle = (
                f"{args.duration} s of traffic on one tritonserver"
                f"{' with Redis' if args.redis else ''}, {when}; Prometheus query_range, "
                f"$__rate_interval={args.rate_interval}"
                " (drawn by tiercache_dev.diagnostics.render_dashboard, not Grafana)"
            )
            notes = draw(dashboard, prom, start, end, args.rate_interval, args.out, subtitle)
            print(f"requests by kind: {tally.kinds}", flush=True)
            print(f"responses by cache status: {tally.statuses}", flush=True)
            print(f"errors: {tally.errors or 'none'}", flush=True)
            for kind, message in tally.first_errors.items():
                print(f"  first {kind}: {message}", flush=True)
            print(f"invalidations: {len(tally.invalidations)} {tally.invalidations}", flush=True)
            for note in notes:
                print(f"note: {note}", flush=True)
            print(f"wrote {args.out}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
