"""RSS of the CPU engine alone while its prefix KV pool is full and evicting (issue 7, flat memory).

Usage::

    python -m tiercache_dev.diagnostics.engine_rss [--prompts 200]
        [--kv-pool-max-bytes 33554432] [--every 20] [--max-tokens 8] [--state-dir .tiercache]

Loads SmolLM2-135M-Instruct as torch_llm does (tiercache.engine.torch_engine), one torch thread,
and sends `--prompts` distinct prompts (a seeded random "system prompt" of 60-400 words plus a
question), so every prompt stores new blocks and, once the pool is full, evicts old ones. Prints
the process's RSS and the pool's bytes every `--every` prompts, then the RSS growth from the first
sample taken with a full pool to the last. The soak (tiercache_dev.perf.soak) saw torch_llm's RSS
rise after its pool was full; this separates the engine and its pool from the Triton stub around
it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

from tiercache_dev.paths import DEFAULT_STATE_DIR

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega"
).split()


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--kv-pool-max-bytes", type=int, default=32 << 20)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("TIERCACHE_STATE_DIR") or DEFAULT_STATE_DIR),
        help="where converted weights live ($TIERCACHE_STATE_DIR, else .tiercache/)",
    )
    args = p.parse_args(argv)
    import torch

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine
    from tiercache.exact.request import GenerationRequest

    torch.set_num_threads(1)
    engine = TorchEngine(
        resolve_model(),
        args.state_dir / "models",
        "cpu",
        kv_pool_max_bytes=args.kv_pool_max_bytes,
    )
    rng = random.Random(0)
    full_rss: float | None = None
    started = time.monotonic()
    print("prompt  rss_mib  pool_mib  seconds")
    for i in range(args.prompts):
        system = " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 400)))
        request = GenerationRequest(
            f"{system}\nQuestion {i}: what comes next?", max_tokens=args.max_tokens
        )
        for _ in engine.generate(request):
            pass
        pool_bytes = engine.kv_stats().bytes
        if full_rss is None and pool_bytes > 0.9 * args.kv_pool_max_bytes:
            full_rss = rss_mib()
        if i % args.every == 0 or i == args.prompts - 1:
            print(
                f"{i:6d}  {rss_mib():7.0f}  {pool_bytes / 2**20:8.1f}  "
                f"{time.monotonic() - started:7.0f}",
                flush=True,
            )
    if full_rss is None:
        print("the pool never filled: raise --prompts or lower --kv-pool-max-bytes")
        return 1
    print(f"RSS growth with a full pool: {rss_mib() - full_rss:+.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
