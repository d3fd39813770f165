"""The draft replay's arithmetic (tiercache_dev.bench.draft_replay): the cost model, the
workloads a recording makes, and a replay of the real drafter on a toy tokenizer (one character
a token). That its steps are the engine's own is tested against the engine in
tests/unit/test_engine_speculation.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tiercache_dev.bench.draft_replay import (
    Case,
    CostModel,
    cases,
    parse_args,
    replay,
    truncated,
)

COST = CostModel({1: 1.0, 5: 2.0, 33: 4.0}, {10: 3.0, 100: 12.0})


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_the_cost_model_interpolates_and_grows_past_its_largest_size() -> None:
    assert COST.step_s(1) == 1.0
    assert COST.step_s(3) == pytest.approx(1.5)
    assert COST.step_s(66) == pytest.approx(8.0)  # in proportion past 33
    assert COST.prefill_s(5) == 3.0  # never under the smallest measured
    assert CostModel.from_json(COST.to_json()) == COST
    rows = CostModel(COST.step, {11: 2.0}, {11: 4.0})  # every row's logits: 2 s more
    assert rows.prefill_s(11) == 2.0
    assert rows.prefill_s(11, 6) == pytest.approx(3.0)  # half the other rows
    assert rows.prefill_s(11, 11) == pytest.approx(4.0)
    assert CostModel.from_json(rows.to_json()) == rows


def test_a_cached_answer_is_free_up_to_where_the_model_leaves_it() -> None:
    answer = encode("the quick brown fox jumps over the lazy dog")
    case = Case("fox", encode("say it"), [("answer", "the quick brown fox")], 60, answer, True)
    done = replay(case, COST, encode, decode)
    # the prefill pass verified the 19 cached tokens; the rest drafted or stepped
    assert done.steps[0] == ("answer", 19, 19)
    assert done.plain_passes == len(answer) + 1  # every pick, the end token's included
    assert done.plain_s == COST.prefill_s(6) + COST.step_s(1) * len(answer)
    assert done.ceiling_s <= done.spec_s < done.plain_s
    nothing = replay(Case("fox", encode("say it"), [], 60, answer, True), COST, encode, decode)
    assert nothing.spec_s > done.spec_s


def test_a_replay_that_cannot_rebuild_the_answer_is_refused() -> None:
    case = Case("x", encode("p"), [], 3, encode("abcdef"), False)  # longer than max_tokens
    with pytest.raises(AssertionError, match="did not rebuild"):
        replay(case, COST, encode, decode)


def test_truncated_answers_end_at_the_token_limit_not_with_an_end_token() -> None:
    assert truncated([1, 2, 3], True, 2) == ([1, 2], False)
    assert truncated([1, 2, 3], True, 5) == ([1, 2, 3], True)


def test_a_recording_makes_every_workload_in_its_split() -> None:
    data = {
        "max_tokens": 4,
        "rows": [
            {"kind": "again", "split": "tune", "prompt": "p", "prompt_ids": [1],
             "answer": encode("abcdefgh"), "ended": False},
            {"kind": "dev", "split": "held-out", "prompt": "q", "prompt_ids": [2],
             "answer": encode("xyz"), "ended": True},
            {"kind": "new", "split": "tune", "prompt": "r", "prompt_ids": [3],
             "answer": encode("abcd"), "ended": False},
            {"kind": "reworded", "split": "held-out", "prompt": "s", "prompt_ids": [4],
             "answer": encode("hello"), "ended": True, "neighbour": "hullo"},
        ],
    }  # fmt: skip
    made = cases(data, decode)
    assert sorted(made) == [
        ("again", "held-out"), ("again", "tune"), ("again-near", "held-out"),
        ("again-near", "tune"), ("new", "held-out"), ("new", "tune"), ("reworded", "held-out"),
    ]  # fmt: skip
    again = made[("again", "tune")][0]
    assert again.drafts == [("answer", "abcd")] and again.max_tokens == 8
    assert again.answer == encode("abcdefgh") and not again.ended
    near = made[("again-near", "tune")][0]
    assert near.max_tokens == 5 and near.answer == encode("abcde") and not near.ended
    short = made[("again", "held-out")][0]  # ended before the limit: all of it cached
    assert short.drafts == [("answer", "xyz")] and short.ended
    assert made[("new", "held-out")][0].drafts == []
    assert made[("reworded", "held-out")][0].drafts == [("neighbour", "hullo")]


@pytest.mark.parametrize("flag", ["--max-tokens", "--repeats", "--threads"])
def test_counts_under_one_are_refused(flag: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["replay", flag, "0"])
