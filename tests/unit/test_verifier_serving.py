"""The serving benchmark's choice of pairs and neighbours (bench.verifier_serving)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from tiercache_dev.bench.verifier_serving import (
    count_hits,
    nearest_texts,
    parse_args,
    spread_pairs,
)

# unit vectors by hand: cosine to the query "q" falls with the index
VECTORS = {
    "q": [1.0, 0.0, 0.0],
    "own a": [0.99, 0.141, 0.0],
    "same  cluster": [0.98, 0.199, 0.0],
    "near one": [0.97, 0.243, 0.0],
    "near   one ": [0.96, 0.0, 0.28],  # the same text once normalized: a single neighbour
    "near two": [0.9, 0.436, 0.0],
    "far": [0.0, 0.0, 1.0],
}


def fake_embed(texts: Sequence[str]) -> np.ndarray:
    vectors = np.array([VECTORS[t] for t in texts], dtype=np.float64)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


ROWS = [
    {"a": "own a", "b": "q", "label": 1, "cluster_a": 1, "cluster_b": 1},
    {"a": "same  cluster", "b": "x", "label": 1, "cluster_a": 1, "cluster_b": 1},
    {"a": "near one", "b": "x", "label": 0, "cluster_a": 2, "cluster_b": 3},
    {"a": "near   one ", "b": "x", "label": 0, "cluster_a": 2, "cluster_b": 4},
    {"a": "near two", "b": "x", "label": 0, "cluster_a": 5, "cluster_b": 6},
    {"a": "far", "b": "x", "label": 0, "cluster_a": 7, "cluster_b": 8},
    {"a": "q", "b": "x", "label": 0, "cluster_a": 9, "cluster_b": 10},  # the query's own text
]


def test_neighbours_are_the_nearest_texts_that_would_be_wrong_answers() -> None:
    (near,) = nearest_texts(ROWS, [ROWS[0]], 2, fake_embed)
    # not the pair's own a, not the query's text, not a text of its cluster, one spelling once
    assert near == ["near one", "near two"]
    (three,) = nearest_texts(ROWS, [ROWS[0]], 3, fake_embed)
    assert three == ["near one", "near two", "far"]
    assert nearest_texts(ROWS, [ROWS[0]], 0, fake_embed) == [[]]


def test_pairs_are_spread_over_the_file_and_bad_arguments_are_refused() -> None:
    rows = [{"a": str(i), "b": str(i), "label": i % 2} for i in range(20)]
    chosen = spread_pairs(rows, 3, 1)
    assert [r["a"] for r in chosen] == ["1", "7", "13"]  # every third of the ten label-1 rows
    for bad in (["--threads", "0"], ["--neighbours", "-1"], ["--count", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--verifier", "builtin", *bad])


def test_hits_are_judged_by_the_answer_they_serve() -> None:
    pairs = [{"label": 1}, {"label": 0}, {"label": 1}, {"label": 1}, {"label": 0}]
    asked = [
        ("semantic", "answer of a", 0.02),  # a's answer on a label-1 pair: right
        ("semantic", "answer of a", 0.02),  # on a label-0 pair: wrong
        ("semantic", "a neighbour's", 0.02),  # another stored answer: wrong
        ("semantic", "shared", 0.02),  # a's answer, but a neighbour stored the same text
        ("miss", "generated", 0.5),  # not a hit
    ]
    stored = [
        ("answer of a", ["x"]),
        ("answer of a", []),
        ("answer of a", ["a neighbour's"]),
        ("shared", ["y", "shared"]),
        ("answer of a", []),
    ]
    assert count_hits(pairs, asked, stored) == {
        "hits_label_1": 1,
        "hits_label_0": 1,
        "hits_neighbour": 1,
        "hits_undetermined": 1,
    }
