"""Draft tokens for speculative decoding (tiercache.engine.drafts): aligned cached answers, n-gram
matches in answers, the scope's answer index and the context (prompt and generated tokens), the
longest continuation wins, the length adapts, rejected n-gram drafts back off."""

from __future__ import annotations

import pytest

from tiercache.engine.drafts import (
    MAX_BACKOFF_STEPS,
    MAX_DRAFT_TOKENS,
    MAX_PREFILL_DRAFT_TOKENS,
    MIN_DRAFT_TOKENS,
    AnswerIndex,
    Codec,
    Drafter,
    cut_at_stop,
    prefill_draft,
)

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
SCOPE, OTHER = b"scope-a", b"scope-b"


def test_an_aligned_answer_proposes_its_next_tokens_while_the_generation_follows_it() -> None:
    drafter = Drafter([("answer", [10, 11, 12, 13, 14, 15])], PROMPT, length=4)
    assert drafter.propose([10], limit=10) == [11, 12, 13, 14]
    assert drafter.source == "answer"
    assert drafter.propose([10, 11, 12], limit=2) == [13, 14]
    # the generation left the answer: no aligned draft, and no n-gram of it matches
    assert drafter.propose([10, 11, 12, 99], limit=10) == []
    assert drafter.source is None


def test_an_ngram_of_an_answer_proposes_what_followed_its_latest_occurrence() -> None:
    answer = [40, 50, 60, 70, 80, 50, 60, 70, 90, 91]
    drafter = Drafter([("neighbour", answer)], [5], length=8)
    # "50 60 70" last occurs before 90 (not aligned: the generation did not start with 40)
    assert drafter.propose([50, 60, 70], limit=8) == [90, 91]
    assert drafter.source == "neighbour"
    # the longest matching suffix wins over a shorter one: "40 50 60 70" -> 80 ...
    other = Drafter([("neighbour", answer)], [5, 40], length=8)
    assert other.propose([50, 60, 70], limit=3) == [80, 50, 60]
    # two tokens are under an answer's n-gram (MIN_ANSWER_NGRAM): "60 70" drafts nothing
    assert Drafter([("neighbour", answer)], [5], length=8).propose([60, 70], limit=8) == []


def test_the_context_is_matched_by_ngram_and_a_repeating_run_continues() -> None:
    drafter = Drafter([], PROMPT, length=8)
    assert drafter.propose([3, 4], limit=3) == [5, 6, 7]  # the prompt's n-gram
    assert drafter.source == "context"
    looping = Drafter([], [100], length=8)
    # "7 8 9 7 8": "7 8" occurred 3 tokens back, so the run of period 3 goes on
    assert looping.propose([7, 8, 9, 7, 8], limit=8) == [9, 7, 8, 9, 7, 8, 9, 7]
    assert Drafter([], PROMPT).propose([1], limit=3) == []  # one token is under the n-gram


def test_the_longest_continuation_of_all_sources_is_proposed() -> None:
    short = [0, 9, 3, 4, 5]  # an answer whose n-gram "9 3 4" continues with one token
    drafter = Drafter([("neighbour", short)], PROMPT, length=8)
    # the prompt's is longer (and runs on periodically: 5 6 7 8 9 3 4 again)
    assert drafter.propose([9, 3, 4], limit=8) == [5, 6, 7, 8, 9, 3, 4, 5]
    assert drafter.source == "context"


def test_the_scope_index_drafts_from_earlier_answers_of_its_scope_only() -> None:
    index = AnswerIndex(max_tokens=100)
    index.add(SCOPE, [40, 41, 42, 43, 44])
    assert index.view(OTHER) is None
    drafter = Drafter([], [1], index=index.view(SCOPE), length=8)
    assert drafter.propose([40, 41, 42], limit=8) == [43, 44]
    assert drafter.source == "index"
    assert Drafter([], [1], index=index.view(OTHER)).propose([40, 41, 42], limit=8) == []
    # two tokens in common with another prompt's answer are chance: three are needed
    assert Drafter([], [1], index=index.view(SCOPE)).propose([41, 42], limit=8) == []


def test_the_answer_index_keeps_to_its_budget_dropping_the_least_recent_first() -> None:
    index = AnswerIndex(max_tokens=20)
    index.add(SCOPE, list(range(100, 108)))  # 8 tokens
    index.add(OTHER, list(range(200, 208)))  # 16
    index.add(SCOPE, list(range(100, 108)))  # the same answer again: not kept twice
    assert index.tokens == 16
    index.add(OTHER, list(range(300, 308)))  # 24 > 20: down to 15, SCOPE (least recent) first
    assert index.tokens <= 15 and index.view(SCOPE) is None
    view = index.view(OTHER)
    assert view is not None and Drafter([], [1], index=view).propose([300, 301, 302], 4) == [
        303,
        304,
        305,
        306,
    ]
    index.add(SCOPE, list(range(500, 530)))  # over the whole budget: not kept
    assert index.view(SCOPE) is None
    assert AnswerIndex(max_tokens=0).view(SCOPE) is None
    with pytest.raises(ValueError, match="max_tokens"):
        AnswerIndex(max_tokens=-1)


def test_the_draft_length_adapts_to_acceptance_per_source() -> None:
    drafter = Drafter([("answer", [1])], length=8)
    drafter.source = "answer"
    drafter.accepted(8, 8)
    assert drafter.by_source["answer"].length == 16
    for _ in range(5):
        drafter.accepted(drafter.by_source["answer"].length, drafter.by_source["answer"].length)
    assert drafter.by_source["answer"].length == MAX_DRAFT_TOKENS
    drafter.accepted(32, 5)
    assert drafter.by_source["answer"].length == 6
    drafter.accepted(6, 1)
    assert drafter.by_source["answer"].length == MIN_DRAFT_TOKENS
    drafter.source = "context"
    drafter.accepted(8, 0)
    assert drafter.by_source["context"].length == MIN_DRAFT_TOKENS
    assert drafter.by_source["answer"].length == MIN_DRAFT_TOKENS  # each its own
    assert (drafter.proposed, drafter.accepted_total) == (
        8 + 16 + 32 * 4 + 32 + 6 + 8,
        8 + 16 + 32 * 4 + 5 + 1,
    )
    assert drafter.by_source["context"].drafts == 1
    assert drafter.steps[-2:] == [("answer", 6, 1), ("context", 8, 0)]


def test_a_source_rejected_whole_sits_out_while_the_others_go_on() -> None:
    answer = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    drafter = Drafter([("answer", answer)], [3, 4, 5, 3, 4], length=4)
    assert drafter.propose([3, 4], limit=4) == [3, 4, 3, 4]  # the context's latest "3 4"
    assert drafter.source == "context"
    drafter.accepted(4, 0)
    assert drafter.propose([3, 4], limit=4) == []  # the context sits out one step
    assert drafter.propose([3, 4], limit=4) == [3, 4, 3, 4]
    drafter.accepted(4, 0)
    assert [drafter.propose([3, 4], limit=4) for _ in range(2)] == [[], []]  # then two
    assert drafter.propose([3, 4], limit=4) != []
    drafter.accepted(4, 1)  # one kept: the pause is over, the next rejection starts at 1
    drafter.accepted(4, 0)
    assert drafter.propose([3, 4], limit=4) == []
    # the cached answer is not paused by the context's rejections
    aligned = Drafter([("answer", answer)], [3, 4, 5, 3, 4], length=4)
    aligned.source = "context"
    aligned.accepted(4, 0)
    assert aligned.propose([10], limit=4) == [11, 12, 13, 14]
    assert aligned.source == "answer"
    many = Drafter([], [3, 4, 5, 3, 4])
    for _ in range(10):
        many.source = "context"
        many.accepted(4, 0)
    assert many.by_source["context"].backoff == MAX_BACKOFF_STEPS + 1


def test_no_sources_no_drafts() -> None:
    assert Drafter().propose([2], 8) == []
    assert Drafter([("answer", [])]).propose([2], 8) == []


def test_a_long_partly_kept_draft_leaves_its_source_within_the_cap() -> None:
    """A verify draft (a whole answer) partly accepted must not leave its source drafting
    hundreds of tokens per step afterwards."""
    from tiercache.engine.drafts import MAX_DRAFT_TOKENS, Drafter

    drafter = Drafter([("verify", list(range(300)))], [1, 2, 3])
    drafter.source = "verify"
    drafter.accepted(300, 120)
    assert drafter.by_source["verify"].length == MAX_DRAFT_TOKENS


def test_the_prefill_pass_verifies_a_hits_answer_else_a_greedy_requests_own_answer() -> None:
    """A semantic hit's answer to verify goes into the prefill pass first; without one, a
    greedy request's own prompt's cached answer does (the model repeats it); a sampled
    request's does not, nor a neighbour's, the index's or an empty answer."""
    verify, answer, neighbour = ("verify", [1, 2]), ("answer", [3, 4, 5]), ("neighbour", [6])
    assert prefill_draft([answer, verify], greedy=True) == ("verify", [1, 2])
    assert prefill_draft([neighbour, answer], greedy=True) == ("answer", [3, 4, 5])
    assert prefill_draft([neighbour, answer], greedy=False) == ("", [])
    assert prefill_draft([answer, verify], greedy=False) == ("verify", [1, 2])
    assert prefill_draft([("answer", []), neighbour], greedy=True) == ("", [])
    long = list(range(MAX_PREFILL_DRAFT_TOKENS + 10))  # the pass takes the first ones only
    assert prefill_draft([("answer", long)], greedy=True) == ("answer", long[:-10])


def test_a_draft_ends_with_the_first_stop_word_it_holds() -> None:
    text = "Paris is the capital. It is in France. END more text"
    assert cut_at_stop(text, ("END", "France")) == "Paris is the capital. It is in France"
    assert cut_at_stop(text, ("nowhere",)) == text
    assert cut_at_stop(text, ()) == text
    assert cut_at_stop(text, ("",)) == text


# A tokenizer of one token per character, but for the model's own token for a paragraph break
# ("\n\n", PARAGRAPH), which encoding a text never gives (as SmolLM2's tokenizer does).
PARAGRAPH = 1000
CHARS = Codec(
    decode=lambda ids: "".join("\n\n" if t == PARAGRAPH else chr(t) for t in ids),
    encode=lambda text: [ord(c) for c in text],
)


def test_a_draft_follows_its_answers_text_where_the_tokens_part() -> None:
    text = "ab\n\ncdefgh"
    drafter = Drafter([("answer", CHARS.encode(text))], PROMPT, texts=[text], codec=CHARS, length=4)
    # the model wrote the paragraph break as one token: the token-aligned draft is left, the
    # text still agrees, and the rest of it, tokenized, is the draft
    assert drafter.propose([ord("a"), ord("b"), PARAGRAPH], limit=10) == [ord(c) for c in "cdef"]
    assert drafter.source == "answer"
    # once the text leaves the answer's there is no text-aligned draft any more
    assert drafter.propose([ord("a"), ord("x"), PARAGRAPH, ord("z")], limit=10) == []
    assert drafter.propose([ord("a"), ord("b"), PARAGRAPH], limit=10) == []
    # without the codec (or the text) only token-aligned drafts
    plain = Drafter([("answer", CHARS.encode(text))], PROMPT, texts=[text], length=4)
    assert plain.propose([ord("a"), ord("b"), PARAGRAPH], limit=10) == []


def test_a_text_aligned_draft_ends_with_the_answer() -> None:
    text = "ab\n\ncd"
    drafter = Drafter([("neighbour", CHARS.encode(text))], PROMPT, texts=[text], codec=CHARS)
    assert drafter.propose([ord("a"), ord("b"), PARAGRAPH], limit=10) == [ord("c"), ord("d")]
    done = [ord("a"), ord("b"), PARAGRAPH, ord("c"), ord("d")]
    assert drafter.propose(done, limit=10) == []  # the whole text written: nothing more of it
