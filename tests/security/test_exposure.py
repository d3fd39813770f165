"""Safe by default (issue 14, item 1) and the admin token (item 4), against `tiercache serve` as an
operator starts it: tritonserver listens on loopback only, HTTP is off, the Triton APIs a client
does not need are refused, inference and health still work, and cache_admin refuses every op
without the token file's token. docs/security.md lists which 2.51 CVEs this keeps out."""

from __future__ import annotations

import re
import socket
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tiercache.server import GRPC_RESTRICTED_HEADER
from tiercache_client import ForbiddenError, TierCacheClient, read_admin_token

from .conftest import Served

pytestmark = pytest.mark.integration
MAX_TOKENS = 6

# Each call of a restricted API group, as an attacker on the gRPC port would make it.
RESTRICTED_CALLS: dict[str, Callable[[grpcclient.InferenceServerClient, dict], Any]] = {
    "model-repository index": lambda c, h: c.get_model_repository_index(headers=h),
    "model-repository unload": lambda c, h: c.unload_model("llm", headers=h),
    "model-repository load": lambda c, h: c.load_model("llm", headers=h),
    "model-config (stage parameters)": lambda c, h: c.get_model_config("prompt_cache", headers=h),
    "shared-memory status": lambda c, h: c.get_system_shared_memory_status(headers=h),
    "shared-memory register": lambda c, h: c.register_system_shared_memory(
        "probe", "/tiercache-probe", 64, headers=h
    ),
    "cuda shared-memory status": lambda c, h: c.get_cuda_shared_memory_status(headers=h),
    "statistics (a model's inference count tells a hit from a miss)": lambda c, h: (
        c.get_inference_statistics("llm", headers=h)
    ),
    "trace settings": lambda c, h: c.get_trace_settings(headers=h),
    "trace update": lambda c, h: c.update_trace_settings(settings={"trace_rate": "1"}, headers=h),
    "log settings": lambda c, h: c.get_log_settings(headers=h),
    "log update": lambda c, h: c.update_log_settings({"log_verbose_level": 1}, headers=h),
}


@pytest.fixture(scope="module")
def raw(served: Served) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(served.grpc_url)
    yield c
    c.close()


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} has them) of sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


# 127.0.0.1 as /proc/net/tcp writes it, and as an IPv4-mapped IPv6 address in /proc/net/tcp6.
LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F"}


def test_listens_on_loopback_only_and_http_is_off(served: Served) -> None:
    for port in (served.ports.grpc, served.ports.metrics):
        listeners = _listeners(port)
        assert listeners and set(listeners) <= LOOPBACK_HEX, (port, listeners)
    assert _listeners(served.ports.http) == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", served.ports.http), timeout=5).close()


@pytest.mark.parametrize("call", sorted(RESTRICTED_CALLS))
@pytest.mark.parametrize("header", ["none", "guessed"])
def test_restricted_api_refused(
    raw: grpcclient.InferenceServerClient, call: str, header: str
) -> None:
    headers = {} if header == "none" else {GRPC_RESTRICTED_HEADER: "0" * 32}
    with pytest.raises(InferenceServerException, match="This protocol is restricted"):
        RESTRICTED_CALLS[call](raw, headers)


def test_models_stay_loaded_after_the_refused_calls(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    """The refused unload did nothing: every stage still answers."""
    for name in ("ensemble", "prompt_cache", "llm", "cache_admin"):
        assert raw.is_model_ready(name), name


def test_inference_health_and_metadata_still_work(
    raw: grpcclient.InferenceServerClient, served: Served
) -> None:
    prompt = f"Name one ocean ({uuid.uuid4().hex[:6]})."
    with TierCacheClient(served.grpc_url, timeout_s=300, api_key=served.keys["acme"]) as client:
        first = client.generate_text(prompt, max_tokens=MAX_TOKENS)
        again = client.generate_text(prompt, max_tokens=MAX_TOKENS)
        health = client.health()
    assert (first.cache_status, again.cache_status) == ("miss", "exact") and first.text
    assert health["live"] and health["ready"]
    assert health["models"] == {"ensemble": True, "cache_admin": True}
    # What tritonclient code and perf tools read first: server and model metadata stay open.
    assert raw.get_server_metadata().version == "2.51.0"
    assert {i.name for i in raw.get_model_metadata("ensemble").inputs} >= {"text_input"}


def test_serve_names_the_token_file_and_prints_no_secret(served: Served) -> None:
    token_file = served.state_dir.resolve() / "admin_token"
    out = served.output()
    assert f"admin token file {token_file}" in out
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert read_admin_token(token_file) not in out
    # The restricted APIs' header value (random per start) is not printed either.
    assert not re.search(r"tiercache-restricted=[0-9a-f]{32}", out)
    assert "gRPC 127.0.0.1:" in out and "no HTTP" in out


def admin_ops(prompt: str) -> dict[str, Callable[[TierCacheClient], Any]]:
    """One call of each cache_admin op kind; `warm` stores an answer for `prompt`."""
    return {
        "stats": lambda c: c.stats(),
        "warm": lambda c: c.warm(prompts=[{"text_input": prompt, "answer": "attacker's text"}]),
        "invalidate": lambda c: c.invalidate(tag="any"),
        "flush": lambda c: c.flush(),
    }


@pytest.mark.parametrize("token", ["none", "empty", "wrong"])
def test_admin_ops_refused_without_the_admin_token(served: Served, token: str) -> None:
    given = {"none": None, "empty": "", "wrong": "ab" * 32}[token]
    prompt = f"What is the capital of Australia ({uuid.uuid4().hex[:6]})?"
    with TierCacheClient(
        served.grpc_url, timeout_s=300, admin_token=given, api_key=served.keys["acme"]
    ) as attacker:
        for op in admin_ops(prompt).values():
            with pytest.raises(ForbiddenError):
                op(attacker)
        answer = attacker.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert answer.cache_status == "miss"  # the refused warm stored nothing


def test_admin_ops_served_with_the_token_from_the_printed_file(served: Served) -> None:
    token = read_admin_token(served.state_dir / "admin_token")
    prompt = f"Name a warm colour ({uuid.uuid4().hex[:6]})."
    with TierCacheClient(served.grpc_url, timeout_s=300, admin_token=token) as operator:
        results = {name: op(operator) for name, op in admin_ops(prompt).items()}
    assert {name: r["op"] for name, r in results.items()} == {
        "stats": "stats",
        "warm": "warm",
        "invalidate": "invalidate",
        "flush": "flush",
    }
    assert results["warm"]["stored"] == 1
