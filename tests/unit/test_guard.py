"""The semantic hit guard (tiercache.semantic.guard) and its features, with fixed cosines.

No embedding model is loaded: every cosine here is given. Rejections are tested at cosines as
high as all-MiniLM-L6-v2 really gives those pairs (0.98 for the number and negation flips, 0.99
for the swapped roles), acceptances at a cosine a true rewording typically reaches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiercache.errors import ConfigError
from tiercache.semantic import features as feats
from tiercache.semantic.guard import (
    MODEL_PATH,
    GuardConfig,
    SemanticGuard,
    load_guard,
    read_guard_config,
)


@pytest.fixture(scope="module")
def guard() -> SemanticGuard:
    return load_guard()


def feature(name: str, query: str, candidate: str, cosine: float = 0.95) -> float:
    return feats.features(query, candidate, cosine)[feats.FEATURE_NAMES.index(name)]


# ---------------------------------------------------------------- the guard refuses


REJECTED = [
    pytest.param("How do I cancel my order?", "How do I not cancel my order?", 0.98, id="negation"),
    pytest.param("Is it safe to eat raw eggs?", "Is it unsafe to eat raw eggs?", 0.99, id="un-"),
    pytest.param("Why can't I sleep at night?", "Why can I sleep at night?", 0.97, id="n't"),
    pytest.param("Top 5 movies of 2020", "Top 10 movies of 2020", 0.98, id="number"),
    pytest.param("Best laptops of 2023", "Best laptops of 2024", 0.98, id="year"),
    pytest.param("Is 1GB enough RAM for Ubuntu?", "Is 2GB enough RAM for Ubuntu?", 0.98, id="2GB"),
    pytest.param("Top five movies of 2020", "Top 10 movies of 2020", 0.97, id="number-word"),
    pytest.param(
        "What is the capital of France?", "What is the capital of Germany?", 0.95, id="entity"
    ),
    pytest.param(
        "Will Jio sim work on Moto E2?", "Will Jio sim work on Moto G2?", 0.97, id="model"
    ),
    pytest.param(
        "Do black girls like Mexican guys?", "Do Mexican girls like black guys?", 0.99, id="roles"
    ),
    pytest.param(
        "How do I fly from Paris to Rome?", "How do I fly from Rome to Paris?", 0.99, id="from-to"
    ),
    pytest.param("Brutus betrayed Caesar.", "Caesar betrayed Brutus.", 0.99, id="subject-object"),
    pytest.param("Is India afraid of China?", "Why is China afraid of India?", 0.95, id="of"),
]


@pytest.mark.parametrize(("query", "candidate", "cosine"), REJECTED)
def test_rejects_a_changed_question_even_at_high_cosine(
    guard: SemanticGuard, query: str, candidate: str, cosine: float
) -> None:
    assert not guard.accept(query, candidate, cosine)
    assert not guard.accept(candidate, query, cosine)
    assert guard.score(query, candidate, cosine) == 0.0  # a veto, not a low score


def test_what_the_features_cannot_tell_who_did_what_to_whom_in_a_question() -> None:
    # "Who did Brutus betray?" / "Who betrayed Brutus?": the wh-word's role changes, no content
    # word moves around a pivot, so role_swap stays 0 and the guard leans on the cosine.
    assert feature("role_swap", "Who did Brutus betray?", "Who betrayed Brutus?") == 0.0


# ---------------------------------------------------------------- the guard serves


ACCEPTED = [
    pytest.param("What is the capital of France?", "Which city is France's capital?", id="city"),
    pytest.param("What is the capital of France?", "What is France's capital?", id="possessive"),
    pytest.param("How do I cancel my order?", "How can I cancel my order?", id="modal"),
    pytest.param("How can one make money online?", "How could I make money online?", id="one"),
    pytest.param("Is India a safe country?", "Is India a safe country to visit?", id="extra"),
    pytest.param(
        "Top 10 movies of 2020?", "What are the ten best movies of 2020?", id="number-as-word"
    ),
    pytest.param(
        "Brutus betrayed Caesar.", "Caesar was betrayed by Brutus.", id="passive-keeps-roles"
    ),
    pytest.param(
        "What is the population of the U.S.?", "What's the population of the US?", id="acronym"
    ),
    pytest.param("Why don't cats like water?", "Why do cats not like water?", id="both-negated"),
]


@pytest.mark.parametrize(("query", "candidate"), ACCEPTED)
def test_accepts_a_true_rewording(guard: SemanticGuard, query: str, candidate: str) -> None:
    assert guard.accept(query, candidate, 0.95)
    assert guard.accept(candidate, query, 0.95)


def test_identical_text_is_accepted_and_scores_high(guard: SemanticGuard) -> None:
    text = "How do I reset my password?"
    assert guard.accept(text, text, 1.0)
    assert guard.score(text, text, 1.0) > max(0.8, guard.threshold)


def test_cosine_floor_is_a_hard_prefilter(guard: SemanticGuard) -> None:
    floor = guard.config.cosine_floor
    text = "How do I reset my password?"
    assert guard.score(text, text, floor - 1e-6) == 0.0
    assert not guard.accept(text, text, floor - 1e-6, threshold=0.0)


def test_score_rises_with_cosine(guard: SemanticGuard) -> None:
    q, c = "How do I cancel my order?", "How can I cancel an order I placed?"
    scores = [guard.score(q, c, x) for x in (0.7, 0.8, 0.9, 0.95, 1.0)]
    assert scores == sorted(scores)
    assert all(0.0 < s < 1.0 for s in scores)


def test_choose_returns_the_best_accepted_candidate(guard: SemanticGuard) -> None:
    query = "Top 5 movies of 2020"
    candidates = [
        ("Top 10 movies of 2020", 0.98),  # vetoed: another number
        ("Top 5 films of 2020", 0.96),
        ("Top 5 movies of 2020 ranked", 0.95),
        ("How do I bake bread?", 0.2),  # under the floor
    ]
    best = guard.choose(query, candidates)
    assert best in (1, 2)
    assert guard.choose(query, candidates[:1]) is None
    assert guard.choose(query, []) is None


# ---------------------------------------------------------------- operating table


def test_packaged_model_loads_and_matches_the_features() -> None:
    config = read_guard_config()
    assert config.feature_names == feats.FEATURE_NAMES
    assert len(config.coefficients) == len(feats.FEATURE_NAMES)
    assert config.embedder == "sentence-transformers/all-MiniLM-L6-v2"
    data = json.loads(MODEL_PATH.read_text(encoding="utf-8"))
    assert set(data["vetoes"]) <= set(feats.FEATURE_NAMES)
    assert config.cosine_floor == pytest.approx(0.6)
    assert config.coefficients[0] > 0  # more similar, more likely the same question


def test_default_threshold_meets_the_default_target(guard: SemanticGuard) -> None:
    config = guard.config
    assert guard.target_precision == config.default_target_precision
    assert guard.threshold == config.threshold_for(config.default_target_precision)
    at = [p for p in config.operating_table if p.threshold >= guard.threshold]
    assert at and all(p.precision >= config.default_target_precision for p in at)


def test_threshold_for_is_monotonic(guard: SemanticGuard) -> None:
    config = guard.config
    reachable = [t for t in np.arange(0.90, 1.0, 0.0025) if _reachable(config, float(t))]
    assert len(reachable) > 5
    thresholds = [config.threshold_for(float(t)) for t in reachable]
    assert thresholds == sorted(thresholds)


def _reachable(config: GuardConfig, target: float) -> bool:
    try:
        config.threshold_for(target)
    except ConfigError:
        return False
    return True


def test_target_precision_is_configurable(guard: SemanticGuard) -> None:
    strict = load_guard(target_precision=0.98)
    assert strict.threshold >= guard.threshold
    with pytest.raises(ConfigError, match="target_precision"):
        load_guard(target_precision=1.5)


def _model(**overrides: Any) -> dict[str, Any]:
    model: dict[str, Any] = {
        "format": "tiercache-semantic-guard/1",
        "embedder": "test",
        "features": list(feats.FEATURE_NAMES),
        "coefficients": [10.0] + [0.0] * (len(feats.FEATURE_NAMES) - 1),
        "intercept": -9.0,
        "cosine_floor": 0.6,
        "vetoes": {"number_mismatch": 1.0},
        "default_target_precision": 0.95,
        "operating_table": {
            "columns": ["threshold", "precision", "recall"],
            "rows": [[0.2, 0.90, 0.9], [0.5, 0.96, 0.7], [0.6, 0.94, 0.6], [0.8, 0.99, 0.3]],
        },
    }
    model.update(overrides)
    return model


def test_threshold_for_takes_the_lowest_row_from_which_on_all_rows_qualify(tmp_path: Path) -> None:
    path = tmp_path / "guard.json"
    path.write_text(json.dumps(_model()), encoding="utf-8")
    config = read_guard_config(path)
    assert config.threshold_for(0.90) == 0.2
    assert config.threshold_for(0.95) == 0.8  # row 0.6 dips under 0.95 after row 0.5
    assert config.threshold_for(0.99) == 0.8
    with pytest.raises(ConfigError, match="not held from any threshold"):
        config.threshold_for(0.995)
    assert load_guard(path).threshold == 0.8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"format": "v0"}, "format"),
        ({"features": ["cosine"]}, "coefficients"),
        ({"vetoes": {"nope": 1.0}}, "unknown feature"),
        ({"intercept": "x"}, "malformed"),
        (
            {"operating_table": {"columns": ["threshold", "precision", "recall"], "rows": []}},
            "rows",
        ),
        ({"cosine_floor": float("nan")}, "non-finite"),
        ({"vetoes": {"number_mismatch": float("nan")}}, "non-finite"),  # it would never fire
        (
            {
                "operating_table": {
                    "columns": ["threshold", "precision", "recall"],
                    "rows": [[0.5, float("nan"), 0.5]],  # it would pass every target
                }
            },
            "non-finite",
        ),
    ],
)
def test_malformed_model_is_a_config_error(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    path = tmp_path / "guard.json"
    path.write_text(json.dumps(_model(**overrides)), encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        load_guard(path)


def test_model_for_other_features_is_refused(tmp_path: Path) -> None:
    names = list(reversed(feats.FEATURE_NAMES))
    path = tmp_path / "guard.json"
    path.write_text(json.dumps(_model(features=names)), encoding="utf-8")
    with pytest.raises(ConfigError, match="trained on features"):
        load_guard(path)


def test_missing_model_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_guard(tmp_path / "none.json")


def test_score_matrix_agrees_with_score(guard: SemanticGuard) -> None:
    pairs = [(q, c, x) for q, c, x in (p.values for p in REJECTED)]
    pairs += [(q, c, 0.95) for q, c in (p.values for p in ACCEPTED)]
    matrix = np.array([feats.features(q, c, x) for q, c, x in pairs])
    expected = [guard.score(q, c, x) for q, c, x in pairs]
    assert guard.score_matrix(matrix) == pytest.approx(expected)


# ---------------------------------------------------------------- features


def test_features_are_symmetric_and_fixed_length() -> None:
    for q, c, x in (p.values for p in REJECTED):
        assert feats.features(q, c, x) == feats.features(c, q, x)
        assert len(feats.features(q, c, x)) == len(feats.FEATURE_NAMES)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("It costs 1,000 dollars", "It costs 1000 dollars", 0.0),
        ("It costs 1,000 dollars", "It costs 2,000 dollars", 1.0),
        ("Top ten movies", "Top 10 movies", 0.0),
        ("Top 10 movies", "Top movies", 0.5),
        ("How can one learn Python?", "How can I learn Python?", 0.0),
        ("Pick one book", "Pick 2 books", 1.0),
        ("Which one is best?", "Which is best?", 0.0),  # "one" alone may be a pronoun
        ("Pick one book", "Pick 1 book", 0.0),
        ("Pick one book", "Pick two books", 1.0),
        ("What is pi to 3.14?", "What is pi to 3.15?", 1.0),
        ("What does roll No. 1 mean?", "What does roll no.1 mean?", 0.0),
        # A review found these served as one question: a sign, a leading point, digits past a
        # float's, a version read as its digits, and the same numbers in another order.
        ("Is -3 greater than 2?", "Is 3 greater than 2?", 1.0),
        ("What is -40 degrees in Fahrenheit?", "What is 40 degrees in Fahrenheit?", 1.0),
        ("What is .5 times 4?", "What is 5 times 4?", 1.0),
        ("Balance of account 12345678901234567", "Balance of account 12345678901234568", 1.0),
        ("What changed in version 1.2.3?", "What changed in version 123?", 1.0),
        ("What is 2^10?", "What is 10^2?", 1.0),
        ("What is 1/4 of 100?", "What is 4/1 of 100?", 1.0),
        # ...and what still agrees: a range's dash, a name's, trailing zeros, number words.
        ("Read pages 3-4", "Read pages 3 4", 0.0),
        ("COVID-19 cases in May", "COVID 19 cases in May", 0.0),
        ("It costs 3.50 dollars", "It costs 3.5 dollars", 0.0),
        ("Top five of 100", "Top 5 of 100", 0.0),
    ],
)
def test_number_mismatch(a: str, b: str, expected: float) -> None:
    assert feature("number_mismatch", a, b) == expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("Is it legal?", "Is it illegal?", 1.0),
        ("Can I park here?", "Can't I park here?", 1.0),
        ("Is this the No. 1 song?", "Is this the number 1 song?", 0.0),
        ("No, the method was removed.", "The method was removed.", 0.0),
        # A free rewording: "without" against "removed" is not a flip of the same sentence.
        (
            "The method returns a new table without the given column.",
            "The method creates a new table with the specified column removed.",
            0.0,
        ),
    ],
)
def test_negation_mismatch(a: str, b: str, expected: float) -> None:
    assert feature("negation_mismatch", a, b) == expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("Is India safe?", "Is India safe for Indian women?", 0.0),
        ("How did Donald Trump win?", "How did donald trump win?", 0.0),
        ("Best hotels in Paris", "Best hotels in London", 1.0),
        ("Why do people hate Apple?", "Why do people hate smartphones?", 0.5),
        ("What is PyTorch?", "What is pytorch?", 0.0),
    ],
)
def test_entity_mismatch(a: str, b: str, expected: float) -> None:
    assert feature("entity_mismatch", a, b) == expected


def test_a_cached_prompt_is_profiled_once() -> None:
    """Pairs with a text already seen reuse its profile (the cost is timed by `make
    bench-semantic`, not here): the second pass over the same texts profiles nothing new and
    gives the same features as fresh profiles."""
    texts = [p.values[:2] for p in REJECTED] + [p.values for p in ACCEPTED]
    first = [feats.features(q, c, 0.9) for q, c in texts]
    misses = feats.profile_memo_misses()
    second = [feats.features(q, c, 0.9) for q, c in texts]
    assert feats.profile_memo_misses() == misses
    assert second == first
    fresh = [
        feats.pair_features(feats.profile_text(q), feats.profile_text(c), 0.9) for q, c in texts
    ]
    assert fresh == first


def test_the_calibrated_score_is_the_tables_precision_per_band_never_falling(
    guard: SemanticGuard,
) -> None:
    """`calibrated` (the trust gate's score) reads P(right) per score band from the operating
    table's cumulative rows, pooled so that it never falls as the score rises; a refused
    candidate is 0."""
    thresholds, curve = guard.config.local_precision()
    assert len(thresholds) == len(curve) == len(guard.config.operating_table)
    assert np.all(np.diff(curve) >= 0) and 0.0 <= curve[0] and curve[-1] <= 1.0
    # pooled bands still hold the table's hits: the top row's precision is its band's or more
    top = guard.config.operating_table[-1]
    assert curve[-1] >= top.precision - 0.02
    text = "How do I reset my password?"
    raw = guard.score(text, text, 1.0)
    assert raw >= thresholds[-1]  # the same text: in the top band (its raw score only 0.86)
    assert guard.calibrated(text, text, 1.0) == pytest.approx(curve[-1]) and curve[-1] > raw
    assert guard.calibrated("a", "b", guard.config.cosine_floor - 0.01) == 0.0


def test_the_calibration_of_a_small_table_by_hand(guard: SemanticGuard) -> None:
    """Three rows (threshold, precision, recall): the bands between them hold recall
    differences in right hits among recall / precision differences in hits; a band less often
    right than the one below it is pooled with it; a score on a threshold is in the band it
    opens, one under the first threshold in the first band, a refused one (0.0) is 0."""
    import dataclasses

    from tiercache.semantic.guard import OperatingPoint

    def table(*rows: tuple[float, float, float]) -> SemanticGuard:
        points = tuple(OperatingPoint(*row) for row in rows)
        config = dataclasses.replace(
            guard.config, operating_table=points, default_target_precision=0.85
        )
        return SemanticGuard(config)

    plain = table((0.2, 0.8, 0.9), (0.5, 0.9, 0.6), (0.8, 1.0, 0.2))
    _, curve = plain.config.local_precision()
    # bands: 0.3 / (1.125 - 0.6667), 0.4 / (0.6667 - 0.2), 0.2 / 0.2
    assert curve == pytest.approx([0.3 / (1.125 - 0.6 / 0.9), 0.4 / (0.6 / 0.9 - 0.2), 1.0])
    got = plain.calibrate(np.array([0.0, 0.1, 0.4999, 0.5, 0.79, 0.8, 1.0]))
    assert got == pytest.approx([0.0, curve[0], curve[0], curve[1], curve[1], 1.0, 1.0])
    pooled = table((0.2, 0.8, 0.9), (0.5, 0.95, 0.6), (0.8, 0.9, 0.2))
    _, curve = pooled.config.local_precision()
    # the top band (0.9) is less often right than the middle one (0.977): pooled, 0.6 / 0.6316
    assert curve == pytest.approx([0.3 / (1.125 - 0.6 / 0.95), 0.95, 0.95])


def test_a_profile_is_memoized_within_one_scope_only() -> None:
    """A text another tenant looked up is profiled again in this tenant's scope: the memo's
    saving (about 20 us a text) must not tell one tenant which texts another asked."""
    text = "which laptop should a student buy in 2026 for photo editing"
    with feats.memo_scope("tenant-a"):
        feats.profile(text)
        misses = feats.profile_memo_misses()
        feats.profile(text)
        assert feats.profile_memo_misses() == misses  # memoized within the scope
    with feats.memo_scope("tenant-b"):
        assert feats.profile(text) == feats.profile_text(text)
        assert feats.profile_memo_misses() == misses + 1  # computed again in another scope


def test_a_long_text_is_profiled_each_time_never_memoized() -> None:
    """The memo is bounded by count: a profile of a 16,000-character prompt holds about 650
    KiB, and variants of one long cached prompt filled 8,192 entries (about 5 GiB)."""
    from tiercache.semantic import features as feats

    long_text = "why does my cache miss " * 400  # 9,200 characters
    before = feats.profile_memo_misses()
    first, second = feats.profile(long_text), feats.profile(long_text)
    assert first == second and feats.profile_memo_misses() == before  # not through the memo
    feats.profile("a short question?")
    feats.profile("a short question?")
    assert feats.profile_memo_misses() == before + 1  # short texts still memoized
