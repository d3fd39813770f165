"""tiercache.exact.confidence: an answer's confidence is stored with it, an unsure answer is
never served to a rewording and is kept shorter; an unknown confidence counts as sure."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tiercache.exact.codec import CacheEntry, CorruptEntry, decode_entry, encode_entry
from tiercache.exact.confidence import ConfidencePolicy, confidence_of
from tiercache.exact.stores import MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.stage import EmbeddingCache, SemanticOutcome
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache
from tiercache.vocabulary import Tier

DIM = 8


def test_confidence_is_the_geometric_mean_token_probability() -> None:
    assert confidence_of(None) is None and confidence_of(math.nan) is None
    assert confidence_of(math.log(0.25)) == pytest.approx(0.25)
    assert confidence_of(0.0) == 1.0 and confidence_of(1e-9) == 1.0  # rounding above 0


def test_the_policy_marks_answers_under_the_floor_unsure_and_shortens_their_ttl() -> None:
    policy = ConfidencePolicy(floor=0.5, unsure_ttl_s=60.0)
    assert policy.unsure(math.log(0.49)) and not policy.unsure(math.log(0.5))
    assert not policy.unsure(None)  # unknown: the floor acts only on what was measured
    assert policy.ttl_s(math.log(0.2), 3600.0) == 60.0
    assert policy.ttl_s(math.log(0.2), 30.0) == 30.0  # never longer than the cache's
    assert policy.ttl_s(math.log(0.2), 0.0) == 60.0  # the cache keeps forever: 60 s
    assert policy.ttl_s(math.log(0.9), 3600.0) is None
    assert ConfidencePolicy(0.5).ttl_s(math.log(0.2), 3600.0) is None  # no unsure TTL set
    assert not ConfidencePolicy().unsure(math.log(1e-6))  # floor 0: nothing is unsure
    for bad in ({"floor": 1.5}, {"floor": -0.1}, {"unsure_ttl_s": -1.0}):
        with pytest.raises(ValueError):
            ConfidencePolicy(**bad)  # type: ignore[arg-type]


def test_the_entry_keeps_its_mean_logprob_and_rejects_a_non_number() -> None:
    entry = CacheEntry("an answer", 1.0, mean_logprob=-0.4375)
    assert decode_entry(encode_entry(entry)).mean_logprob == -0.4375
    assert decode_entry(encode_entry(CacheEntry("old", 1.0))).mean_logprob is None
    bad = CacheEntry("x", 1.0, mean_logprob="high")  # type: ignore[arg-type]
    with pytest.raises(CorruptEntry):
        decode_entry(encode_entry(bad))


def unit(*values: float) -> np.ndarray:
    vector = np.zeros(DIM, dtype=np.float32)
    vector[: len(values)] = values
    return vector / np.linalg.norm(vector)


def test_an_unsure_answer_is_not_served_to_a_rewording_but_a_sure_neighbour_is(
    tmp_path: Path,
) -> None:
    answers = TieredCache([(Tier.L1, MemoryStore(1 << 20))])
    stage = EmbeddingCache(
        VectorCache(tmp_path / "vec", DIM),
        SemanticIndex(SemanticStore(tmp_path / "sem"), DIM),
        answers,
        lambda texts: np.stack([unit(1, 0.05) for _ in texts]),
        lambda query, candidates: 0 if candidates else None,  # takes the nearest offered
        "emb@1",
        min_similarity=0.5,
        confidence=ConfidencePolicy(0.5),
    )
    answers.put("unsure", "a guess", mean_logprob=math.log(0.3))
    answers.put("sure", "an answer", mean_logprob=math.log(0.8))
    answers.put("unknown", "a warmed answer")
    stage.index.add("only-unsure", "unsure", "p", unit(1, 0))
    stage.index.add("both", "unsure", "p", unit(1, 0.04))  # the nearest: offered first
    stage.index.add("both", "sure", "p2", unit(1, 0.2))
    stage.index.add("unknown", "unknown", "p", unit(1, 0))
    only, both, unknown = (stage.lookup(["q"], [s])[0] for s in ("only-unsure", "both", "unknown"))
    assert (only.outcome, only.text) == (SemanticOutcome.UNSURE, "")
    assert (both.outcome, both.text) == (SemanticOutcome.HIT, "an answer")
    assert (unknown.outcome, unknown.text) == (SemanticOutcome.HIT, "a warmed answer")
