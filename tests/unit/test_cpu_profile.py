"""tiercache_dev.diagnostics.cpu_profile: reading `perf script`, naming the run's processes and
charging samples to configurations per request (the profile itself needs perf and root)."""

from __future__ import annotations

import pytest

from tiercache_dev.diagnostics import cpu_profile as cp

SCRIPT = """\
100/100 10.000100:
\t    7f00 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
\t    7f01 [unknown] ([unknown])

 100/105  10.100000:
\tffffffff81 futex_wake ([kernel.kallsyms])
\t    ee017 syscall (/usr/lib/x86_64-linux-gnu/libc.so.6)

not a sample line
\t    1 lost (frame)

200/200 10.2:
"""


def test_parse_perf_script_reads_each_sample_with_its_frames_leaf_first() -> None:
    samples = list(cp.parse_perf_script(SCRIPT.splitlines(keepends=True)))
    assert [(s.pid, s.tid, s.time_s) for s in samples] == [
        (100, 100, 10.0001),
        (100, 105, 10.1),
        (200, 200, 10.2),
    ]
    assert samples[0].frames == [
        ("_PyEval_EvalFrameDefault", "libpython3.11.so.1.0"),
        ("[unknown]", "[unknown]"),
    ]
    assert samples[1].frames[0] == ("futex_wake", "[kernel.kallsyms]")
    assert samples[2].frames == []


def test_a_script_with_each_threads_name_reads_it() -> None:
    """`-F comm,pid,tid,...`: the kernel's thread name first (it may hold spaces)."""
    script = (
        "triton_python_b   100/100  10.000100:\n"
        "\t    7f00 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)\n\n"
        "l1-endorsements   100/105  10.100000:\n\n"
        "Chrome IO thread  7/9 3.5:\n"
    )
    samples = list(cp.parse_perf_script(script.splitlines(keepends=True)))
    assert [(s.comm, s.pid, s.tid, s.time_s) for s in samples] == [
        ("triton_python_b", 100, 100, 10.0001),
        ("l1-endorsements", 100, 105, 10.1),
        ("Chrome IO thread", 7, 9, 3.5),
    ]
    assert samples[0].frames == [("_PyEval_EvalFrameDefault", "libpython3.11.so.1.0")]


def test_processes_and_windows_come_from_the_benchmarks_report() -> None:
    """The benchmark's JSON names each configuration's processes (a model's second instance
    under its stage's name) and when each level was measured."""
    summary = {
        "processes": {
            "tiercache": {"1": "tritonserver", "11": "llm", "12": "embedding_cache#1"},
            "floor": {"2": "tritonserver", "21": "llm"},
        },
        "measured_windows": [
            {"config": "tiercache", "level": 1, "start_s": 10.0, "end_s": 11.0},
            {"config": "floor", "level": 1, "start_s": 11.5, "end_s": 12.0},
            {"config": "floor", "level": 4, "start_s": 13.0, "end_s": 14.0},
        ],
    }
    assert cp.names_of(summary) == {
        1: "tiercache:tritonserver",
        11: "tiercache:llm",
        12: "tiercache:embedding_cache",
        2: "floor:tritonserver",
        21: "floor:llm",
    }
    assert cp.intervals_of(summary, "1") == [(10.0, 11.0, "tiercache"), (11.5, 12.0, "floor")]
    assert cp.intervals_of({}, "1") == [] and cp.names_of({}) == {}


def samples_of(
    pid: int, tid: int, times: list[float], leaf: str = "f", comm: str = ""
) -> list[cp.Sample]:
    return [cp.Sample(pid, tid, t, [(leaf, "lib.so")], comm) for t in times]


def test_samples_are_charged_per_request_in_the_windows_each_configuration_was_measured() -> None:
    names = {
        1: "tiercache:tritonserver",
        11: "tiercache:llm",
        2: "floor:tritonserver",
        21: "floor:llm",
    }
    frequency = 100.0
    # 0.0-1.0 s: ours measured (two windows); 1.0-1.5 s: the floor; 1.5-2.0 s: neither
    ours = samples_of(1, 1, [i / 100 for i in range(100)])
    stage = samples_of(11, 11, [i / 100 for i in range(0, 100, 2)], "eval")
    theirs = samples_of(2, 2, [1 + i / 100 for i in range(50)])
    their_stage = samples_of(21, 21, [1 + i / 100 for i in range(0, 50, 5)], "eval")
    both = samples_of(1, 1, [1.5 + i / 100 for i in range(50)]) + samples_of(
        2, 2, [1.5 + i / 100 for i in range(50)]
    )
    stray = samples_of(99, 99, [0.5])  # another process: not charged
    samples = ours + stage + theirs + their_stage + both + stray
    intervals = [(0.0, 0.5, "tiercache"), (0.5, 1.0, "tiercache"), (1.0, 1.5, "floor")]
    rates = {"tiercache": 100.0, "floor": 50.0}  # requests per second
    profile = cp.charge(samples, names, intervals, rates, frequency, "process")
    assert profile.seconds == {"tiercache": 1.0, "floor": 0.5}
    # ours: 100 samples of 10 ms over 100 requests -> 10,000 us each; llm 50 -> 5,000
    assert profile.per_request["tiercache"] == pytest.approx(
        {"tritonserver": 10_000.0, "llm": 5_000.0}
    )
    # the floor: 50 samples over 25 requests -> 20,000 us; llm 10 -> 4,000
    assert profile.per_request["floor"] == pytest.approx({"tritonserver": 20_000.0, "llm": 4_000.0})
    by_function = cp.charge(samples, names, intervals, rates, frequency, "function", "llm")
    assert by_function.per_request == {
        "tiercache": pytest.approx({"eval (lib.so)": 5_000.0}),
        "floor": pytest.approx({"eval (lib.so)": 4_000.0}),
    }
    rows = cp.table(profile, "tiercache", "floor", 5)
    assert rows[2] == "| llm | 5000.0 | 4000.0 | +1000.0 |"  # the largest difference first
    assert rows[-1] == "| all | 15000.0 | 24000.0 | -9000.0 |"


def test_the_benchmarks_measured_windows_are_charged_and_nothing_between_them() -> None:
    """With the benchmark's own windows (its JSON's `measured_windows`), a sample between two
    measurements (a warm-up pass, a server starting) is charged to nobody, and a window's
    seconds are its length."""
    names = {1: "tiercache:tritonserver", 2: "floor:tritonserver"}
    samples = (
        samples_of(1, 1, [10.0 + i / 100 for i in range(100)])  # 10.0-11.0: ours measured
        + samples_of(1, 1, [20.0 + i / 100 for i in range(100)])  # 20.0-21.0: a warm-up
        + samples_of(2, 2, [30.0 + i / 100 for i in range(50)])  # 30.0-30.5: the floor
    )
    intervals = [(30.0, 30.5, "floor"), (10.0, 11.0, "tiercache")]  # any order
    rates = {"tiercache": 10.0, "floor": 10.0}
    profile = cp.charge(samples, names, intervals, rates, 100.0, "process")
    assert profile.seconds == {"tiercache": 1.0, "floor": 0.5}
    # ours: 1 s of CPU over 10 requests; the floor's 0.5 s over 5
    assert profile.per_request == {
        "tiercache": pytest.approx({"tritonserver": 100_000.0}),
        "floor": pytest.approx({"tritonserver": 100_000.0}),
    }


def test_threads_line_up_by_rank_with_the_serving_thread_apart() -> None:
    names = {1: "tiercache:tritonserver", 11: "tiercache:llm"}
    samples = (  # all in the one window (0.0 to 0.5 s)
        samples_of(1, 1, [i / 100 for i in range(40)])
        + samples_of(11, 11, [i / 100 for i in range(0, 40, 2)])  # the stub's serving thread
        + samples_of(11, 17, [i / 100 for i in range(0, 40, 5)])
        + samples_of(1, 5, [i / 100 for i in range(0, 40, 4)])
        + samples_of(1, 4, [i / 100 for i in range(0, 40, 10)])
    )
    intervals = [(0.0, 0.5, "tiercache")]
    profile = cp.charge(samples, names, intervals, {"tiercache": 10.0}, 100.0, "thread")
    # five requests in the window; a sample is 10 ms: 2,000 us a request
    assert profile.per_request["tiercache"] == pytest.approx(
        {
            "tritonserver main": 80_000.0,
            "tritonserver thread 1": 20_000.0,
            "tritonserver thread 2": 8_000.0,
            "llm main": 40_000.0,
            "llm thread 1": 16_000.0,
        }
    )


def test_a_thread_named_for_the_kernel_is_counted_by_its_name() -> None:
    """tiercache.threads names the stages' threads: those are counted by name (threads of one
    name together); one that kept its process's name is ranked as before."""
    names = {11: "tiercache:llm"}
    samples = (
        samples_of(11, 11, [i / 100 for i in range(0, 40, 2)], comm="triton_python_b")
        + samples_of(11, 17, [i / 100 for i in range(0, 40, 5)], comm="llm-serve_0")
        + samples_of(11, 18, [i / 100 for i in range(0, 40, 10)], comm="llm-serve_0")
        + samples_of(11, 19, [i / 100 for i in range(0, 40, 8)], comm="triton_python_b")
    )
    profile = cp.charge(
        samples, names, [(0.0, 0.5, "tiercache")], {"tiercache": 10.0}, 100.0, "thread"
    )
    assert profile.per_request["tiercache"] == pytest.approx(
        {
            "llm main": 40_000.0,
            "llm llm-serve_0": 24_000.0,  # two threads of one name
            "llm thread 1": 10_000.0,  # the stub's own unnamed thread
        }
    )
