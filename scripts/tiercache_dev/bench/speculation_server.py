"""Speculative decoding through a real tritonserver (issue 17): the `again` and `new` workloads of
tiercache_dev.bench.speculation over gRPC, speculation on and off side by side on one server.

Usage::

    python -m tiercache_dev.bench.speculation_server [--requests 4] [--max-tokens 96]
        [--state-dir .tiercache] [--out-dir .perf]

One tritonserver on a copy of model_repository/ (a temporary state dir, the converted weights
linked from `--state-dir/models`) whose torch_llm has `kv_reuse` false, so neither run of a pair
reuses the other's prompt blocks. Through the whole ensemble:

- `again`: each prompt is asked with `--max-tokens` (a miss: the answer is stored, and kept as
  the prompt's draft), then asked with twice as many, twice: once with `cache_control`
  "no-cache no-store no-speculate" (plain decoding) and once with "no-cache no-store"
  (speculative: llm reads the kept answer as the draft); which one goes first alternates;
- `new`: new prompts, each asked the same two ways (nothing of theirs is cached; the engine's
  own sources, its recent answers in the scope and the prompt, are all it has).

Reports per workload the plain and speculative latency (sum and p50), the speedup (plain time
over speculative time), the `speculated_tokens` the ensemble returned, and whether every answer
was identical. Ends with one line per workload: `spec-server <workload> speedup <x> identical
<yes|no>`. Writes OUT_DIR/bench_spec_server.md and .json; the server log under
OUT_DIR/bench_spec_server/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.server import copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.bench.speculation import AGAIN_PROMPTS, NEW_PROMPTS
from tiercache_dev.console import invocation, machine_summary, progress, write_report
from tiercache_dev.paths import DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.servers import fresh_state, running, triton
from tiercache_dev.stats import median

PLAIN = "no-cache, no-store, no-speculate"
SPECULATIVE = "no-cache, no-store"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--requests", type=int, default=4, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="tiercache state")
    p.add_argument("--out-dir", type=Path, default=PERF_DIR, help="output folder")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= min(len(AGAIN_PROMPTS), len(NEW_PROMPTS)):
        p.error(f"--requests must be 1 to {min(len(AGAIN_PROMPTS), len(NEW_PROMPTS))}")
    return args


@dataclass(slots=True)
class Pair:
    plain_s: float
    spec_s: float
    identical: bool
    speculated_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class Workload:
    name: str
    pairs: list[Pair] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        plain = [p.plain_s for p in self.pairs]
        spec = [p.spec_s for p in self.pairs]
        return {
            "requests": len(self.pairs),
            "plain_s": sum(plain),
            "spec_s": sum(spec),
            "plain_p50_s": median(plain),
            "spec_p50_s": median(spec),
            "speedup": sum(plain) / sum(spec),
            "speculated_tokens": sum(p.speculated_tokens for p in self.pairs),
            "completion_tokens": sum(p.completion_tokens for p in self.pairs),
            "identical": all(p.identical for p in self.pairs),
        }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raw = args.out_dir / "bench_spec_server"
    raw.mkdir(parents=True, exist_ok=True)
    results: dict[str, Workload] = {}
    with tempfile.TemporaryDirectory(prefix="tiercache-spec-") as tmp:
        work = Path(tmp)
        state = fresh_state(work, args.state_dir)
        repository = copy_repository(
            MODEL_REPOSITORY, work / "repository", {"torch_llm": {"kv_reuse": "false"}}
        )
        server = triton(repository, state, log_path=raw / "server.log", exit_timeout_s=2)
        progress(f"starting tritonserver (grpc {server.ports.grpc})")
        started = time.monotonic()
        with running(server, ready_timeout_s=300):
            progress(f"  ready in {time.monotonic() - started:.1f} s")
            with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=600) as client:
                long = args.max_tokens

                def ask(prompt: str, max_tokens: int, control: str) -> Any:
                    return client.generate_text(
                        prompt, max_tokens=max_tokens, cache_control=control
                    )

                def measure(name: str, prompts: Sequence[str], max_tokens: int) -> Workload:
                    workload = Workload(name)
                    for i, prompt in enumerate(prompts):
                        order = (PLAIN, SPECULATIVE) if i % 2 == 0 else (SPECULATIVE, PLAIN)
                        got = {control: ask(prompt, max_tokens, control) for control in order}
                        plain, spec = got[PLAIN], got[SPECULATIVE]
                        pair = Pair(
                            plain.latency_s,
                            spec.latency_s,
                            plain.text == spec.text,
                            spec.speculated_tokens or 0,
                            spec.completion_tokens or 0,
                        )
                        workload.pairs.append(pair)
                        progress(
                            f"  {name} {i + 1}/{len(prompts)}: plain {pair.plain_s:.2f} s, "
                            f"speculative {pair.spec_s:.2f} s, {pair.speculated_tokens}/"
                            f"{pair.completion_tokens} tokens from drafts, "
                            f"{'identical' if pair.identical else 'DIFFERENT'}"
                        )
                    return workload

                again = AGAIN_PROMPTS[: args.requests]
                progress(f"again: asking {len(again)} prompts with max_tokens {long} first")
                for prompt in again:
                    first = ask(prompt, long, "")
                    progress(f"  {first.cache_status}, {first.completion_tokens} tokens")
                results["again"] = measure("again", again, 2 * long)
                results["new"] = measure("new", NEW_PROMPTS[: args.requests], long)
    md, summary = report(args, results)
    write_report(args.out_dir, "bench_spec_server", md, summary)
    for name, workload in results.items():
        s = workload.summary()
        print(
            f"spec-server {name} speedup {s['speedup']:.2f} "
            f"identical {'yes' if s['identical'] else 'no'}"
        )
    return 0 if results and all(w.summary()["identical"] for w in results.values()) else 1


def report(args: argparse.Namespace, results: dict[str, Workload]) -> tuple[str, dict]:
    machine = machine_summary()
    lines = [
        "## Speculative decoding through tritonserver",
        "",
        f"- command: `{invocation('tiercache_dev.bench.speculation_server')}`",
        f"- date: {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}; {machine['nproc']} "
        f"CPUs ({machine['cpu']}), load {machine['loadavg']}",
        f"- one server, torch_llm kv_reuse false; plain = cache_control `{PLAIN}`, "
        f"speculative = `{SPECULATIVE}`, alternating which goes first",
        "",
        "| workload | requests | plain s | spec s | plain p50 s | spec p50 s | speedup | "
        "speculated / completion tokens | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    summary = {}
    for name, workload in results.items():
        s = summary[name] = workload.summary()
        lines.append(
            f"| {name} | {s['requests']} | {s['plain_s']:.2f} | {s['spec_s']:.2f} | "
            f"{s['plain_p50_s']:.2f} | {s['spec_p50_s']:.2f} | {s['speedup']:.2f} | "
            f"{s['speculated_tokens']} / {s['completion_tokens']} | "
            f"{'yes' if s['identical'] else 'no'} |"
        )
    return "\n".join(lines) + "\n", summary


if __name__ == "__main__":
    sys.exit(main())
