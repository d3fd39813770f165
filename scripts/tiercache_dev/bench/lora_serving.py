"""`make bench-lora` (serving half): many adapters through few engine slots, against one adapter.

Starts a real tritonserver on a copy of model_repository whose lora_cache and torch_llm hold
`--slots` adapters (default 4), serving `--adapters` synthetic adapters (default 20). Each is a
copy of one committed rank-8 adapter (adapters/<name>/) whose LoRA B matrices are scaled by a
seeded random factor: real PEFT files of the real size, each with its own digest, so every one is
a distinct version to load. Then, in alternating rounds within one run:

- one adapter: `--requests` generations at concurrency `--concurrency`, all on adapter 0;
- round robin: the same prompts, the i-th request on adapter i mod N, so with N > slots nearly
  every request evicts one adapter and loads another.

Every request carries `cache_control: no-cache, no-store`, so each one runs the engine (the point
is the swap cost, not the prompt cache). Reports throughput per mode, the ratio (target >= 0.8),
failed requests (target 0) and the engine's adapter loads and evictions from the metrics port.

Usage::

    python -m tiercache_dev.bench.lora_serving [--adapters 20] [--slots 4] [--requests 40]
        [--rounds 2] [--concurrency 4] [--max-tokens 16] [--template french] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tiercache.server import copy_repository
from tiercache_client import TierCacheClient, TierCacheClientError
from tiercache_dev.console import exit_on_sigterm
from tiercache_dev.metrics import metric_total, scrape_metrics
from tiercache_dev.paths import ADAPTERS, MODEL_REPOSITORY
from tiercache_dev.servers import TritonServer, running, triton
from tiercache_dev.stats import median

PROMPTS = [
    "How do I boil an egg?",
    "What is 7 plus 5?",
    "Name a large animal.",
    "Why is the sky blue?",
    "Give me a tip for sleeping better.",
    "What is the capital of Italy?",
    "How do plants make food?",
    "What is a good name for a cat?",
]


def make_adapters(dest: Path, count: int, template: str, seed: int = 0) -> list[str]:
    """`count` distinct adapters derived from adapters/<template>/ (see the module docstring)."""
    source = ADAPTERS / template
    tensors = load_file(str(source / "adapter_model.safetensors"))
    rng = np.random.default_rng(seed)
    names = []
    for i in range(count):
        name = f"synthetic-{i:02d}"
        folder = dest / name
        folder.mkdir(parents=True)
        shutil.copy2(source / "adapter_config.json", folder / "adapter_config.json")
        factor = float(rng.uniform(0.5, 1.5))
        scaled = {k: (v * factor if "lora_B" in k else v).contiguous() for k, v in tensors.items()}
        save_file(scaled, str(folder / "adapter_model.safetensors"))
        names.append(name)
    return names


def metric(server: TritonServer, name: str) -> float:
    """One metric's value, summed over its label sets."""
    return metric_total(scrape_metrics(server.ports.metrics), name)


TIMERS = (
    "tiercache_engine_adapter_load_seconds",
    "tiercache_engine_adapter_swap_seconds",
    "tiercache_lora_disk_read_seconds",
    "tiercache_llm_time_to_first_token_seconds",
    "tiercache_llm_generation_seconds",
)


def timer(server: TritonServer, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram."""
    return metric(server, f"{name}_sum"), metric(server, f"{name}_count")


def run_mode(
    client: TierCacheClient, adapters: list[str], requests: int, concurrency: int, max_tokens: int
) -> tuple[float, int, list[float]]:
    """(requests per second, failed requests, per-request seconds)."""
    jobs = [(PROMPTS[i % len(PROMPTS)], adapters[i % len(adapters)]) for i in range(requests)]

    def one(job: tuple[str, str]) -> float | None:
        prompt, adapter = job
        started = time.perf_counter()
        try:
            client.generate_text(
                prompt,
                max_tokens=max_tokens,
                lora_name=adapter,
                cache_control="no-cache, no-store",
            )
        except TierCacheClientError as exc:
            print(f"  failed: {adapter}: {exc}", file=sys.stderr)
            return None
        return time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(one, jobs))
    wall = time.perf_counter() - started
    latencies = [o for o in outcomes if o is not None]
    return len(latencies) / wall, len(outcomes) - len(latencies), latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--requests", type=int, default=40, help="per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--template", default="french", help="committed adapter to derive from")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped
    torch.set_num_threads(1)

    tmp = Path(tempfile.mkdtemp(prefix="tiercache-bench-lora-"))
    try:
        names = make_adapters(tmp / "adapters", args.adapters, args.template)
        slots = str(args.slots)
        repository = copy_repository(
            MODEL_REPOSITORY,
            tmp / "model_repository",
            {"lora_cache": {"engine_slots": slots}, "torch_llm": {"lora_slots": slots}},
        )
        server = triton(
            repository,
            tmp / "state",
            log_path=tmp / "triton.log",
            adapters_dir=tmp / "adapters",
        )
        print(
            f"{args.adapters} adapters, {args.slots} engine slots; starting tritonserver",
            flush=True,
        )
        with running(server, ready_timeout_s=600):
            figures = measure(server, names, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(figures, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if figures["failed"] == 0 else 1


def measure(server: TritonServer, names: list[str], args: argparse.Namespace) -> dict:
    modes = {"one adapter": names[:1], "round robin": names}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    latencies: dict[str, list[float]] = {m: [] for m in modes}
    failed = 0
    with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=600) as client:
        # Warm-up: the engine's first forward passes, and adapter 0 resident for "one adapter".
        run_mode(client, names[:1], args.concurrency, args.concurrency, args.max_tokens)
        loads_before = metric(server, "tiercache_engine_adapter_loads_total")
        evictions_before = metric(server, "tiercache_engine_adapter_evictions_total")
        timers = {name: timer(server, name) for name in TIMERS}
        for round_no in range(1, args.rounds + 1):
            for mode, adapters in modes.items():
                rate, lost, seconds = run_mode(
                    client, adapters, args.requests, args.concurrency, args.max_tokens
                )
                rates[mode].append(rate)
                latencies[mode].extend(seconds)
                failed += lost
                print(f"round {round_no}: {mode}: {rate:.2f} req/s, {lost} failed", flush=True)
        time.sleep(0.6)  # the stages flush metrics every 0.25 s
        loads = metric(server, "tiercache_engine_adapter_loads_total") - loads_before
        evictions = metric(server, "tiercache_engine_adapter_evictions_total") - evictions_before
        mean_ms = {}
        for name, (total, count) in timers.items():
            now_total, now_count = timer(server, name)
            n = now_count - count
            mean_ms[name] = 1000.0 * (now_total - total) / n if n else None
    one, rr = median(rates["one adapter"]), median(rates["round robin"])
    return {
        "adapters": len(names),
        "slots": args.slots,
        "concurrency": args.concurrency,
        "requests_per_mode": args.requests * args.rounds,
        "max_tokens": args.max_tokens,
        "one_adapter_rps": one,
        "round_robin_rps": rr,
        "ratio": rr / one,
        "one_adapter_p50_s": median(latencies["one adapter"]),
        "round_robin_p50_s": median(latencies["round robin"]),
        "failed": failed,
        "engine_loads": loads,
        "engine_evictions": evictions,
        "mean_ms": mean_ms,
    }


def report(f: dict, args: argparse.Namespace) -> None:
    print()
    print(
        f"{f['adapters']} adapters, {f['slots']} engine slots, concurrency {f['concurrency']}, "
        f"{f['requests_per_mode']} requests per mode, max_tokens {f['max_tokens']}"
    )
    print("| mode | req/s (median of rounds) | latency p50 |")
    print("|---|---|---|")
    print(f"| one adapter | {f['one_adapter_rps']:.2f} | {f['one_adapter_p50_s'] * 1000:.0f} ms |")
    print(f"| round robin | {f['round_robin_rps']:.2f} | {f['round_robin_p50_s'] * 1000:.0f} ms |")
    print(
        f"round robin / one adapter: {f['ratio']:.2f}x (target >= 0.8); failed requests: "
        f"{f['failed']} (target 0); engine adapter loads {f['engine_loads']:.0f}, "
        f"evictions {f['engine_evictions']:.0f}"
    )
    for name, value in f["mean_ms"].items():
        print(f"  mean {name}: " + ("-" if value is None else f"{value:.1f} ms"))


if __name__ == "__main__":
    sys.exit(main())
