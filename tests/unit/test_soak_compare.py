"""tiercache_dev.perf.soak --compare, the parts that need no server: argument checks, the
repositories it builds, per-round ratios, the report's last line, compare.json's shape and the
CPU-by-process arithmetic."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

import psutil
import pytest

from tiercache.config import STAGE_CONFIGS, LlmConfig
from tiercache_dev.perf.analyzer import LevelStats
from tiercache_dev.perf.soak import (
    FINAL_RATIO,
    L1_STAGES,
    OFF,
    RESPONSE_CACHE,
    TIERCACHE,
    Ask,
    CpuSample,
    Run,
    compare_ratios,
    compare_report,
    compare_summary,
    cpu_breakdown,
    cpu_snapshot,
    final_line,
    generation_bounds,
    parse_args,
    response_cache_repository,
    status_counters,
    status_line,
    tiercache_repository,
    top_thread_groups,
)


@pytest.fixture
def pairs(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        json.dumps({"a": "What is a cache?", "b": "What's a cache?", "label": 1}) + "\n"
    )
    return path


def args_for(pairs: Path, *extra: str) -> argparse.Namespace:
    return parse_args(["--pairs", str(pairs), *extra])


def run(
    config: str,
    round_no: int,
    throughput: float,
    p50_ms: float,
    tokens: int = 100,
    wall_s: float = 100.0,
) -> Run:
    level = LevelStats(
        concurrency=8,
        throughput=throughput,
        p50_us=p50_ms * 1000,
        p99_us=p50_ms * 2000,
        request_count=int(throughput * wall_s),
    )
    statuses = {"status:miss": 10, "engine:generated_tokens": tokens}
    return Run(config, level, 0, statuses, wall_s, f"perf_analyzer {config}", round=round_no)


MIX = [Ask("new", "acme", "", "What is a cache?")]

# -- arguments ----------------------------------------------------------------------------------


def test_redis_with_compare_is_refused(pairs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        args_for(pairs, "--compare", "--redis")
    assert exc.value.code == 2
    assert "--redis cannot be combined with --compare" in capsys.readouterr().err


def test_rounds_default_to_four_with_compare_and_one_without(pairs: Path) -> None:
    assert args_for(pairs, "--compare").rounds == 4
    assert args_for(pairs, "--compare", "--rounds", "5").rounds == 5
    assert args_for(pairs).rounds == 1
    assert args_for(pairs, "--redis").redis


@pytest.mark.parametrize(
    "extra",
    [
        ("--rounds", "2"),  # the soak is one run
        ("--compare", "--rounds", "0"),
        ("--background-load", "-1"),
        ("--background-duty", "0"),
        ("--background-duty", "1.5"),
        ("--engine-threads", "0"),
        ("--embedder-threads", "two"),
        ("--pass-threads", "-1"),
        ("--pass-threads", "Auto"),
    ],
)
def test_bad_arguments_are_refused(pairs: Path, extra: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as exc:
        args_for(pairs, *extra)
    assert exc.value.code == 2


# -- the repositories ---------------------------------------------------------------------------


def params_of(config: Path) -> dict[str, str]:
    pattern = r'parameters \{ key: "([^"]+)" value: \{ string_value: "([^"]*)" \} \}'
    return dict(re.findall(pattern, config.read_text()))


def test_l1_stages_are_the_stage_configs_with_an_l1() -> None:
    with_l1 = {
        name
        for name, cls in STAGE_CONFIGS.items()
        if "l1_max_bytes" in {f.name for f in dataclasses.fields(cls)}
    }
    assert set(L1_STAGES) == with_l1


def test_tiercache_repository_overrides(pairs: Path, tmp_path: Path) -> None:
    args = args_for(pairs, "--compare", "--kv-pool-max-bytes", "1048576", "--l1-max-bytes", "4096")
    repo = tiercache_repository(tmp_path / "off", args, OFF, "")
    engine = params_of(repo / "torch_llm" / "config.pbtxt")
    assert engine["kv_pool_max_bytes"] == "1048576" and engine["kv_reuse"] == "false"
    for stage in ("prompt_cache", "embedding_cache"):
        assert params_of(repo / stage / "config.pbtxt")["l1_max_bytes"] == "4096"
    for stage in ("llm", "cache_admin"):
        assert "l1_max_bytes" not in params_of(repo / stage / "config.pbtxt")


def test_response_cache_repository_has_the_same_engine_overrides(
    pairs: Path, tmp_path: Path
) -> None:
    args = args_for(pairs, "--compare", "--kv-pool-max-bytes", "1048576", "--pass-threads", "2")
    repo = response_cache_repository(tmp_path, args)
    assert sorted(p.name for p in repo.iterdir()) == ["llm_plain", "torch_llm"]
    engine = params_of(repo / "torch_llm" / "config.pbtxt")
    assert engine["kv_pool_max_bytes"] == "1048576"
    assert engine["pass_threads"] == "2"
    ours = params_of(
        tiercache_repository(tmp_path / "ours", args, OFF, "") / "torch_llm" / "config.pbtxt"
    )
    assert ours["pass_threads"] == "2"  # the same engine setting behind every configuration
    assert "kv_reuse" not in engine  # prefix KV reuse on, as tiercache serves it
    plain = (repo / "llm_plain" / "config.pbtxt").read_text()
    count = re.search(r"instance_group \[ \{ count: (\d+)", plain)
    assert count is not None and int(count.group(1)) == LlmConfig().engine_streams
    assert (repo / "llm_plain" / "1" / "model.py").is_file()


# -- ratios and the report ----------------------------------------------------------------------


def three_rounds() -> list[Run]:
    # Round 2 ran on a machine twice as slow for every configuration: per-round ratios hold.
    return [
        run(TIERCACHE, 1, 3.0, 2000, tokens=300),
        run(OFF, 1, 2.0, 4000),
        run(RESPONSE_CACHE, 1, 2.5, 3000, tokens=200),
        run(RESPONSE_CACHE, 2, 1.25, 6000, tokens=100),
        run(OFF, 2, 1.0, 8000),
        run(TIERCACHE, 2, 1.5, 4000, tokens=150),
        run(TIERCACHE, 3, 3.3, 2000, tokens=330),
        run(OFF, 3, 2.0, 4000),
        run(RESPONSE_CACHE, 3, 2.5, 2500, tokens=200),
    ]


def test_a_round_with_failed_requests_is_left_out_of_the_ratios(pairs: Path) -> None:
    """Requests that fail fast raise a run's throughput: such a run must not enter a ratio."""
    runs = three_rounds()
    failing = runs[6]  # tiercache, round 3
    failing.statuses["status:error"] = 40
    thr = compare_ratios(runs)["tiercache/response-cache throughput"]
    assert thr is not None and thr.values == pytest.approx((1.2, 1.2))
    md = compare_report(args_for(pairs, "--compare"), runs, MIX, 900.0, "pa", "none")
    assert "Left out of the medians and ratios" in md and "round 3" in md


def test_ratios_are_taken_per_round() -> None:
    ratios = compare_ratios(three_rounds())
    thr = ratios["tiercache/response-cache throughput"]
    assert thr is not None
    assert thr.values == pytest.approx((1.2, 1.2, 1.32))
    assert thr.text() == "1.20 (1.20-1.32, 3 rounds)"
    off = ratios["tiercache/caching-off throughput"]
    assert off is not None and off.values == pytest.approx((1.5, 1.5, 1.65))
    p50 = ratios["tiercache/response-cache p50"]
    assert p50 is not None and p50.values == pytest.approx((2 / 3, 2 / 3, 0.8))
    tokens = ratios["tiercache/response-cache engine tokens/s"]
    assert tokens is not None and tokens.values == pytest.approx((1.5, 1.5, 1.65))


def test_a_failed_run_leaves_its_round_out() -> None:
    runs = three_rounds()
    runs[3] = Run(RESPONSE_CACHE, None, 1, {}, 0.0, "", ["failed: boom"], round=2)
    thr = compare_ratios(runs)["tiercache/response-cache throughput"]
    assert thr is not None and thr.values == pytest.approx((1.2, 1.32))


def test_engine_tokens_per_s_is_tokens_over_perf_analyzers_wall_time() -> None:
    r = run(TIERCACHE, 1, 3.0, 2000, tokens=250, wall_s=125.0)
    assert r.engine_tokens == 250 and r.engine_tokens_per_s == pytest.approx(2.0)
    r.statuses = {}  # counters not read
    assert r.engine_tokens is None and r.engine_tokens_per_s is None


def test_report_ends_with_the_median_ratio(pairs: Path) -> None:
    args = args_for(pairs, "--compare")
    md = compare_report(args, three_rounds(), MIX, 900.0, "perf_analyzer 2.60", "none")
    lines = md.rstrip("\n").splitlines()
    assert lines[-1] == "ratio tiercache/response-cache throughput 1.20"
    assert md.endswith(lines[-1] + "\n")
    assert lines[-3].startswith("- machine: ") and "background load: none" in lines[-3]
    assert "| tiercache/response-cache throughput | 1.20 (1.20-1.32, 3 rounds) |" in md
    assert "| tiercache/caching-off throughput | 1.50 (1.50-1.65, 3 rounds) |" in md
    per_round_rows = [line for line in lines if re.match(r"\| .* \| [123] \| \d+ \|", line)]
    assert len(per_round_rows) == 9
    assert "tiercache_engine_generated_tokens_total" in md


def test_report_final_line_without_the_response_cache(pairs: Path) -> None:
    args = args_for(pairs, "--compare", "--only", TIERCACHE, "--only", OFF)
    runs = [r for r in three_rounds() if r.config != RESPONSE_CACHE]
    md = compare_report(args, runs, MIX, 600.0, "perf_analyzer", "none")
    assert md.rstrip("\n").splitlines()[-1] == f"ratio {FINAL_RATIO} n/a"
    assert final_line({}) == f"ratio {FINAL_RATIO} n/a"


def test_summary_shape(pairs: Path) -> None:
    args = args_for(pairs, "--compare", "--rounds", "3")
    runs = three_rounds()
    runs[0].cpu = cpu_breakdown(
        {"llm": CpuSample(1.0, 4, 10, 1)}, {"llm": CpuSample(11.0, 5, 30, 6)}, 100.0, 2
    )
    runs[0].cpu_count = 2
    summary = compare_summary(args, runs, MIX, 900.0, "perf_analyzer 2.60", "none")
    again = json.loads(json.dumps(summary))  # JSON through and through
    assert again["rounds"] == 3 and again["background_load"] == "none"
    assert again["order"][:4] == [
        {"round": 1, "config": TIERCACHE},
        {"round": 1, "config": OFF},
        {"round": 1, "config": RESPONSE_CACHE},
        {"round": 2, "config": RESPONSE_CACHE},
    ]
    assert set(again["machine"]) == {"nproc", "cpu", "loadavg"}
    assert again["command"] and again["ok"] is True
    assert len(again["runs"]) == 9
    first = again["runs"][0]
    assert set(first) >= {
        "config",
        "round",
        "requests",
        "throughput_infer_per_s",
        "p50_ms",
        "p99_ms",
        "errors",
        "statuses",
        "engine_generated_tokens",
        "engine_tokens_per_s",
        "wall_s",
        "cpu",
    }
    assert first["p50_ms"] == pytest.approx(2000) and first["engine_tokens_per_s"] == 3.0
    assert first["cpu"][0]["process"] == "llm" and first["cpu"][0]["cpu_s"] == 10.0
    assert again["ratios"][FINAL_RATIO] == {
        "median": pytest.approx(1.2),
        "low": pytest.approx(1.2),
        "high": pytest.approx(1.32),
        "rounds": pytest.approx([1.2, 1.2, 1.32]),
    }


def test_summary_is_not_ok_with_a_failed_run(pairs: Path) -> None:
    runs = three_rounds()
    runs[4] = Run(OFF, None, 1, {}, 0.0, "", ["failed: boom"], round=2)
    summary = compare_summary(args_for(pairs, "--compare"), runs, MIX, 1.0, "pa", "none")
    assert summary["ok"] is False
    assert summary["ratios"]["tiercache/caching-off throughput"]["rounds"] == [1.5, 1.65]  # type: ignore[index]


def test_generation_bounds_per_round(pairs: Path) -> None:
    """The bound: the response cache's generations per request over the new questions' share
    of the first N entries sent (N = tiercache's requests); rounds without both are left out."""
    mix = [Ask("new", "acme", "", f"q{i}") for i in range(4)] + [
        Ask("repeat", "acme", "", "q0") for _ in range(6)
    ]
    mine = run(TIERCACHE, 1, 1.0, 100, wall_s=10.0)  # 10 requests: 4 new among them
    theirs = run(RESPONSE_CACHE, 1, 1.0, 100, wall_s=8.0)  # 8 requests
    mine.statuses["engine:generations"] = 5
    theirs.statuses["engine:generations"] = 6
    lone = run(TIERCACHE, 2, 1.0, 100)  # round 2: no response cache run
    lone.statuses["engine:generations"] = 1
    failed_mine = run(TIERCACHE, 3, 1.0, 100)  # round 3: tiercache's run failed
    failed_mine.statuses["engine:generations"] = 1
    failed_mine.returncode = 1
    failed_theirs = run(RESPONSE_CACHE, 3, 1.0, 100)
    failed_theirs.statuses["engine:generations"] = 1
    bounds = generation_bounds([mine, theirs, lone, failed_mine, failed_theirs], mix)
    assert list(bounds) == [1]  # a failed run is left out, as from the ratios
    b = bounds[1]
    assert b["tiercache_generations_per_request"] == pytest.approx(0.5)
    assert b["response_cache_generations_per_request"] == pytest.approx(0.75)
    assert b["new_question_share"] == pytest.approx(0.4)
    assert b["bound_at_equal_generation_cost"] == pytest.approx(0.75 / 0.4)
    assert b["ratio_at_equal_generation_cost"] == pytest.approx(1.5)
    md = compare_report(args_for(pairs, "--compare"), [mine, theirs, lone], mix, 10.0, "pa", "none")
    assert "| 1 | 0.500 | 0.750 | 0.400 | 1.50 | 1.88 |" in md
    summary = compare_summary(args_for(pairs, "--compare"), [mine, theirs], mix, 1.0, "pa", "none")
    assert json.loads(json.dumps(summary))["generation_bounds"]["1"]["new_question_share"] == 0.4


# -- CPU by process -----------------------------------------------------------------------------


def test_cpu_breakdown_arithmetic() -> None:
    start = {
        "tritonserver": CpuSample(10.0, 20, 100, 10, {1: ("tritonserver", 2.0), 2: ("grpc", 8.0)}),
        "torch_llm": CpuSample(
            50.0, 8, 1000, 50, {10: ("triton_python_b", 5.0), 11: ("omp", 45.0)}
        ),
        "llm": CpuSample(5.0, 6, 300, 3, {20: ("triton_python_b", 5.0)}),
        "lost": CpuSample(1.0, 1, 1, 1),
    }
    end = {
        # tid 2 reused by another thread name: counted from 0.
        "tritonserver": CpuSample(
            22.0, 21, 160, 15, {1: ("tritonserver", 4.0), 2: ("cq", 3.0), 3: ("grpc", 7.0)}
        ),
        "torch_llm": CpuSample(
            170.0, 8, 1500, 450, {10: ("triton_python_b", 15.0), 11: ("omp", 155.0)}
        ),
        "llm": CpuSample(9.0, 5, 350, 4, {20: ("triton_python_b", 9.0)}),  # its last sample
        "embedder": CpuSample(6.0, 3, 40, 2, {30: ("triton_python_b", 6.0)}),  # started later
    }
    cpu = cpu_breakdown(start, end, wall_s=100.0, cpu_count=2, gone_at={"llm": 60.0})
    assert [p.label for p in cpu] == ["torch_llm", "tritonserver", "embedder", "llm", "lost"]
    by = {p.label: p for p in cpu}
    engine = by["torch_llm"]
    assert engine.cpu_s == pytest.approx(120.0)
    assert engine.machine_share == pytest.approx(0.6)  # 120 s of 200 CPU-seconds
    assert (engine.threads, engine.ctx_voluntary, engine.ctx_involuntary) == (8, 500, 400)
    assert engine.thread_groups == (("omp", 110.0), ("triton_python_b", 10.0))
    assert engine.busiest_threads_s == pytest.approx((110.0, 10.0))
    assert engine.note == ""
    server = by["tritonserver"]
    assert server.cpu_s == pytest.approx(12.0)
    assert dict(server.thread_groups) == {"grpc": 7.0, "cq": 3.0, "tritonserver": 2.0}
    assert server.busiest_threads_s == pytest.approx((7.0, 3.0, 2.0))  # tid 3 new: all of it
    assert by["embedder"].cpu_s == 6.0 and "started during the run" in by["embedder"].note
    assert by["llm"].cpu_s == 4.0 and "last sample, 60 s into the run" in by["llm"].note
    assert by["lost"].cpu_s == 0.0 and "gone" in by["lost"].note
    assert top_thread_groups(cpu, 3) == [
        ("torch_llm", "omp", 110.0),
        ("torch_llm", "triton_python_b", 10.0),
        ("tritonserver", "grpc", 7.0),
    ]


def test_cpu_breakdown_needs_a_wall_time() -> None:
    with pytest.raises(ValueError, match="wall_s"):
        cpu_breakdown({}, {}, wall_s=0.0, cpu_count=2)


def test_cpu_snapshot_of_this_process() -> None:
    me = psutil.Process()
    snap = cpu_snapshot([("me", me)])["me"]
    assert snap.cpu_s > 0 and snap.threads >= 1
    assert os.getpid() in snap.thread_cpu_s  # the main thread's id is the pid
    name, cpu_s = snap.thread_cpu_s[os.getpid()]
    assert name and cpu_s >= 0


def test_thread_overrides_reach_every_engine_and_the_embedder(pairs: Path, tmp_path: Path) -> None:
    args = args_for(pairs, "--compare", "--engine-threads", "1", "--embedder-threads", "2")
    repo = tiercache_repository(tmp_path / "t", args, TIERCACHE, "")
    assert params_of(repo / "torch_llm" / "config.pbtxt")["torch_threads"] == "1"
    assert params_of(repo / "embedder" / "config.pbtxt")["torch_threads"] == "2"
    plain = response_cache_repository(tmp_path / "rc", args)
    assert params_of(plain / "torch_llm" / "config.pbtxt")["torch_threads"] == "1"


def test_an_adapter_refusal_is_neither_a_generation_nor_an_error() -> None:
    """torch_llm's adapter_missing (refused before any output; llm asks again with the weights)
    is counted apart: the retry that follows is the generation, and nothing failed."""
    finished = "tiercache_engine_finished_total"
    counters = status_counters(
        [
            (finished, {"reason": "stop"}, 4.0),
            (finished, {"reason": "length"}, 2.0),
            (finished, {"reason": "adapter_missing"}, 1.0),
            (finished, {"reason": "error"}, 3.0),
        ]
    )
    assert counters["engine:generations"] == 6
    assert counters["engine:adapter_missing"] == 1
    assert counters["error:engine"] == 3
    run = Run(TIERCACHE, None, 0, counters, 90.0, "perf_analyzer ...")
    assert "1 engine refusals for an adapter it did not hold" in status_line(run)
