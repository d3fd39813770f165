"""`make bench-spec`'s arithmetic (tiercache_dev.bench.speculation): the speedup and the bound a
cached answer alone sets (its covered part free, the rest decoded plainly)."""

from __future__ import annotations

import pytest

from tiercache_dev.bench.speculation import Run, Workload, covered, exit_code


def test_the_bound_frees_the_covered_tokens_and_keeps_the_rest_plain() -> None:
    work = Workload("again")
    work.plain = [Run("a", 100, 10.0), Run("b", 50, 5.0)]
    work.spec = [Run("a", 100, 4.0), Run("b", 50, 1.0)]
    work.covered = [50, 50]  # half of the first answer; all of the second
    # the rest: 10 s * 50/100 + 5 s * 1/50 (one pass at least)
    assert work.covered_bound() == pytest.approx(15.0 / (5.0 + 0.1))
    assert work.speedup() == pytest.approx(15.0 / 5.0)
    work.covered = [0, 0]
    assert work.covered_bound() == pytest.approx(1.0)
    assert work.summary()["covered_bound"] == pytest.approx(1.0)


def test_covered_counts_the_leading_tokens_whose_text_the_draft_holds() -> None:
    def decode(ids: list[int]) -> str:  # one character a token, 0 a paragraph break
        return "".join("\n\n" if t == 0 else chr(t) for t in ids)

    answer = [ord("a"), 0, ord("b"), ord("c")]
    assert covered("a\n\nbx", answer, decode) == 3  # however the draft would tokenize
    assert covered("a\n\nbc and more", answer, decode) == 4
    assert covered("x", answer, decode) == 0
    assert covered("", answer, decode) == 0


def test_the_exit_code_counts_greedy_workloads_only() -> None:
    def workload(name: str, same: bool) -> Workload:
        work = Workload(name)
        work.plain, work.spec = [Run("a", 1, 1.0)], [Run("a" if same else "b", 1, 1.0)]
        return work

    assert exit_code({}) == 1  # nothing ran
    assert exit_code({"new": workload("new", True)}) == 0
    assert exit_code({"new": workload("new", False)}) == 1
    assert exit_code({"new": workload("new", True), "sampled-hot": workload("s", False)}) == 0
