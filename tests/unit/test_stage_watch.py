"""Finding tritonserver's stage processes (Python-backend stubs) in /proc, and their deaths;
children tied to the supervisor that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tiercache.server import StageWatch, TritonServer, stage_processes

STUB = "/opt/backends/python/triton_python_backend_stub"


def add_process(proc: Path, pid: int, ppid: int, argv: list[str], state: str = "S") -> None:
    entry = proc / str(pid)
    entry.mkdir()
    comm = Path(argv[0]).name[:15]
    # comm may hold spaces and parentheses: the parser must split on the last ')'.
    (entry / "stat").write_text(f"{pid} ({comm} (x) y) {state} {ppid} {pid} 0 0 0\n")
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def fake_proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "self").mkdir()  # not a pid: skipped
    add_process(proc, 100, 1, ["/usr/bin/tritonserver", "--model-repository=/r"])
    add_process(proc, 101, 100, [STUB, "/r/llm/1/model.py", "shm_region", "1048576"])
    add_process(proc, 102, 100, [STUB, "/r/embedding_cache/1/model.py", "shm_region"])
    add_process(proc, 103, 100, [STUB, "/r/embedding_cache/1/model.py", "shm_region"])
    add_process(proc, 104, 100, [STUB, "/r/prompt_cache/1/model.py", "shm"], state="Z")
    add_process(proc, 105, 100, ["/bin/sh", "-c", "true"])  # a child, not a stub
    add_process(proc, 201, 200, [STUB, "/other/llm/1/model.py", "shm"])  # another server's
    return proc


def test_stage_processes_are_the_servers_live_stubs_by_model(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    assert stage_processes(100, proc) == {
        101: "llm",
        102: "embedding_cache",
        103: "embedding_cache",
    }
    assert stage_processes(200, proc) == {201: "llm"}
    assert stage_processes(999, proc) == {}


class _Server(TritonServer):
    """A TritonServer whose stage processes come from a list of snapshots (no process)."""

    def __init__(self, snapshots: list[dict[int, str]]) -> None:
        super().__init__(model_repository=Path("r"), state_dir=Path("s"))
        self.snapshots = snapshots

    def stage_processes(self, stopped: set[int] | None = None) -> dict[int, str]:
        snapshot = self.snapshots.pop(0)
        if stopped is not None:
            stopped.update(pid for pid, model in snapshot.items() if model.endswith(" (T)"))
        return snapshot


def test_stage_watch_reports_each_death_once_and_watches_new_stubs() -> None:
    server = _Server(
        [
            {1: "llm", 2: "prompt_cache"},
            {1: "llm", 2: "prompt_cache", 3: "embedding_cache"},  # a new instance: not a death
            {2: "prompt_cache", 3: "embedding_cache"},  # llm died
            {2: "prompt_cache", 3: "embedding_cache"},  # reported once only
            {2: "prompt_cache"},
        ]
    )
    watch = StageWatch(server)
    watch.reset()
    assert watch.dead() == {}
    assert watch.dead() == {1: "llm"}
    assert watch.dead() == {}
    assert watch.dead() == {3: "embedding_cache"}


def test_a_stub_stopped_by_a_signal_for_three_looks_is_dead() -> None:
    """A stage stopped with SIGSTOP (or stuck stopped) is alive in /proc and serves nothing:
    every request through it waits, and the server looks healthy. Seen stopped three looks
    in a row it counts as dead (once); stopped for a look or two (a debugger, a pause) not."""
    server = _Server(
        [
            {1: "llm", 2: "prompt_cache"},
            {1: "llm", 2: "prompt_cache (T)"},
            {1: "llm", 2: "prompt_cache"},  # resumed: the count starts again
            {1: "llm", 2: "prompt_cache (T)"},
            {1: "llm", 2: "prompt_cache (T)"},
            {1: "llm", 2: "prompt_cache (T)"},  # the third look in a row
            {1: "llm", 2: "prompt_cache (T)"},
        ]
    )
    watch = StageWatch(server)
    watch.reset()
    assert [watch.dead() for _ in range(5)] == [{}, {}, {}, {}, {2: "prompt_cache (T)"}]
    assert watch.dead() == {}  # reported once


def test_stage_processes_names_the_stopped_ones(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    add_process(proc, 106, 100, [STUB, "/r/lora_cache/1/model.py", "shm"], state="T")
    stopped: set[int] = set()
    assert stage_processes(100, proc, stopped=stopped)[106] == "lora_cache"
    assert stopped == {106}


def test_a_tied_child_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """`tiercache serve` starts tritonserver and the gateway tied to itself
    (`tied_to_this_thread`): a supervisor killed with SIGKILL, which runs no cleanup, leaves
    neither behind holding its ports. Here a parent process starts a sleeping child tied to it
    and is killed; the child goes too."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from tiercache.server import tied_to_this_thread\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
        "                         start_new_session=True, preexec_fn=tied_to_this_thread())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the tied child outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class _TritonProcess:
    """A tritonserver stand-in: `wait` returns `code` once `exits` is set, else times out."""

    def __init__(self, code: int | None = None) -> None:
        self.code = code

    @property
    def returncode(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            raise subprocess.TimeoutExpired("tritonserver", timeout or 0)
        return self.code

    def poll(self) -> int | None:
        return self.code


class _Supervised:
    """What `_supervise` drives: each start makes the next process of `processes`; each
    wait_ready raises the next of `ready_errors` (None: ready)."""

    def __init__(
        self, processes: list[_TritonProcess], ready_errors: list[Exception | None]
    ) -> None:
        self.processes = processes
        self.ready_errors = ready_errors
        self.process: _TritonProcess | None = processes.pop(0)
        self.starts = self.stops = 0

    def start(self) -> None:
        self.starts += 1
        self.process = self.processes.pop(0)

    def wait_ready(self, timeout_s: float) -> None:
        error = self.ready_errors.pop(0)
        if error is not None:
            raise error

    def stop(self) -> None:
        self.stops += 1

    def stage_processes(self, stopped: set[int] | None = None) -> dict[int, str]:
        return {}


def _supervised(
    server: _Supervised,
    max_restarts: int = 5,
    gateways: list[Any] | None = None,
    restart_gateway: Any = None,
) -> int | None:
    import argparse

    from tiercache.cli import _supervise

    args = argparse.Namespace(
        watch_interval_s=0.01, restart=True, max_restarts=max_restarts, ready_timeout=1.0
    )
    watch = StageWatch(server)  # type: ignore[arg-type]
    watch.reset()
    return _supervise(server, args, watch, gateways, restart_gateway)  # type: ignore[arg-type]


def test_a_failed_tritonserver_is_restarted_and_a_failed_restart_tried_again() -> None:
    """tritonserver itself failing (a stub that died holding its IPC mutex aborts it) was the
    end of `tiercache serve`, as was a restart that did not come up: both are restarts now,
    counted against --max-restarts; a clean exit (0) still ends the supervision."""
    from tiercache.server import ServerError

    server = _Supervised(
        [_TritonProcess(134), _TritonProcess(1), _TritonProcess(0)],
        [ServerError("not ready within 1 s"), None],
    )
    assert _supervised(server) == 0
    assert server.starts == 2  # the failed start, then the one that came up
    given_up = _Supervised(
        [_TritonProcess(134), _TritonProcess(134), _TritonProcess(134)], [None, None]
    )
    assert _supervised(given_up, max_restarts=2) is None
    assert given_up.starts == 2


def test_a_gateway_that_exits_is_started_again_and_counts_as_a_restart() -> None:
    """The OpenAI gateway was started and never watched: dead (OOM, a crash), the endpoint
    stayed down while serve said it was ready. It is started again now, counted against
    --max-restarts; a start that fails is tried at the next look."""
    from tiercache.server import ServerError

    server = _Supervised([_TritonProcess(None)], [])
    gateways = [_TritonProcess(137)]  # exited
    starts: list[int] = []

    def restart_gateway() -> Any:
        starts.append(len(starts))
        if len(starts) == 1:
            raise ServerError("the gateway did not listen within 60 s")
        gateways[:] = [_TritonProcess(None)]  # up
        server.process = _TritonProcess(0)  # and the server ends cleanly: supervision ends
        return gateways[0]

    assert _supervised(server, gateways=gateways, restart_gateway=restart_gateway) == 0
    assert starts == [0, 1]
    given_up = _Supervised([_TritonProcess(None)], [])
    assert _supervised(given_up, 2, [_TritonProcess(1)], lambda: None) is None
    assert given_up.stops == 1


def test_a_restart_whose_start_raises_oserror_is_tried_again() -> None:
    """A fork that failed (ENOMEM, EAGAIN) raised OSError out of the restart loop, which ended
    serve whatever --max-restarts said; it is a failed restart now, tried again after a pause."""

    class _ForkFails(_Supervised):
        def start(self) -> None:
            if self.starts == 0:
                self.starts += 1
                raise OSError(12, "Cannot allocate memory")
            super().start()

    server = _ForkFails([_TritonProcess(134), _TritonProcess(0)], [None])
    assert _supervised(server) == 0
    assert server.starts == 2


def test_free_ports_are_three_distinct_ones() -> None:
    """Each probe socket closed before the next was bound, the kernel could hand one port out
    twice: Triton then failed to bind, or two front ends shared a port."""
    from tiercache.server import Ports

    for _ in range(50):
        ports = Ports.free()
        assert len({ports.http, ports.grpc, ports.metrics}) == 3
