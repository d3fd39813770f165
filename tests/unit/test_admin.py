"""tiercache.admin without Redis: stats, flush, warm (prompt_cache then hits `exact` with the
warmed answer), local invalidation, the ADMIN protocol's errors, and the admin token (its file
and the gate in front of every operation)."""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import multiprocessing
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.adapter_types import AdapterRef
from tiercache.admin import (
    Admin,
    AdminGate,
    GateStats,
    admin_token_path,
    load_or_create_admin_token,
)
from tiercache.config import CacheAdminConfig
from tiercache.errors import ConfigError, Forbidden, InvalidRequest, NotFound
from tiercache.exact.keys import EngineIdentity
from tiercache.exact.request import RawInputs
from tiercache.stages.parts import open_admin, open_exact_cache
from tiercache.vocabulary import CacheStatus

ENGINE = EngineIdentity("m", "r1")


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def admin(tmp_path: Path, clock: Clock) -> Iterator[Admin]:
    config = CacheAdminConfig(state_dir=str(tmp_path), l2_max_bytes=16 << 20)
    found = open_admin(config, ENGINE, clock=clock)
    yield found
    found.cache.close()


def run(admin: Admin, **op: object) -> dict:
    return admin.run(json.dumps(op)).result


def test_warm_then_prompt_cache_hits_exact(admin: Admin) -> None:
    result = run(
        admin,
        op="warm",
        prompts=[
            {"text_input": "Capital of France?", "answer": "Paris.", "tenant": "acme"},
            {"text_input": "x", "answer": "y", "temperature": 0.7},  # sampled, no seed
            {"text_input": "x"},  # no answer
            {"text_input": "x", "answer": "y", "max_tokens": "9"},
            {"text_input": "x", "answer": "y", "lora_name": "nope"},
        ],
    )
    items = result["prompts"]
    assert [i["status"] for i in items] == ["stored", "error", "error", "error", "error"]
    assert (result["stored"], result["failed"]) == (1, 4)
    assert "not found" in items[4]["error"]
    # the tenant is normalized as prompt_cache normalizes it
    hit = admin.prompts.lookup(RawInputs("Capital of France?", tenant=" acme "))
    assert (hit.status, hit.text, hit.digest) == (CacheStatus.EXACT, "Paris.", items[0]["digest"])
    other = admin.prompts.lookup(RawInputs("Capital of France?", tenant="other"))
    assert other.status is CacheStatus.MISS


def test_a_value_under_a_requests_key_made_for_another_tenant_or_adapter_is_a_miss(
    admin: Admin,
) -> None:
    """L2's checksum does not cover the key: a value moved under another key (a damaged page
    pointer, a local writer) was served as that request's answer, another tenant's included.
    A value whose tenant scope or adapter is not the request's is a miss now."""
    (item,) = run(
        admin, op="warm", prompts=[{"text_input": "Capital?", "answer": "Paris.", "tenant": "acme"}]
    )["prompts"]
    digest = item["digest"]
    hit = admin.prompts.lookup(RawInputs("Capital?", tenant="acme"))
    assert (hit.status, hit.text) == (CacheStatus.EXACT, "Paris.")
    for moved in ({"tenant_scope": "f" * 64}, {"adapter": "a" * 64}):
        admin.cache.put(digest, "someone else's answer", **moved)  # type: ignore[arg-type]
        found = admin.prompts.lookup(RawInputs("Capital?", tenant="acme"))
        assert found.status is CacheStatus.MISS and found.text == ""


def test_warm_is_bounded_per_call_and_an_op_that_is_no_string_is_a_clear_error(
    admin: Admin,
) -> None:
    """One call of a million prompts stored on for minutes after its client gave up, every
    other admin call waiting behind it; a warmed answer could be any size; an op that was a
    list or an object was an internal TypeError."""
    from tiercache.admin import MAX_WARM_ANSWER_CHARS, MAX_WARM_PROMPTS
    from tiercache.errors import InvalidRequest

    many = [{"text_input": f"p{i}", "answer": "a"} for i in range(MAX_WARM_PROMPTS + 1)]
    with pytest.raises(InvalidRequest, match=f"at most {MAX_WARM_PROMPTS}"):
        run(admin, op="warm", prompts=many)
    assert admin.prompts.lookup(RawInputs("p0")).status is CacheStatus.MISS  # none stored
    long = {"text_input": "q", "answer": "x" * (MAX_WARM_ANSWER_CHARS + 1)}
    (item,) = run(admin, op="warm", prompts=[long])["prompts"]
    assert item["status"] == "error" and "at most" in item["error"]
    for op in ([], {}, 5):
        with pytest.raises(InvalidRequest, match="op one of"):
            admin.run(json.dumps({"op": op}))


def test_warm_refuses_a_number_past_floats_range_for_that_prompt_alone(admin: Admin) -> None:
    result = run(
        admin,
        op="warm",
        prompts=[
            {"text_input": "x", "answer": "y", "temperature": 10**400},
            {"text_input": "Capital of France?", "answer": "Paris."},
        ],
    )
    items = result["prompts"]
    assert [i["status"] for i in items] == ["error", "stored"]
    assert "temperature must be a finite number" in items[0]["error"]


def test_warm_refuses_an_answer_with_a_lone_surrogate_for_that_prompt_alone(admin: Admin) -> None:
    result = run(
        admin,
        op="warm",
        prompts=[
            {"text_input": "x", "answer": "bad \ud800 answer"},
            {"text_input": "Capital of France?", "answer": "Paris."},
        ],
    )
    items = result["prompts"]
    assert [i["status"] for i in items] == ["error", "stored"]
    assert "not valid Unicode" in items[0]["error"]


def test_a_store_failing_mid_warm_is_that_prompts_error_alone(
    admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that fails on one prompt (a full disk, a damaged file) is reported for that
    prompt; the ones before and after it are stored and said to be, instead of the whole warm
    failing after some prompts were stored without saying which."""
    real = admin.cache.put

    def put(key: str, text: str, **kwargs: object) -> object:
        if text == "2":
            raise OSError(28, "No space left on device")
        return real(key, text, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(admin.cache, "put", put)
    prompts = [{"text_input": t, "answer": a} for t, a in (("a", "1"), ("b", "2"), ("c", "3"))]
    result = run(admin, op="warm", prompts=prompts)
    assert [p["status"] for p in result["prompts"]] == ["stored", "error", "stored"]
    assert result["prompts"][1]["error"] == "storing it failed: OSError"
    assert (result["stored"], result["failed"]) == (2, 1)


def test_warm_again_replaces_the_answer(admin: Admin) -> None:
    first = run(admin, op="warm", prompts=[{"text_input": "Capital of France?", "answer": "Lyon."}])
    again = run(
        admin, op="warm", prompts=[{"text_input": "Capital of France?", "answer": "Paris."}]
    )
    assert again["prompts"][0] == {"status": "stored", "digest": first["prompts"][0]["digest"]}
    assert admin.prompts.lookup(RawInputs("Capital of France?")).text == "Paris."
    no_store = {"text_input": "Capital of France?", "answer": "x", "cache_control": "no-store"}
    assert run(admin, op="warm", prompts=[no_store])["prompts"][0]["status"] == "error"
    assert admin.prompts.lookup(RawInputs("Capital of France?")).text == "Paris."


def test_stats_counts_l2_and_says_l1_is_unreachable(admin: Admin) -> None:
    run(admin, op="warm", prompts=[{"text_input": "a", "answer": "b"}])
    stats = run(admin, op="stats")
    assert stats["tiers"]["l1"]["reachable"] is False
    assert stats["tiers"]["l2"]["entries"] == 1
    assert stats["tiers"]["l2"]["bytes"] > 0
    assert "l3" not in stats["tiers"] and stats["redis"] is False


def test_flush_needs_confirm(admin: Admin) -> None:
    run(admin, op="warm", prompts=[{"text_input": "a", "answer": "b"}])
    for bad in ({}, {"confirm": False}, {"confirm": "yes"}):
        with pytest.raises(InvalidRequest, match="confirm"):
            run(admin, op="flush", **bad)
    assert run(admin, op="stats")["tiers"]["l2"]["entries"] == 1
    assert run(admin, op="flush", confirm=True)["flushed"] == {"l2": 1}
    assert run(admin, op="stats")["tiers"]["l2"]["entries"] == 0
    assert admin.prompts.lookup(RawInputs("a")).status is CacheStatus.MISS


def test_invalidate_tenant_and_tag_locally(admin: Admin, clock: Clock) -> None:
    run(
        admin,
        op="warm",
        prompts=[
            {"text_input": "a", "answer": "1", "tenant": "acme"},
            {"text_input": "b", "answer": "2", "tenant": "acme"},
            {"text_input": "a", "answer": "3", "tenant": "beta", "cache_control": "tag=kb"},
        ],
    )
    report = run(admin, op="invalidate", tenant="acme")
    assert (report["kind"], report["dropped_l2"], report["published"]) == ("tenant", 2, False)
    assert "this host only" in report["reaches"]
    assert admin.prompts.lookup(RawInputs("a", tenant="acme")).status is CacheStatus.MISS
    beta = admin.prompts.lookup(RawInputs("a", tenant="beta", cache_control="tag=kb"))
    assert beta.status is CacheStatus.EXACT
    assert run(admin, op="invalidate", tag="kb")["dropped_l2"] == 1
    # a warm after the invalidation (past the clock-skew margin) is served again
    clock.now_s += 1.0
    run(admin, op="warm", prompts=[{"text_input": "a", "answer": "4", "tenant": "acme"}])
    again = admin.prompts.lookup(RawInputs("a", tenant="acme"))
    assert (again.status, again.text) == (CacheStatus.EXACT, "4")


def test_invalidate_refuses_a_tenant_or_tag_that_could_match_nothing(admin: Admin) -> None:
    """A tenant name that is not valid Unicode (a lone surrogate) or too long, and a tag that
    no request can carry (cache_control's tag alphabet), are the caller's error, not an
    internal one nor an invalidation that silently matches nothing; a tag with blanks around
    it is taken trimmed."""
    for op in (
        {"tenant": "\ud800"},
        {"tenant": "t" * 10_000},
        {"tag": "kb v7"},
        {"tag": "k" * 200},
    ):
        with pytest.raises(InvalidRequest):
            run(admin, op="invalidate", **op)
    assert run(admin, op="invalidate", tag=" kb:v7 ")["value"] == "kb:v7"


def test_flush_says_when_a_tier_could_not_be_flushed(tmp_path: Path) -> None:
    """With Redis down, a flush empties this host's L2 and then says L3 was not flushed
    (Unavailable, naming what was), instead of answering that it flushed nothing there; stats
    say L3 is unreachable."""
    from tiercache.errors import Unavailable

    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    url = f"redis://127.0.0.1:{port.getsockname()[1]}/0"  # nothing listens
    port.close()
    config = CacheAdminConfig(state_dir=str(tmp_path), l2_max_bytes=16 << 20, redis_url=url)
    admin = open_admin(config, ENGINE)
    try:
        run(admin, op="warm", prompts=[{"text_input": "a", "answer": "1"}])
        assert run(admin, op="stats")["tiers"]["l3"]["reachable"] is False
        with pytest.raises(Unavailable, match="l3 could not be flushed.*l2 \\(1 entries\\)"):
            run(admin, op="flush", confirm=True)
    finally:
        admin.cache.close()


def test_invalidate_by_key(admin: Admin) -> None:
    digest = run(admin, op="warm", prompts=[{"text_input": "a", "answer": "b"}])["prompts"][0][
        "digest"
    ]
    assert run(admin, op="invalidate", key=digest)["dropped_l2"] == 1
    assert admin.prompts.lookup(RawInputs("a")).status is CacheStatus.MISS


def test_invalidate_adapter_by_name_or_digest(tmp_path: Path, clock: Clock) -> None:
    digests = {"french": "ab" * 32, "caps": "cd" * 32}

    def resolve(name: str) -> AdapterRef:
        if name not in digests:
            raise NotFound(f"unknown adapter {name!r}")
        return AdapterRef(name, 1 + sorted(digests).index(name), digests[name])

    config = CacheAdminConfig(state_dir=str(tmp_path), l2_max_bytes=16 << 20)
    admin = open_admin(config, ENGINE, resolve, clock=clock)
    try:
        prompts = [{"text_input": t, "answer": "x", "lora_name": n} for t in "ab" for n in digests]
        assert run(admin, op="warm", prompts=prompts)["stored"] == 4
        report = run(admin, op="invalidate", adapter=" french ")
        assert (report["value"], report["dropped_l2"]) == (digests["french"], 2)
        assert run(admin, op="invalidate", adapter=digests["caps"].upper())["dropped_l2"] == 2
        with pytest.raises(NotFound, match="unknown adapter 'nope'"):
            run(admin, op="invalidate", adapter="nope")
    finally:
        admin.cache.close()


def test_invalidate_key_is_normalized_and_checked(admin: Admin) -> None:
    digest = run(admin, op="warm", prompts=[{"text_input": "a", "answer": "b"}])["prompts"][0][
        "digest"
    ]
    assert run(admin, op="invalidate", key=f" {digest.upper()} ")["dropped_l2"] == 1
    for bad in ("abc", "g" * 64, digest + "0"):
        with pytest.raises(InvalidRequest, match="64-character hex digest"):
            run(admin, op="invalidate", key=bad)


def test_invalidate_adapter_name_without_adapters_is_not_found(admin: Admin) -> None:
    with pytest.raises(NotFound, match="no adapters are configured"):
        run(admin, op="invalidate", adapter="french")
    assert run(admin, op="invalidate", adapter="0" * 64)["dropped_l2"] == 0


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        '{"op": "nope"}',
        '{"op": "stats", "x": 1}',
        '{"op": "invalidate"}',
        '{"op": "invalidate", "tag": "a", "tenant": "b"}',
        '{"op": "invalidate", "tag": ""}',
        '{"op": "warm"}',
        '{"op": "warm", "prompts": {}}',
        '{"op": "warm", "adapters": "french"}',
        '{"op": "warm", "adapters": ["french"]}',  # no lora_cache behind this admin
        "1" * 5000,  # a number past Python's int-parsing limit
        '{"op": "stats", "n": ' + "1" * 5000 + "}",
        "[" * 100_000,  # nesting past the JSON decoder's recursion limit
    ],
)
def test_bad_admin_is_invalid_request(admin: Admin, text: str) -> None:
    with pytest.raises(InvalidRequest):
        admin.run(text)


def test_warm_adapters_forwarded(admin: Admin) -> None:
    asked: list[list[str]] = []

    def lora(op: dict) -> dict:
        if op["op"] == "list":
            return {"op": "list", "adapters": []}
        asked.append(list(op["names"]))
        if "nope" in asked[-1]:
            raise NotFound("unknown adapter 'nope'")
        return {"warmed": {n: "loaded" for n in asked[-1]}}

    admin.lora_admin = lora
    result = run(admin, op="warm", adapters=["french"])
    assert result["adapters"] == {"warmed": {"french": "loaded"}}
    assert "prompts" not in result
    with pytest.raises(NotFound):
        run(admin, op="warm", adapters=["nope"])
    assert run(admin, op="adapters") == {"op": "list", "adapters": []}
    assert run(admin, op="adapters", warm=["french"]) == {"warmed": {"french": "loaded"}}
    with pytest.raises(InvalidRequest, match="list of adapter names"):
        run(admin, op="adapters", warm="french")


def _invalidate_tag_elsewhere(state_dir: str, tag: str) -> None:
    """In another process, as cache_admin does: record the watermark, sweep L2."""
    config = CacheAdminConfig(state_dir=state_dir, l2_max_bytes=16 << 20)
    other = open_admin(config, ENGINE)
    try:
        assert run(other, op="invalidate", tag=tag)["published"] is False
    finally:
        other.cache.close()


def test_without_redis_an_invalidation_reaches_the_hosts_other_processes(tmp_path: Path) -> None:
    """Before, the watermark stayed in cache_admin's process: prompt_cache's L1 copies kept being
    served, and so did an answer an llm process wrote after the sweep (its generation started
    before the invalidation)."""
    import multiprocessing

    config = CacheAdminConfig(state_dir=str(tmp_path), l2_max_bytes=16 << 20)
    # this process: an L1 (as prompt_cache has) and the host's L2
    here = open_exact_cache(dataclasses.replace(config.cache(), l1_max_bytes=64 << 20)).cache
    try:
        here.put("copied", "old", tags=("kb",))
        assert here.get("copied") is not None  # now in this process's L1 too
        started_s = time.time() - 5.0
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(target=_invalidate_tag_elsewhere, args=(str(tmp_path), "kb"))
        process.start()
        process.join(60)
        assert process.exitcode == 0
        # written after the sweep by a generation that started before the invalidation
        here.put("in-flight", "stale", tags=("kb",), created_s=started_s)
        assert here.get("copied") is None and here.get("in-flight") is None
        time.sleep(0.1)  # past the watermark's clock-skew margin (50 ms)
        here.put("fresh", "new", tags=("kb",))  # generated after it: served
        assert here.get("fresh") is not None
    finally:
        here.close()


# ---- the admin token ----------------------------------------------------------------------------


def test_admin_token_path_state_dir_or_environment(tmp_path: Path) -> None:
    assert admin_token_path(tmp_path, {}) == tmp_path / "admin_token"
    named = {"TIERCACHE_ADMIN_TOKEN_FILE": "/run/secrets/tiercache_admin"}
    assert admin_token_path(tmp_path, named) == Path("/run/secrets/tiercache_admin")


def test_admin_token_created_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "state" / "admin_token"
    token = load_or_create_admin_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes()) == 32 and token == path.read_bytes().hex()
    assert load_or_create_admin_token(path) == token
    assert load_or_create_admin_token(tmp_path / "other") != token


def _create_token(path: Path, results: multiprocessing.Queue) -> None:
    results.put(load_or_create_admin_token(path))


def test_admin_token_race_free_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "admin_token"
    results: multiprocessing.Queue = multiprocessing.Queue()
    workers = [
        multiprocessing.Process(target=_create_token, args=(path, results)) for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert len({results.get(timeout=5) for _ in workers}) == 1


def test_operator_token_file_serves_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"operator-chosen random text, 40 bytes..")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        assert load_or_create_admin_token(path) == path.read_bytes().hex()
    assert "readable by other users" in caplog.text
    path.write_bytes(b"too short")
    with pytest.raises(ConfigError, match="fewer than 32 bytes"):
        load_or_create_admin_token(path)


def test_gate_lets_the_token_through_and_counts_refusals() -> None:
    token = "ab" * 32
    gate = AdminGate(token)
    gate.check(token)
    for given, reason in [(None, "missing"), ("", "missing"), ("ab" * 31 + "ac", "wrong")]:
        with pytest.raises(Forbidden) as info:
            gate.check(given)
        assert info.value.client_message().startswith("forbidden: ")
        assert ("ADMIN_TOKEN is not" in info.value.message) == (reason == "wrong")
    with pytest.raises(Forbidden):
        gate.check("é" * 64)  # not ASCII: refused, not an error of its own
    assert gate.stats() == GateStats(allowed=1, refused_missing=2, refused_wrong=2)


def test_gate_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token is compared with hmac.compare_digest, whose time does not depend on where the
    first differing byte is (a timing measurement over gRPC could not resolve it anyway)."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("tiercache.admin.hmac.compare_digest", spy)
    gate = AdminGate("cd" * 32)
    with pytest.raises(Forbidden):
        gate.check("00" * 32)
    gate.check("cd" * 32)
    assert compared == [(b"00" * 32, b"cd" * 32), (b"cd" * 32, b"cd" * 32)]


def test_gate_refuses_a_short_token() -> None:
    with pytest.raises(ValueError):
        AdminGate("ab" * 8)


def test_l1_evicts_by_the_policy_l1_eviction_names(tmp_path: Path) -> None:
    from tiercache.eviction import GreedyDualFrequencyPolicy, LruPolicy

    config = CacheAdminConfig(state_dir=str(tmp_path), l2_max_bytes=16 << 20).cache()
    for name, kind in (("gdsf", GreedyDualFrequencyPolicy), ("lru", LruPolicy)):
        chosen = dataclasses.replace(config, l1_max_bytes=1 << 20, l1_eviction=name)
        cache = open_exact_cache(chosen).cache
        try:
            l1 = cache.tiers[0].store
            assert isinstance(l1._policy, kind)  # noqa: SLF001 - which policy the stage built
        finally:
            cache.close()
    assert dataclasses.replace(config, l1_max_bytes=1).l1_eviction == "gdsf"  # the default
