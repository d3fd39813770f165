"""Unit tests of tiercache_client: no Triton needed.

The streaming path runs against a tiny in-process gRPC server speaking Triton's
GRPCInferenceService, so the real tritonclient stream, result decoding and final-flag handling
are exercised.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from tiercache_client import (
    CapacityError,
    ForbiddenError,
    GenerationResult,
    InvalidRequestError,
    NotFoundError,
    ServerError,
    ServerUnreachableError,
    TierCacheClient,
    TierCacheClientError,
    UnavailableError,
    build_inputs,
    classify,
    read_admin_token,
)
from tiercache_client.cli import (
    build_parser,
    default_admin_token_file,
    main,
    shown,
    summary_line,
)

TOKEN_BYTES = bytes(range(32))  # what the fake server's admin token file holds
TOKEN = TOKEN_BYTES.hex()
ANSWER_ID = "a1." + "Q" * 96  # the fake server's answer id (the client treats it as opaque)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- error mapping


@pytest.mark.parametrize("prefix", ["", "in ensemble 'ensemble', "])
@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("invalid request", InvalidRequestError),
        ("not found", NotFoundError),
        ("unavailable", UnavailableError),
        ("capacity", CapacityError),
    ],
)
def test_classify_kind_prefix(prefix: str, kind: str, cls: type[TierCacheClientError]) -> None:
    err = classify(f"{prefix}{kind}: something went wrong, got 0")
    assert type(err) is cls
    assert err.kind == kind
    assert err.message == "something went wrong, got 0"
    assert str(err) == f"{kind}: something went wrong, got 0"


def test_classify_kind_wins_over_status_and_unknown_is_internal() -> None:
    err = classify("in ensemble 'ensemble', not found: adapter 'x'", "StatusCode.INTERNAL")
    assert type(err) is NotFoundError
    err = classify("in ensemble 'ensemble', boom")
    assert type(err) is ServerError and err.kind == "internal"
    assert err.message == "in ensemble 'ensemble', boom"
    assert type(classify("config: bad parameter")) is ServerError


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        ("StatusCode.INVALID_ARGUMENT", InvalidRequestError),
        ("StatusCode.NOT_FOUND", NotFoundError),
        ("StatusCode.UNAVAILABLE", UnavailableError),
        ("StatusCode.DEADLINE_EXCEEDED", UnavailableError),
        ("StatusCode.RESOURCE_EXHAUSTED", CapacityError),
        ("StatusCode.INTERNAL", ServerError),
        (None, ServerError),
    ],
)
def test_classify_by_status(status: str | None, cls: type[TierCacheClientError]) -> None:
    err = classify("opaque failure", status)
    assert type(err) is cls
    assert err.status == status


def test_classify_connection_failure_and_unknown_model() -> None:
    msg = "failed to connect to all addresses; last error: UNKNOWN: Connection refused"
    err = classify(msg, "StatusCode.UNAVAILABLE")
    assert type(err) is ServerUnreachableError and isinstance(err, UnavailableError)
    assert type(classify("Request for unknown model: 'foo' is not found")) is NotFoundError
    # gRPC's message carries a kind word ("UNAVAILABLE:"): the connection failure is recognised
    msg = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1: Socket closed"
    err = classify(msg, "StatusCode.UNAVAILABLE")
    assert type(err) is ServerUnreachableError and "failed to connect" in str(err)
    # a server failure whose text holds another kind word keeps its own kind
    assert type(classify("internal: ValueError: key not found: x", "StatusCode.INTERNAL")) is (
        ServerError
    )
    # a stage's own unavailability, naming a connection problem, is not an unreachable server
    err = classify("unavailable: Redis connection refused", "StatusCode.UNAVAILABLE")
    assert type(err) is UnavailableError


# ---------------------------------------------------------------- input tensors


def _shapes(**kwargs: Any) -> dict[str, tuple[str, list[int]]]:
    return {t.name(): (t.datatype(), list(t.shape())) for t in build_inputs("hi", **kwargs)}


def test_build_inputs_minimal() -> None:
    assert _shapes() == {"text_input": ("BYTES", [1, 1]), "stream": ("BOOL", [1, 1])}


def test_build_inputs_all() -> None:
    got = _shapes(
        max_tokens=8,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=2**63,
        stop_words=["\n", "END", "x"],
        tenant="acme",
        cache_control="no-cache, no-store",
        lora_name="sql",
        stream=False,
    )
    assert got == {
        "text_input": ("BYTES", [1, 1]),
        "stream": ("BOOL", [1, 1]),
        "max_tokens": ("INT32", [1, 1]),
        "temperature": ("FP32", [1, 1]),
        "top_p": ("FP32", [1, 1]),
        "top_k": ("INT32", [1, 1]),
        "seed": ("UINT64", [1, 1]),
        "stop_words": ("BYTES", [1, 3]),
        "tenant": ("BYTES", [1, 1]),
        "cache_control": ("BYTES", [1, 1]),
        "lora_name": ("BYTES", [1, 1]),
    }


def test_build_inputs_empty_stop_words_not_sent() -> None:
    assert "stop_words" not in _shapes(stop_words=[])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1.5},
        {"max_tokens": True},
        {"temperature": "hot"},
        {"stop_words": "END"},
        {"tenant": 3},
        {"stream": 1},
    ],
)
def test_build_inputs_type_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        build_inputs("hi", **kwargs)


def test_build_inputs_out_of_range_ints() -> None:
    with pytest.raises(InvalidRequestError):
        build_inputs("hi", seed=-1)
    with pytest.raises(InvalidRequestError):
        build_inputs("hi", max_tokens=2**31)


def test_build_inputs_non_str_prompt() -> None:
    with pytest.raises(TypeError):
        build_inputs(b"hi")  # type: ignore[arg-type]


# ---------------------------------------------------------------- fake Triton


def _bytes_output(
    resp: service_pb2.ModelInferResponse, name: str, values: list[str] | list[bytes]
) -> None:
    out = resp.outputs.add()
    out.name, out.datatype = name, "BYTES"
    out.shape.extend([1, len(values)])
    array = np.array([v if isinstance(v, bytes) else v.encode() for v in values], dtype=np.object_)
    resp.raw_output_contents.append(serialize_byte_tensor(array).item())


def _warm_outcome(name: str) -> str:
    """lora_cache's outcome for one adapter it warms: "broken" fails, as a folder it cannot
    read would (reported, not raised), the rest load."""
    return "error: cannot read its weights" if name == "broken" else "loaded"


class _FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Prompt decides the behaviour: "error:<msg>" fails, "slow" never answers, else two chunks."""

    def __init__(self) -> None:
        self.requests: list[dict[str, tuple[str, list[int]]]] = []
        self.admin_calls: list[dict[str, Any]] = []
        self.stream_headers: list[dict[str, str]] = []
        self.feedback_calls: list[tuple[dict[str, str], dict[str, str]]] = []
        self.hang_started = threading.Event()
        self.hang_ended = threading.Event()
        # what a broken or hostile server sends: cache_admin's raw answer instead of its own,
        # and more model names in the repository index
        self.admin_answer: bytes | None = None
        self.extra_models: list[str] = []

    def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=True)

    def RepositoryIndex(self, request: Any, context: Any) -> Any:
        M = service_pb2.RepositoryIndexResponse.ModelIndex
        extra = [M(name=name, state="READY") for name in self.extra_models]
        return service_pb2.RepositoryIndexResponse(
            models=[
                M(name="ensemble", version="1", state="READY"),
                M(name="engine", state=""),
                *extra,
            ]
        )

    def ModelInfer(self, request: Any, context: Any) -> Any:
        """cache_admin's ADMIN call: a fixed answer per op; lora_cache's adapter report for
        `adapters` (cache_admin forwards it there). feedback's call: its inputs echoed."""
        names = [i.name for i in request.inputs]
        if request.model_name == "feedback":
            return self._feedback(request, names, context)
        assert request.model_name == "cache_admin"
        (admin,) = deserialize_bytes_tensor(request.raw_input_contents[names.index("ADMIN")])
        op = json.loads(admin)
        # As cache_admin: no or a wrong token is refused before anything else.
        if "ADMIN_TOKEN" not in names:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "forbidden: no admin token")
        raw = request.raw_input_contents[names.index("ADMIN_TOKEN")]
        if deserialize_bytes_tensor(raw)[0].decode() != TOKEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "forbidden: wrong admin token")
        self.admin_calls.append(op)
        if self.admin_answer is not None:
            resp = service_pb2.ModelInferResponse(model_name="cache_admin", id=request.id)
            _bytes_output(resp, "ADMIN_RESULT", [self.admin_answer])
            return resp
        if op["op"] == "adapters":
            return self._adapters(request, op.get("warm") or [], context)
        return self._cache_admin(request, op, context)

    def _feedback(self, request: Any, names: list[str], context: Any) -> Any:
        values = {
            name: deserialize_bytes_tensor(request.raw_input_contents[i])[0].decode()
            for i, name in enumerate(names)
        }
        self.feedback_calls.append((values, dict(context.invocation_metadata())))
        if values["ANSWER_ID"] != ANSWER_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "forbidden: not this tenant's")
        answer = {"verdict": values["VERDICT"], "served": "semantic", "reaches": "every replica"}
        resp = service_pb2.ModelInferResponse(model_name="feedback", id=request.id)
        _bytes_output(resp, "FEEDBACK_RESULT", [json.dumps(answer)])
        return resp

    def _adapters(self, request: Any, warm: list[str], context: Any) -> Any:
        if "nope" in warm:
            context.abort(grpc.StatusCode.NOT_FOUND, "not found: unknown adapter 'nope'")
        report: dict[str, Any] = {
            "op": "warm" if warm else "list",
            "adapters": [
                {"name": "caps", "task_id": 2, "digest": "ab" * 32, "tier": "engine"},
                {"name": "french", "task_id": 1, "digest": "cd" * 32, "tier": "disk"},
            ],
            "engine_reported": [{"name": "caps", "digest": "ab" * 32}],
        }
        if warm:
            report["warmed"] = {name: _warm_outcome(name) for name in warm}
        resp = service_pb2.ModelInferResponse(model_name="cache_admin", id=request.id)
        _bytes_output(resp, "ADMIN_RESULT", [json.dumps(report)])
        return resp

    def _cache_admin(self, request: Any, op: dict, context: Any) -> Any:
        if op["op"] == "flush" and op.get("confirm") is not True:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "invalid request: confirm")
        if "nope" in op.get("adapters", []):
            context.abort(grpc.StatusCode.NOT_FOUND, "not found: unknown adapter 'nope'")
        stats = {"reachable": True, "entries": 3, "bytes": 120, "max_bytes": 1024}
        answers: dict[str, Any] = {
            "stats": {"tiers": {"l1": {"reachable": False, "note": "per process"}, "l2": stats}},
            "invalidate": {"kind": "tenant", "dropped_l2": 2, "dropped_l3": 0, "reaches": "L2"},
            "flush": {"flushed": {"l2": 3}},
            "warm": {
                "prompts": [
                    {"status": "stored", "digest": "ab" * 32}
                    if p.get("answer")
                    else {"status": "error", "error": "invalid request: answer"}
                    for p in op.get("prompts", [])
                ],
                "adapters": {"warmed": {n: _warm_outcome(n) for n in op.get("adapters", [])}},
            },
        }
        resp = service_pb2.ModelInferResponse(model_name="cache_admin", id=request.id)
        _bytes_output(resp, "ADMIN_RESULT", [json.dumps({"op": op["op"], **answers[op["op"]]})])
        return resp

    def ModelStreamInfer(self, request_iterator: Any, context: Any) -> Iterator[Any]:
        self.stream_headers.append(dict(context.invocation_metadata()))
        for req in request_iterator:
            self.requests.append({i.name: (i.datatype, list(i.shape)) for i in req.inputs})
            names = [i.name for i in req.inputs]
            raw = req.raw_input_contents[names.index("text_input")]
            prompt = deserialize_bytes_tensor(raw)[0].decode()
            if prompt.startswith("error:"):
                yield service_pb2.ModelStreamInferResponse(error_message=prompt[len("error:") :])
                continue
            if prompt == "slow":
                time.sleep(3)
                continue
            if prompt == "vanish":  # the stream closed cleanly, no response at all (a proxy)
                return
            if prompt in ("bad-utf8", "bad-number"):  # a broken server's final response
                final = service_pb2.ModelInferResponse(model_name="ensemble", id=req.id)
                if prompt == "bad-utf8":
                    _bytes_output(final, "cache_status", [b"\xff\xfe"])
                else:
                    _bytes_output(final, "kv_reused_tokens", ["zz"])
                final.parameters["triton_final_response"].bool_param = True
                yield service_pb2.ModelStreamInferResponse(infer_response=final)
                continue
            if prompt in ("drip", "stall"):  # a chunk every 0.3 s for 1.8 s; or one, then 3 s
                for i in range(6 if prompt == "drip" else 1):
                    time.sleep(0.3)
                    resp = service_pb2.ModelInferResponse(model_name="ensemble", id=req.id)
                    _bytes_output(resp, "text_output", [str(i)])
                    resp.parameters["triton_final_response"].bool_param = False
                    yield service_pb2.ModelStreamInferResponse(infer_response=resp)
                if prompt == "stall":
                    time.sleep(3)
                    continue
                final = service_pb2.ModelInferResponse(model_name="ensemble", id=req.id)
                _bytes_output(final, "cache_status", ["miss"])
                final.parameters["triton_final_response"].bool_param = True
                yield service_pb2.ModelStreamInferResponse(infer_response=final)
                continue
            if prompt == "hang":  # never answers; notes when the client's call ends
                context.add_callback(self.hang_ended.set)
                self.hang_started.set()
                while context.is_active():
                    time.sleep(0.02)
                return
            for chunk in ("Hello", ", world"):
                resp = service_pb2.ModelInferResponse(model_name="ensemble", id=req.id)
                _bytes_output(resp, "text_output", [chunk])
                resp.parameters["triton_final_response"].bool_param = False
                yield service_pb2.ModelStreamInferResponse(infer_response=resp)
            final = service_pb2.ModelInferResponse(model_name="ensemble", id=req.id)
            _bytes_output(final, "cache_status", ["semantic"])
            _bytes_output(final, "answer_id", [ANSWER_ID])
            sim = final.outputs.add()
            sim.name, sim.datatype = "cache_similarity", "FP32"
            sim.shape.extend([1, 1])
            final.raw_output_contents.append(np.array([0.9375], dtype=np.float32).tobytes())
            final.parameters["triton_final_response"].bool_param = True
            yield service_pb2.ModelStreamInferResponse(infer_response=final)


@pytest.fixture(autouse=True)
def admin_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake server's admin token file, where the CLI looks by default."""
    path = tmp_path / "admin_token"
    path.write_bytes(TOKEN_BYTES)
    monkeypatch.setenv("TIERCACHE_ADMIN_TOKEN_FILE", str(path))
    return path


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, _FakeTriton]]:
    servicer = _FakeTriton()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def test_generate_streams_chunks_then_result(fake_server: tuple[str, _FakeTriton]) -> None:
    url, servicer = fake_server
    with TierCacheClient(url, timeout_s=10) as client:
        items = list(client.generate("hi", max_tokens=4, tenant="acme"))
        again = client.generate_text("hi")
    assert items[:2] == ["Hello", ", world"]
    result = items[2]
    assert isinstance(result, GenerationResult)
    assert (result.text, result.cache_status, result.chunks) == ("Hello, world", "semantic", 2)
    assert result.similarity == pytest.approx(0.9375)
    assert result.first_chunk_s is not None and 0 <= result.first_chunk_s <= result.latency_s
    assert again.text == "Hello, world"
    assert servicer.requests[-2]["max_tokens"] == ("INT32", [1, 1])
    assert servicer.requests[-2]["tenant"] == ("BYTES", [1, 1])


def test_generate_maps_stream_error(fake_server: tuple[str, _FakeTriton]) -> None:
    url, _ = fake_server
    msg = "in ensemble 'ensemble', invalid request: max_tokens must be >= 1, got 0"
    with TierCacheClient(url, timeout_s=10) as client:
        with pytest.raises(InvalidRequestError) as info:
            client.generate_text(f"error:{msg}")
        assert info.value.message == "max_tokens must be >= 1, got 0"
        with pytest.raises(CapacityError):
            client.generate_text("error:capacity: adapter slots full")
        assert client.generate_text("hi").text == "Hello, world"  # client still usable


def test_generate_times_out(fake_server: tuple[str, _FakeTriton]) -> None:
    url, _ = fake_server
    start = time.monotonic()
    with TierCacheClient(url, timeout_s=0.5) as client, pytest.raises(UnavailableError):
        client.generate_text("slow")
    assert time.monotonic() - start < 2.5


def test_an_idle_timeout_fails_a_stalled_stream_and_lets_a_steady_one_run(
    fake_server: tuple[str, _FakeTriton],
) -> None:
    """`idle_timeout_s`: a generation streaming a chunk every 0.3 s runs its 1.8 s under an idle
    timeout of 1 s (the whole-call timeout alone, at 1 s, fails it); one that sends a chunk and
    then nothing fails within about the idle timeout, not the call's 30 s."""
    url, _ = fake_server
    with TierCacheClient(url, timeout_s=30, idle_timeout_s=1.0) as client:
        assert client.generate_text("drip").text == "012345"
        start = time.monotonic()
        with pytest.raises(UnavailableError, match="for 1 s \\(idle timeout\\)"):
            client.generate_text("stall")
        assert time.monotonic() - start < 3
    with TierCacheClient(url, timeout_s=1.0) as client, pytest.raises(UnavailableError):
        client.generate_text("drip")
    with pytest.raises(ValueError, match="idle_timeout_s"):
        TierCacheClient(url, idle_timeout_s=0)


def test_a_stream_that_ends_without_a_final_response_fails_at_once(
    fake_server: tuple[str, _FakeTriton],
) -> None:
    """A stream closed cleanly with nothing sent (a proxy, a misbehaving server): tritonclient
    calls back nothing, and the call waited its whole timeout, then said "no response"."""
    url, _ = fake_server
    start = time.monotonic()
    with TierCacheClient(url, timeout_s=30) as client:
        with pytest.raises(UnavailableError, match="ended without a final response"):
            client.generate_text("vanish")
        assert client.generate_text("hi").text == "Hello, world"  # still usable
    assert time.monotonic() - start < 5


def test_a_caller_slower_than_the_timeout_still_gets_what_arrived(
    fake_server: tuple[str, _FakeTriton],
) -> None:
    """The server answered within the timeout; the caller took longer over its chunks: what
    is already there is served, not a timeout."""
    url, _ = fake_server
    with TierCacheClient(url, timeout_s=1.0) as client:
        stream = client.generate("hi")
        assert next(stream) == "Hello"
        time.sleep(1.5)
        rest = list(stream)
    assert rest[0] == ", world" and isinstance(rest[-1], GenerationResult)


def test_close_cancels_a_call_in_progress(fake_server: tuple[str, _FakeTriton]) -> None:
    """A generation another thread waits on (or a generator left paused) when the client is
    closed: its stream is cancelled, the server sees the call end and the waiting thread gets
    an error, instead of both holding on (and keeping the process alive) until the timeout."""
    url, servicer = fake_server
    servicer.hang_started.clear()
    servicer.hang_ended.clear()
    client = TierCacheClient(url, timeout_s=60)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            client.generate_text("hang")
        except BaseException as exc:  # noqa: BLE001 - what the waiting thread was told
            outcome.append(exc)

    waiting = threading.Thread(target=wait)
    waiting.start()
    assert servicer.hang_started.wait(10)
    client.close()
    assert servicer.hang_ended.wait(5), "the server's call was kept open"
    waiting.join(5)
    assert not waiting.is_alive() and outcome
    assert isinstance(outcome[0], TierCacheClientError)


def test_health(fake_server: tuple[str, _FakeTriton]) -> None:
    url, _ = fake_server
    with TierCacheClient(url, timeout_s=5) as client:
        assert client.health() == {
            "live": True,
            "ready": True,
            "models": {"ensemble": True, "engine": False},
        }


def test_generate_unreachable_fails_fast() -> None:
    url = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with TierCacheClient(url, timeout_s=3) as client, pytest.raises(ServerUnreachableError):
        client.generate_text("hi")
    assert time.monotonic() - start < 3.5


# ---------------------------------------------------------------- CLI


def test_parser_generate_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCACHE_URL", "triton:9001")
    args = build_parser().parse_args(
        [
            "generate",
            "why?",
            "--max-tokens",
            "5",
            "--temperature",
            "0.2",
            "--top-p",
            "0.9",
            "--top-k",
            "3",
            "--seed",
            "7",
            "--stop",
            "a",
            "--stop",
            "b",
            "--tenant",
            "t",
            "--cache-control",
            "no-cache",
            "--adapter",
            "sql",
            "--no-stream",
            "--json",
        ]
    )
    assert (args.command, args.prompt, args.url) == ("generate", "why?", "triton:9001")
    assert (args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed) == (
        5,
        0.2,
        0.9,
        3,
        7,
    )
    assert (args.stop, args.tenant, args.cache_control, args.lora_name) == (
        ["a", "b"],
        "t",
        "no-cache",
        "sql",
    )
    assert args.stream is False and args.json is True


def test_parser_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCACHE_URL", raising=False)
    args = build_parser().parse_args(["generate", "p"])
    assert args.url == "localhost:8001" and args.stream is True and args.json is False
    assert args.stop is None and args.max_tokens is None
    assert build_parser().parse_args(["health", "--url", "h:1"]).url == "h:1"


def test_parser_rejects_bad_args() -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "p", "--max-tokens", "many"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_summary_line() -> None:
    result = GenerationResult("x", "semantic", 0.95, 0.00123, 0.0009, 1)
    assert summary_line(result) == "[cache: semantic (sim 0.950) | 1.23 ms | first chunk 0.90 ms]"
    assert summary_line(GenerationResult("", "exact", None, 0.002, None, 0)) == (
        "[cache: exact | 2.00 ms]"
    )


def test_cli_generate_stream(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = fake_server
    assert main(["generate", "hi", "--url", url]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello, world\n"
    assert err.startswith("[cache: semantic (sim 0.938) | ")


def test_cli_files_it_cannot_use_are_one_line_errors(
    fake_server: tuple[str, _FakeTriton], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompts file that is not UTF-8 and an API key file holding a line break (which no
    Authorization header can carry) are an `error:` line and exit code 2, not a traceback or
    the server's "internal: Invalid metadata"."""
    url, _ = fake_server
    latin = tmp_path / "prompts.jsonl"
    latin.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    assert main(["warm", "--url", url, "--prompts", str(latin)]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot read {latin}")
    key = tmp_path / "key"
    key.write_text("tc_first\ntc_second\n")
    assert main(["generate", "hi", "--url", url, "--api-key-file", str(key)]) == 2
    assert "line break" in capsys.readouterr().err


def test_cli_generate_json(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = fake_server
    assert main(["generate", "hi", "--url", url, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] == "Hello, world" and record["cache_status"] == "semantic"
    assert set(record) == {
        "text",
        "cache_status",
        "similarity",
        "latency_ms",
        "first_chunk_ms",
        "kv_reused_tokens",
        "kv_computed_tokens",
        "speculated_tokens",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "answer_id",
    }
    assert record["answer_id"] == ANSWER_ID
    # a hit: no engine counts
    assert (
        record["kv_reused_tokens"],
        record["kv_computed_tokens"],
        record["speculated_tokens"],
    ) == (None, None, None)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("invalid request: bad", 2),
        ("not found: adapter 'x'", 2),
        ("capacity: full", 1),
        ("boom", 1),
    ],
)
def test_cli_error_exit_codes(
    fake_server: tuple[str, _FakeTriton],
    capsys: pytest.CaptureFixture[str],
    message: str,
    code: int,
) -> None:
    url, _ = fake_server
    assert main(["generate", f"error:{message}", "--url", url]) == code
    assert capsys.readouterr().err.startswith("error: ")


def test_cli_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"127.0.0.1:{_free_port()}"
    assert main(["health", "--url", url, "--timeout", "3"]) == 1
    assert capsys.readouterr().err.startswith("error: unreachable: ")
    assert main(["generate", "hi", "--url", url, "--timeout", "3"]) == 1


def test_cli_health(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = fake_server
    assert main(["health", "--url", url]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "live: yes",
        "ready: yes",
        "model engine: not ready",
        "model ensemble: ready",
    ]


def test_adapters_lists_tiers_and_warms(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    url, servicer = fake_server
    assert main(["adapters", "--url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["adapter", "task", "digest", "tier", "in", "engine", "pinned"]
    assert lines[1].split() == ["caps", "2", "ab" * 6, "engine", "yes", "no"]
    assert lines[2].split() == ["french", "1", "cd" * 6, "disk", "no", "no"]
    assert main(["adapters", "--url", url, "--warm", "french", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warmed"] == {"french": "loaded"}
    assert servicer.admin_calls[-2:] == [
        {"op": "adapters", "warm": []},
        {"op": "adapters", "warm": ["french"]},
    ]


def test_adapters_unknown_name_exits_2(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = fake_server
    assert main(["adapters", "--url", url, "--warm", "nope"]) == 2
    assert "unknown adapter 'nope'" in capsys.readouterr().err


def test_cli_stats_table_and_json(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    url, fake = fake_server
    assert main(["stats", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "l2" in out and "120" in out and "l1: per process" in out
    assert main(["stats", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tiers"]["l2"]["entries"] == 3
    assert fake.admin_calls[-1] == {"op": "stats"}


def test_cli_invalidate_and_flush(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    url, fake = fake_server
    assert main(["invalidate", "--url", url, "--tenant", "acme"]) == 0
    assert fake.admin_calls[-1] == {"op": "invalidate", "tenant": "acme"}
    assert "dropped 2 from L2" in capsys.readouterr().out
    calls = len(fake.admin_calls)
    assert main(["flush", "--url", url]) == 2  # no --yes: nothing sent
    assert len(fake.admin_calls) == calls
    assert main(["flush", "--url", url, "--yes"]) == 0
    assert fake.admin_calls[-1] == {"op": "flush", "confirm": True}
    assert "flushed l2: 3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["invalidate", "--url", url, "--tag", "a", "--key", "b"])


def test_cli_warm(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url, fake = fake_server
    good = tmp_path / "good.jsonl"
    good.write_text('{"text_input": "a", "answer": "b", "tenant": "t"}\n\n')
    assert main(["warm", "--url", url, "--prompts", str(good), "--adapter", "caps"]) == 0
    assert fake.admin_calls[-2:] == [
        {"op": "warm", "adapters": ["caps"]},  # the adapters first: prompts may name them
        {"op": "warm", "prompts": [{"text_input": "a", "answer": "b", "tenant": "t"}]},
    ]
    out = capsys.readouterr().out
    assert "adapter caps: loaded" in out and "prompt 1: stored" in out
    refused = tmp_path / "refused.jsonl"
    refused.write_text('{"text_input": "a"}\n')
    assert main(["warm", "--url", url, "--prompts", str(refused)]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{\n")
    assert main(["warm", "--url", url, "--prompts", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["warm", "--url", url, "--adapter", "nope"]) == 2
    assert main(["warm", "--url", url]) == 2
    # a line past what JSON readers take (an integer of 5,000 digits, deep nesting): the
    # line named, exit 2, no traceback
    for text in ("1" * 5_000, "[" * 100_000):
        odd = tmp_path / "odd.jsonl"
        odd.write_text('{"text_input": "a", "answer": "b"}\n' + text + "\n")
        assert main(["warm", "--url", url, "--prompts", str(odd)]) == 2
        assert "odd.jsonl:2" in capsys.readouterr().err
    # a file of 2,500 prompts goes in three calls of at most 1,000 (the server's bound), after
    # the adapters' own, progress on stderr, every prompt reported once
    many = tmp_path / "many.jsonl"
    many.write_text("".join(f'{{"text_input": "p{i}", "answer": "b"}}\n' for i in range(2_500)))
    calls = len(fake.admin_calls)
    assert main(["warm", "--url", url, "--prompts", str(many), "--adapter", "caps"]) == 0
    sent = fake.admin_calls[calls:]
    assert [len(c.get("prompts", [])) for c in sent] == [0, 1_000, 1_000, 500]
    assert [c.get("adapters") for c in sent] == [["caps"], None, None, None]
    captured = capsys.readouterr()
    assert "warm: 2500 of 2500 prompts sent" in captured.err
    assert captured.out.count(": stored") == 2_500 and "adapter caps: loaded" in captured.out


# ---------------------------------------------------------------- admin token


def test_read_admin_token_is_the_files_bytes_in_hex(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(TOKEN_BYTES)
    assert read_admin_token(path) == TOKEN
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 32"):
        read_admin_token(path)
    with pytest.raises(OSError):
        read_admin_token(tmp_path / "missing")


def test_admin_calls_carry_the_token(fake_server: tuple[str, _FakeTriton]) -> None:
    url, fake = fake_server
    with TierCacheClient(url, timeout_s=5, admin_token=TOKEN) as client:
        assert client.stats()["op"] == "stats"
        assert client.invalidate(tag="t")["op"] == "invalidate"
        assert client.flush()["op"] == "flush"
        assert client.warm(prompts=[{"text_input": "a", "answer": "b"}])["op"] == "warm"
        assert client.adapters()["op"] == "list"  # through cache_admin, with the token
    assert [c["op"] for c in fake.admin_calls[-5:]] == [
        "stats",
        "invalidate",
        "flush",
        "warm",
        "adapters",
    ]


@pytest.mark.parametrize("token", [None, "00" * 32])
def test_admin_calls_without_the_right_token_are_forbidden(
    fake_server: tuple[str, _FakeTriton], token: str | None
) -> None:
    url, fake = fake_server
    calls = len(fake.admin_calls)
    with TierCacheClient(url, timeout_s=5, admin_token=token) as client:
        for call in (
            client.stats,
            lambda: client.invalidate(tag="t"),
            client.flush,
            lambda: client.warm(adapters=["caps"]),
        ):
            with pytest.raises(ForbiddenError) as info:
                call()
            assert isinstance(info.value, InvalidRequestError)
    assert len(fake.admin_calls) == calls


def test_classify_forbidden() -> None:
    error = classify("forbidden: ADMIN_TOKEN is not the operator's admin token", "INVALID_ARG")
    assert isinstance(error, ForbiddenError) and error.kind == "forbidden"


def test_default_admin_token_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIERCACHE_ADMIN_TOKEN_FILE", "/etc/tiercache/token")
    assert default_admin_token_file() == "/etc/tiercache/token"
    monkeypatch.delenv("TIERCACHE_ADMIN_TOKEN_FILE")
    monkeypatch.setenv("TIERCACHE_STATE_DIR", str(tmp_path))
    assert default_admin_token_file() == str(tmp_path / "admin_token")
    monkeypatch.delenv("TIERCACHE_STATE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_admin_token_file() == str(tmp_path / ".cache" / "tiercache" / "admin_token")


def test_cli_admin_token_file_flag(
    fake_server: tuple[str, _FakeTriton],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = fake_server
    monkeypatch.delenv("TIERCACHE_ADMIN_TOKEN_FILE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert main(["stats", "--url", url]) == 2  # the default file does not exist
    assert "cannot read the admin token" in capsys.readouterr().err
    other = tmp_path / "elsewhere"
    other.write_bytes(TOKEN_BYTES)
    assert main(["stats", "--url", url, "--admin-token-file", str(other)]) == 0
    wrong = tmp_path / "wrong"
    wrong.write_bytes(bytes(32))
    assert main(["flush", "--yes", "--url", url, "--admin-token-file", str(wrong)]) == 2
    assert capsys.readouterr().err.startswith("error: forbidden: wrong admin token")
    with pytest.raises(SystemExit):  # generate takes no admin token
        build_parser().parse_args(["generate", "p", "--admin-token-file", str(other)])


class _RestrictedIndexTriton(_FakeTriton):
    """As `tiercache serve` runs Triton: the repository index is a restricted API."""

    def RepositoryIndex(self, request: Any, context: Any) -> Any:
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "This protocol is restricted, expecting header "
            "'triton-grpc-protocol-tiercache-restricted'",
        )

    def ModelReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ModelReadyResponse(ready=request.name == "ensemble")


def test_health_when_the_repository_index_is_restricted() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_RestrictedIndexTriton(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with TierCacheClient(f"127.0.0.1:{port}", timeout_s=5) as client:
            assert client.health() == {
                "live": True,
                "ready": True,
                "models": {"ensemble": True, "cache_admin": False},
            }
    finally:
        server.stop(grace=None)


def test_an_api_key_goes_as_the_authorization_header(
    fake_server: tuple[str, _FakeTriton], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, fake = fake_server
    with TierCacheClient(url, timeout_s=5, api_key="tc_secret") as client:
        client.generate_text("hello")
    assert fake.stream_headers[-1]["authorization"] == "Bearer tc_secret"
    with TierCacheClient(url, timeout_s=5) as client:
        client.generate_text("hello")
    assert "authorization" not in fake.stream_headers[-1]
    key_file = tmp_path / "key"
    key_file.write_text("tc_from_file\n")
    assert main(["generate", "hello", "--url", url, "--api-key-file", str(key_file)]) == 0
    assert fake.stream_headers[-1]["authorization"] == "Bearer tc_from_file"


def test_cli_feedback_sends_the_id_verdict_tenant_and_api_key(
    fake_server: tuple[str, _FakeTriton], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, servicer = fake_server
    key_file = tmp_path / "key"
    key_file.write_text("tc_secret\n")
    argv = ["feedback", ANSWER_ID, "bad", "--tenant", "acme", "--url", url]
    assert main([*argv, "--api-key-file", str(key_file)]) == 0
    assert capsys.readouterr().out == "bad (semantic): every replica\n"
    values, headers = servicer.feedback_calls[-1]
    assert values == {"ANSWER_ID": ANSWER_ID, "VERDICT": "bad", "tenant": "acme"}
    assert headers["authorization"] == "Bearer tc_secret"
    # the server's refusal is the CLI's exit code 2 with its message
    assert main(["feedback", "a1.other", "good", "--url", url]) == 2
    assert "forbidden" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a verdict argparse does not know
        main(["feedback", ANSWER_ID, "meh", "--url", url])


def test_the_idle_timeout_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """`--idle-timeout` must be positive and finite, as `--timeout` (NaN included)."""
    for bad in ("0", "-1", "nan", "inf"):
        assert main(["generate", "hi", "--idle-timeout", bad]) == 2
        assert "--idle-timeout must be > 0 and finite" in capsys.readouterr().err


def test_warm_splits_adapters_and_an_adapter_that_fails_to_warm_fails_the_command(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    """More than 64 adapter names (the server's bound for one call) go in calls of 64; an
    adapter lora_cache reports it could not warm exits 2 (before, 0: a deploy script read it
    as loaded), in `warm` and in `adapters --warm` alike."""
    url, fake = fake_server
    names = [f"a{i}" for i in range(65)]
    calls = len(fake.admin_calls)
    argv = ["warm", "--url", url]
    for name in names:
        argv += ["--adapter", name]
    assert main(argv) == 0
    assert [c["adapters"] for c in fake.admin_calls[calls:]] == [names[:64], names[64:]]
    assert capsys.readouterr().out.count(": loaded") == 65
    assert main(["warm", "--url", url, "--adapter", "caps", "--adapter", "broken"]) == 2
    assert "adapter broken: error: cannot read its weights" in capsys.readouterr().out
    assert main(["adapters", "--url", url, "--warm", "broken"]) == 2
    assert main(["adapters", "--url", url, "--warm", "broken", "--json"]) == 2
    assert main(["adapters", "--url", url, "--warm", "caps"]) == 0


@pytest.mark.parametrize(
    ("argv", "answer"),
    [
        (["stats"], b"\xff not utf-8"),
        (["stats"], b'{"tiers": ["l1"]}'),
        (["flush", "--yes"], b'{"flushed": ["l2"]}'),
        (["warm", "--prompts", "PROMPTS"], b'{"stored": "many"}'),
        (["warm", "--prompts", "PROMPTS"], b'{"prompts": ["x"]}'),
        (["warm", "--adapter", "caps"], b'{"adapters": {"warmed": ["caps"]}}'),
        (["stats"], b"[" * 100_000),
    ],
)
def test_a_malformed_server_answer_is_an_error_not_a_traceback(
    fake_server: tuple[str, _FakeTriton],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
    answer: bytes,
) -> None:
    url, fake = fake_server
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text_input": "a", "answer": "b"}\n')
    fake.admin_answer = answer
    try:
        code = main([a.replace("PROMPTS", str(prompts)) for a in argv] + ["--url", url])
    finally:
        fake.admin_answer = None
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


@pytest.mark.parametrize("prompt", ["bad-utf8", "bad-number"])
def test_a_malformed_generation_result_is_a_client_error(
    fake_server: tuple[str, _FakeTriton], prompt: str
) -> None:
    """A final response whose strings are not UTF-8 or whose numbers are not numbers raises
    the client's own UnavailableError (callers catch TierCacheClientError), not Python's."""
    url, _ = fake_server
    with TierCacheClient(url, timeout_s=10) as client, pytest.raises(UnavailableError):
        client.generate_text(prompt)


def test_what_a_server_names_reaches_the_terminal_escaped(
    fake_server: tuple[str, _FakeTriton], capsys: pytest.CaptureFixture[str]
) -> None:
    """A model name carrying an escape sequence (which could rewrite the operator's terminal)
    is printed with its control characters escaped."""
    url, fake = fake_server
    fake.extra_models = ["\x1b[2Jevil\nmodel ensemble: ready"]
    try:
        assert main(["health", "--url", url]) == 0
    finally:
        fake.extra_models = []
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "model \\x1b[2Jevil\\nmodel ensemble: ready: ready" in out
    assert shown("caf\u00e9 \u202e") == "caf\u00e9 \\u202e"


def test_an_unresolvable_host_is_unreachable() -> None:
    assert isinstance(
        classify("errors resolving nosuchhost.invalid:1: ...", "StatusCode.UNAVAILABLE"),
        ServerUnreachableError,
    )
