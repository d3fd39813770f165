"""Draft tokens for speculative decoding (tiercache.engine.drafts): aligned cached answers, n-gram
matches in answers and the prompt, the longest continuation wins, the length adapts."""

from __future__ import annotations

import pytest

from tiercache.engine.drafts import MAX_DRAFT_TOKENS, MIN_DRAFT_TOKENS, Drafter

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def test_an_aligned_answer_proposes_its_next_tokens_while_the_generation_follows_it() -> None:
    drafter = Drafter([[10, 11, 12, 13, 14, 15]], PROMPT, length=4)
    assert drafter.propose([*PROMPT, 10], [10], limit=10) == [11, 12, 13, 14]
    assert drafter.propose([*PROMPT, 10, 11, 12], [10, 11, 12], limit=2) == [13, 14]
    # the generation left the answer: no aligned draft, and no n-gram of it matches
    assert drafter.propose([*PROMPT, 10, 99], [10, 99], limit=10) == []


def test_an_ngram_of_the_context_proposes_what_followed_it_last() -> None:
    drafter = Drafter([[50, 60, 70, 80, 60, 70, 90, 91]], aligned_answers=False, length=8)
    # "60 70" last occurs before 90: the latest occurrence's continuation
    assert drafter.propose([5, 60, 70], [60, 70], limit=8) == [90, 91]
    # the longest matching suffix wins over a shorter one: "50 60 70" -> 80 ...
    assert drafter.propose([50, 60, 70], [50, 60, 70], limit=3) == [80, 60, 70]
    assert drafter.propose([5, 6, 7], [7], limit=8) == []  # nothing matches


def test_the_prompt_is_matched_by_ngram_only() -> None:
    drafter = Drafter([], PROMPT, length=8)
    assert drafter.propose([*PROMPT, 3, 4], [3, 4], limit=3) == [5, 6, 7]
    assert drafter.propose([*PROMPT, 1], [1], limit=3) == []  # one token is under min_ngram


def test_the_longest_continuation_of_all_sources_is_proposed() -> None:
    short = [3, 4, 5]  # an answer whose n-gram "3 4" continues with one token
    drafter = Drafter([short], PROMPT, aligned_answers=False, length=8)
    assert drafter.propose([9, 3, 4], [3, 4], limit=8) == [5, 6, 7, 8]  # the prompt's is longer


def test_the_draft_length_adapts_to_acceptance() -> None:
    drafter = Drafter([[1]], length=8)
    drafter.accepted(8, 8)
    assert drafter.length == 16
    for _ in range(5):
        drafter.accepted(drafter.length, drafter.length)
    assert drafter.length == MAX_DRAFT_TOKENS
    drafter.accepted(32, 3)
    assert drafter.length == 4
    drafter.accepted(4, 0)
    assert drafter.length == MIN_DRAFT_TOKENS
    assert (drafter.steps, drafter.accepted_total) == (8, 8 + 16 + 32 * 4 + 3 + 0)


def test_no_sources_no_drafts_and_bad_ngram_bounds_refused() -> None:
    assert Drafter().empty and Drafter().propose([1, 2], [2], 8) == []
    with pytest.raises(ValueError, match="min_ngram"):
        Drafter(min_ngram=3, max_ngram=2)
