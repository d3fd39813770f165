"""Start and stop a real `tritonserver` from the nvidia-pytriton wheel (used by `tiercache serve`,
the integration tests and the benchmarks alike).

Safe by default (`Exposure`, docs/security.md): loopback only; gRPC and metrics, no HTTP,
SageMaker or Vertex AI front ends; and the Triton APIs no client of the ensemble needs
(model-repository control, model configs, shared memory, trace and log settings) restricted
behind a header whose value is random per server and never printed.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.config import STATE_DIR_ENV

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """tritonserver is missing, failed to start or did not become ready."""


LOOPBACK = "127.0.0.1"
HOST_ENV = "TIERCACHE_HOST"
# Triton's API groups (--grpc-restricted-protocol / --http-restricted-api) that no client of the
# ensemble needs, and that would let a client unload models, read every stage's parameters,
# map shared-memory regions (the path of CVE-2025-23319/23320/23334), trace requests or change
# logging, or read the per-model statistics (a model's inference count rises on a miss only, so
# a caller of a padded tenant could tell a hit from a miss). Open ones: health, metadata,
# inference.
RESTRICTABLE_APIS = (
    "model-repository",
    "model-config",
    "shared-memory",
    "statistics",
    "trace",
    "logging",
)
RESTRICTED_KEY = "tiercache-restricted"
# Triton prefixes the key of a restricted gRPC protocol: this is the header a gRPC call sends.
GRPC_RESTRICTED_HEADER = f"triton-grpc-protocol-{RESTRICTED_KEY}"


AUTH_HEADER_PATTERN = "^authorization$"


@dataclass(frozen=True, slots=True)
class Exposure:
    """Where tritonserver listens and which of its APIs a client may call.

    `host` is the address gRPC (and HTTP, when `http`) bind to; `metrics_host` the metrics
    port's (default: `host` when it is a loopback address, else 127.0.0.1: the metrics tell a
    hit from a miss, which padded tenants must not learn, so reaching them from the network is
    the operator's explicit choice). `restricted_apis` need the restricted header (`args`). The
    default is loopback only, HTTP off, everything in RESTRICTABLE_APIS restricted."""

    host: str = LOOPBACK
    metrics_host: str | None = None
    http: bool = False
    restricted_apis: tuple[str, ...] = RESTRICTABLE_APIS

    def __post_init__(self) -> None:
        unknown = sorted(set(self.restricted_apis) - set(RESTRICTABLE_APIS))
        if unknown:
            raise ValueError(f"not restrictable here: {unknown}; choose from {RESTRICTABLE_APIS}")

    @property
    def metrics_address(self) -> str:
        """Where the metrics port listens (`metrics_host`, or as the class docstring says)."""
        if self.metrics_host:
            return self.metrics_host
        return self.host if is_loopback(self.host) else LOOPBACK

    def args(self, restricted_value: str) -> list[str]:
        """tritonserver's flags for this exposure; `restricted_value` is the header value that
        opens the restricted APIs (it shows in tritonserver's command line: see
        docs/security.md)."""
        out = [
            # The caller's API key reaches prompt_cache as a request parameter (a tenant key
            # file, tiercache.exact.tenant_keys); no other header is forwarded.
            f"--grpc-header-forward-pattern={AUTH_HEADER_PATTERN}",
            f"--grpc-address={_bracketed(self.host)}",
            f"--metrics-address={_bracketed(self.metrics_address)}",
            f"--allow-http={'true' if self.http else 'false'}",
            "--allow-sagemaker=false",
            "--allow-vertex-ai=false",
        ]
        if self.http:
            out.append(f"--http-address={_bracketed(self.host)}")
            out.append(f"--http-header-forward-pattern={AUTH_HEADER_PATTERN}")
        if self.restricted_apis:
            rule = f"{','.join(self.restricted_apis)}:{RESTRICTED_KEY}={restricted_value}"
            out.append(f"--grpc-restricted-protocol={rule}")
            if self.http:
                out.append(f"--http-restricted-api={rule}")
        return out


def is_loopback(host: str) -> bool:
    """Whether `host` (an address as --host takes it) reaches this host only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets: Triton's gRPC front end appends ":port" to the address as
    given, and a bare "::1" does not parse ("Name or service not known")."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def connect_host(host: str) -> str:
    """The address a client on this host dials to reach a server bound to `host` (gRPC
    "host:port" form: IPv6 in brackets)."""
    if host in ("", "0.0.0.0"):
        return LOOPBACK
    if host in ("::", "[::]"):
        return "[::1]"
    return _bracketed(host)


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
        if target.exists():
            held = target.stat()  # copy2 keeps the time: a new build of the same size differs
            if held.st_size == st.st_size and held.st_mtime_ns == st.st_mtime_ns:
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
        """Three distinct free ports: each probe socket is held until all three are chosen
        (closed one at a time, the kernel could hand the same port out twice)."""
        with contextlib.ExitStack() as held:
            ports = []
            for _ in range(3):
                probe = held.enter_context(socket.socket())
                probe.bind(("127.0.0.1", 0))
                ports.append(int(probe.getsockname()[1]))
        return cls(*ports)


_PR_SET_PDEATHSIG = 1  # prctl(2)


def tied_to_this_thread() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that has the child sent SIGTERM when the thread
    that starts it ends, this process's death included (Linux's `PR_SET_PDEATHSIG`): a
    supervisor killed (SIGKILL, a crash) leaves no tritonserver, stubs or gateway behind
    holding its ports. None where prctl cannot be had (not Linux). The library is opened
    here, in the parent: the child, forked from a process with threads, only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def tie() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the tie: as if after it
            os.kill(os.getpid(), signal.SIGTERM)

    return tie


@dataclass(slots=True)
class TritonServer:
    """One tritonserver process serving `model_repository` with the venv first on PATH.
    `tied`: it gets SIGTERM when the thread that started it ends (`tied_to_this_thread`), as
    `tiercache serve` wants for the server it supervises."""

    model_repository: Path
    state_dir: Path
    ports: Ports = field(default_factory=Ports)
    extra_args: Sequence[str] = ()
    exit_timeout_s: int = 5
    log_path: Path | None = None
    env_overrides: dict[str, str] = field(default_factory=dict)
    exposure: Exposure = field(default_factory=Exposure)
    # Opens exposure.restricted_apis (header GRPC_RESTRICTED_HEADER); random per server, so a
    # value seen once (it is in tritonserver's command line) opens nothing after a new start.
    restricted_value: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    process: subprocess.Popen | None = None
    tied: bool = False

    @property
    def grpc_url(self) -> str:
        """The "host:port" a gRPC client on this host dials."""
        return f"{connect_host(self.exposure.host)}:{self.ports.grpc}"

    @property
    def admin_token_file(self) -> Path:
        """The file cache_admin takes its admin token from, under this server's environment
        (tiercache.admin.admin_token_path)."""
        from tiercache.admin import admin_token_path  # the cache package: only when asked

        return admin_token_path(self.state_dir, {**os.environ, **self.env_overrides})

    @property
    def restricted_headers(self) -> dict[str, str]:
        """The gRPC headers that open the restricted APIs of this server (tests, perf_analyzer
        `-H`)."""
        return {GRPC_RESTRICTED_HEADER: self.restricted_value}

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
            # last: Triton takes an option's last value, so nothing in extra_args reopens
            # what the exposure closes (an address, HTTP, SageMaker, Vertex AI)
            *self.exposure.args(self.restricted_value),
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
        shown = " ".join(cmd).replace(self.restricted_value, "<restricted>")
        log.info("starting %s", shown)
        output = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self.process = subprocess.Popen(
            cmd,
            env=self.environment(install),
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            start_new_session=True,
            preexec_fn=tied_to_this_thread() if self.tied else None,  # noqa: PLW1509 - see there
        )

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until gRPC's ServerReady says so (HTTP may be off), or ServerError when the process
        exits first or `timeout_s` passes."""
        import tritonclient.grpc as grpcclient  # the launcher's only client call; lazy
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerError(
                    f"tritonserver exited with code {self.process.returncode} before it was ready"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            # A channel per try: one kept across a long model load would back off its
            # reconnects to tens of seconds and see the port open that much late.
            client = grpcclient.InferenceServerClient(self.grpc_url)
            try:
                if client.is_server_ready(client_timeout=2):
                    return
            except InferenceServerException:
                pass
            finally:
                client.close()
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not ready within {timeout_s:.0f} s")

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGINT (Triton's clean shutdown), then SIGKILL to the process group if it hangs
        past `timeout_s` (default: its own `--exit-timeout-secs` and 20 s more, so the time
        given to requests in flight is kept). Stubs left behind (seen after a stub of the same
        server died) are killed too: they are in tritonserver's process group, which it leads
        (`start_new_session`). Interrupted while it waits (a second Ctrl-C or SIGTERM), it
        kills the group before the interruption goes on: nothing is left holding the ports."""
        if self.process is None:
            return None
        if timeout_s is None:
            timeout_s = self.exit_timeout_s + 20.0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except BaseException:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                raise
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers; none after a clean exit
        return self.process.returncode

    def stage_processes(self, stopped: set[int] | None = None) -> dict[int, str]:
        """pid -> model name of each live Python-backend stub of this server (empty when the
        server is not running); `stopped` (given) gets those stopped by a signal."""
        if self.process is None or self.process.poll() is not None:
            return {}
        return stage_processes(self.process.pid, stopped=stopped)

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


def stage_processes(
    server_pid: int, proc: Path = Path("/proc"), stopped: set[int] | None = None
) -> dict[int, str]:
    """pid -> model name of each live `triton_python_backend_stub` child of `server_pid`: one
    per model instance (`<repository>/<model>/1/model.py` is its first argument). A stub that
    died and was not reaped yet (a zombie) is not live; one stopped by a signal (state T) is,
    and goes into `stopped` when that is given. Linux only (reads /proc)."""
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
            if stopped is not None and fields[0] == "T":
                stopped.add(int(entry.name))
    return stubs


@dataclass(slots=True)
class StageWatch:
    """Finds stage processes (Python-backend stubs) that died since the last look.

    Triton 2.51 does not restart a dead stub: every request through that stage then fails with
    "Stub process ... is not healthy" while /v2/health/ready stays green (docs/faults.md), so
    a supervisor must notice the death itself."""

    server: TritonServer
    seen: dict[int, str] = field(default_factory=dict)
    # a stub stopped by a signal (SIGSTOP) this many looks in a row serves nothing, as a dead
    # one: every request through it waits, and the server looks healthy
    stopped_looks: int = 3
    _stopped: dict[int, int] = field(default_factory=dict)  # pid -> looks it was seen stopped
    _reported: set[int] = field(default_factory=set)  # stopped ones reported dead already

    def reset(self) -> None:
        self.seen = self.server.stage_processes()
        self._stopped, self._reported = {}, set()

    def dead(self) -> dict[int, str]:
        """Stubs seen before and gone now, or stopped `stopped_looks` looks in a row (pid ->
        model); new ones are watched from now on."""
        stopped: set[int] = set()
        alive = self.server.stage_processes(stopped)
        gone = {pid: model for pid, model in self.seen.items() if pid not in alive}
        self._stopped = {pid: self._stopped.get(pid, 0) + 1 for pid in stopped}
        for pid, looks in self._stopped.items():
            if looks >= self.stopped_looks and pid in alive and pid not in self._reported:
                self._reported.add(pid)
                gone[pid] = alive[pid]
        self.seen = alive
        return gone


REDIS_STAGES = ("prompt_cache", "embedding_cache", "llm", "cache_admin", "feedback")
"""The stages a replica deployment gives the fleet's `redis_url` and `redis_prefix` (L3,
invalidations, leases, shared rows; lora_cache may join them for the fleet's adapter metadata,
docs/replicas.md)."""


def copy_repository(
    source: Path, dest: Path, parameters: Mapping[str, Mapping[str, str]] | None = None
) -> Path:
    """A copy of the model repository `source` at `dest`, with `parameters` ({model: {key:
    value}}) set in those models' config.pbtxt: for benchmarks and tests that serve a variant of
    the committed repository. A key the committed config already sets (one `parameters { key:
    ... }` line, as committed) is replaced there, so the config never names a key twice."""
    shutil.copytree(source, dest)
    for model, values in (parameters or {}).items():
        config = dest / model / "config.pbtxt"
        text = config.read_text()
        for key, value in values.items():
            text = set_parameter(text, key, value)
        config.write_text(text)
    return dest


def set_parameter(config_text: str, key: str, value: str) -> str:
    """`config_text` (a config.pbtxt) with stage parameter `key` set to `value`: its one-line
    `parameters { key: "<key>" ... }` replaced, else one such line appended."""
    line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
    committed = re.compile(rf'^parameters \{{ key: "{re.escape(key)}" .*$', re.MULTILINE)
    if committed.search(config_text):
        return committed.sub(lambda _: line, config_text, count=1)
    return config_text + f"\n{line}\n"
