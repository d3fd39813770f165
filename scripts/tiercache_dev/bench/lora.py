"""`make bench-lora` (engine half): what loading and switching LoRA adapters costs in the engine.

Usage::

    python -m tiercache_dev.bench.lora engine [--rounds 40] [--swaps 200] [--steps 32] [--threads 1]
        [--state-dir .tiercache] [--json FILE]

`engine` loads SmolLM2-135M-Instruct as torch_llm does (tiercache.engine.torch_engine) and
measures, in one process and one run, on the committed rank-8 adapters (adapters/<name>/):

- cold load: read adapter_config.json and adapter_model.safetensors from disk (and hash them, as
  the registry does), then `EngineAdapters.load`; evicted again after each round (`--rounds`);
- load from host bytes: `EngineAdapters.load` of weights already in memory (what lora_cache sends);
- each of the two loads both ways (tiercache.engine.adapters): "recycled", into the free slot the
  previous round's evict left (same shapes: the weights are copied in place), which is what a
  serving engine with its slots all injected does; and "injected", with the free slots deleted
  from the model before each round (untimed), so the load injects a new peft adapter;
- swap: `activate(A)` then `activate(B)` with both resident, each call timed (`--swaps`); and, to
  pin the cached-layer trick in tiercache.engine.adapters, the same switch done by walking every
  module of the model (as transformers' `model.set_adapter` does);
- one decode step (one token, KV cache of the prompt) with the base model and with an adapter
  active, `--steps` greedy steps each, alternating.

Targets (issue 4): cold load p50 < 150 ms, swap p50 < 5 ms. Runs on `--threads` torch threads
(default 1: on a shared machine more threads than free cores is slower and noisier). Exit code 0
whether or not the targets are met (PASS/MISS is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache_dev.paths import ADAPTERS, DEFAULT_STATE_DIR
from tiercache_dev.stats import mean, percentile

PROMPT = "How do I boil an egg?"
COLD_LOAD_TARGET_MS = 150.0
SWAP_TARGET_MS = 5.0


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    samples_ms: tuple[float, ...]
    target_ms: float | None = None

    @property
    def p50(self) -> float:
        return percentile(self.samples_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.samples_ms, 99)

    def verdict(self) -> str:
        if self.target_ms is None:
            return ""
        return "PASS" if self.p50 < self.target_ms else "MISS"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n": len(self.samples_ms),
            "p50_ms": round(self.p50, 3),
            "p99_ms": round(self.p99, 3),
            "mean_ms": round(mean(self.samples_ms), 3),
            "target_p50_ms": self.target_ms,
            "verdict": self.verdict(),
        }


def timed_ms(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = p.add_subparsers(dest="command", required=True)
    engine = commands.add_parser(
        "engine",
        help="adapter load, swap and step cost in the engine, in process",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    engine.add_argument("--rounds", type=int, default=40, help="loads timed per kind")
    engine.add_argument("--swaps", type=int, default=200, help="A->B switches timed")
    engine.add_argument("--steps", type=int, default=32, help="decode steps timed per model")
    engine.add_argument("--threads", type=int, default=1, help="torch threads")
    engine.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("TIERCACHE_STATE_DIR") or DEFAULT_STATE_DIR),
        help="where converted weights live ($TIERCACHE_STATE_DIR, else .tiercache/)",
    )
    engine.add_argument("--adapters", default="french,caps", help="two committed adapters: A,B")
    engine.add_argument("--json", type=Path, default=None, help="also write the rows here")
    engine.add_argument(
        "--no-packed-linears",
        action="store_true",
        help="the engine's linear layers through torch's own kernels (docs/engine.md)",
    )
    engine.set_defaults(run=run_engine)
    return p.parse_args(argv)


def read_adapter(name: str, task_id: int) -> Any:
    """adapters/<name>/ as AdapterWeights (the digest here is only a key, over the two files)."""
    import hashlib

    from tiercache.adapter_types import AdapterRef, AdapterWeights

    folder = ADAPTERS / name
    config = (folder / "adapter_config.json").read_text()
    weights = (folder / "adapter_model.safetensors").read_bytes()
    digest = hashlib.sha256(config.encode() + weights).hexdigest()
    return AdapterWeights(AdapterRef(name, task_id, digest), config, weights)


def decode_steps(engine: Any, input_ids: Any, steps: int) -> list[float]:
    """Prefill the prompt, then time `steps` greedy one-token forwards."""
    import torch

    times = []
    with torch.inference_mode():
        out = engine.model(input_ids=input_ids, use_cache=True)
        for _ in range(steps):
            token = torch.argmax(out.logits[:, -1, :], dim=-1, keepdim=True)
            started = time.perf_counter()
            out = engine.model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            times.append((time.perf_counter() - started) * 1e3)
    return times


def run_engine(args: argparse.Namespace) -> list[Row]:
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine
    from tiercache.exact.request import GenerationRequest

    torch.set_num_threads(args.threads)
    engine = TorchEngine(
        resolve_model(),
        args.state_dir / "models",
        "cpu",
        lora_slots=4,
        packed_linears=not args.no_packed_linears,
    )
    adapters = engine.adapters
    name_a, name_b = args.adapters.split(",")
    a, b = read_adapter(name_a, 1), read_adapter(name_b, 2)

    adapters.load(a)  # warm-up: peft's first injection also wraps the target layers
    adapters.evict(a.ref.digest)
    loads: dict[str, list[float]] = {}
    for way in ("recycled", "injected"):
        cold, host = loads.setdefault(f"cold {way}", []), loads.setdefault(f"host {way}", [])
        for _ in range(args.rounds):
            for samples, load in (
                (cold, lambda: adapters.load(read_adapter(name_a, 1))),
                (host, lambda: adapters.load(a)),
            ):
                if way == "injected":
                    adapters.remove_free_slots()
                recycled = adapters.stats().recycled_loads
                samples.append(timed_ms(load))
                if (adapters.stats().recycled_loads > recycled) != (way == "recycled"):
                    raise RuntimeError(f"a load meant to be {way} was not")
                adapters.evict(a.ref.digest)

    adapters.load(a)
    adapters.load(b)
    swaps = []
    for _ in range(args.swaps):
        swaps.append(timed_ms(lambda: adapters.activate(a.ref)))
        swaps.append(timed_ms(lambda: adapters.activate(b.ref)))
    layers = [m for m in engine.model.modules() if isinstance(m, BaseTunerLayer)]
    names = []
    for ref in (a.ref, b.ref):  # the peft names of their slots
        adapters.activate(ref)
        names.append(list(layers[0].active_adapters))

    def walk(index: int) -> None:
        for module in engine.model.modules():
            if isinstance(module, BaseTunerLayer):
                module.set_adapter(names[index], inference_mode=True)

    walks = [timed_ms(lambda i=i: walk(i % 2)) for i in range(2 * args.swaps)]
    adapters.activate(None)  # the walks bypassed `adapters`; this sets every layer again

    input_ids = engine.prompt_ids(GenerationRequest(PROMPT))
    base_steps, lora_steps = [], []
    for _ in range(3):
        adapters.activate(None)
        base_steps += decode_steps(engine, input_ids, args.steps)
        adapters.activate(a.ref)
        lora_steps += decode_steps(engine, input_ids, args.steps)

    print(
        f"{len(layers)} LoRA layers, torch threads {args.threads}, "
        f"{engine.packed_layers} linear layers packed",
        file=sys.stderr,
    )
    return [
        Row("cold load, recycled slot", tuple(loads["cold recycled"]), COLD_LOAD_TARGET_MS),
        Row("cold load, injected", tuple(loads["cold injected"]), COLD_LOAD_TARGET_MS),
        Row("load from host bytes, recycled slot", tuple(loads["host recycled"])),
        Row("load from host bytes, injected", tuple(loads["host injected"])),
        Row("swap A<->B (cached layer list)", tuple(swaps), SWAP_TARGET_MS),
        Row("swap A<->B (walk all modules)", tuple(walks)),
        Row("decode step, base model", tuple(base_steps)),
        Row("decode step, adapter active", tuple(lora_steps)),
    ]


def table(rows: Sequence[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'measure':<{width}}  {'n':>4}  {'p50 ms':>8}  {'p99 ms':>8}  target"]
    for r in rows:
        target = f"p50 < {r.target_ms:g} ms {r.verdict()}" if r.target_ms is not None else ""
        lines.append(
            f"{r.name:<{width}}  {len(r.samples_ms):>4}  {r.p50:>8.2f}  {r.p99:>8.2f}  {target}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = args.run(args)
    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.to_dict() for r in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
