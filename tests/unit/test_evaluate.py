"""`tiercache eval-semantic` (tiercache.semantic.evaluate) on tiny pair sets with a fake embedder.

The fake embedder returns hand-made unit vectors, so every cosine is known and no model loads.
A small guard model (cosine only, a number veto) is written per test, so the counts do not
depend on the packaged model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiercache.errors import ConfigError
from tiercache.semantic import evaluate as ev
from tiercache.semantic import features as feats
from tiercache.semantic.verifier import guard_logits

# Inserted side: four directions. A query's vector is cos * e_i + sqrt(1 - cos^2) * e_noise.
CAPITAL = "What is the capital of France?"
TOP5 = "Top 5 movies of 2020"
RESET = "How do I reset my password?"
RESET_PIN = "How do I reset my PIN?"
BREAD = "How do I bake bread?"
DIM = 8


def _unit(axis: int, cos: float = 1.0, noise_axis: int = 7) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[axis] = cos
    v[noise_axis] = np.sqrt(max(0.0, 1.0 - cos * cos))
    return v


VECTORS = {
    CAPITAL: _unit(0),
    TOP5: _unit(1),
    RESET: _unit(2),
    RESET_PIN: _unit(3),
    BREAD: _unit(4),
    "Which city is France's capital?": _unit(0, 0.95, 5),  # correct hit
    "Top 10 movies of 2020": _unit(1, 0.98, 5),  # label 0: the guard vetoes, cosine hits
    "How can I change my password?": _unit(3, 0.95, 2),  # 0.95 to RESET_PIN, 0.31 to RESET
    "Where do penguins live?": _unit(6),  # nothing near: a miss
}


def fake_embed(texts: Sequence[str]) -> np.ndarray:
    return np.stack([VECTORS[t] / np.linalg.norm(VECTORS[t]) for t in texts])


PAIRS = [
    {"a": CAPITAL, "b": "Which city is France's capital?", "label": 1, "source": "s1"},
    {"a": TOP5, "b": "Top 10 movies of 2020", "label": 0, "source": "s1"},
    {"a": RESET, "b": "How can I change my password?", "label": 1, "source": "s2"},
    {"a": BREAD, "b": "Where do penguins live?", "label": 1, "source": "s2"},
    {"a": "How do I   reset my PIN?", "b": RESET_PIN, "label": 1, "source": "s2"},
]


def write_pairs(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_guard(path: Path) -> Path:
    model = {
        "format": "tiercache-semantic-guard/1",
        "embedder": "fake",
        "features": list(feats.FEATURE_NAMES),
        "coefficients": [40.0] + [0.0] * (len(feats.FEATURE_NAMES) - 1),
        "intercept": -36.0,  # p = 0.5 at cosine 0.9
        "cosine_floor": 0.6,
        "vetoes": {"number_mismatch": 1.0},
        "default_target_precision": 0.97,
        "operating_table": {
            "columns": ["threshold", "precision", "recall"],
            "rows": [[0.3, 0.9, 0.9], [0.5, 0.97, 0.8], [0.9, 0.99, 0.5]],
        },
    }
    path.write_text(json.dumps(model), encoding="utf-8")
    return path


def run(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    pairs = write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    guard = write_guard(tmp_path / "guard.json")
    out = tmp_path / "out.json"
    argv = ["--pairs", str(pairs), "--guard", str(guard), "--json", str(out), *extra]
    code = ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed)
    return code, json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}


def test_protocol_counts_for_guard_and_cosine(tmp_path: Path, capsys: Any) -> None:
    code, result = run(tmp_path, "--k", "3")
    assert code == 0
    assert result["inserted"] == 5  # "How do I   reset my PIN?" normalizes onto RESET_PIN
    guard = result["guard"]["counts"]
    # s1: correct hit on the capital; the number change is vetoed (a miss, the right outcome).
    assert (guard["s1"]["correct"], guard["s1"]["false"], guard["s1"]["miss"]) == (1, 0, 1)
    # s2: the password query lands on RESET_PIN (wrong neighbour), penguins miss, the PIN
    # query is identical to its own (normalized) a: correct.
    s2 = guard["s2"]
    assert (s2["correct"], s2["false"], s2["miss"], s2["neighbour"]) == (1, 1, 1, 1)
    assert guard["overall"]["precision"] == pytest.approx(2 / 3, abs=1e-4)
    assert guard["overall"]["recall"] == pytest.approx(2 / 4)
    base = result["cosine_baseline"]["counts"]
    # The baseline serves the number change: a false hit on a label-0 pair.
    assert (base["s1"]["correct"], base["s1"]["false"], base["s1"]["miss"]) == (1, 1, 0)
    assert base["overall"]["false"] == 2
    printed = capsys.readouterr().out
    assert "hit guard" in printed and "plain cosine >= 0.9" in printed
    assert "lookup latency" in printed


def test_same_text_neighbour_is_counted_apart(tmp_path: Path) -> None:
    rows = [
        {"a": RESET, "b": RESET_PIN, "label": 1, "source": "s"},  # RESET_PIN is inserted too
        {"a": RESET_PIN, "b": BREAD, "label": 0, "source": "s"},
    ]
    pairs = ev.load_pairs(write_pairs(tmp_path / "p.jsonl", rows))
    corpus = ev.build_corpus(pairs)
    embedded = ev.embed_corpus(corpus, fake_embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, 2)
    counts = ev.tally(corpus, candidates, ev.choose_by_cosine(candidates.cosine, 0.9))
    assert (counts["s"].false, counts["s"].neighbour, counts["s"].same_text) == (1, 1, 1)
    assert counts["s"].correct == 0 and counts["s"].miss == 1


def test_search_one_matches_search_topk() -> None:
    rng = np.random.default_rng(0)
    inserted = rng.normal(size=(50, DIM)).astype(np.float32)
    inserted /= np.linalg.norm(inserted, axis=1, keepdims=True)
    queries = inserted[:7] + 0.1 * rng.normal(size=(7, DIM)).astype(np.float32)
    batch = ev.search_topk(inserted, queries, 5, block=3)
    for i, q in enumerate(queries):
        idx, cos = ev.search_one(inserted, q, 5)
        assert list(idx) == list(batch.index[i])
        assert cos == pytest.approx(batch.cosine[i], abs=1e-5)
        assert list(cos) == sorted(cos, reverse=True)


def test_sweep_and_plot(tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "pr.png"
    code, result = run(tmp_path, "--sweep", "--plot", str(plot))
    assert code == 0
    assert plot.stat().st_size > 1000
    assert result["sweep"]["cosine"] and result["sweep"]["guard"]
    assert "plain cosine sweep" in capsys.readouterr().out


def test_sweep_with_a_source_without_positives(tmp_path: Path, capsys: Any) -> None:
    rows = [*PAIRS, {"a": TOP5, "b": "Top 10 movies of 2020", "label": 0, "source": "neg"}]
    pairs = write_pairs(tmp_path / "pairs.jsonl", rows)
    guard = write_guard(tmp_path / "guard.json")
    argv = ["--pairs", str(pairs), "--guard", str(guard), "--sweep"]
    assert ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed) == 0
    printed = capsys.readouterr().out
    assert "neg" in printed and "(score >= 0.50)" in printed


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"a": "x", "b": "y", "label": 1}\n{"a": "x", "b": "y"\n', ":2: not JSON"),
        ('{"a": "x", "b": "y", "label": 1}\n\n[1, 2]\n', ":3: expected a JSON object"),
        ('{"a": "x", "label": 1}\n', ":1: 'b' must be a non-empty string"),
        ('{"a": "  ", "b": "y", "label": 1}\n', ":1: 'a' must be a non-empty string"),
        ('{"a": "x", "b": "y", "label": 2}\n', ":1: 'label' must be 0 or 1"),
        ('{"a": "x", "b": "y", "label": true}\n', ":1: 'label' must be 0 or 1"),
        ('{"a": "x", "b": "y", "label": 1, "source": 3}\n', ":1: 'source'"),
        ("\n\n", "holds no pairs"),
        ('{"a": "x", "b": "y", "label": 1, "cluster_a": 1}\n', ":1: 'cluster_a' and 'cluster_b'"),
        ('{"a": "x", "b": "y", "label": 1, "cluster_a": "1", "cluster_b": 2}\n', "integer"),
        (
            '{"a": "x", "b": "y", "label": 1, "cluster_a": 1, "cluster_b": 1}\n'
            '{"a": "p", "b": "q", "label": 0}\n',
            ":2: clusters on some lines only",
        ),
    ],
)
def test_malformed_pairs_file_names_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ev.PairsFileError, match=message):
        ev.load_pairs(path)


def test_cli_reports_bad_input_with_exit_code_2(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": "x", "b": "y", "label": 1}\nnot json\n', encoding="utf-8")
    assert ev.main_eval_semantic(["--pairs", str(path)], embed_factory=lambda: fake_embed) == 2
    err = capsys.readouterr().err
    assert "invalid request" in err and "bad.jsonl:2" in err
    assert ev.main_eval_semantic(["--pairs", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("count", ["0", "-3"])
def test_no_latency_queries_is_refused_before_any_work(
    tmp_path: Path, capsys: Any, count: str
) -> None:
    """A count that would time nothing is refused up front (it used to fail with a traceback
    after embedding every text)."""
    path = write_pairs(tmp_path / "p.jsonl", [{"a": "x", "b": "y", "label": 1}])

    def never() -> Any:
        raise AssertionError("the embedder was loaded")

    with pytest.raises(SystemExit) as exit_info:
        ev.main_eval_semantic(["--pairs", str(path), "--latency-queries", count], never)
    assert exit_info.value.code == 2
    assert f"--latency-queries must be >= 1, got {count}" in capsys.readouterr().err


def test_source_is_optional(tmp_path: Path) -> None:
    path = write_pairs(tmp_path / "p.jsonl", [{"a": "x", "b": "y", "label": 0}])
    assert ev.load_pairs(path)[0].source == "-"


def test_byte_order_mark_and_crlf_lines_are_read(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    rows = '{"a": "x y", "b": "y x", "label": 1}\r\n{"a": "p", "b": "q", "label": 0}\r\n'
    path.write_bytes(b"\xef\xbb\xbf" + rows.encode("utf-8"))
    pairs = ev.load_pairs(path)
    assert [(p.a, p.b, p.label) for p in pairs] == [("x y", "y x", 1), ("p", "q", 0)]


def clustered(rows: list[dict[str, Any]], clusters: list[tuple[int, int]]) -> list[dict[str, Any]]:
    return [{**r, "cluster_a": a, "cluster_b": b} for r, (a, b) in zip(rows, clusters, strict=True)]


def test_hits_are_judged_by_duplicate_clusters_when_the_file_has_them(
    tmp_path: Path, capsys: Any
) -> None:
    """The password query is served RESET_PIN, another pair's `a`: a false hit by GPTCache's
    rule, a correct one when RESET_PIN is in the query's duplicate cluster, false again when
    it is not; recall counts correct hits on label-1 pairs only."""
    guard = write_guard(tmp_path / "guard.json")

    def counts(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        pairs = write_pairs(tmp_path / "pairs.jsonl", rows)
        out = tmp_path / "out.json"
        argv = ["--pairs", str(pairs), "--guard", str(guard), "--json", str(out), "--k", "3"]
        assert ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed) == 0
        result = json.loads(out.read_text(encoding="utf-8"))
        return result["guard"]["counts"]["s2"], result["judged_by"]

    plain, rule = counts(PAIRS)
    assert rule == "own-a" and (plain["correct"], plain["false"]) == (1, 1)
    assert "judged by the pair's own a" in capsys.readouterr().out
    # clusters: CAPITAL 1, TOP5 2 / its query 3, RESET + RESET_PIN + the password query 4
    same = clustered(PAIRS, [(1, 1), (2, 3), (4, 4), (5, 6), (4, 4)])
    judged, rule = counts(same)
    assert rule == "clusters"
    assert (judged["correct"], judged["false"], judged["correct_neighbour"]) == (2, 0, 1)
    assert judged["recall"] == pytest.approx(2 / 3, abs=1e-4) and judged["precision"] == 1.0
    assert "judged by duplicate clusters" in capsys.readouterr().out
    apart = clustered(PAIRS, [(1, 1), (2, 3), (4, 4), (5, 6), (7, 7)])  # RESET_PIN elsewhere
    judged, _ = counts(apart)
    assert (judged["correct"], judged["false"], judged["neighbour"]) == (1, 1, 1)


def test_a_label_0_query_served_a_text_of_its_own_cluster_is_correct_but_not_recall(
    tmp_path: Path,
) -> None:
    rows = clustered(
        [
            {"a": RESET, "b": "How can I change my password?", "label": 0, "source": "s"},
            {"a": RESET_PIN, "b": BREAD, "label": 0, "source": "s"},
        ],
        [(1, 9), (9, 8)],  # the query's cluster (9) is RESET_PIN's
    )
    corpus = ev.build_corpus(ev.load_pairs(write_pairs(tmp_path / "p.jsonl", rows)))
    embedded = ev.embed_corpus(corpus, fake_embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, 2)
    counts = ev.tally(corpus, candidates, ev.choose_by_cosine(candidates.cosine, 0.9))["s"]
    assert (counts.correct, counts.correct_positive, counts.false) == (1, 0, 0)
    assert counts.positives == 0 and counts.precision == 1.0


def test_hits_file_has_one_line_per_pair_in_input_order(tmp_path: Path) -> None:
    hits = tmp_path / "out" / "hits.jsonl"
    code, result = run(tmp_path, "--k", "3", "--hits", str(hits))
    assert code == 0
    lines = [json.loads(line) for line in hits.read_text(encoding="utf-8").splitlines()]
    assert lines == [
        {"served": CAPITAL},
        {"served": None},  # the number change, vetoed
        {"served": RESET_PIN},  # the wrong neighbour, as served
        {"served": None},
        {"served": RESET_PIN},  # normalized as inserted
    ]
    guard = result["guard"]["counts"]["overall"]
    assert guard["correct"] + guard["false"] == sum(line["served"] is not None for line in lines)


def test_a_text_given_two_clusters_is_reported(tmp_path: Path, capsys: Any) -> None:
    rows = clustered(PAIRS, [(1, 1), (2, 3), (4, 4), (5, 6), (4, 4)])
    rows.append({**rows[0], "cluster_a": 99})  # CAPITAL again, another cluster
    pairs = write_pairs(tmp_path / "pairs.jsonl", rows)
    guard = write_guard(tmp_path / "guard.json")
    out = tmp_path / "out.json"
    argv = ["--pairs", str(pairs), "--guard", str(guard), "--json", str(out)]
    assert ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["cluster_conflicts"] == 1
    assert "1 pairs give their `a` another cluster" in capsys.readouterr().err


def test_the_evaluation_decides_as_serving_does(tmp_path: Path) -> None:
    """The vectorized decision the command counts is the serving guard's `choose` on the same
    candidates, query by query (the packaged guard and one of these tests' own)."""
    pairs = ev.load_pairs(write_pairs(tmp_path / "p.jsonl", PAIRS))
    corpus = ev.build_corpus(pairs)
    embedded = ev.embed_corpus(corpus, fake_embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, 3)
    matrix = ev.candidate_features(corpus, candidates)
    for guard in (ev.load_guard(), ev.load_guard(write_guard(tmp_path / "g.json"))):
        chosen = ev.choose_by_score(
            guard.score_matrix(matrix), candidates.cosine, guard.threshold,
            guard.config.cosine_floor,
        )  # fmt: skip
        for i, pair in enumerate(corpus.pairs):
            offered = [
                (corpus.inserted[j], float(c))
                for j, c in zip(candidates.index[i], candidates.cosine[i], strict=True)
            ]
            served = guard.choose(pair.b, offered)
            assert (-1 if served is None else served) == chosen[i], pair


def test_the_verifier_decides_among_what_the_guards_vetoes_let_through(tmp_path: Path) -> None:
    """The verifier scores only candidates past the floor and the vetoes, and serves the best
    at or above its threshold: here a verifier that likes exactly the PIN candidate."""
    pairs = ev.load_pairs(write_pairs(tmp_path / "p.jsonl", PAIRS))
    corpus = ev.build_corpus(pairs)
    embedded = ev.embed_corpus(corpus, fake_embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, 3)
    guard = ev.load_guard(write_guard(tmp_path / "g.json"))
    scores = guard.score_matrix(ev.candidate_features(corpus, candidates))
    asked: list[tuple[str, str]] = []
    guard_given: dict[tuple[str, str], float] = {}

    def score_pairs(
        queries: Sequence[str], texts: Sequence[str], guard: Sequence[float]
    ) -> np.ndarray:
        asked.extend(zip(queries, texts, strict=True))
        guard_given.update(zip(zip(queries, texts, strict=True), guard, strict=True))
        return np.array([0.99 if t == RESET_PIN else 0.2 for t in texts])

    v = ev.verifier_scores(corpus, candidates, scores, score_pairs)
    assert len(asked) == int((scores > 0).sum()) and (v[scores <= 0] == 0).all()
    # each pair comes with its own guard score (a verifier on top of the guard reads it)
    assert guard_given == {
        (pair.b, corpus.inserted[j]): float(g)
        for pair, row, gs in zip(corpus.pairs, candidates.index, scores, strict=True)
        for j, g in zip(row, gs, strict=True)
        if g > 0
    }
    assert ("Top 10 movies of 2020", TOP5) not in asked  # vetoed: never scored
    served = ev.served_texts(corpus, candidates, ev.choose_by_verifier(v, 0.9))
    assert served == [None, None, RESET_PIN, None, RESET_PIN]
    assert ev.served_texts(corpus, candidates, ev.choose_by_verifier(v, 0.1))[0] == CAPITAL


def test_the_serving_verifier_choice_decides_as_the_evaluation_does(tmp_path: Path) -> None:
    """`tiercache.semantic.verifier.VerifiedChoice` (what embedding_cache runs) serves, query by
    query, what `choose_by_verifier` counts; a vetoed candidate never reaches the model, and
    asking again without the chosen one (its answer gone) does not score anything again."""
    from tiercache.semantic.verifier import VerifiedChoice

    pairs = ev.load_pairs(write_pairs(tmp_path / "p.jsonl", PAIRS))
    corpus = ev.build_corpus(pairs)
    embedded = ev.embed_corpus(corpus, fake_embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, 3)
    guard = ev.load_guard(write_guard(tmp_path / "g.json"))
    scores = guard.score_matrix(ev.candidate_features(corpus, candidates))
    eval_guard = {
        (pair.b, corpus.inserted[j]): float(g)
        for pair, row, gs in zip(corpus.pairs, candidates.index, scores, strict=True)
        for j, g in zip(row, gs, strict=True)
    }

    def score_pairs(
        queries: Sequence[str], texts: Sequence[str], guard: Sequence[float]
    ) -> np.ndarray:
        # a verifier on top of the guard: the text's own say plus the guard's log-odds
        own = np.array([3.0 if t == RESET_PIN else 0.5 if t == CAPITAL else -1.0 for t in texts])
        return 1.0 / (1.0 + np.exp(-(own + guard_logits(guard))))

    for threshold in (0.1, 0.5, 0.9):
        counted = ev.choose_by_verifier(
            ev.verifier_scores(corpus, candidates, scores, score_pairs), threshold
        )
        asked: list[str] = []

        def scoring(
            queries: Sequence[str],
            texts: Sequence[str],
            guard: Sequence[float],
            asked: list[str] = asked,
        ) -> np.ndarray:
            asked.extend(texts)
            # each pair's guard score, as the evaluation hands it over (to float rounding:
            # the evaluation scores a matrix, serving one vector at a time)
            handed = [eval_guard[(queries[0], text)] for text in texts]
            assert np.allclose(guard, handed, rtol=0, atol=1e-12)
            return score_pairs(queries, texts, guard)

        choice = VerifiedChoice(guard, scoring, threshold)
        calls: list[tuple[int, float]] = []
        choice.on_scored = lambda count, seconds, calls=calls: calls.append((count, seconds))
        for i, pair in enumerate(corpus.pairs):
            offered = [
                (corpus.inserted[j], float(c))
                for j, c in zip(candidates.index[i], candidates.cosine[i], strict=True)
            ]
            served = choice(pair.b, offered)
            assert (-1 if served is None else served) == counted[i], (threshold, pair)
            if served is not None:
                before = len(asked)
                rest = offered[:served] + offered[served + 1 :]
                again = choice(pair.b, rest)
                assert len(asked) == before  # the retry reuses the query's scores
                expected, best = None, -1.0  # the next best of what is left, as a reference
                for k, (text, cosine) in enumerate(rest):
                    g = guard.score(pair.b, text, cosine)
                    if g > 0:
                        value = float(score_pairs([pair.b], [text], [g])[0])
                        if value >= threshold and value > best:
                            expected, best = k, value
                assert again == expected
        assert TOP5 not in asked  # vetoed for "Top 10 movies of 2020"
        assert len(asked) == int((scores > 0).sum()) == choice.pairs_scored
        # every model call was told to the stage's metrics: its pairs and its time
        assert sum(count for count, _ in calls) == choice.pairs_scored
        assert calls and all(count > 0 and seconds >= 0 for count, seconds in calls)
    with pytest.raises(ConfigError, match="threshold"):
        VerifiedChoice(guard, score_pairs, 0.0)


def test_mined_training_pairs_are_what_serving_hands_the_verifier(tmp_path: Path) -> None:
    """tiercache_dev.train.hard_pairs: every candidate past the floor and the vetoes, labelled
    as the evaluation judges it; the pair itself follows when it was not among them."""
    from tiercache_dev.train.hard_pairs import mine

    clusters = [(1, 1), (2, 3), (4, 4), (5, 6), (7, 7)]
    pairs = ev.load_pairs(write_pairs(tmp_path / "p.jsonl", clustered(PAIRS, clusters)))
    guard = ev.load_guard(write_guard(tmp_path / "g.json"))
    lines = list(mine(pairs, [1, 2, 3, 4, 5], fake_embed, guard, block=10, k=3))
    got = {(line["a"], line["b"]): (line["label"], line["rank"]) for line in lines}
    assert got[("Which city is France's capital?", CAPITAL)] == (1, 0)
    assert got[("Top 10 movies of 2020", TOP5)] == (0, -1)  # vetoed: only the pair itself
    assert got[("How can I change my password?", RESET_PIN)] == (0, 0)  # another cluster
    assert got[("How can I change my password?", RESET)] == (1, -1)  # under the floor
    assert got[(RESET_PIN, RESET_PIN)] == (1, 0)
    assert {line["index"] for line in lines} == {1, 2, 3, 4, 5}


def test_eval_semantic_decides_at_the_verifiers_recorded_point_as_serving_does(
    tmp_path: Path, capsys: Any
) -> None:
    """No --verifier-threshold (or 0): the folder's operating point, as embedding_cache's
    verifier_threshold 0; a folder without one asks for the flag (exit 2); out of (0, 1]
    is refused; --verifier-threshold alone is refused."""
    pytest.importorskip("peft")
    from verifier_folders import untrained_verifier

    from tiercache.semantic.verifier import INFO_FILE

    folder, info = untrained_verifier(tmp_path / "verifier", operating_point=0.25)
    pairs = write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    guard = write_guard(tmp_path / "guard.json")
    out = tmp_path / "out.json"
    base_argv = ["--pairs", str(pairs), "--guard", str(guard), "--json", str(out)]
    for extra, expected in (([], 0.25), (["--verifier-threshold", "0"], 0.25),
                            (["--verifier-threshold", "0.6"], 0.6)):  # fmt: skip
        argv = [*base_argv, "--verifier", str(folder), *extra]
        assert ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed) == 0
        written = json.loads(out.read_text())["verifier"]
        assert written["threshold"] == expected
        intervals, counts = written["intervals"]["overall"], written["counts"]["overall"]
        assert intervals["hits"] == counts["correct"] + counts["false"]
    argv = [*base_argv, "--verifier", str(folder), "--verifier-threshold", "1.5"]
    assert ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed) == 2
    assert "must be in (0, 1]" in capsys.readouterr().err
    (folder / INFO_FILE).write_text(json.dumps({**info, "operating_point": None}))
    argv = [*base_argv, "--verifier", str(folder)]
    assert ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed) == 2
    assert "names no operating_point" in capsys.readouterr().err
    argv = [*base_argv, "--verifier-threshold", "0.5"]
    assert ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed) == 2
    assert "--verifier-threshold needs --verifier" in capsys.readouterr().err
    argv = [*base_argv, "--verifier-dtype", "int8"]
    assert ev.main_eval_semantic(argv, embed_factory=lambda: fake_embed) == 2
    assert "--verifier-dtype needs --verifier" in capsys.readouterr().err


def synthetic_decisions(
    hits: int, right: int, positives: int, pairs: int, source: str = "s"
) -> tuple[ev.Corpus, ev.Candidates, np.ndarray]:
    """A corpus of `pairs` pairs (the first `positives` label 1) where the first `hits` pairs
    are served their own `a`, `right` of them label-1 pairs: precision right / hits."""
    assert right <= min(hits, positives) and hits - right <= pairs - positives
    rows = []
    for i in range(pairs):
        rows.append({"a": f"text {i}", "b": f"query {i}", "label": int(i < positives)})
    served = list(range(right)) + list(range(positives, positives + hits - right))
    corpus = ev.build_corpus([ev.Pair(r["a"], r["b"], r["label"], source) for r in rows])
    index = np.arange(pairs, dtype=np.int64)[:, None]
    candidates = ev.Candidates(index=index, cosine=np.ones((pairs, 1), dtype=np.float32))
    chosen = np.full(pairs, -1)
    chosen[served] = 0
    return corpus, candidates, chosen


def test_bootstrap_intervals_hold_the_measured_figures_and_narrow_with_more_pairs() -> None:
    small = synthetic_decisions(hits=100, right=90, positives=200, pairs=400)
    large = synthetic_decisions(hits=1000, right=900, positives=2000, pairs=4000)
    widths = []
    for corpus, candidates, chosen in (small, large):
        counts = ev.tally(corpus, candidates, chosen)["s"]
        assert counts.precision == pytest.approx(0.9)
        found = ev.bootstrap_intervals(corpus, candidates, chosen, rounds=400)
        for source in ("s", ev.OVERALL):
            i = found[source]
            assert i.precision_low < 0.9 < i.precision_high
            assert i.recall_low < counts.recall < i.recall_high
        widths.append(found["s"].precision_high - found["s"].precision_low)
    # precision of 100 hits is known to about +-6 points, of 1,000 to about +-2
    assert 0.08 < widths[0] < 0.16 and 0.025 < widths[1] < 0.05
    again = ev.bootstrap_intervals(*small, rounds=400)
    assert again == ev.bootstrap_intervals(*small, rounds=400)  # seeded: a run repeats
    assert again != ev.bootstrap_intervals(*small, rounds=400, seed=1)  # and the seed is used
    assert again["s"].hits == 100
    with pytest.raises(ValueError):
        ev.bootstrap_intervals(*small, rounds=0)


def test_precision_is_never_narrower_than_wilsons_interval_near_1() -> None:
    every = synthetic_decisions(hits=30, right=30, positives=60, pairs=90)
    found = ev.bootstrap_intervals(*every, rounds=1000)["s"]
    # 30 of 30: every resample says 1.0; Wilson's 95 % bound is about 0.886
    assert found.precision_high == 1.0
    assert found.precision_low == pytest.approx(0.886, abs=0.002)
    assert ev.wilson(30, 30)[0] == pytest.approx(found.precision_low)
    # one wrong hit more cannot raise the lower bound (the bootstrap alone gives about 0.9)
    one_wrong = synthetic_decisions(hits=30, right=29, positives=60, pairs=90)
    lower = ev.bootstrap_intervals(*one_wrong, rounds=1000)["s"]
    assert lower.precision_low <= ev.wilson(29, 30)[0] < found.precision_low
    low, high = ev.wilson(90, 100)  # the usual case, checked against the closed form
    assert (round(low, 3), round(high, 3)) == (0.826, 0.945)
    assert all(np.isnan(ev.wilson(0, 0)))


def test_recall_counts_label_1_pairs_only_and_a_source_without_positives_has_none(
    tmp_path: Path,
) -> None:
    """Judged by clusters, a label-0 query served a text of its own cluster is a correct hit
    (precision) but not in recall; a source without label-1 pairs has no recall interval."""
    rows = clustered(
        [
            {"a": RESET, "b": "How can I change my password?", "label": 0, "source": "s"},
            {"a": RESET_PIN, "b": BREAD, "label": 0, "source": "s"},
            {"a": CAPITAL, "b": "Which city is France's capital?", "label": 1, "source": "t"},
        ],
        [(1, 9), (9, 8), (3, 3)],  # the first query's cluster (9) is RESET_PIN's
    )
    corpus = ev.build_corpus(ev.load_pairs(write_pairs(tmp_path / "p.jsonl", rows)))
    embedded = ev.embed_corpus(corpus, fake_embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, 2)
    chosen = ev.choose_by_cosine(candidates.cosine, 0.9)
    found = ev.bootstrap_intervals(corpus, candidates, chosen, rounds=200)
    assert found["s"].hits == 1 and found["s"].precision_high == 1.0
    assert np.isnan(found["s"].recall_low) and np.isnan(found["s"].recall_high)
    assert found["s"].as_dict()["recall_low"] is None
    # overall: the one label-1 pair (source t) is served its own a: recall 1 in every resample,
    # although two hits are correct (a numerator of correct hits would make it 2)
    assert (found[ev.OVERALL].recall_low, found[ev.OVERALL].recall_high) == (1.0, 1.0)


def test_bootstrap_resamples_within_each_source() -> None:
    # every pair is served: each one of source "a" rightly, each one of "b" wrongly. Resampled
    # within the sources, every resample has 20 hits of each, so the overall precision keeps
    # the file's mix (exactly 0.5), where resampling the pooled pairs would move it
    one, _, chosen_one = synthetic_decisions(hits=20, right=20, positives=20, pairs=20, source="a")
    two, _, chosen_two = synthetic_decisions(hits=20, right=0, positives=0, pairs=20, source="b")
    both = ev.build_corpus(
        [*one.pairs, *[ev.Pair(p.a + " b", p.b + " b", p.label, "b") for p in two.pairs]]
    )
    index = np.arange(40, dtype=np.int64)[:, None]
    candidates = ev.Candidates(index=index, cosine=np.ones((40, 1), dtype=np.float32))
    chosen = np.concatenate([chosen_one, chosen_two])
    found = ev.bootstrap_intervals(both, candidates, chosen, rounds=200)
    # each source alone cannot vary (all right, all wrong): Wilson's intervals
    assert (found["a"].precision_low, found["a"].precision_high) == ev.wilson(20, 20)
    assert (found["b"].precision_low, found["b"].precision_high) == ev.wilson(0, 20)
    # nor can the overall precision: within each source, every resample holds 20 hits of each
    # (pooled resampling would move it); the bootstrap's zero width is widened to Wilson's
    sums = ev.resampled_sums(both, np.stack([chosen >= 0, both.labels == 1]), 200, seed=0)
    assert set(sums["a"][:, 0]) == {20.0} and set(sums[ev.OVERALL][:, 0]) == {40.0}
    assert set(sums[ev.OVERALL][:, 1]) == {20.0}  # the label-1 pairs, all of source a
    overall = found[ev.OVERALL]
    assert (overall.precision_low, overall.precision_high) == pytest.approx(ev.wilson(20, 40))
    assert overall.precision_low + overall.precision_high == pytest.approx(1.0)


def test_eval_semantic_prints_and_writes_the_intervals(tmp_path: Path, capsys: Any) -> None:
    code, result = run(tmp_path, "--k", "3", "--bootstrap", "200")
    assert code == 0
    assert result["bootstrap"] == 200
    overall = result["guard"]["intervals"]["overall"]
    measured = result["guard"]["counts"]["overall"]["precision"]
    assert overall["precision_low"] <= measured <= overall["precision_high"]
    printed = capsys.readouterr().out
    assert "95 % intervals (bootstrap over the pairs, 200 resamples)" in printed
    assert f"({result['guard']['intervals']['overall']['hits']} hits)" in printed
    code, result = run(tmp_path, "--k", "3", "--bootstrap", "0")
    assert code == 0 and result["guard"]["intervals"] is None
    assert "95 % intervals" not in capsys.readouterr().out
    for bad in ("-1", "10"):
        code, _ = run(tmp_path, "--bootstrap", bad)
        assert code == 2
        assert "--bootstrap must be 0 or at least 100" in capsys.readouterr().err


def test_texts_serving_refuses_are_never_candidates_nor_looked_up(tmp_path: Path) -> None:
    """Serving neither indexes nor looks up a text its screen refuses (emoji, [UNK], too
    long): the evaluation once searched them and counted hits serving cannot make."""
    pairs = ev.load_pairs(write_pairs(tmp_path / "p.jsonl", PAIRS))
    corpus = ev.build_corpus(pairs)

    def refuses(text: str) -> str | None:
        return "unsupported" if text in (CAPITAL, "How can I change my password?") else None

    plain = ev.embed_corpus(corpus, fake_embed)
    screened = ev.embed_corpus(corpus, fake_embed, screen=refuses)
    assert not np.allclose(plain.inserted, screened.inserted)
    before = ev.search_topk(plain.inserted, plain.queries, 3)
    after = ev.search_topk(screened.inserted, screened.queries, 3)
    capital, password = 0, 2  # the pairs whose `a` and whose `b` are refused
    assert ev.choose_by_cosine(before.cosine, 0.9)[capital] == 0  # served before
    assert ev.choose_by_cosine(after.cosine, 0.9)[capital] == -1  # never a candidate
    assert (after.cosine[password] == 0.0).all()  # the refused query finds nothing
    code, result = run(tmp_path)  # the fake embedder: no screen unless one is given
    assert code == 0 and result["guard"]["counts"]["s1"]["correct"] == 1


def test_a_query_identical_to_an_inserted_text_is_served_it_whatever_the_scores(
    tmp_path: Path,
) -> None:
    """prompt_cache answers it before the semantic stage decides: a guard or verifier score
    under the threshold must not turn it into a miss, nor another candidate win over it."""
    rows = [
        {"a": RESET_PIN, "b": RESET_PIN, "label": 1, "source": "s", "cluster_a": 1,
         "cluster_b": 1},
        {"a": RESET, "b": "How can I change my password?", "label": 1, "source": "s",
         "cluster_a": 2, "cluster_b": 2},
    ]  # fmt: skip
    corpus = ev.build_corpus(ev.load_pairs(write_pairs(tmp_path / "p.jsonl", rows)))
    embedded = ev.embed_corpus(corpus, fake_embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, 2)
    scores = np.array([[0.1, 0.9], [0.2, 0.1]])  # the identical text scored low, another high
    own_a = [{k: v for k, v in row.items() if not k.startswith("cluster")} for row in rows]
    unjudged = ev.build_corpus(ev.load_pairs(write_pairs(tmp_path / "o.jsonl", own_a)))
    # by the pair's own `a` alone another pair's identical text counts false: scores decide
    assert (ev.served_exactly(unjudged, candidates, scores) == scores).all()
    served = ev.served_exactly(corpus, candidates, scores)
    identical = int(np.nonzero(candidates.index[0] == corpus.query_match[0])[0][0])
    assert served[0, identical] == 1.0 and ev.choose_by_verifier(served, 0.95)[0] == identical
    assert (served[1] == scores[1]).all()  # no identical text: unchanged
    assert (scores[0] == [0.1, 0.9]).all()  # a copy


def test_the_verifier_scores_one_lookup_at_a_time_as_serving_batches(tmp_path: Path) -> None:
    """Serving scores one query's candidates per call; batches of many queries' pairs padded
    and rounded otherwise (up to 1e-3 apart in bfloat16)."""
    rows = [
        {"a": CAPITAL, "b": "Which city is France's capital?", "label": 1, "source": "s"},
        {"a": RESET, "b": "How can I change my password?", "label": 1, "source": "s"},
        {"a": RESET_PIN, "b": "Where do penguins live?", "label": 0, "source": "s"},
    ]
    corpus = ev.build_corpus(ev.load_pairs(write_pairs(tmp_path / "p.jsonl", rows)))
    embedded = ev.embed_corpus(corpus, fake_embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, 2)
    guard_scores = np.array([[0.9, 0.0], [0.8, 0.7], [0.0, 0.0]])
    calls: list[list[str]] = []

    def score_pairs(queries: Sequence[str], texts: Sequence[str], guard: Sequence[float]) -> Any:
        calls.append(list(queries))
        return np.full(len(texts), 0.5)

    out = ev.verifier_scores(corpus, candidates, guard_scores, score_pairs)
    assert calls == [["Which city is France's capital?"], ["How can I change my password?"] * 2]
    assert (out == np.array([[0.5, 0.0], [0.5, 0.5], [0.0, 0.0]])).all()
