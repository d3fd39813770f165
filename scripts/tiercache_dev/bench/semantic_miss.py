"""The embedding_cache stage's miss-path overhead inside Triton, against a generation.

Usage::

    python -m tiercache_dev.bench.semantic_miss [--prompts 300] [--rounds 10] [--generations 5]
        [--max-tokens 32] [--scope-rows 10000] [--model-repository DIR]

Starts a real tritonserver on the repository's model_repository (free loopback ports, a
temporary state dir of its own, removed at the end), then in one run, one request at a time:

1. `embedding_cache` called directly over gRPC with the inputs prompt_cache sends it on an exact
   miss: REQUEST (a GenerationRequest's JSON), CACHED_TEXT "", LOOKUP_STATUS "miss", SCOPE and
   SEMANTIC_LOOKUP true. Every prompt is new, so each lookup embeds it (a BLS call to
   `embedder`), stores its vector and searches a scope of `--scope-rows` rows (written into the
   state dir before the start: random unit vectors, so no candidate passes the similarity floor
   and every lookup is a miss, checked); the same in an empty scope (no search cost); and with
   SEMANTIC_LOOKUP false: the stage passes its inputs through, the floor of any Python step
   (gRPC, scheduling, IPC).
2. `embedder` called directly with new texts: the part of (1) that is the embedding.
   These four rows run in `--rounds` rounds of short blocks, so that load from elsewhere on a
   shared machine falls on all of them alike.
3. Greedy generations through `ensemble` over the gRPC stream, `cache_control` "no-cache" (no
   cache lookup, no write), new prompts, `--max-tokens` tokens: the time to the final response.

Prints client-side p50/p99 per row, Triton's own mean compute time per request for each model
and, for lookups, the embedder's compute and queue time on the stage's BLS calls (statistics
API), then the stage's p50 against a generation's. Only figures from one run mean anything on a
shared machine.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from tiercache.config import EmbeddingCacheConfig
from tiercache.exact.request import GenerationRequest
from tiercache.semantic.store import SemanticStore
from tiercache.stages.envelope import Envelope
from tiercache.stages.parts import open_sealer
from tiercache.stages.seal import EMBED_LABEL, Sealer
from tiercache.vocabulary import CacheStatus
from tiercache_dev.console import exit_on_sigterm, invocation
from tiercache_dev.paths import MODEL_REPOSITORY
from tiercache_dev.servers import running, triton
from tiercache_dev.stats import percentile

DIMENSIONS = 384  # all-MiniLM-L6-v2
SCOPE = "bench-semantic-miss"
EMPTY_SCOPE = "bench-semantic-miss-empty"

QUESTIONS = [
    "How do I {verb} a {noun} when I am {place}?",
    "What is the fastest way to {verb} a {noun} {place}?",
    "Can you explain how to {verb} an old {noun} {place}?",
    "Why does it take so long to {verb} a {noun} {place}?",
    "Give me three tips to {verb} a {noun} {place}.",
]
VERBS = ["repair", "clean", "paint", "sell", "insure", "ship", "photograph", "store"]
NOUNS = ["bicycle", "piano", "laptop", "sofa", "guitar", "kayak", "camera", "tent", "lamp", "rug"]
PLACES = ["at home", "in winter", "on a budget", "in a small flat", "abroad", "in a hurry"]


class PromptSource:
    """Distinct, natural questions, each handed out once (every lookup is on a new prompt)."""

    def __init__(self) -> None:
        combos = [
            q.format(verb=v, noun=n, place=p)
            for q in QUESTIONS
            for v in VERBS
            for n in NOUNS
            for p in PLACES
        ]
        order = np.random.default_rng(0).permutation(len(combos))
        self._left = [combos[i] for i in order]

    def take(self, count: int) -> list[str]:
        if count > len(self._left):
            raise SystemExit(f"only {len(self._left)} more distinct prompts; ask for fewer")
        taken, self._left = self._left[:count], self._left[count:]
        return taken


def progress(label: str, done: int, total: int) -> None:
    end = "\n" if done == total else ""
    print(f"\r  {label}: {done}/{total}", end=end, file=sys.stderr, flush=True)


def bytes_input(name: str, values: list[str]) -> grpcclient.InferInput:
    array = np.array([[v.encode("utf-8")] for v in values], dtype=np.object_)
    tensor = grpcclient.InferInput(name, list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    return tensor


def typed_input(name: str, value: Any, datatype: str, dtype: Any) -> grpcclient.InferInput:
    array = np.array([[value]], dtype=dtype)
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def stage_inputs(
    sealer: Sealer, prompt: str, max_tokens: int, lookup: bool, scope: str = SCOPE
) -> list[grpcclient.InferInput]:
    """What prompt_cache hands embedding_cache for an exact miss of `prompt`, sealed under the
    server's secret (read from its state folder) as prompt_cache seals it."""
    envelope = Envelope(
        request=GenerationRequest(prompt, max_tokens=max_tokens),
        status=CacheStatus.MISS,
        semantic_scope=scope,
        semantic_lookup=lookup,
    )
    return [
        bytes_input("ENVELOPE", [envelope.seal(sealer).decode()]),
        bytes_input("CACHED_TEXT", [""]),
    ]


def timed(call: Callable[[str], None], item: str) -> float:
    started = time.perf_counter()
    call(item)
    return (time.perf_counter() - started) * 1e3


COMPUTE = ("compute_input", "compute_infer", "compute_output")


class ModelStats:
    """Triton's cumulative per-model times (statistics API), read before and after a phase."""

    def __init__(self, client: grpcclient.InferenceServerClient, model: str) -> None:
        self.client, self.model = client, model
        self._start = self._read()

    def _read(self) -> tuple[dict[str, int], int]:
        stats = self.client.get_inference_statistics(model_name=self.model, as_json=True)
        total_ns: dict[str, int] = {}
        count = 0
        for model in stats.get("model_stats", []):
            infer = model.get("inference_stats", {})
            count += int(infer.get("success", {}).get("count", 0))
            for part, value in infer.items():
                total_ns[part] = total_ns.get(part, 0) + int(value.get("ns", 0))
        return total_ns, count

    def spent(self, parts: tuple[str, ...] = COMPUTE) -> tuple[int, int]:
        """Nanoseconds in `parts` and requests served since construction."""
        total_ns, count = self._read()
        ns = sum(total_ns.get(p, 0) - self._start[0].get(p, 0) for p in parts)
        return ns, count - self._start[1]


@dataclass(slots=True)
class Phase:
    """One row of the report, gathered over all rounds."""

    label: str
    model: str
    call: Callable[[str], None]
    times_ms: list[float] = field(default_factory=list)
    compute_ns: int = 0
    requests: int = 0
    bls_compute_ns: int = 0  # the embedder's time on this phase's BLS calls
    bls_queue_ns: int = 0
    bls_requests: int = 0

    def mean_ms(self, ns: int, count: int) -> float:
        return ns / count / 1e6 if count else float("nan")


def generate(client: grpcclient.InferenceServerClient, prompt: str, max_tokens: int) -> str:
    """One greedy, uncached generation through `ensemble` over the stream; its full text."""
    results: queue.Queue = queue.Queue()
    inputs = [
        bytes_input("text_input", [prompt]),
        typed_input("max_tokens", max_tokens, "INT32", np.int32),
        bytes_input("cache_control", ["no-cache"]),
    ]
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        text: list[str] = []
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                raise RuntimeError(f"generation failed: {error}")
            chunk = result.as_numpy("text_output")
            if chunk is not None:
                text.extend(c.decode("utf-8") for c in chunk.reshape(-1))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "".join(text)
    finally:
        client.stop_stream()


def fill_scope(state_dir: Path, rows: int) -> None:
    """`rows` random unit vectors in the benchmark's scope (no answers: never a hit)."""
    if rows <= 0:
        return
    store = SemanticStore(EmbeddingCacheConfig(state_dir=str(state_dir)).semantic_path())
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((rows, DIMENSIONS)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for start in range(0, rows, 10_000):
        stop = min(rows, start + 10_000)
        store.append_many(
            [(SCOPE, f"bench-{i}", f"stored prompt {i}", vectors[i]) for i in range(start, stop)]
        )
    store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=300, help="new prompts per row")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--generations", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--scope-rows", type=int, default=10_000)
    parser.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    args = parser.parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped
    if not 1 <= args.generations <= len(NOUNS):
        parser.error(f"--generations must be 1 to {len(NOUNS)}")
    began = time.monotonic()
    state_dir = Path(tempfile.mkdtemp(prefix="tiercache-semantic-miss-"))
    fill_scope(state_dir, args.scope_rows)
    server = triton(args.model_repository.resolve(), state_dir, log_path=state_dir / "triton.log")
    print(f"starting tritonserver on {args.model_repository} (first start: about a minute)")
    try:
        with running(server, ready_timeout_s=600):
            print(f"  ready after {time.monotonic() - began:.0f} s", flush=True)
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
            report = measure(client, args, open_sealer(state_dir))
            client.close()
    except BaseException:
        print(f"server log: {state_dir / 'triton.log'}", file=sys.stderr)
        raise
    shutil.rmtree(state_dir, ignore_errors=True)
    print_report(report, args, time.monotonic() - began)
    return 0


def measure(
    client: grpcclient.InferenceServerClient, args: argparse.Namespace, sealer: Sealer
) -> dict[str, Any]:
    statuses: dict[str, int] = {}

    def lookup(prompt: str, scope: str = SCOPE) -> None:
        result = client.infer(
            "embedding_cache", stage_inputs(sealer, prompt, args.max_tokens, True, scope)
        )
        status = result.as_numpy("ANSWER_STATUS").reshape(-1)[0].decode()
        statuses[status] = statuses.get(status, 0) + 1
        if result.as_numpy("EMBEDDING").shape[-1] != DIMENSIONS:
            raise RuntimeError("the lookup returned no vector: the prompt was not embedded")

    def pass_through(prompt: str) -> None:
        client.infer("embedding_cache", stage_inputs(sealer, prompt, args.max_tokens, False))

    def embed(text: str) -> None:  # sealed as embedding_cache seals it (an internal stage)
        seal = sealer.seal(EMBED_LABEL, text.encode("utf-8"))
        client.infer("embedder", [bytes_input("TEXT", [text]), bytes_input("TEXT_SEAL", [seal])])

    prompts = PromptSource()
    print("warming up (not counted)", flush=True)
    for prompt in prompts.take(10):
        lookup(prompt)
        pass_through(prompt)
    for prompt in prompts.take(10):
        embed(prompt)
    generate(client, "Say hello.", 4)
    statuses.clear()

    phases = [
        Phase("embedding_cache, lookup on a new prompt", "embedding_cache", lookup),
        Phase(
            "embedding_cache, lookup on a new prompt, empty scope",
            "embedding_cache",
            lambda prompt: lookup(prompt, EMPTY_SCOPE),
        ),
        Phase("embedding_cache, pass-through (no lookup)", "embedding_cache", pass_through),
        Phase("embedder alone, a new text", "embedder", embed),
    ]
    # Rounds of short blocks, so that load from elsewhere on the machine falls on every row
    # alike; a block per model keeps Triton's per-model statistics apart.
    per_round = max(1, args.prompts // args.rounds)
    for r in range(args.rounds):
        for phase in phases:
            stats, bls = ModelStats(client, phase.model), ModelStats(client, "embedder")
            phase.times_ms += [timed(phase.call, p) for p in prompts.take(per_round)]
            ns, count = stats.spent()
            phase.compute_ns, phase.requests = phase.compute_ns + ns, phase.requests + count
            if phase.model == "embedding_cache":
                ns, count = bls.spent()
                phase.bls_compute_ns += ns
                phase.bls_requests += count
                phase.bls_queue_ns += bls.spent(("queue",))[0]
        progress("rounds of lookups, pass-throughs and embeddings", r + 1, args.rounds)
    lookups = 2 * per_round * args.rounds
    if statuses != {"miss": lookups}:
        raise RuntimeError(f"every lookup should be a miss, got {statuses}")

    lengths = []

    def one_generation(prompt: str) -> None:
        lengths.append(len(generate(client, prompt, args.max_tokens)))

    generation_ms = []
    for i, noun in enumerate(NOUNS[: args.generations]):
        generation_ms.append(timed(one_generation, f"Write two sentences about a {noun}."))
        progress(f"greedy generations of {args.max_tokens} tokens", i + 1, args.generations)
    return {"phases": phases, "generation_ms": generation_ms, "lengths": lengths}


def print_report(report: dict[str, Any], args: argparse.Namespace, elapsed_s: float) -> None:
    phases: list[Phase] = report["phases"]
    generation_ms: list[float] = report["generation_ms"]
    cmd = invocation("tiercache_dev.bench.semantic_miss")
    print(f"\n## embedding_cache miss path inside Triton, {args.scope_rows:,} rows in the scope\n")
    print(
        f"- command: `{cmd}`; {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; one request "
        f"at a time over gRPC, in {args.rounds} rounds of every row; run took {elapsed_s:.0f} s"
    )
    print(
        "\n| call | n | p50 ms | p99 ms | Triton compute mean ms | of which embedder via BLS:"
        " compute / queue mean ms |\n|---|---:|---:|---:|---:|---:|"
    )
    for phase in phases:
        p50, p99 = percentile(phase.times_ms, 50), percentile(phase.times_ms, 99)
        compute = phase.mean_ms(phase.compute_ns, phase.requests)
        bls = (
            f"{phase.mean_ms(phase.bls_compute_ns, phase.bls_requests):.2f} / "
            f"{phase.mean_ms(phase.bls_queue_ns, phase.bls_requests):.2f}"
            if phase.bls_requests
            else ""
        )
        print(
            f"| {phase.label} | {len(phase.times_ms)} | {p50:.2f} | {p99:.2f} | {compute:.2f} "
            f"| {bls} |"
        )
    gen_p50 = percentile(generation_ms, 50)
    print(
        f"| ensemble, greedy generation, max_tokens {args.max_tokens}, no-cache "
        f"| {len(generation_ms)} | {gen_p50:.1f} | {max(generation_ms):.1f} (max) | | |"
    )
    stage_p50 = percentile(phases[0].times_ms, 50)
    added_p50 = stage_p50 - percentile(phases[2].times_ms, 50)
    print(
        f"\n- generated text: {min(report['lengths'])} to {max(report['lengths'])} characters"
        f"\n- the stage on a miss (p50) / a generation (p50): "
        f"{stage_p50:.2f} / {gen_p50:.1f} ms = {100 * stage_p50 / gen_p50:.2f} %"
        f"\n- added by the lookup over the pass-through floor (p50): "
        f"{added_p50:.2f} ms = {100 * added_p50 / gen_p50:.2f} % of a generation"
    )


if __name__ == "__main__":
    sys.exit(main())
