"""An exact hit's own Python, per stage, in process: what the stages add to the floor.

Usage::

    python -m tiercache_dev.bench.hit_path [--requests 5000] [--rounds 5] [--distinct K]
        [--evict-mib M] [--profile N] [--opcodes N]

`make bench` compares a hit through tritonserver with a floor of no-op stages; on a shared
machine that ratio moves by more than the few percent a change to the hit path makes (the same
configuration's CPU per request moved 1.5x between two runs of it, docs/benchmarks.md). This
runs the ensemble's steps (model_repository/ensemble/config.pbtxt, in its order and with its
tensor mapping) in one process against the pb_utils stand-in (tiercache_dev.pb_utils_stub):
each stage's real model.py, initialized with its defaults over a scratch state directory of
its own (one secret for all, as replicas share one), one exact hit at a time, each step's
outputs becoming the next steps' inputs as the ensemble maps them. What it times is the
stages' own work per hit (decoding, lookups, seals, answer ids, metrics, building outputs),
not Triton's IPC nor pb_utils.Tensor's serialization, which the floor pays too. The floor's
no-op steps (scripts/bench_fixtures/floor) run the same way, in the same rounds, interleaved.
Reported per step: median over rounds of the mean microseconds per hit (and the range), the
floor's, and what the stage adds; and their sums. `--evict-mib M` reads M MiB before each step
(untimed), so that each starts with the CPU caches evicted, as after a hop between a server's
processes. `--profile N` also prints cProfile's top N functions by own time over one more round;
`--opcodes N` counts the bytecode instructions each step runs per hit over N more hits.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import json
import os
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from tiercache.exact.codec import CacheEntry
from tiercache.stages.envelope import Envelope, Freshness
from tiercache_dev import pb_utils_stub as pb
from tiercache_dev.console import invocation
from tiercache_dev.paths import BENCH_FIXTURES as FIXTURES
from tiercache_dev.paths import MODEL_REPOSITORY

PROMPT = "What is Triton Inference Server?"
ANSWER = "An inference server."
SECRET_FILE_ENV = "TIERCACHE_SECRET_FILE"  # tiercache.stages.parts.host_secret reads it


@dataclass(frozen=True, slots=True)
class Step:
    model: str
    inputs: dict[str, str]  # the model's input name -> the ensemble tensor it reads
    outputs: dict[str, str]  # the model's output name -> the ensemble tensor it writes


def ensemble_steps(config_text: str) -> list[Step]:
    """The ensemble's steps in order, with their input and output maps."""
    steps = []
    for block in re.split(r"\n\s*\{\s*\n\s*model_name:", config_text)[1:]:
        model = re.match(r'\s*"([^"]+)"', block)
        if model is None:
            continue
        pairs = r'{}_map\s*\{{\s*key:\s*"([^"]+)"\s*value:\s*"([^"]+)"\s*\}}'
        steps.append(
            Step(
                model.group(1),
                dict(re.findall(pairs.format("input"), block)),
                dict(re.findall(pairs.format("output"), block)),
            )
        )
    return steps


def load(name: str, state_dir: Path, floor: bool = False) -> Any:
    """model_repository/<name>/1/model.py (`floor`: the benchmark floor's no-op one), imported
    by path and initialized with its defaults over `state_dir`, as the Python backend would
    (against the stand-in)."""
    path = (
        FIXTURES / "floor" / name / "model.py"
        if floor
        else MODEL_REPOSITORY / name / "1" / "model.py"
    )
    kind = "floor" if floor else "stage"
    spec = importlib.util.spec_from_file_location(f"tiercache_bench_{kind}_{name}", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    if floor:  # the no-op steps have no initialize
        return model
    config = {"parameters": {"state_dir": {"string_value": str(state_dir)}}}
    model.initialize(
        {
            "model_config": json.dumps(config),
            "model_name": name,
            "model_instance_name": f"{name}_0",
        }
    )
    return model


class Ensemble:
    """The steps' models, run one request at a time as the ensemble runs them."""

    def __init__(self, steps: Sequence[Step], state_dir: Path, floor: bool = False) -> None:
        self.steps = list(steps)
        # one state directory each (one process cannot open an LMDB environment twice), one
        # secret for all (as a fleet's replicas share one: TIERCACHE_SECRET_FILE), so the
        # stages' seals verify across them as in one server
        os.environ[SECRET_FILE_ENV] = str(state_dir / "secret")
        self.models = {
            step.model: load(step.model, state_dir / step.model, floor) for step in self.steps
        }
        # Each stage's metrics flusher thread is stopped here and its flush run between rounds
        # (`flush_metrics`). In a stub the request thread waits for the next request between
        # executes, and a flusher waking for the GIL gets it then; here the request thread never
        # waits, so a woken flusher stays queued for the GIL (over 100 ms seen under strace),
        # and every GIL release on the request path (each LMDB call) wakes it and waits to get
        # the GIL back: the invalidation log's read took about 11 us per hit, 0.5 us alone.
        for model in self.models.values():
            if not floor:
                model.stage.metrics.close()
        self.seconds = {step.model: 0.0 for step in self.steps}
        # read before each timed step when set (`--evict-mib`): a step then runs as after a hop
        # between processes, with what it touches evicted from the CPU caches
        self.evict: np.ndarray | None = None
        # each step's outputs in the last untimed request: name -> (dtype, shape), and the bytes of
        # each BYTES output's values (what the stub serializes and the next step reads)
        self.sent: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self.sizes: dict[str, dict[str, int]] = {}

    def run(self, public: dict[str, np.ndarray], timed: bool = True) -> dict[str, np.ndarray]:
        """One request through every step; the tensors the last step sent."""
        tensors = dict(public)
        last: dict[str, np.ndarray] = {}
        for step in self.steps:
            inputs = [
                pb.Tensor(name, tensors[source])
                for name, source in step.inputs.items()
                if source in tensors
            ]
            model = self.models[step.model]
            if timed and self.evict is not None:
                self.evict.sum()  # the step starts with the CPU caches holding other data
            started = time.perf_counter()
            responses = self._execute(model, inputs)
            if timed:
                self.seconds[step.model] += time.perf_counter() - started
            (response,) = responses
            if response.has_error():
                raise RuntimeError(f"{step.model}: {response.error().message()}")
            last = {t.name(): t.as_numpy() for t in response.output_tensors()}
            if not timed:  # what a step sent, for the checks: not on every timed request
                self.sent[step.model] = {k: (str(v.dtype), v.shape) for k, v in last.items()}
                self.sizes[step.model] = {
                    k: sum(len(x) for x in v.reshape(-1))
                    for k, v in last.items()
                    if v.dtype == object
                }
            for name, value in last.items():
                tensors[step.outputs.get(name, name)] = value
        return last

    def flush_metrics(self) -> None:
        """What the stopped flushers would have sent (untimed: a stub sends it off the request
        path)."""
        for model in self.models.values():
            stage = getattr(model, "stage", None)
            if stage is not None:
                stage.metrics.flush()

    @staticmethod
    def _execute(model: Any, inputs: list[Any]) -> list[Any]:
        request = pb.InferenceRequest(inputs)
        sender = pb.ResponseSender()
        request.get_response_sender = lambda: sender  # type: ignore[attr-defined]
        returned = model.execute([request])
        if returned is not None:  # not decoupled
            return list(returned)
        if not sender.done.wait(30.0):
            raise RuntimeError("a decoupled step sent no final response")
        return [sender.responses[-1]]

    def close(self) -> None:
        for model in self.models.values():
            if hasattr(model, "finalize"):
                model.finalize()


def public_inputs(prompt: str) -> dict[str, np.ndarray]:
    return {
        "text_input": np.array([[prompt.encode()]], dtype=np.object_),
        "max_tokens": np.array([[16]], dtype=np.int32),
    }


def cache_the_answer(ensemble: Ensemble, public: dict[str, np.ndarray]) -> None:
    """The prompt's answer put in prompt_cache's tiers under the digest its lookup gives, so
    every later request is an exact hit."""
    model = ensemble.models["prompt_cache"]
    (response,) = model.execute([pb.InferenceRequest([pb.Tensor(k, v) for k, v in public.items()])])
    envelope = next(t for t in response.output_tensors() if t.name() == "ENVELOPE")
    digest = Envelope.open(
        bytes(envelope.as_numpy().reshape(-1)[0]), model.stage.sealer, Freshness()
    ).digest
    assert digest is not None
    for _, store in model.stage.cache.cache.stores():
        store.put(digest, CacheEntry(ANSWER, created_s=time.time()))


def count_opcodes(
    ensemble: Ensemble, inputs: Sequence[dict[str, np.ndarray]], requests: int
) -> dict[str, float]:
    """Bytecode instructions the interpreter runs per hit in each step (its model's `execute`
    and everything it calls on the request's thread), over `requests` untimed hits: a count
    that a shared machine's noise does not move, where the timings above move by several
    percent. Python code only: C work (numpy, the HMAC, LMDB) counts nothing here."""
    counts = dict.fromkeys(ensemble.models, 0)
    current: list[str] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[current[0]] += 1
        return trace

    saved = {name: model.execute for name, model in ensemble.models.items()}

    def traced(name: str, execute: Any) -> Any:
        def run(requests: list[Any]) -> Any:
            current[:] = [name]
            before = sys.gettrace()  # a debugger's or coverage's, put back after
            sys.settrace(trace)
            try:
                return execute(requests)
            finally:
                sys.settrace(before)

        return run

    try:
        for name, model in ensemble.models.items():
            model.execute = traced(name, saved[name])
        for i in range(requests):
            ensemble.run(inputs[i % len(inputs)], timed=False)
    finally:
        for name, model in ensemble.models.items():
            model.execute = saved[name]
    return {name: count / requests for name, count in counts.items()}


def shown(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="exact hits per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--distinct",
        type=int,
        default=1,
        help="distinct cached prompts the hits cycle through (1: one prompt, served from the "
        "stages' memos after its first time; up to 4,096, the memos' entries, the same once "
        "each was asked (the sealed envelopes and llm's hits while their envelope's one-minute "
        "issue step lasts); more: a part of them (a memo keeps two generations of 4,096: about "
        "half of the hits at 6,000), the others do their whole work)",
    )
    parser.add_argument(
        "--evict-mib",
        type=int,
        default=0,
        help="before each step (outside its timer), read this many MiB to evict the CPU caches, "
        "as a hop between processes does (0: not; 16 is past a 2-core VM's caches)",
    )
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N")
    parser.add_argument(
        "--opcodes",
        type=int,
        default=0,
        help="also count the bytecode instructions per hit of each step over this many more "
        "hits (at most --requests), traced: noise-free, where timings are not",
    )
    args = parser.parse_args(argv)
    if args.distinct < 1 or args.requests < 1 or args.rounds < 1:
        parser.error("--distinct, --requests and --rounds must be at least 1")
    if not 0 <= args.evict_mib <= 1024:
        parser.error("--evict-mib must be between 0 and 1024")
    with stand_in():
        return run(args, argv)


@contextlib.contextmanager
def stand_in() -> Iterator[None]:
    """The pb_utils stand-in as `triton_python_backend_utils` (the model.py files import it by
    name), and the secret file's variable, put back as they were after (this runs inside the
    tests' process too)."""
    saved = sys.modules.get("triton_python_backend_utils"), os.environ.get(SECRET_FILE_ENV)
    sys.modules["triton_python_backend_utils"] = pb
    try:
        yield
    finally:
        if saved[0] is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved[0]
        if saved[1] is None:
            os.environ.pop(SECRET_FILE_ENV, None)
        else:
            os.environ[SECRET_FILE_ENV] = saved[1]


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    steps = ensemble_steps((MODEL_REPOSITORY / "ensemble" / "config.pbtxt").read_text())
    with tempfile.TemporaryDirectory(prefix="tiercache-hit-path-") as tmp:
        ensemble = Ensemble(steps, Path(tmp) / "tiercache")
        floor = Ensemble(steps, Path(tmp) / "floor", floor=True)
        if args.evict_mib:
            ensemble.evict = floor.evict = np.ones(args.evict_mib << 20, dtype=np.uint8)
        try:
            prompts = (
                [PROMPT]
                if args.distinct == 1
                else [f"{PROMPT} (variant {i})" for i in range(args.distinct)]
            )
            inputs = [public_inputs(p) for p in prompts]
            for public in inputs:
                cache_the_answer(ensemble, public)
            for public in (inputs[0], inputs[-1]):
                final = ensemble.run(public, timed=False)
                status = final["CACHE_STATUS"].reshape(-1)[0]
                if status != b"exact":
                    raise SystemExit(f"error: the request is not an exact hit ({status!r})")
            runs = {"tiercache": ensemble, "floor": floor}
            for which in runs.values():  # each warmed alike: one pass over the prompts
                for public in inputs:
                    which.run(public, timed=False)
            per_round: dict[str, dict[str, list[float]]] = {
                name: {step.model: [] for step in steps} for name in runs
            }
            for round_no in range(args.rounds):  # interleaved, the order turning each round
                order = list(runs.items()) if round_no % 2 == 0 else list(runs.items())[::-1]
                for name, which in order:
                    which.seconds = dict.fromkeys(which.seconds, 0.0)
                    for i in range(args.requests):
                        which.run(inputs[i % len(inputs)])
                    which.flush_metrics()
                    for model, seconds in which.seconds.items():
                        per_round[name][model].append(seconds * 1e6 / args.requests)
            print(f"`{invocation('tiercache_dev.bench.hit_path', argv)}`")
            print(
                f"{args.requests} exact hits per round"
                + (f" over {args.distinct} distinct prompts" if args.distinct > 1 else "")
                + f", median of {args.rounds} rounds\n"
            )
            print("| step | tiercache us per hit (range) | floor us per hit (range) | added |")
            print("|---|---:|---:|---:|")
            for model in per_round["tiercache"]:
                ours, theirs = per_round["tiercache"][model], per_round["floor"][model]
                print(
                    f"| {model} | {shown(ours)} | {shown(theirs)} | "
                    f"{statistics.median(ours) - statistics.median(theirs):.1f} |"
                )
            totals = {
                name: [sum(v[i] for v in per_round[name].values()) for i in range(args.rounds)]
                for name in runs
            }
            added = statistics.median(totals["tiercache"]) - statistics.median(totals["floor"])
            print(
                f"| all steps | {shown(totals['tiercache'])} | {shown(totals['floor'])} | "
                f"{added:.1f} |"
            )
            if args.opcodes:
                requests = min(args.requests, args.opcodes)
                counted = {
                    name: count_opcodes(which, inputs, requests) for name, which in runs.items()
                }
                print(
                    f"\nBytecode instructions per hit (sys.settrace, {requests} hits; the "
                    "stand-in pb_utils's own counted alike in both)\n"
                )
                print("| step | tiercache | floor | added |")
                print("|---|---:|---:|---:|")
                for model in counted["tiercache"]:
                    ours, theirs = counted["tiercache"][model], counted["floor"][model]
                    print(f"| {model} | {ours:.0f} | {theirs:.0f} | {ours - theirs:.0f} |")
                ours, theirs = sum(counted["tiercache"].values()), sum(counted["floor"].values())
                print(f"| all steps | {ours:.0f} | {theirs:.0f} | {ours - theirs:.0f} |")
            if args.profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for i in range(args.requests):
                    ensemble.run(inputs[i % len(inputs)])
                profiler.disable()
                print()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        finally:
            ensemble.close()
            floor.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
