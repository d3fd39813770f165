"""Start and stop a real `tritonserver` from the nvidia-pytriton wheel (used by `tiercache serve`,
the integration tests and the benchmarks alike)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.config import STATE_DIR_ENV

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """tritonserver is missing, failed to start or did not become ready."""


@dataclass(frozen=True, slots=True)
class TritonInstall:
    """What the nvidia-pytriton wheel ships."""

    root: Path  # .../site-packages/pytriton/tritonserver
    libs: Path  # .../site-packages/nvidia_pytriton.libs (the wheel's bundled shared libraries)

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def caches(self) -> Path:
        return self.root / "caches"

    def stub(self, version: tuple[int, int] = sys.version_info[:2]) -> Path:
        return (
            self.root
            / "python_backend_stubs"
            / f"{version[0]}.{version[1]}"
            / ("triton_python_backend_stub")
        )


def find_triton() -> TritonInstall:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("nvidia-pytriton is not installed; run `make setup`")
    package = Path(list(spec.submodule_search_locations)[0])
    install = TritonInstall(package / "tritonserver", package.parent / "nvidia_pytriton.libs")
    if not install.binary.is_file():
        raise ServerError(f"no tritonserver binary in {install.root}")
    if not install.stub().is_file():
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {sys.version}")
    return install


def prepare_backends(install: TritonInstall, dest: Path) -> Path:
    """A backends folder of our own: the Python backend plus the stub for this interpreter.
    Copies only what changed, so repeated starts are cheap."""
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    sources = [
        install.root / "backends" / "python" / "libtriton_python.so",
        install.root / "backends" / "python" / "triton_python_backend_utils.py",
        install.stub(),
    ]
    for source in sources:
        target = python_dir / source.name
        st = source.stat()
        if target.exists() and target.stat().st_size == st.st_size:
            continue
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copy2(source, tmp)
        tmp.replace(target)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> Ports:
        return cls(free_port(), free_port(), free_port())


@dataclass(slots=True)
class TritonServer:
    """One tritonserver process serving `model_repository` with the venv first on PATH."""

    model_repository: Path
    state_dir: Path
    ports: Ports = field(default_factory=Ports)
    extra_args: Sequence[str] = ()
    exit_timeout_s: int = 5
    log_path: Path | None = None
    env_overrides: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    def command(self, install: TritonInstall, backends: Path) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            f"--cache-directory={install.caches}",
            f"--http-port={self.ports.http}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            *self.extra_args,
        ]

    def environment(self, install: TritonInstall) -> dict[str, str]:
        env = dict(os.environ)
        venv_bin = str(Path(sys.executable).parent)
        # The stub process runs the first python3 on PATH: it must be this venv's.
        env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])
        # The stub links libpython3.X.so: it must be this interpreter's, not an older system copy
        # (a mismatch fails on C extensions, e.g. `_ssl ... undefined symbol _PyModule_Add`).
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in [libdir, str(install.libs), env.get("LD_LIBRARY_PATH", "")] if p
        )
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        env[STATE_DIR_ENV] = str(self.state_dir)
        env.update(self.env_overrides)
        return env

    def start(self) -> None:
        install = find_triton()
        backends = prepare_backends(install, self.state_dir / "backends")
        cmd = self.command(install, backends)
        log.info("starting %s", " ".join(cmd))
        output = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self.process = subprocess.Popen(
            cmd,
            env=self.environment(install),
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.ports.http}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(
                    f"tritonserver exited with code {self.process.returncode} before it was ready"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not ready within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (Triton's clean shutdown), then SIGKILL to the process group if it hangs.
        Stubs left behind (seen after a stub of the same server died) are killed too: they
        are in tritonserver's process group, which it leads (`start_new_session`)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers; none after a clean exit
        return self.process.returncode

    def stage_processes(self) -> dict[int, str]:
        """pid -> model name of each live Python-backend stub of this server (empty when the
        server is not running)."""
        if self.process is None or self.process.poll() is not None:
            return {}
        return stage_processes(self.process.pid)

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stage_processes(server_pid: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """pid -> model name of each live `triton_python_backend_stub` child of `server_pid`: one
    per model instance (`<repository>/<model>/1/model.py` is its first argument). A stub that
    died and was not reaped yet (a zombie) is not live. Linux only (reads /proc)."""
    stubs: dict[int, str] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces and ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != server_pid or fields[0] in ("Z", "X"):
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        if len(argv) > 1 and argv[0].endswith(b"triton_python_backend_stub"):
            model_py = Path(os.fsdecode(argv[1]))
            stubs[int(entry.name)] = model_py.parent.parent.name
    return stubs


@dataclass(slots=True)
class StageWatch:
    """Finds stage processes (Python-backend stubs) that died since the last look.

    Triton 2.51 does not restart a dead stub: every request through that stage then fails with
    "Stub process ... is not healthy" while /v2/health/ready stays green (docs/faults.md), so
    a supervisor must notice the death itself."""

    server: TritonServer
    seen: dict[int, str] = field(default_factory=dict)

    def reset(self) -> None:
        self.seen = self.server.stage_processes()

    def dead(self) -> dict[int, str]:
        """Stubs seen before and gone now (pid -> model); new ones are watched from now on."""
        alive = self.server.stage_processes()
        gone = {pid: model for pid, model in self.seen.items() if pid not in alive}
        self.seen = alive
        return gone


def copy_repository(
    source: Path, dest: Path, parameters: Mapping[str, Mapping[str, str]] | None = None
) -> Path:
    """A copy of the model repository `source` at `dest`, with `parameters` ({model: {key:
    value}}) appended to those models' config.pbtxt: for benchmarks and tests that serve a
    variant of the committed repository."""
    shutil.copytree(source, dest)
    for model, values in (parameters or {}).items():
        config = dest / model / "config.pbtxt"
        text = config.read_text()
        for key, value in values.items():
            text += f'\nparameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        config.write_text(text)
    return dest
