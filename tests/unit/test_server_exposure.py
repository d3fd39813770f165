"""tritonserver's command line as `tiercache serve` builds it: loopback, no HTTP/SageMaker/Vertex
AI, the APIs clients do not need restricted behind a per-server random header value, which never
reaches the log (issue 14, "Safe by default"). The flags' effect on a real tritonserver is
tests/security/test_exposure.py."""

from __future__ import annotations

import json
import logging
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


def test_extra_args_come_last_so_an_operator_can_override() -> None:
    command = server(extra_args=["--log-verbose=1"]).command(INSTALL, Path("/b"))
    assert command[-1] == "--log-verbose=1"


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
