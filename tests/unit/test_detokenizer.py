"""The engine's incremental detokenizer and sampler, with a fake tokenizer (no model loaded)."""

from __future__ import annotations

import pytest
import torch

from tiercache.engine.torch_engine import _Detokenizer, _Sampler
from tiercache.exact.request import GenerationRequest


class ByteTokenizer:
    """Each id is a byte string; decoding joins them and replaces broken UTF-8 like HF does."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        assert skip_special_tokens
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def run(pieces: list[bytes], stop_words: tuple[str, ...] = ()) -> tuple[list[str], bool, str]:
    """Push every token in turn: (text emitted per push, stopped, flush at the end)."""
    detok = _Detokenizer(ByteTokenizer(pieces), stop_words)
    emitted: list[str] = []
    for n in range(1, len(pieces) + 1):
        text, stopped = detok.push(list(range(n)))
        emitted.append(text)
        if stopped:
            return emitted, True, ""
    return emitted, False, detok.flush()


def test_emits_incrementally() -> None:
    assert run([b"Hel", b"lo", b" world"]) == (["Hel", "lo", " world"], False, "")


def test_holds_back_unfinished_multibyte_char() -> None:
    e_acute = "é".encode()
    assert run([b"caf", e_acute[:1], e_acute[1:], b"!"]) == (["caf", "", "é", "!"], False, "")


def test_holds_back_four_byte_char_across_tokens() -> None:
    snowman = "☃".encode()  # three bytes, one token each
    emitted, stopped, rest = run([b"a", snowman[:1], snowman[1:2], snowman[2:]])
    assert emitted == ["a", "", "", "☃"]
    assert not stopped and rest == ""
    assert all("\ufffd" not in text for text in emitted)


def test_a_stop_word_never_matches_a_character_still_being_decoded() -> None:
    """An emoji's first bytes decode as U+FFFD until its last arrive: a stop word holding
    U+FFFD matched that and cut the answer ('I love ' with finish "stop", its final text
    holding no U+FFFD at all)."""
    grin = "😀".encode()
    emitted, stopped, rest = run([b"I love ", grin[:2], grin[2:], b" emoji"], ("\ufffd",))
    assert not stopped and "".join(emitted) + rest == "I love 😀 emoji"


def test_never_emits_partial_stop_word() -> None:
    emitted, stopped, _ = run([b"abcEN", b"D", b"more"], stop_words=("END",))
    assert stopped
    assert "".join(emitted) == "abc"
    assert emitted == ["abc", ""]


def test_partial_stop_word_released_when_it_does_not_complete() -> None:
    assert run([b"abcEN", b"X"], stop_words=("END",)) == (["abc", "ENX"], False, "")


def test_stop_word_cut_mid_text() -> None:
    emitted, stopped, _ = run([b"one ", b"two END three"], stop_words=("END",))
    assert stopped and "".join(emitted) == "one two "


def test_earliest_of_several_stop_words_wins() -> None:
    emitted, stopped, _ = run([b"a\nb STOP c"], stop_words=("STOP", "\n"))
    assert stopped and emitted == ["a"]


def test_stop_word_spanning_tokens() -> None:
    emitted, stopped, _ = run([b"x <", b"|e", b"nd|> y"], stop_words=("<|end|>",))
    assert stopped and "".join(emitted) == "x "


def test_flush_returns_held_back_text_without_replacement_char() -> None:
    e_acute = "é".encode()
    emitted, stopped, rest = run([b"abcEN", e_acute[:1]], stop_words=("END",))
    assert emitted == ["abc", ""]
    assert not stopped
    assert rest == "EN"


def test_flush_drops_lone_unfinished_char() -> None:
    assert run([b"ok", b"\xe2\x98"]) == (["ok", ""], False, "")


def test_flush_twice_returns_nothing_new() -> None:
    detok = _Detokenizer(ByteTokenizer([b"abcE"]), ("END",))
    assert detok.push([0]) == ("abc", False)
    assert detok.flush() == "E"
    assert detok.flush() == ""


# ---------------------------------------------------------------- sampler


def logits(seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed))


def picks(request: GenerationRequest, count: int = 32, vocab: int = 64) -> list[int]:
    sampler = _Sampler(request, "cpu")
    fixed = logits(vocab=vocab)
    return [sampler.pick(fixed, position) for position in range(count)]


def test_greedy_is_argmax() -> None:
    for seed in range(5):
        row = logits(seed)
        assert _Sampler(GenerationRequest("p"), "cpu").pick(row, 0) == int(row.argmax())


def test_a_position_takes_its_own_draw_whatever_the_order() -> None:
    """Position n always takes draw n of the seed's stream: picked ahead, picked twice or in
    another order, each position's token is the one sequential picking gives (what lets a
    verification pass pick drafted positions of a sampled request)."""
    request = GenerationRequest("p", temperature=1.0, seed=99)
    sequential = picks(request)
    sampler = _Sampler(request, "cpu")
    fixed = logits()
    ahead = [sampler.pick(fixed, position) for position in (5, 3, 3, 0, 31, 5)]
    assert ahead == [sequential[p] for p in (5, 3, 3, 0, 31, 5)]
    assert [sampler.pick(fixed, p) for p in range(32)] == sequential


def test_greedy_has_no_random_source() -> None:
    assert _Sampler(GenerationRequest("p", seed=None), "cpu").rng is None


def test_same_seed_same_picks() -> None:
    request = GenerationRequest("p", temperature=1.0, seed=1234)
    first = picks(request)
    assert first == picks(request)
    assert len(set(first)) > 1  # it really samples


@pytest.mark.parametrize("seeds", [(1, 2), (0, 2**63), (7, 2**64 - 1)])
def test_different_seeds_differ(seeds: tuple[int, int]) -> None:
    a, b = (picks(GenerationRequest("p", temperature=1.0, seed=s)) for s in seeds)
    assert a != b


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_top_k_1_is_argmax(temperature: float) -> None:
    request = GenerationRequest("p", temperature=temperature, top_k=1, seed=3)
    assert set(picks(request)) == {int(logits().argmax())}


def test_tiny_top_p_is_argmax() -> None:
    request = GenerationRequest("p", temperature=1.0, top_p=1e-6, seed=3)
    assert set(picks(request)) == {int(logits().argmax())}


def test_top_k_limits_choices() -> None:
    request = GenerationRequest("p", temperature=2.0, top_k=3, seed=5)
    allowed = set(torch.topk(logits()[0], 3).indices.tolist())
    chosen = set(picks(request, count=200))
    assert chosen <= allowed and len(chosen) > 1


def test_a_temperature_near_zero_samples_the_best_token_not_nan() -> None:
    """1e-40 passes the request's checks; dividing raw logits by it overflowed to inf / inf =
    NaN, and the draw then took the vocabulary's last token on every step (a seeded request's
    answer, cached as clean). Shifted first, it is greedy."""
    rows = torch.randn(5, 1, 1000, generator=torch.Generator().manual_seed(1)) * 10
    for temperature in (1e-40, 1e-30, 1e-8):
        sampler = _Sampler(GenerationRequest("p", temperature=temperature, seed=3), "cpu")
        assert [sampler.pick(row, i) for i, row in enumerate(rows)] == [
            int(row.argmax()) for row in rows
        ]
    normal = _Sampler(GenerationRequest("p", temperature=1.0, seed=3), "cpu")
    assert all(0 <= normal.pick(row, i) < 1000 for i, row in enumerate(rows))
