"""A disk squeeze through a real tritonserver (issue 20): the server's state directory on a small
filesystem that another writer fills while requests go on; the server keeps answering and its
exact hits, L2 turns over inside its file instead of growing or failing, and what L2 held
last is still served after a restart.

Usage (root: it mounts a tmpfs)::

    python -m tiercache_dev.perf.disk_serve [--size-mib 1024] [--headroom-mib 512]
        [--phase-s 45] [--out-dir .perf/disk_serve]

1. Mounts a tmpfs of `--size-mib` and starts tritonserver on `make serve`'s repository with its
   state directory there (the converted weights stay where they are, linked) and
   `disk_headroom_bytes` `--headroom-mib` on the stages that watch the disk (512 MiB: the
   default).
2. A client sends requests without pause: a new prompt (a miss: the engine answers and llm
   writes the answer to L2, where prompt_cache finds it), then the prompt before it again (an
   exact hit, if its answer reached L2).
3. Phases of `--phase-s` each: `room`; `short` (a filler file takes the disk until 3/4 of the
   headroom is left: L2 turns over inside its file); `critical` (1/4 left: inside half of
   it, and llm logs no new semantic row); `full` (the filler takes every free byte: every
   writer on that disk, not only L2, meets a full disk: L2 must find room inside its file);
   `room again` (the filler deleted).
4. The server is stopped and started again on the same state directory (L1 empty: what
   answers exactly now comes from L2) and asked, for each phase, up to `--recheck` of the
   prompts first answered in it.

Per phase it records the requests and those that failed, the exact hits, the sizes of L2's
file and the semantic row log's, llm's failed writes (an answer or its row), the answers L2
did not store for want of disk (`tiercache_cache_rejected_total{tier="l2"}`), the semantic rows
not logged (`tiercache_semantic_rows_skipped_total`), the prompt vectors kept out of L2, the
least free disk seen, and after the restart how many of the phase's answers L2 served (an
answer written earlier may have been turned over since: L2 keeps its file's size while the
disk is short). Writes `disk_serve.md` and `disk_serve.json` to `--out-dir`; exit code 1 when
a request failed, a server process died, fewer than 9 in 10 repeats of a phase were exact
hits, llm failed a write, L2's file grew after `short` (or past twice its size in `room`: its
first eviction copies the tree once), the row log grew while `critical`
(from 2 s in: the stages read the disk at most once a second), or the last phase's answers
(written with room again) were not all served from L2 after the restart.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercache.machine import read_disk
from tiercache.server import copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.console import invocation, progress
from tiercache_dev.metrics import Sample, scrape_metrics
from tiercache_dev.paths import DEFAULT_STATE_DIR, MODEL_REPOSITORY, PERF_DIR
from tiercache_dev.perf.disk_squeeze import fill, tmpfs
from tiercache_dev.perf.soak import labelled_processes
from tiercache_dev.perf.squeeze import gone
from tiercache_dev.servers import fresh_state, running, triton

MIB = 1 << 20
# the stages that watch the disk: L2 (all three), the prompt vectors' L2, the semantic rows (llm)
STAGES = ("prompt_cache", "embedding_cache", "llm")
PHASES = ("room", "short", "critical", "full", "room again")
MAX_TOKENS = 4


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="the tmpfs's size")
    parser.add_argument("--headroom-mib", type=int, default=512, help="disk_headroom_bytes")
    parser.add_argument("--phase-s", type=float, default=45.0, help="each phase's length")
    parser.add_argument(
        "--recheck", type=int, default=12, help="prompts per phase asked after the restart"
    )
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--out-dir", type=Path, default=PERF_DIR / "disk_serve")
    return parser.parse_args(argv)


def prompt(number: int) -> str:
    """A short new prompt (no two alike), so a miss costs the engine little."""
    return f"Question {number}: name one colour and one number below {number % 97 + 3}."


class Client(threading.Thread):
    """New prompt, then the one before it again, until `done`; each request's phase, status and
    outcome in `results`, each new prompt's phase in `first_phase`."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.phase = PHASES[0]
        self.done = threading.Event()
        self.results: list[dict[str, Any]] = []
        self.first_phase: dict[int, str] = {}
        self.errors: list[str] = []

    def ask(self, client: TierCacheClient, number: int, repeat: bool = False) -> None:
        phase, begun = self.phase, time.monotonic()
        try:
            result = client.generate_text(prompt(number), max_tokens=MAX_TOKENS)
            status = result.cache_status
        except Exception as exc:  # noqa: BLE001 - counted: a failed request fails the run
            status = "failed"
            if len(self.errors) < 5:
                self.errors.append(f"{phase}: {exc}"[:300])
        self.results.append(
            {
                "phase": phase,
                "repeat": repeat,
                "status": status,
                "latency_s": time.monotonic() - begun,
            }
        )

    def run(self) -> None:
        with TierCacheClient(f"127.0.0.1:{self.port}", timeout_s=120) as client:
            number = 0
            while not self.done.is_set():
                number += 1
                self.first_phase[number] = self.phase
                self.ask(client, number)
                if number > 1:
                    self.ask(client, number - 1, repeat=True)


COUNTERS = {
    "write_failures": "tiercache_llm_write_failures_total",
    "l2_rejected": "tiercache_cache_rejected_total",  # tier l2 only (below)
    "rows_skipped": "tiercache_semantic_rows_skipped_total",
    "vector_l2_skipped": "tiercache_vector_l2_skipped_total",
}


def disk_counters(samples: list[Sample]) -> dict[str, float]:
    """llm's failed writes (an answer or its row), the answers L2 did not store for want of
    disk (llm's and prompt_cache's), the semantic rows llm did not log, and the prompt vectors
    kept out of L2."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for name, labels, value in samples:
        for key, metric in COUNTERS.items():
            if name == metric and (key != "l2_rejected" or labels.get("tier") == "l2"):
                out[key] += value
    return out


def mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.2f}"


def file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


SETTLE_S = 2.0  # past the stages' disk readings (at most one a second) after a phase begins


def serve_phases(
    args: argparse.Namespace, server: Any, mount: Path, state: Path
) -> tuple[Client, list[dict[str, Any]], list[int]]:
    filler = mount / "filler"
    files = {"l2": state / "l2" / "data.mdb", "rows": state / "semantic" / "data.mdb"}
    headroom = args.headroom_mib * MIB
    labels: dict[int, str] = {}
    pids = {p.pid for _, p in labelled_processes(server.process.pid, labels)}
    client = Client(server.ports.grpc)
    client.start()
    rows = []
    leave = {"short": 3 * headroom // 4, "critical": headroom // 4, "full": 0}
    for phase in PHASES:
        if phase in leave:
            fill(filler, mount, leave[phase])
        elif filler.exists():
            filler.unlink()
        client.phase = phase
        before = disk_counters(scrape_metrics(server.ports.metrics))
        least_free = read_disk(mount).free_bytes
        progress(f"  {phase}: {least_free / MIB:.0f} MiB free")
        begun = time.monotonic()
        ends, settled = begun + args.phase_s, None
        while time.monotonic() < ends:
            least_free = min(least_free, read_disk(mount).free_bytes)
            if settled is None and time.monotonic() >= begun + SETTLE_S:
                settled = {name: file_bytes(path) for name, path in files.items()}
            time.sleep(0.5)
        after = disk_counters(scrape_metrics(server.ports.metrics))
        rows.append(
            {
                "phase": phase,
                "least_free_mib": round(least_free / MIB, 1),
                "settled": settled or {},
                "end": {name: file_bytes(path) for name, path in files.items()},
                **{k: int(after[k] - before[k]) for k in after},
            }
        )
    client.done.set()
    client.join(timeout=150)
    alive = {p.pid for _, p in labelled_processes(server.process.pid, labels) if not gone(p)}
    return client, rows, sorted(pids - alive)


def recheck(port: int, first_phase: dict[int, str], per_phase: int) -> dict[str, list[int]]:
    """After the restart: per phase, [asked, served exactly, failed] of the prompts first
    answered in it (its earliest and latest)."""
    out: dict[str, list[int]] = {}
    with TierCacheClient(f"127.0.0.1:{port}", timeout_s=120) as client:
        for phase in PHASES:
            numbers = [n for n, p in first_phase.items() if p == phase]
            half = per_phase // 2
            chosen = numbers if len(numbers) <= per_phase else numbers[:half] + numbers[-half:]
            counts = [0, 0, 0]
            for number in chosen:
                counts[0] += 1
                try:
                    result = client.generate_text(prompt(number), max_tokens=MAX_TOKENS)
                    counts[1] += result.cache_status == "exact"
                except Exception:  # noqa: BLE001 - counted
                    counts[2] += 1
            out[phase] = counts
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with (
        tmpfs(args.size_mib * MIB, "tiercache-disk-serve-") as mount,
        tempfile.TemporaryDirectory(prefix="tiercache-disk-serve-") as tmp,
    ):
        params = {"disk_headroom_bytes": str(args.headroom_mib * MIB)}
        repository = copy_repository(
            MODEL_REPOSITORY, Path(tmp) / "repository", {s: dict(params) for s in STAGES}
        )
        state = fresh_state(mount, args.state_dir)
        server = triton(repository, state, log_path=args.out_dir / "server.log")
        progress(f"starting tritonserver, its state on a {args.size_mib} MiB tmpfs")
        with running(server, ready_timeout_s=400):
            client, rows, lost = serve_phases(args, server, mount, state)
        (mount / "filler").unlink(missing_ok=True)
        progress("restarting on the same state directory")
        again = triton(repository, state, log_path=args.out_dir / "server-restart.log")
        with running(again, ready_timeout_s=400):
            served = recheck(again.ports.grpc, client.first_phase, args.recheck)
    return report(args, client, rows, lost, served)


def report(
    args: argparse.Namespace,
    client: Client,
    rows: list[dict[str, Any]],
    lost: list[int],
    served: dict[str, list[int]],
) -> int:
    for row in rows:
        mine = [r for r in client.results if r["phase"] == row["phase"]]
        row["requests"] = len(mine)
        row["failed"] = sum(r["status"] == "failed" for r in mine)
        row["exact"] = sum(r["status"] == "exact" for r in mine)
        row["repeats"] = sum(r["repeat"] for r in mine)
        row["after_restart"] = served.get(row["phase"], [0, 0, 0])
    (args.out_dir / "disk_serve.json").write_text(
        json.dumps(
            {
                "phases": rows,
                "requests": client.results,
                "lost_pids": lost,
                "errors": client.errors,
            },
            indent=1,
        )
    )
    lines = [
        f"`{invocation('tiercache_dev.perf.disk_serve', None)}`",
        "",
        f"a {args.size_mib} MiB tmpfs, disk_headroom_bytes {args.headroom_mib} MiB, "
        f"{args.phase_s:.0f} s per phase; server processes lost: {len(lost)}",
        "",
        "| phase | least free MiB | requests | failed | exact hits / repeats | L2 file MiB "
        "| row log MiB | llm write failures | L2 rejected | semantic rows skipped "
        "| vectors' L2 skipped | after the restart: served from L2 / asked (failed) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        asked, hits, failed = row["after_restart"]
        lines.append(
            f"| {row['phase']} | {row['least_free_mib']} | {row['requests']} | {row['failed']} "
            f"| {row['exact']} / {row['repeats']} | {mib(row['end']['l2'])} "
            f"| {mib(row['end']['rows'])} | {row['write_failures']} | {row['l2_rejected']} "
            f"| {row['rows_skipped']} | {row['vector_l2_skipped']} | {hits} / {asked} ({failed}) |"
        )
    if client.errors:
        lines += ["", "First errors: " + "; ".join(client.errors)]
    (args.out_dir / "disk_serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    problems = [
        f"{r['phase']}: {what}"
        for r in rows
        for what, bad in (
            ("requests failed", r["failed"] > 0),
            ("repeats missed", r["exact"] < 0.9 * r["repeats"] or not r["repeats"]),
            ("llm failed writes", r["write_failures"] > 0),
        )
        if bad
    ]
    sizes = {r["phase"]: r for r in rows}
    # L2 grows once as the disk runs short (its first eviction's copies), then holds; the row
    # log takes rows while short, none once the stages have read the disk as critical
    l2 = [sizes["short"]["end"]["l2"], sizes["critical"]["end"]["l2"], sizes["full"]["end"]["l2"]]
    if len(set(l2)) != 1 or l2[0] > 2 * sizes["room"]["end"]["l2"] + (64 << 10):
        problems.append(f"L2's file grew while the disk was short: {l2} bytes")  # once: the tree
    log_bytes = [
        sizes["critical"]["settled"].get("rows"),
        sizes["critical"]["end"]["rows"],
        sizes["full"]["end"]["rows"],
    ]
    if len(set(log_bytes)) != 1:
        problems.append(f"the row log grew while the disk was critical: {log_bytes} bytes")
    asked, served, _ = rows[-1]["after_restart"]  # written last, with room: L2 holds them
    if not asked or served < asked:
        problems.append("the last phase's answers were not all served after the restart")
    if lost:
        problems.append(f"server processes lost: {lost}")
    for problem in problems:
        progress(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
