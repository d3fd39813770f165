"""Many concurrent misses through a real tritonserver; reports whether a stage process died.

Usage::

    python -m tiercache_dev.diagnostics.stress_llm_streams [--engine-streams N]
        [--concurrency 16] [--duration 270]

Starts tritonserver on a copy of model_repository/ (fresh state dir; `llm`'s `engine_streams`
set to N when given, else the committed default), then `--concurrency` client threads send
short prompts (max_tokens 1-6, four tenants; mostly misses, some repeats) for `--duration`
seconds. Every 5 s it prints the requests answered and failed and whether a Python-backend stub
died (tritonserver does not restart one: docs/faults.md). Exit code 1 if a stub died, else 0.

Before tiercache.triton.bls.StreamKeeper, Triton 2.51's Python stub died under this load (heap
corruption from a bug in its decoupled BLS cleanup; `tiercache_dev.diagnostics.repro_bls_streams`
isolates it): after 155 s in one run; with the keeper, 600 s and 2,240 answers without a death
(docs/faults.md). Run it with `ulimit -c unlimited` to get a core dump of a stub that dies (in the
working directory).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tiercache.server import StageWatch, copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.console import exit_on_sigterm
from tiercache_dev.paths import MODEL_REPOSITORY
from tiercache_dev.servers import TritonServer, running, triton

TOPICS = ("cats", "dogs", "rain", "tea", "maps", "trains", "bread", "clocks")


def drive(
    server: TritonServer,
    threads: list[threading.Thread],
    stop: threading.Event,
    status: Callable[[], str],
    join_timeout_s: float = 130.0,
) -> bool:
    """Start the client `threads` and, every 5 s until they end, print the seconds so far,
    `status()` and any stage process that died; at the first death, or at the end, set `stop`,
    stop the server and join the threads. True (after saying so) if a stage process died."""
    watch = StageWatch(server)
    watch.reset()
    for thread in threads:
        thread.start()
    started = time.monotonic()
    dead: dict[int, str] = {}
    try:
        while not dead and any(t.is_alive() for t in threads):
            time.sleep(5)
            dead = watch.dead()
            line = f"{time.monotonic() - started:6.0f} s  {status()}"
            print(line + (f"  DIED: {sorted(dead.values())}" if dead else ""), flush=True)
    finally:
        stop.set()
        server.stop()  # clients waiting on a dead stage fail now instead of at their deadline
        for thread in threads:
            thread.join(timeout=join_timeout_s)
    if dead:
        seconds = time.monotonic() - started
        print(f"a stage process died after {seconds:.0f} s; see {server.log_path}")
    return bool(dead)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-streams", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=270.0)
    args = p.parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped

    work = Path(tempfile.mkdtemp(prefix="tiercache-stress-"))
    params = {} if args.engine_streams is None else {"llm": {"engine_streams": args.engine_streams}}
    repository = copy_repository(MODEL_REPOSITORY, work / "repository", params)
    server = triton(repository, work / "state", log_path=work / "tritonserver.log")
    with running(server, ready_timeout_s=600):
        return exercise(server, args)


def exercise(server: TritonServer, args: argparse.Namespace) -> int:
    """--concurrency client threads until --duration passes or a stage process dies."""
    print(f"ready; engine_streams={args.engine_streams}; log {server.log_path}", flush=True)
    deadline = time.monotonic() + args.duration
    counts = {"ok": 0, "failed": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def client_thread(seed: int) -> None:
        rng = random.Random(seed)
        with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=120) as client:
            while not stop.is_set() and time.monotonic() < deadline:
                prompt = f"Say something about {rng.choice(TOPICS)} {rng.randint(0, 60)}."
                try:
                    client.generate_text(
                        prompt, max_tokens=rng.randint(1, 6), tenant=f"t{rng.randint(0, 3)}"
                    )
                    outcome = "ok"
                except Exception:  # noqa: BLE001 - counted; a dead stub fails every request
                    outcome = "failed"
                with lock:
                    counts[outcome] += 1

    def status() -> str:
        with lock:
            return f"answered {counts['ok']:5d}  failed {counts['failed']:4d}"

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(args.concurrency)]
    if drive(server, threads, stop, status):
        return 1
    print(f"no stage process died in {args.duration:.0f} s ({counts['ok']} answered)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
