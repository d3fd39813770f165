"""Faults through a real tritonserver (issue 7): Redis killed under perf_analyzer load, Python
backend stubs killed mid-request, a client that cancels its stream, state files damaged while the
server is stopped, and engine refusals that must never be cached.

One server for the module: a copy of model_repository with Redis on a redis-server of its own (so
it can be killed) and torch_llm refusing prompts that match REFUSE_PATTERN. The stub tests and the
damaged-state test restart it on the same state dir (a killed stub is not restarted by Triton
2.51). What each test measures (recovery times, failed requests) is printed (`-s`) and collected
in docs/faults.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis_server import RedisServer

from tiercache.exact.stores import LmdbStore
from tiercache.server import REDIS_STAGES, TritonServer, copy_repository
from tiercache_client import (
    GenerationResult,
    TierCacheClient,
    TierCacheClientError,
    UnavailableError,
)
from tiercache_dev.perf.analyzer import install_perf_analyzer, run_perf_analyzer

from .conftest import (
    MODEL_REPOSITORY,
    RawOutcome,
    metric_value,
    raw_stream_infer,
    settled_metric,
    start_server,
    tensor,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
REFUSE_PATTERN = "(?i)forbidden topic"
REFUSAL_TEXT = "That topic is not served here."
RECOVERY_TIMEOUT_S = 120.0
VICTIM_DEADLINE_S = 20.0  # the client deadline of a request whose stub is killed under it
EMBEDDER_TIMEOUT_S = 2.0  # embedding_cache's deadline on its embedder calls in this server
ENGINE_TIMEOUT_S = 15.0  # llm's deadline per engine response here (a loaded CI waits seconds)
L2_MAX_BYTES = 1 << 30  # CacheConfig's default: the test process opens the server's L2 too


@dataclass(slots=True)
class Faults:
    server: TritonServer
    redis: RedisServer
    prefix: str
    state: Path
    repository: Path


def fault_repository(root: Path, redis_url: str, prefix: str) -> Path:
    shared = {"redis_url": redis_url, "redis_prefix": prefix, "redis_retry_s": "0.5"}
    parameters: dict[str, dict[str, str]] = dict.fromkeys(REDIS_STAGES, shared)
    parameters["torch_llm"] = {
        "refuse_prompt_pattern": REFUSE_PATTERN,
        "refusal_text": REFUSAL_TEXT,
    }
    parameters["embedding_cache"] = {
        **parameters["embedding_cache"],
        "embedder_timeout_s": str(EMBEDDER_TIMEOUT_S),
    }
    parameters["llm"] = {**parameters["llm"], "engine_timeout_s": str(ENGINE_TIMEOUT_S)}
    repository = copy_repository(MODEL_REPOSITORY, root / "model_repository", parameters)
    # the embedder and the engine, each held while a HOLD file lies beside it (held_model.py)
    for model in ("embedder", "torch_llm"):
        version = repository / model / "1"
        (version / "model.py").rename(version / "real_model.py")
        shutil.copyfile(Path(__file__).with_name("held_model.py"), version / "model.py")
    return repository


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    state = tmp_path_factory.mktemp("faults")
    redis_server = RedisServer(state / "redis").start()
    prefix = f"f{uuid.uuid4().hex[:10]}:"
    repository = fault_repository(state, redis_server.url, prefix)
    server = start_server(state, "triton-faults.log", repository)
    setup = Faults(server, redis_server, prefix, state, repository)
    try:
        yield setup
    finally:
        setup.server.stop()
        redis_server.stop()
        stop_stray_stubs(repository)


def stop_stray_stubs(repository: Path) -> None:
    """Stubs of this module's servers that outlived them (a server stopped while one of its
    decoupled stubs was dead left the others running): killed by pid."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and b"triton_python_backend_stub" in argv[0]
            and any(a.startswith(str(repository).encode() + b"/") for a in argv[1:])
        ):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)


def server_died(server: TritonServer) -> bool:
    return server.process is not None and server.process.poll() is not None


def connect(server: TritonServer) -> TierCacheClient:
    return TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=300)


def ask(server: TritonServer, prompt: str, **kwargs: object) -> GenerationResult:
    with connect(server) as client:
        return client.generate_text(prompt, **kwargs)  # type: ignore[arg-type]


def stub_pid(server: TritonServer, model: str) -> int:
    """The Python backend stub serving `model`: a descendant of tritonserver whose command line
    names `<repository>/<model>/1/model.py`."""
    assert server.process is not None
    children: dict[int, list[int]] = {}
    commands: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
        commands[int(entry)] = [a.decode(errors="replace") for a in argv if a]
    wanted = f"/{model}/1/model.py"
    todo, found = [server.process.pid], []
    while todo:
        pid = todo.pop()
        argv = commands.get(pid, [])
        if (
            argv
            and "triton_python_backend_stub" in argv[0]
            and any(a.endswith(wanted) for a in argv)
        ):
            found.append(pid)
        todo.extend(children.get(pid, []))
    assert len(found) == 1, f"stub processes for {model}: {found}"
    return found[0]


def finish_reason(outcome: RawOutcome) -> str | None:
    for result in outcome.responses:
        values = result.as_numpy("finish_reason")
        if values is not None:
            return str(values.reshape(-1)[0].decode())
    return None


def outcome_text(outcome: RawOutcome, name: str = "text_output") -> str:
    parts = []
    for result in outcome.responses:
        values = result.as_numpy(name)
        if values is not None:
            parts.extend(v.decode() for v in values.reshape(-1))
    return "".join(parts)


def l2_texts(state: Path) -> list[str]:
    store = LmdbStore(state / "l2", L2_MAX_BYTES)
    try:
        return [entry.text for _, entry in store.scan()]
    finally:
        store.close()


def l2_keys(state: Path) -> set[str]:
    store = LmdbStore(state / "l2", L2_MAX_BYTES)
    try:
        return {key for key, _ in store.scan()}
    finally:
        store.close()


# -- a dependency that stops answering ------------


def test_an_embedder_that_stops_answering_costs_lookups_one_deadline(faults: Faults) -> None:
    """The embedder's execute held (its stub healthy to Triton, answering nothing): a new prompt
    is still answered, as a miss, once embedding_cache's deadline passed; later new prompts are
    not held at all while the late call is out; cached answers keep being served; and once the
    embedder answers again, lookups embed again."""
    server = faults.server
    tag = uuid.uuid4().hex[:6]
    cached = f"Name one use of the embedder deadline {tag}."
    assert ask(server, cached, max_tokens=4).cache_status == "miss"
    lookups = "tiercache_embedding_cache_lookups_total"
    late = "tiercache_embedding_cache_embedder_late_total"
    errors_before = settled_metric(server, lookups, outcome="error")
    timed_out_before = settled_metric(server, late, event="timed_out")
    refused_before = settled_metric(server, late, event="refused")
    hold = faults.repository / "embedder" / "1" / "HOLD"
    hold.touch()
    try:
        fresh = [f"Name {n} colours of the sea {tag}." for n in ("two", "three", "four", "five")]
        results = [ask(server, prompt, max_tokens=4) for prompt in fresh]
        assert [r.cache_status for r in results] == ["miss"] * len(fresh)
        assert all(r.text for r in results)
        hit = ask(server, cached, max_tokens=4)
        assert hit.cache_status == "exact"
        errors = settled_metric(server, lookups, outcome="error") - errors_before
        timed_out = settled_metric(server, late, event="timed_out") - timed_out_before
        refused = settled_metric(server, late, event="refused") - refused_before
        # one late call per embedding_cache instance at most; every other lookup refused at once
        assert errors == len(fresh)
        assert 1 <= timed_out <= 2
        assert timed_out + refused == len(fresh)
        assert server_died(server) is False
        print(
            f"\nembedder held: {len(fresh)} new prompts answered as misses in "
            f"{', '.join(f'{r.latency_s:.2f}' for r in results)} s ({timed_out:g} waited "
            f"{EMBEDDER_TIMEOUT_S:g} s, {refused:g} refused at once); "
            f"exact hit {hit.latency_s:.3f} s"
        )
    finally:
        hold.unlink(missing_ok=True)
    # the late calls end once the embedder answers; lookups then embed again (not `error`)
    deadline = time.monotonic() + 60
    while True:
        before = settled_metric(server, lookups, outcome="error")
        result = ask(server, f"Name six colours of the sky {uuid.uuid4().hex[:6]}.", max_tokens=4)
        assert result.cache_status == "miss"
        if settled_metric(server, lookups, outcome="error") == before:
            break
        assert time.monotonic() < deadline, "lookups still fail a minute after the release"
        time.sleep(0.5)


def test_an_engine_that_stops_answering_fails_a_miss_after_engine_timeout_s(
    faults: Faults,
) -> None:
    """torch_llm's execute held (its stub healthy to Triton, answering nothing): a new prompt
    fails as unavailable once llm's deadline per engine response passed, counted as timed out;
    cached answers keep being served meanwhile; once the engine answers again, misses are
    generated again."""
    server = faults.server
    tag = uuid.uuid4().hex[:6]
    cached = f"Name one use of the engine deadline {tag}."
    assert ask(server, cached, max_tokens=4).cache_status == "miss"
    late = "tiercache_llm_engine_late_total"
    timed_out_before = settled_metric(server, late, event="timed_out")
    hold = faults.repository / "torch_llm" / "1" / "HOLD"
    hold.touch()
    try:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as info:
            ask(server, f"Name two rivers of the north {tag}.", max_tokens=4)
        waited = time.monotonic() - started
        assert f"no response within {ENGINE_TIMEOUT_S:g} s" in str(info.value)
        assert ENGINE_TIMEOUT_S - 0.5 < waited < ENGINE_TIMEOUT_S + 30, waited
        hit = ask(server, cached, max_tokens=4)
        assert hit.cache_status == "exact"
        assert settled_metric(server, late, event="timed_out") - timed_out_before == 1
        assert server_died(server) is False
        print(
            f"\nengine held: a new prompt failed after {waited:.2f} s ({info.value}); "
            f"exact hit {hit.latency_s:.3f} s"
        )
    finally:
        hold.unlink(missing_ok=True)
    result = ask(server, f"Name three rivers of the south {tag}.", max_tokens=4)
    assert result.cache_status == "miss" and result.text


# -- refusals ------------


def test_refused_prompt_is_answered_twice_and_never_cached(faults: Faults) -> None:
    prompt = f"Tell me about the Forbidden Topic number {uuid.uuid4().hex[:6]}."
    tenant = f"refuse-{uuid.uuid4().hex[:6]}"
    inputs = lambda: [  # noqa: E731 - a fresh tensor list per request
        tensor("text_input", [prompt], "BYTES"),
        tensor("max_tokens", [16], "INT32"),
        tensor("tenant", [tenant], "BYTES"),
    ]
    outcomes = [raw_stream_infer(faults.server, inputs()) for _ in range(2)]
    for outcome in outcomes:
        assert outcome.error is None
        assert outcome_text(outcome) == REFUSAL_TEXT
        assert outcome_text(outcome, "cache_status") == "miss"
        assert finish_reason(outcome) == "content_filter"
    assert REFUSAL_TEXT not in l2_texts(faults.state)
    client = redis.Redis.from_url(faults.redis.url)
    stored = [client.get(k) or b"" for k in client.scan_iter(f"{faults.prefix}e:*")]
    assert all(REFUSAL_TEXT.encode() not in v for v in stored)

    # An ordinary prompt still reports its finish reason and is cached.
    plain = [
        tensor("text_input", [f"Name a colour ({tenant})."], "BYTES"),
        tensor("max_tokens", [4], "INT32"),
    ]
    first = raw_stream_infer(faults.server, plain)
    assert first.error is None and finish_reason(first) in ("stop", "length")
    plain = [
        tensor("text_input", [f"Name a colour ({tenant})."], "BYTES"),
        tensor("max_tokens", [4], "INT32"),
    ]
    again = raw_stream_infer(faults.server, plain)
    assert outcome_text(again, "cache_status") == "exact"


# -- a client that cancels its stream ------------


def test_cancelled_stream_never_leaves_a_partial_answer(faults: Faults) -> None:
    """Closing the client's stream after the first chunk. Triton 2.51 does not pass the
    cancellation from the ensemble to llm, so the generation runs on: the next identical request
    gets the whole answer (joined, generated again, or exact), never the part sent before the
    cancel."""
    prompt = f"List five animals that live in the sea ({uuid.uuid4().hex[:6]})."
    reference = ask(faults.server, prompt, tenant="ref-cancel", max_tokens=24)
    tenant = f"cancel-{uuid.uuid4().hex[:6]}"
    with connect(faults.server) as client:
        stream = client.generate(prompt, tenant=tenant, max_tokens=24)
        first = next(stream)
        assert isinstance(first, str) and first
        stream.close()
    after = ask(faults.server, prompt, tenant=tenant, max_tokens=24)
    print(f"\ncancelled stream: next identical request {after.cache_status!r}")
    assert after.text == reference.text
    assert after.cache_status in ("miss", "exact")


# -- Python backend stubs killed ------------


@dataclass(slots=True)
class Victim:
    """A streamed request read on a thread of its own, for a stub killed under it: its chunks,
    and its end as (when, the final result or the client's error)."""

    thread: threading.Thread
    chunks: list[str]
    outcome: list[tuple[float, object]]


def stream_victim(
    server: TritonServer, prompt: str, tenant: str, max_tokens: int, timeout_s: float
) -> Victim:
    """Start `prompt`'s streamed request; returns once its first chunk came (or it ended)."""
    victim = Victim(threading.Thread(target=lambda: None), [], [])
    first_chunk = threading.Event()

    def read() -> None:
        try:
            with TierCacheClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=timeout_s) as c:
                for item in c.generate(prompt, tenant=tenant, max_tokens=max_tokens):
                    if isinstance(item, str):
                        victim.chunks.append(item)
                        first_chunk.set()
                    else:
                        victim.outcome.append((time.monotonic(), item))
        except TierCacheClientError as exc:
            victim.outcome.append((time.monotonic(), exc))
        finally:
            first_chunk.set()

    victim.thread = threading.Thread(target=read)
    victim.thread.start()
    assert first_chunk.wait(RECOVERY_TIMEOUT_S)
    return victim


def test_llm_stub_killed_mid_generation(faults: Faults) -> None:
    """SIGKILL llm's stub while it streams an answer. llm is decoupled, and Triton 2.51's Python
    backend restarts a dead stub only for models that are not (python_be.cc restarts it in the
    non-decoupled branch of TRITONBACKEND_ModelInstanceExecute): every later request fails at
    once with "Stub process 'llm_0_0' is not healthy" (hits too: llm is the ensemble's last step)
    and the request in flight is never completed by the server (its client deadline ends it).
    Serving comes back with a restart of the server, on the same state. No half-written answer
    is ever stored: the killed prompt is then generated again, whole."""
    server = faults.server
    prompt = f"Write a long story about a lighthouse keeper ({uuid.uuid4().hex[:6]})."
    max_tokens = 64
    reference = ask(server, prompt, tenant="ref-kill", max_tokens=max_tokens)
    assert reference.cache_status == "miss" and reference.text
    tenant = f"kill-{uuid.uuid4().hex[:6]}"

    victim = stream_victim(server, prompt, tenant, max_tokens, VICTIM_DEADLINE_S)
    pid = stub_pid(server, "llm")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    # Not restarted: requests fail at once, for as long as we keep asking (here 10 s). Or, when
    # the stub died holding the Python backend's IPC mutex, tritonserver itself aborts
    # (boost::interprocess::lock_exception; seen once, in one CI run of many): Triton's
    # outcome, not ours. Either way every request fails, and the guarantee below is the project's.
    probe_errors: list[tuple[float, str]] = []
    while time.monotonic() - killed < 10.0 and not server_died(server):
        asked = time.monotonic()
        with pytest.raises(TierCacheClientError) as failed:
            ask(server, "Say OK.", max_tokens=1, cache_control="no-cache, no-store")
        probe_errors.append((time.monotonic() - asked, str(failed.value)))
        time.sleep(0.5)
    if server_died(server):
        assert server.log_path is not None
        log = server.log_path.read_text(errors="replace")
        assert "lock_exception" in log, f"tritonserver exited with {server.process.returncode}"
        print(f"\ntritonserver aborted after the stub kill ({len(probe_errors)} probes before)")
    else:
        assert all("is not healthy" in e for _, e in probe_errors), probe_errors
        with pytest.raises(TierCacheClientError, match="is not healthy"):
            ask(server, prompt, tenant="ref-kill", max_tokens=max_tokens)  # a cached answer too
    victim.thread.join(VICTIM_DEADLINE_S + 60)
    assert not victim.thread.is_alive(), "the in-flight request outlived its client deadline"
    ended_s, result = victim.outcome[0]
    assert len(victim.outcome) == 1
    assert isinstance(result, TierCacheClientError), "a killed generation must not succeed"

    server.stop()
    stop_stray_stubs(faults.repository)
    restarted = time.monotonic()
    log_name = "triton-faults-llm-kill.log"
    faults.server = server = start_server(faults.state, log_name, faults.repository)
    restart_s = time.monotonic() - restarted
    slowest = max((s for s, _ in probe_errors), default=0.0)
    first = probe_errors[0][1] if probe_errors else "(the server had exited)"
    print(
        f"\nllm stub {pid} killed after {len(victim.chunks)} chunks; {len(probe_errors)} probes "
        f"in 10 s all failed in at most {slowest * 1e3:.0f} ms with {first!r}; the in-flight "
        f"request ended {ended_s - killed:.1f} s after the kill with {result!r}; server restart "
        f"on the same state {restart_s:.1f} s"
    )

    # Nothing half-written: the same prompt is the whole greedy answer, generated again.
    again = ask(server, prompt, tenant=tenant, max_tokens=max_tokens)
    assert (again.cache_status, again.text) == ("miss", reference.text)
    assert ask(server, prompt, tenant=tenant, max_tokens=max_tokens).cache_status == "exact"
    cached = ask(server, prompt, tenant="ref-kill", max_tokens=max_tokens)
    assert (cached.cache_status, cached.text) == ("exact", reference.text)


def test_engine_stub_killed_mid_generation(faults: Faults) -> None:
    """SIGKILL torch_llm's stub while it generates an answer. torch_llm is decoupled, so Triton
    2.51 does not restart it either: the request in flight fails (llm's engine stream ends in
    an error, or its deadline per response passes), later misses fail, while exact hits are
    still served (they never reach the engine). After a restart of the server on the same
    state, nothing half-written was stored: the killed prompt is generated again, whole."""
    server = faults.server
    prompt = f"Write a long story about a river pilot ({uuid.uuid4().hex[:6]})."
    max_tokens = 64
    reference = ask(server, prompt, tenant="ref-engine-kill", max_tokens=max_tokens)
    assert reference.cache_status == "miss" and reference.text
    cached = f"Name one use of an engine kill test {uuid.uuid4().hex[:6]}."
    assert ask(server, cached, max_tokens=4).cache_status == "miss"
    tenant = f"engine-kill-{uuid.uuid4().hex[:6]}"

    victim = stream_victim(server, prompt, tenant, max_tokens, 120)
    pid = stub_pid(server, "torch_llm")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    victim.thread.join(ENGINE_TIMEOUT_S + 60)
    assert not victim.thread.is_alive(), "the in-flight request was never ended by the server"
    ((ended, result),) = victim.outcome
    assert isinstance(result, TierCacheClientError), "a killed generation must not succeed"
    assert "engine torch_llm" in str(result), result
    aborted = server_died(server)  # tritonserver itself may abort (the llm kill test says when)
    if not aborted:
        asked = time.monotonic()
        with pytest.raises(TierCacheClientError) as miss_failed:
            ask(server, f"Name two river pilots {uuid.uuid4().hex[:6]}.", max_tokens=4)
        miss_s = time.monotonic() - asked
        hit = ask(server, cached, max_tokens=4)
        assert hit.cache_status == "exact" and hit.text
    server.stop()
    stop_stray_stubs(faults.repository)
    restarted = time.monotonic()
    faults.server = server = start_server(
        faults.state, "triton-faults-engine-kill.log", faults.repository
    )
    restart_s = time.monotonic() - restarted
    if aborted:
        print("\ntritonserver aborted after the engine stub kill")
    else:
        print(
            f"\ntorch_llm stub {pid} killed after {len(victim.chunks)} chunks; the in-flight "
            f"request ended {ended - killed:.1f} s after the kill with {result!r}; a new miss "
            f"failed in {miss_s:.2f} s ({miss_failed.value}); an exact hit was served in "
            f"{hit.latency_s:.3f} s; server restart on the same state {restart_s:.1f} s"
        )
    # Nothing half-written: the same prompt is the whole greedy answer, generated again.
    again = ask(server, prompt, tenant=tenant, max_tokens=max_tokens)
    assert (again.cache_status, again.text) == ("miss", reference.text)


def test_prompt_cache_stub_killed_under_requests(faults: Faults) -> None:
    """SIGKILL prompt_cache's stub under a stream of exact hits. Triton 2.51 did not restart it
    either (no restart is logged): every request fails at once with "Stub process
    'prompt_cache_0_0' is not healthy" until the server restarts. No request is ever answered
    with a wrong or partial text, and the cached answer is served again after the restart (from
    L2: it survives the process)."""
    server = faults.server
    prompt = f"Name a month ({uuid.uuid4().hex[:6]})."
    tenant = f"pc-{uuid.uuid4().hex[:6]}"
    cached = ask(server, prompt, tenant=tenant, max_tokens=4)
    stop = threading.Event()
    results: list[tuple[float, float, str]] = []  # (sent, took, outcome)

    def hammer() -> None:
        address = f"127.0.0.1:{server.ports.grpc}"
        with TierCacheClient(address, timeout_s=VICTIM_DEADLINE_S) as client:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    got = client.generate_text(prompt, tenant=tenant, max_tokens=4)
                    outcome = f"ok {got.cache_status} {got.text == cached.text}"
                except TierCacheClientError as exc:
                    outcome = f"error {exc}"
                    time.sleep(0.05)
                results.append((sent, time.monotonic() - sent, outcome))

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    pid = stub_pid(server, "prompt_cache")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    time.sleep(10.0)
    stop.set()
    for t in threads:
        t.join(VICTIM_DEADLINE_S + 60)
    assert not any(t.is_alive() for t in threads)
    # Answered before the kill, answered across it (in flight at the kill), sent after it.
    before = [r for sent, took, r in results if sent + took < killed]
    across = [r for sent, took, r in results if sent < killed <= sent + took]
    after = [(took, r) for sent, took, r in results if sent >= killed]
    print(
        f"\nprompt_cache stub {pid} killed: {len(before)} requests answered before, all "
        f"{sorted(set(before))}; in flight at the kill: {across}; {len(after)} sent after in 10 s: "
        f"{sorted({r for _, r in after})}, each failing in at most "
        f"{max(took for took, _ in after) * 1e3:.0f} ms"
    )
    assert before and all(r == "ok exact True" for r in before)
    assert all(r == "ok exact True" or "is not healthy" in r for r in across)
    assert after and all("is not healthy" in r for _, r in after)  # never a wrong text

    server.stop()
    stop_stray_stubs(faults.repository)
    restarted = time.monotonic()
    log_name = "triton-faults-pc-kill.log"
    faults.server = server = start_server(faults.state, log_name, faults.repository)
    print(f"server restart on the same state: {time.monotonic() - restarted:.1f} s")
    again = ask(server, prompt, tenant=tenant, max_tokens=4)
    assert (again.cache_status, again.text) == ("exact", cached.text)


# -- Redis killed under perf_analyzer load ------------


def perf_inputs(path: Path, tenant: str, count: int = 60) -> None:
    """Half new prompts, half repeats of earlier ones, 4 tokens each, streamed."""
    entries = []
    for i in range(count):
        n = i if i % 2 == 0 else (i // 4) * 2  # odd entries repeat an earlier even one
        entries.append(
            {
                "text_input": {"content": [f"Give one word for the number {n}."], "shape": [1]},
                "max_tokens": {"content": [4], "shape": [1]},
                "stream": {"content": [True], "shape": [1]},
                "tenant": {"content": [tenant], "shape": [1]},
            }
        )
    path.write_text(json.dumps({"data": entries}))


def l3_keys(faults: Faults) -> int:
    client = redis.Redis.from_url(faults.redis.url, socket_timeout=2)
    return sum(1 for _ in client.scan_iter(f"{faults.prefix}e:*"))


def test_redis_killed_under_perf_analyzer_load(faults: Faults) -> None:
    perf_analyzer = install_perf_analyzer(REPO / ".perf" / "pa")
    work = faults.state / "perf"
    work.mkdir(exist_ok=True)
    inputs = work / "inputs.json"
    perf_inputs(inputs, f"perf-{uuid.uuid4().hex[:6]}", count=200)
    args = [
        "-m", "ensemble",
        "-i", "grpc",
        "-u", f"127.0.0.1:{faults.server.ports.grpc}",
        "--streaming",
        "--input-data", str(inputs),
        "--concurrency-range", "2",
        "--request-count", "400",
        "-f", str(work / "perf.csv"),
    ]  # fmt: skip
    for name, value in faults.server.restricted_headers.items():  # it reads the model config
        args += ["-H", f"{name}:{value}"]
    timeline: list[str] = []

    def outage() -> None:
        time.sleep(12)
        faults.redis.kill()
        timeline.append(f"{time.monotonic():.1f} redis killed")
        time.sleep(5)
        faults.redis.start()
        timeline.append(f"{time.monotonic():.1f} redis back")

    failed_before = metric_value(faults.server, "nv_inference_request_failure", model="ensemble")
    killer = threading.Thread(target=outage)
    started = time.monotonic()
    killer.start()
    run = run_perf_analyzer(
        perf_analyzer, args, log_path=work / "perf.txt", timeout_s=300, server=faults.server
    )
    killer.join()
    failed = (
        metric_value(faults.server, "nv_inference_request_failure", model="ensemble")
        - failed_before
    )
    print(
        f"\nperf_analyzer exit {run.returncode} after {run.wall_s:.1f} s (started {started:.1f}); "
        f"{timeline}; ensemble failures {failed:.0f}; levels {run.levels}"
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "error" not in run.stderr.lower(), run.stderr[-2000:]
    assert failed == 0
    assert run.levels and all(level.request_count > 0 for level in run.levels.values())

    # After Redis returns, new answers reach it again ...
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    tenant = f"l3-{uuid.uuid4().hex[:6]}"
    prompt = f"Name a river ({tenant})."
    before = l2_keys(faults.state)
    while True:
        result = ask(faults.server, prompt, tenant=tenant, max_tokens=4)
        if l3_keys(faults) > 0:
            break
        assert time.monotonic() < deadline, "no answer reached Redis after it came back"
        prompt = f"Name a river ({tenant}, {time.monotonic():.3f})."
    # ... and are served from L3: the entry leaves this host's L2, and the next request for it
    # is an exact hit counted on tier l3 (prompt_cache's L1 never held it: llm writes L2 and L3).
    # The new keys are the answer's and its prompt's draft copy (docs/speculation.md).
    new_keys = l2_keys(faults.state) - before
    assert 1 <= len(new_keys) <= 2, new_keys
    store = LmdbStore(faults.state / "l2", L2_MAX_BYTES)
    try:
        for key in new_keys:
            assert store.delete(key)
    finally:
        store.close()
    l3_hits = metric_value(faults.server, "tiercache_prompt_cache_hits_total", tier="l3")
    from_l3 = ask(faults.server, prompt, tenant=tenant, max_tokens=4)
    assert (from_l3.cache_status, from_l3.text) == ("exact", result.text)
    deadline = time.monotonic() + 10
    while metric_value(faults.server, "tiercache_prompt_cache_hits_total", tier="l3") <= l3_hits:
        assert time.monotonic() < deadline, "the hit was not counted on L3"
        time.sleep(0.25)


# -- state damaged while the server is stopped ------------


def damage_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def damage_overwrite(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xa5" * min(4096, max(1, size // 4)))


def state_files(state: Path) -> list[Path]:
    """Every file a restart reads: LMDB stores (L2, semantic row log, vector cache), the semantic
    index's shared tables, the adapters' task ids."""
    found = [state / name / "data.mdb" for name in ("l2", "semantic", "vectors")]
    found += sorted((state / "semantic").rglob("*.tbl"))
    found.append(state / "lora" / "task_ids.json")
    return [p for p in found if p.exists() and p.stat().st_size > 0]


@pytest.mark.parametrize(
    "damage", [damage_truncate, damage_overwrite], ids=["truncated", "overwritten"]
)
def test_damaged_state_files_after_restart(faults: Faults, damage: Callable[[Path], None]) -> None:
    tenant = f"dmg-{uuid.uuid4().hex[:6]}"
    prompts = [f"Name a fruit ({tenant}, {i})." for i in range(3)]
    answers = {p: ask(faults.server, p, tenant=tenant, max_tokens=6).text for p in prompts}
    assert all(
        ask(faults.server, p, tenant=tenant, max_tokens=6).cache_status == "exact" for p in prompts
    )
    faults.server.stop()
    faults.redis.kill()  # else L3 would answer: this test is about the host's own files
    damaged = state_files(faults.state)
    for path in damaged:
        damage(path)
    names = [str(p.relative_to(faults.state)) for p in damaged]
    aside_before = len(list(faults.state.glob("l2.corrupt-*")))
    started = time.monotonic()
    log_name = f"triton-faults-{damage.__name__}.log"
    faults.server = start_server(faults.state, log_name, faults.repository)
    print(f"\n{damage.__name__}: {names}; ready again in {time.monotonic() - started:.1f} s")
    assert "l2/data.mdb" in names
    try:
        for prompt in prompts:
            result = ask(faults.server, prompt, tenant=tenant, max_tokens=6)
            # A damaged entry is a miss that generates the same greedy text again, never a
            # wrong or partial one; the next request is an exact hit in the rebuilt L2.
            assert result.text == answers[prompt]
            assert result.cache_status in ("miss", "exact")
            again = ask(faults.server, prompt, tenant=tenant, max_tokens=6)
            assert (again.cache_status, again.text) == ("exact", answers[prompt])
        semantic = ask(faults.server, f"Name one fruit ({tenant}, 0).", tenant=tenant, max_tokens=6)
        assert semantic.text
    finally:
        faults.redis.start()
    moved = len(list(faults.state.glob("l2.corrupt-*"))) - aside_before
    print(f"{damage.__name__}: L2 moved aside and rebuilt: {bool(moved)}")
    if damage is damage_truncate:
        assert moved == 1, "the truncated L2 was not moved aside"
