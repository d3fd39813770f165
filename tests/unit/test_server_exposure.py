"""tritonserver's command line as `tiercache serve` builds it: loopback, no HTTP/SageMaker/Vertex
AI, the APIs clients do not need restricted behind a per-server random header value, which never
reaches the log (issue 14, "Safe by default"). The flags' effect on a real tritonserver is
tests/security/test_exposure.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.cli import build_parser, exposure_from
from tiercache.server import (
    GRPC_RESTRICTED_HEADER,
    RESTRICTABLE_APIS,
    Exposure,
    Ports,
    TritonInstall,
    TritonServer,
    connect_host,
    is_loopback,
)

INSTALL = TritonInstall(Path("/opt/pytriton/tritonserver"), Path("/opt/pytriton.libs"))


def server(**kwargs: object) -> TritonServer:
    return TritonServer(Path("/repo"), Path("/state"), ports=Ports(1, 2, 3), **kwargs)  # type: ignore[arg-type]


def flags(command: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in command[1:] if "=" in arg)


def test_defaults_are_loopback_grpc_only_with_the_rest_restricted() -> None:
    srv = server()
    found = flags(srv.command(INSTALL, Path("/backends")))
    assert found["--grpc-address"] == "127.0.0.1"
    assert found["--metrics-address"] == "127.0.0.1"
    assert found["--allow-http"] == "false"
    assert found["--allow-sagemaker"] == "false"
    assert found["--allow-vertex-ai"] == "false"
    assert "--http-address" not in found and "--http-restricted-api" not in found
    apis, rule = found["--grpc-restricted-protocol"].split(":")
    assert apis.split(",") == list(RESTRICTABLE_APIS)
    assert set(RESTRICTABLE_APIS) == {
        "model-repository",
        "model-config",
        "shared-memory",
        "statistics",
        "trace",
        "logging",
    }
    assert rule == f"tiercache-restricted={srv.restricted_value}"
    assert srv.restricted_headers == {GRPC_RESTRICTED_HEADER: srv.restricted_value}
    assert GRPC_RESTRICTED_HEADER == "triton-grpc-protocol-tiercache-restricted"
    assert srv.grpc_url == "127.0.0.1:2"
    # Only the authorization header reaches prompt_cache (API keys), as a request parameter.
    assert found["--grpc-header-forward-pattern"] == "^authorization$"
    assert "--http-header-forward-pattern" not in found


def test_restricted_value_is_random_per_server_and_not_in_repr() -> None:
    first, second = server(), server()
    assert len(first.restricted_value) == 32 and first.restricted_value != second.restricted_value
    assert first.restricted_value not in repr(first)


def test_extra_args_cannot_reopen_what_the_exposure_closes() -> None:
    """An operator's extra flags reach tritonserver, but the exposure's come after them
    (Triton takes an option's last value): an address or a front end in them is overridden."""
    srv = server(extra_args=["--log-verbose=1", "--grpc-address=0.0.0.0", "--allow-http=true"])
    command = srv.command(INSTALL, Path("/b"))
    assert "--log-verbose=1" in command
    found = flags(command)  # the last value of each flag, as Triton reads them
    assert found["--grpc-address"] == "127.0.0.1" and found["--allow-http"] == "false"
    assert command.index("--grpc-address=0.0.0.0") < command.index("--grpc-address=127.0.0.1")


def test_http_when_asked_is_restricted_too() -> None:
    srv = server(exposure=Exposure(host="0.0.0.0", http=True, restricted_apis=("model-config",)))
    found = flags(srv.command(INSTALL, Path("/b")))
    assert found["--allow-http"] == "true"
    assert found["--http-address"] == "0.0.0.0" == found["--grpc-address"]
    rule = f"model-config:tiercache-restricted={srv.restricted_value}"
    assert found["--http-restricted-api"] == rule == found["--grpc-restricted-protocol"]
    assert found["--http-header-forward-pattern"] == "^authorization$"
    assert srv.grpc_url == "127.0.0.1:2"  # a bound-to-all server is dialled on loopback


def test_nothing_restricted_means_no_restriction_flag() -> None:
    found = flags(server(exposure=Exposure(restricted_apis=())).command(INSTALL, Path("/b")))
    assert "--grpc-restricted-protocol" not in found


def test_unknown_api_group_is_refused() -> None:
    with pytest.raises(ValueError, match="inference"):
        Exposure(restricted_apis=("inference",))


@pytest.mark.parametrize(
    ("host", "dialled"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("0.0.0.0", "127.0.0.1"),
        ("", "127.0.0.1"),
        ("::", "[::1]"),
        ("::1", "[::1]"),
        ("10.1.2.3", "10.1.2.3"),
    ],
)
def test_connect_host(host: str, dialled: str) -> None:
    assert connect_host(host) == dialled


def test_start_logs_the_command_without_the_restricted_value(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    srv = TritonServer(Path("/repo"), tmp_path, ports=Ports(1, 2, 3))
    started: list[list[str]] = []
    monkeypatch.setattr("tiercache.server.find_triton", lambda: INSTALL)
    monkeypatch.setattr("tiercache.server.prepare_backends", lambda install, dest: dest)
    monkeypatch.setattr(
        "tiercache.server.subprocess.Popen", lambda cmd, **kwargs: started.append(cmd)
    )
    with caplog.at_level(logging.INFO, logger="tiercache.server"):
        srv.start()
    assert any(srv.restricted_value in arg for arg in started[0])  # tritonserver gets it
    assert srv.restricted_value not in caplog.text
    assert "tiercache-restricted=<restricted>" in caplog.text


def test_serve_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCACHE_HOST", raising=False)
    args = build_parser().parse_args(["serve"])
    assert exposure_from(args) == Exposure()
    assert args.admin_token_file == ""  # resolved at start: $TIERCACHE_ADMIN_TOKEN_FILE or state


def test_serve_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCACHE_HOST", "0.0.0.0")
    args = build_parser().parse_args(
        ["serve", "--http", "--open-api", "model-config", "--metrics-host", "127.0.0.1"]
    )
    exposure = exposure_from(args)
    assert (exposure.host, exposure.metrics_host, exposure.http) == ("0.0.0.0", "127.0.0.1", True)
    assert exposure.restricted_apis == tuple(a for a in RESTRICTABLE_APIS if a != "model-config")
    assert exposure_from(build_parser().parse_args(["serve", "--host", "::1"])).host == "::1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--open-api", "inference"])


def test_docker_image_starts_triton_with_the_same_defaults() -> None:
    """The GPU image runs tritonserver itself (deploy/tensorrt_llm/entrypoint.sh): its command
    carries serve's flags, with a restricted value drawn at each start."""
    dockerfile = Path(__file__).resolve().parents[2] / "Dockerfile"
    (cmd,) = [line for line in dockerfile.read_text().splitlines() if line.startswith("CMD ")]
    shell, dash_c, script = json.loads(cmd[len("CMD ") :])
    assert (shell, dash_c) == ("/bin/sh", "-c") and script.startswith("exec ")
    for flag in ("--allow-http=false", "--allow-sagemaker=false", "--allow-vertex-ai=false"):
        assert flag in script.split()
    restricted = f"--grpc-restricted-protocol={','.join(RESTRICTABLE_APIS)}:tiercache-restricted="
    assert restricted + "$(od -An -N16 -tx1 /dev/urandom" in script
    assert "EXPOSE 8001 8002" in dockerfile.read_text()


def test_the_gpu_image_refuses_to_trust_tenants_unless_told_to(tmp_path: Path) -> None:
    """Inside the container Triton listens on every interface: without an API key file the
    entrypoint refuses to start (exit 2, before building or serving anything) unless
    TIERCACHE_TRUST_TENANTS=1 says every caller that can reach the ports may act as any tenant,
    as `tiercache serve` asks off loopback (before, a `-p 8001:8001` served any caller as any
    tenant)."""
    import shutil
    import subprocess

    script = Path(__file__).resolve().parents[2] / "deploy" / "tensorrt_llm" / "entrypoint.sh"
    shell = shutil.which("sh")
    assert shell is not None
    for tool in ("dirname",):  # what the script runs before its check
        found = shutil.which(tool)
        assert found is not None
        (tmp_path / tool).symlink_to(found)
    ran = subprocess.run(
        [shell, str(script)],
        env={"PATH": str(tmp_path)},  # no python3 or tritonserver to reach: it stops first
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.returncode == 2
    assert "TIERCACHE_TRUST_TENANTS=1" in ran.stderr and "TIERCACHE_API_KEYS_FILE" in ran.stderr


def test_ipv6_addresses_go_to_triton_in_brackets() -> None:
    """A bare "::1" makes tritonserver 2.51 exit ("Name or service not known"); "[::1]" serves."""
    found = flags(server(exposure=Exposure(host="::1", http=True)).command(INSTALL, Path("/b")))
    assert found["--grpc-address"] == found["--http-address"] == "[::1]"
    assert found["--metrics-address"] == "[::1]"
    assert (
        flags(server(exposure=Exposure(host="[::]")).command(INSTALL, Path("/b")))["--grpc-address"]
        == "[::]"
    )


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.org", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_metrics_stay_on_loopback_unless_the_operator_names_an_address() -> None:
    """The metrics tell a hit from a miss (padded tenants must not learn which): a server on
    every interface keeps its metrics port on loopback unless --metrics-host says otherwise."""
    everywhere = flags(server(exposure=Exposure(host="0.0.0.0")).command(INSTALL, Path("/b")))
    assert everywhere["--grpc-address"] == "0.0.0.0"
    assert everywhere["--metrics-address"] == "127.0.0.1"
    chosen = Exposure(host="0.0.0.0", metrics_host="0.0.0.0")
    assert flags(server(exposure=chosen).command(INSTALL, Path("/b")))["--metrics-address"] == (
        "0.0.0.0"
    )


# -- stopping, exit codes and arguments (a review of serve and the client) ----------------------


def _ignoring_sigint(tmp_path: Path) -> subprocess.Popen[bytes]:
    """A stand-in for tritonserver that ignores SIGINT, in its own session as Triton is."""
    return subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, "
         "signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
        start_new_session=True,
        stdout=subprocess.PIPE,
    )  # fmt: skip


def test_stop_waits_the_servers_own_exit_timeout_and_more() -> None:
    """--exit-timeout-secs 120 was cut at 30 s by stop()'s fixed default."""
    srv = TritonServer(Path("/repo"), Path("/state"), ports=Ports(1, 2, 3), exit_timeout_s=120)
    waited: list[float | None] = []

    class Process:
        pid, returncode = 1 << 22, 0

        def poll(self) -> None:
            return None

        def send_signal(self, sig: int) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            waited.append(timeout)
            return 0

    srv.process = Process()  # type: ignore[assignment]
    srv.stop()
    assert waited == [140.0]


def test_an_interrupt_while_stopping_leaves_no_server_behind(tmp_path: Path) -> None:
    """A second Ctrl-C (or SIGTERM) during stop()'s wait escaped before the SIGKILL: the
    server, in its own session, kept running and holding its ports."""
    srv = TritonServer(Path("/repo"), tmp_path, ports=Ports(1, 2, 3), exit_timeout_s=60)
    process = _ignoring_sigint(tmp_path)
    assert process.stdout is not None and process.stdout.readline() == b"up\n"
    srv.process = process
    real_wait = process.wait
    calls = []

    def interrupted(timeout: float | None = None) -> int:
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the second signal, while stop() waits
        return real_wait(timeout)

    process.wait = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        srv.stop()
    assert process.poll() is not None and process.returncode == -9


def test_exit_status_reports_a_signal_as_a_shell_does() -> None:
    from tiercache.cli import _exit_status

    assert (_exit_status(-9), _exit_status(-15), _exit_status(0), _exit_status(3)) == (
        137,
        143,
        0,
        3,
    )


@pytest.mark.parametrize("text", ["nan", "inf", "0", "-1"])
def test_seconds_arguments_are_finite_and_positive(text: str) -> None:
    for argv in (
        ["serve", "--watch-interval-s", text],
        ["invalidate", "--tag", "t", "--redis-url", "redis://x", "--timeout-s", text],
        ["gateway", "--timeout-s", text],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0.0])
def test_the_client_refuses_a_timeout_that_never_ends(timeout: float) -> None:
    from tiercache_client import TierCacheClient

    with pytest.raises(ValueError, match="finite"):
        TierCacheClient("127.0.0.1:1", timeout_s=timeout)


def test_a_bracketed_ipv6_host_is_probed_as_an_address() -> None:
    import socket

    from tiercache.cli import _port_in_use

    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        port = s.getsockname()[1]
    assert _port_in_use("[::1]", port) == ""


def test_a_backend_copy_of_the_same_size_but_another_build_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from tiercache.server import prepare_backends

    root = tmp_path / "triton"
    (root / "backends" / "python").mkdir(parents=True)
    lib = root / "backends" / "python" / "libtriton_python.so"
    utils = root / "backends" / "python" / "triton_python_backend_utils.py"
    stub = root / "backends" / "python" / "triton_python_backend_stub"
    for f in (lib, utils, stub):
        f.write_bytes(b"old!")

    class Install:
        pass

    install = Install()
    install.root = root  # type: ignore[attr-defined]
    install.stub = lambda: stub  # type: ignore[attr-defined]
    dest = tmp_path / "copies"
    prepare_backends(install, dest)  # type: ignore[arg-type]
    copied = next(dest.rglob("libtriton_python.so"))
    assert copied.read_bytes() == b"old!"
    lib.write_bytes(b"new!")  # a new build of the same size
    os.utime(lib, ns=(lib.stat().st_atime_ns, lib.stat().st_mtime_ns + 10**9))
    prepare_backends(install, dest)  # type: ignore[arg-type]
    assert copied.read_bytes() == b"new!"


def test_serve_refuses_a_busy_grpc_port_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Triton binds its ports only once every model has loaded: a busy gRPC port showed as an
    exit minutes later, and one held by another server answered the readiness poll ("ready")
    for a server that was not ours."""
    import socket

    from tiercache.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = main(
            ["serve", "--state-dir", str(tmp_path), "--grpc-port", str(port), "--no-gateway"]
        )
    assert code == 1
    assert f"the gRPC port {port} is in use" in capsys.readouterr().err


def test_serve_and_gateway_without_the_gateway_packages_say_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed without the `gateway` extra (`pip install .`), `serve` (whose gateway is on by
    default) and `gateway` name the extra and --no-gateway and exit 2 before making anything
    (before: a ModuleNotFoundError traceback, after the state folder and its token)."""
    import tiercache.cli as cli

    monkeypatch.setattr(cli, "gateway_packages_missing", lambda: ["starlette", "uvicorn"])
    state = tmp_path / "state"
    assert cli.main(["serve", "--state-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert "tiercache[gateway]" in err and "--no-gateway" in err and "Traceback" not in err
    assert not state.exists()
    assert cli.main(["gateway"]) == 2
    assert "tiercache[gateway]" in capsys.readouterr().err


def test_invalidate_names_a_redis_url_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiercache.cli import main

    (tmp_path / "secret").write_bytes(bytes(range(32)))
    (tmp_path / "secret").chmod(0o600)
    code = main(
        ["invalidate", "--redis-url", "localhost:6379", "--tag", "x", "--state-dir", str(tmp_path)]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("tiercache: --redis-url: ") and "Traceback" not in err


def test_serve_refuses_a_network_host_without_api_keys_unless_told_to_trust_tenants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an API key file the tenant input is trusted as sent: on a non-loopback address
    anyone who reaches the port could name any tenant. `serve` refuses that (as the gateway
    does) unless --trust-tenants says so; with it, start goes on (here to the busy-port check,
    which stops it before anything runs)."""
    import socket

    from tiercache.cli import main

    monkeypatch.delenv("TIERCACHE_API_KEYS_FILE", raising=False)
    base = ["serve", "--state-dir", str(tmp_path), "--no-gateway", "--host", "0.0.0.0"]
    assert main(base) == 2
    assert "--trust-tenants" in capsys.readouterr().err
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main([*base, "--trust-tenants", "--grpc-port", str(port)]) == 1
    assert f"the gRPC port {port} is in use" in capsys.readouterr().err
    # tritonserver's own front-end flags after `--` (abbreviated too) are serve's to set
    loopback = ["serve", "--state-dir", str(tmp_path), "--no-gateway"]
    for tail in (["--grpc-addr=0.0.0.0"], ["--http-address", "10.1.2.3"], ["--allow-sage=1"]):
        assert main([*loopback, "--", *tail]) == 2
        err = capsys.readouterr().err
        assert tail[0].partition("=")[0] in err and "serve decides where Triton listens" in err
    # and the flags serve sets and relies on: a port it probes and points the gateway at (it
    # waited out --ready-timeout for a server on the wrong port, then killed it), the exit
    # timeout its stop waits for, the repository and backends it prepared
    for tail in (["--grpc-port=9001"], ["--exit-timeout-secs", "300"], ["--model-repo=/x"]):
        assert main([*loopback, "--", *tail]) == 2
        err = capsys.readouterr().err
        assert tail[0].partition("=")[0] in err and "serve sets these itself" in err


def test_serve_refuses_an_api_key_file_others_may_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whoever may write the API key file may mint a key for any tenant: `serve` refuses one
    writable by other users before starting anything."""
    from tiercache.cli import main
    from tiercache.exact.tenant_keys import add_key

    keys = tmp_path / "keys" / "api_keys.json"
    add_key(keys, "acme")
    keys.chmod(0o666)
    state = tmp_path / "state"
    assert main(["serve", "--state-dir", str(state), "--no-gateway", "--api-keys", str(keys)]) == 1
    err = capsys.readouterr().err
    assert "API key file" in err and "can be written by other users" in err


def test_front_end_flags_passed_to_tritonserver_are_found_abbreviated_too() -> None:
    from tiercache.cli import front_end_flags

    args = ["--log-verbose=1", "--grpc-addr=0.0.0.0", "--metrics-address", "::1", "--grpc-port=1"]
    assert front_end_flags(args) == ["--grpc-addr", "--metrics-address"]
    assert front_end_flags(["--allow-vertex-ai=true", "--allow-grpc=true", "--grpc-use-ssl=1"]) == [
        "--allow-vertex-ai"
    ]


def test_serve_checks_the_links_of_the_admin_token_file_it_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The admin token file is checked as named, not after resolving it: a link in a folder
    others may write, to a root-owned file anyone can read, is refused before anything
    starts (resolved first, the link was never seen and the file's content became the token)."""
    import socket

    from tiercache.cli import main

    known = tmp_path / "known"
    known.write_bytes(b"NAME=a file anyone can read\n" * 2)
    known.chmod(0o644)
    public = tmp_path / "public"
    public.mkdir()
    public.chmod(0o1777)
    (public / "token").symlink_to(known)
    state = tmp_path / "state"
    with socket.socket() as held:  # were the token taken, start would stop here, not run
        held.bind(("127.0.0.1", 0))
        held.listen()
        code = main(
            ["serve", "--state-dir", str(state), "--no-gateway", "--admin-token-file",
             str(public / "token"), "--grpc-port", str(held.getsockname()[1])]
        )  # fmt: skip
    assert code == 1
    assert "reached through a link" in capsys.readouterr().err
