"""`tiercache eval-semantic`: how often a semantic cache serves a wrong answer, guard vs cosine.

The protocol is GPTCache's benchmark, on any JSON-lines file of paraphrase pairs
(`{"a": str, "b": str, "label": 0|1, "source": str, "cluster_a": int, "cluster_b": int}`;
`source` optional, the clusters on every line or on none):

1. Insert side `a` of every pair, normalized as the cache keys prompts
   (`tiercache.exact.request.normalize_text`); identical normalized texts are inserted once.
2. Query with side `b`: the `k` nearest inserted vectors by cosine (exact search), then the
   decision rule picks one candidate or none:
   - guard: the accepted candidate with the highest guard score (`tiercache.semantic.guard`);
   - cosine baseline: the nearest candidate when its cosine >= the threshold (GPTCache, RedisVL).
3. Judging a hit (the rule is printed and written to the JSON):
   - `clusters` (when the file carries `cluster_a`/`cluster_b`, as the project's dev file does;
     ../shared/eval/README.md): serving the pair's own `a` is CORRECT iff the label is 1;
     serving another pair's `a` is CORRECT iff that text's cluster is the query's
     (`cluster_b`). An inserted text's cluster is the `cluster_a` of the first pair that
     inserted it (pairs disagreeing on it are counted and reported);
   - `own-a` (GPTCache's protocol, files without clusters): CORRECT iff the label is 1 and the
     returned text is the pair's own normalized `a`.
   Every other hit is FALSE; no hit is a MISS. precision = correct / (correct + false); recall =
   correct hits on label-1 pairs / label-1 pairs. Per `source` and overall.
4. `--hits FILE.jsonl`: what the guard at its operating point served, one line per pair in
   input order: `{"served": <the inserted text, normalized as inserted>}` or `{"served": null}`,
   so anyone can judge the decisions by their own rules.

Lookup latency is search + decision per query, measured one query at a time; embedding is
excluded and reported separately (per text, batched). The core functions take an injected
`embed` function, so tests run without a model.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from tiercache.errors import ConfigError, InvalidRequest, TierCacheError
from tiercache.exact.request import normalize_text
from tiercache.semantic import features as feats
from tiercache.semantic.guard import SemanticGuard, load_guard
from tiercache.semantic.verifier import DTYPES
from tiercache.stats import percentile

DEFAULT_K = 5
BASELINE_THRESHOLD = 0.90
BASELINE_TARGET_PRECISION = 0.97
OVERALL = "overall"
SWEEP_TARGETS = (0.95, 0.955, 0.96, 0.965, 0.97, 0.975, 0.98, 0.985, 0.99)
SWEEP_COSINES = (0.70, 0.75, 0.80, 0.85, 0.88, 0.90, 0.92, 0.94, 0.96, 0.98)

JUDGED_BY = {
    "clusters": "judged by duplicate clusters (cluster_a / cluster_b): another pair's text is a "
    "correct hit when it is in the query's cluster",
    "own-a": "judged by the pair's own a (GPTCache's protocol; the file has no clusters)",
}

EmbedFn = Callable[[Sequence[str]], np.ndarray]
Progress = Callable[[str], None]


class PairsFileError(InvalidRequest):
    """The pairs file is missing or a line is malformed (the message names the line)."""


@dataclass(frozen=True, slots=True)
class Pair:
    """One evaluation pair; `a` and `b` are normalized."""

    a: str
    b: str
    label: int
    source: str
    cluster_a: int | None = None
    cluster_b: int | None = None


def _cluster(row: dict[str, Any], key: str, where: str) -> int | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise PairsFileError(f"{where}: {key!r} must be an integer, got {value!r}")
    return value


def load_pairs(path: Path | str) -> list[Pair]:
    """Read a pairs file; raises `PairsFileError` naming the file and the 1-based line."""
    where = Path(path)
    try:
        lines = where.read_text(encoding="utf-8-sig").splitlines()  # a leading BOM is fine
    except FileNotFoundError:
        raise PairsFileError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PairsFileError(f"{where}: cannot read: {exc}") from None
    pairs: list[Pair] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PairsFileError(f"{where}:{number}: not JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise PairsFileError(f"{where}:{number}: expected a JSON object")
        texts = []
        for key in ("a", "b"):
            value = row.get(key)
            if not isinstance(value, str) or not normalize_text(value):
                raise PairsFileError(f"{where}:{number}: {key!r} must be a non-empty string")
            texts.append(normalize_text(value))
        label = row.get("label")
        if isinstance(label, bool) or label not in (0, 1):
            raise PairsFileError(f"{where}:{number}: 'label' must be 0 or 1, got {label!r}")
        source = row.get("source", "-")
        if not isinstance(source, str) or not source or source == OVERALL:
            raise PairsFileError(f"{where}:{number}: 'source' must be a non-empty string")
        at = f"{where}:{number}"
        clusters = (_cluster(row, "cluster_a", at), _cluster(row, "cluster_b", at))
        if (clusters[0] is None) != (clusters[1] is None):
            raise PairsFileError(f"{at}: 'cluster_a' and 'cluster_b' come together or not at all")
        if pairs and (pairs[0].cluster_a is None) != (clusters[0] is None):
            raise PairsFileError(
                f"{at}: clusters on some lines only (every line needs them, or none)"
            )
        pairs.append(Pair(texts[0], texts[1], int(label), source, *clusters))
    if not pairs:
        raise PairsFileError(f"{where}: holds no pairs")
    return pairs


@dataclass(frozen=True, slots=True)
class Corpus:
    """The pairs and the deduplicated inserted side (built by `build_corpus`)."""

    pairs: tuple[Pair, ...]
    inserted: tuple[str, ...]  # distinct `a` texts, first-seen order
    own: np.ndarray  # (n_pairs,) index into `inserted` of each pair's own `a`
    query_match: np.ndarray  # (n_pairs,) index of the inserted text identical to `b`, or -1
    labels: np.ndarray  # (n_pairs,) 0 or 1
    source_array: np.ndarray  # (n_pairs,) object: each pair's source
    # With clusters: each inserted text's cluster and each query's; None: judged by own `a`
    inserted_cluster: np.ndarray | None = None
    query_cluster: np.ndarray | None = None
    cluster_conflicts: int = 0  # pairs whose cluster_a differs from their text's first one

    def sources(self) -> list[str]:
        """Distinct sources in first-seen order."""
        return list(dict.fromkeys(p.source for p in self.pairs))

    @property
    def rule(self) -> str:
        """How a hit is judged: "clusters" or "own-a" (the module's docstring)."""
        return "own-a" if self.inserted_cluster is None else "clusters"

    def correct(self, served: np.ndarray) -> np.ndarray:
        """Whether serving inserted text `served` (shape (n_pairs,) or (n_pairs, k), indices
        into `inserted`) to each pair's query is a correct hit, by `rule`."""
        extra = (slice(None),) + (None,) * (served.ndim - 1)
        own = served == self.own[extra]
        own_correct = own & (self.labels[extra] == 1)
        if self.inserted_cluster is None or self.query_cluster is None:
            return own_correct
        same = self.inserted_cluster[served] == self.query_cluster[extra]
        return own_correct | (~own & same)


def build_corpus(pairs: Sequence[Pair]) -> Corpus:
    index: dict[str, int] = {}
    own = np.empty(len(pairs), dtype=np.int64)
    first_cluster: list[int] = []
    conflicts = 0
    for i, pair in enumerate(pairs):
        own[i] = index.setdefault(pair.a, len(index))
        if pair.cluster_a is not None:
            if own[i] == len(first_cluster):
                first_cluster.append(pair.cluster_a)
            elif first_cluster[own[i]] != pair.cluster_a:
                conflicts += 1
    clustered = bool(pairs) and pairs[0].cluster_a is not None
    return Corpus(
        pairs=tuple(pairs),
        inserted=tuple(index),
        own=own,
        query_match=np.array([index.get(p.b, -1) for p in pairs], dtype=np.int64),
        labels=np.array([p.label for p in pairs], dtype=np.int64),
        source_array=np.array([p.source for p in pairs], dtype=object),
        inserted_cluster=np.array(first_cluster, dtype=np.int64) if clustered else None,
        query_cluster=(
            np.array([p.cluster_b for p in pairs], dtype=np.int64) if clustered else None
        ),
        cluster_conflicts=conflicts,
    )


@dataclass(frozen=True, slots=True)
class Embedded:
    inserted: np.ndarray  # (n_inserted, d) float32, L2-normalized
    queries: np.ndarray  # (n_pairs, d)
    seconds: float  # wall time spent embedding
    texts: int  # distinct texts embedded

    @property
    def ms_per_text(self) -> float:
        return 1000.0 * self.seconds / max(1, self.texts)


def embed_corpus(
    corpus: Corpus,
    embed: EmbedFn,
    progress: Progress | None = None,
    chunk: int = 512,
    screen: Callable[[str], str | None] | None = None,
) -> Embedded:
    """Embed every distinct text once (both sides), in chunks, reporting progress. A text
    `screen` refuses (`tiercache.semantic.embedder.Screen.check`: serving neither indexes nor
    looks it up) gets the zero vector: cosine 0 with everything, under every floor, so it is
    never a candidate and its query never finds one (the evaluation once searched them, and
    counted hits serving cannot make: 35 on gptcache-mock's dev pairs at the guard's point)."""
    order = list(dict.fromkeys([*corpus.inserted, *(p.b for p in corpus.pairs)]))
    position = {text: i for i, text in enumerate(order)}
    parts: list[np.ndarray] = []
    start = time.perf_counter()
    for begin in range(0, len(order), chunk):
        part = np.asarray(embed(order[begin : begin + chunk]), dtype=np.float32)
        if part.ndim != 2 or part.shape[0] != len(order[begin : begin + chunk]):
            raise ConfigError(f"embed returned shape {part.shape} for {chunk} texts")
        parts.append(part)
        if progress is not None:
            done = min(len(order), begin + chunk)
            elapsed = time.perf_counter() - start
            progress(f"embedding: {done}/{len(order)} texts ({elapsed:.1f} s)")
    seconds = time.perf_counter() - start
    vectors = np.concatenate(parts)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors = vectors / np.maximum(norms, 1e-12)
    inserted = vectors[[position[t] for t in corpus.inserted]]
    queries = vectors[[position[p.b] for p in corpus.pairs]]
    embedded = Embedded(
        np.ascontiguousarray(inserted), np.ascontiguousarray(queries), seconds, len(order)
    )
    return embedded if screen is None else apply_screen(corpus, embedded, screen, progress)


def apply_screen(
    corpus: Corpus,
    embedded: Embedded,
    screen: Callable[[str], str | None],
    progress: Progress | None = None,
) -> Embedded:
    """`embedded` with the zero vector for every text `screen` refuses (see `embed_corpus`)."""
    inserted = embedded.inserted.copy()
    queries = embedded.queries.copy()
    refused_a = [i for i, text in enumerate(corpus.inserted) if screen(text) is not None]
    refused_b = [i for i, pair in enumerate(corpus.pairs) if screen(pair.b) is not None]
    inserted[refused_a] = 0.0
    queries[refused_b] = 0.0
    if progress is not None and (refused_a or refused_b):
        progress(
            f"screen: {len(refused_a)} inserted texts and {len(refused_b)} queries that serving "
            "would neither index nor look up"
        )
    return Embedded(inserted, queries, embedded.seconds, embedded.texts)


@dataclass(frozen=True, slots=True)
class Candidates:
    """Top-k neighbours of each query among the inserted texts, nearest first."""

    index: np.ndarray  # (n_pairs, k) int64 into Corpus.inserted
    cosine: np.ndarray  # (n_pairs, k) float32


def search_one(inserted: np.ndarray, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by cosine for one query vector: (indices, cosines), nearest first."""
    sims = inserted @ query
    k = min(k, sims.shape[0])
    top = np.argpartition(-sims, k - 1)[:k] if k < sims.shape[0] else np.arange(sims.shape[0])
    top = top[np.lexsort((top, -sims[top]))]
    return top, sims[top]


def search_topk(inserted: np.ndarray, queries: np.ndarray, k: int, block: int = 1024) -> Candidates:
    """`search_one` for every query, in blocks (same result, faster)."""
    k = min(k, inserted.shape[0])
    index = np.empty((queries.shape[0], k), dtype=np.int64)
    cosine = np.empty((queries.shape[0], k), dtype=np.float32)
    for begin in range(0, queries.shape[0], block):
        sims = queries[begin : begin + block] @ inserted.T
        for row in range(sims.shape[0]):
            s = sims[row]
            top = np.argpartition(-s, k - 1)[:k] if k < s.shape[0] else np.arange(s.shape[0])
            top = top[np.lexsort((top, -s[top]))]
            index[begin + row] = top
            cosine[begin + row] = s[top]
    return Candidates(index, cosine)


def candidate_features(corpus: Corpus, candidates: Candidates) -> np.ndarray:
    """(n_pairs, k, n_features) guard features of every (query, candidate) pair."""
    n, k = candidates.index.shape
    out = np.empty((n, k, len(feats.FEATURE_NAMES)), dtype=np.float64)
    for i, pair in enumerate(corpus.pairs):
        query = feats.profile(pair.b)
        for j in range(k):
            text = corpus.inserted[candidates.index[i, j]]
            out[i, j] = feats.pair_features(
                query, feats.profile(text), float(candidates.cosine[i, j])
            )
    return out


def correct_candidates(corpus: Corpus, candidates: Candidates) -> np.ndarray:
    """(n_pairs, k) bool: serving this candidate would be a correct hit (`Corpus.correct`)."""
    return corpus.correct(candidates.index)


def choose_by_score(
    scores: np.ndarray, cosine: np.ndarray, threshold: float, floor: float
) -> np.ndarray:
    """(n_pairs,) position of the best accepted candidate by score, -1 for a miss."""
    accepted = (scores > 0.0) & (scores >= threshold) & (cosine >= floor)
    masked = np.where(accepted, scores, -np.inf)
    best = np.argmax(masked, axis=1)
    return np.where(accepted.any(axis=1), best, -1)


def choose_by_cosine(cosine: np.ndarray, threshold: float) -> np.ndarray:
    """(n_pairs,) 0 (the nearest) when its cosine >= threshold, else -1."""
    return np.where(cosine[:, 0] >= threshold, 0, -1)


@dataclass(frozen=True, slots=True)
class Tally:
    """Protocol counts for one source (or `OVERALL`).

    `false` counts every false hit; `neighbour` is the part of it that served another pair's `a`
    (the rest served the pair's own `a` on a label-0 pair), and `same_text` the part of
    `neighbour` whose served text is identical to the query (another pair holds the same
    question; in tiercache the exact-match tier answers such a prompt first). `correct` counts
    every correct hit, `correct_positive` those on label-1 pairs (recall's numerator; judged by
    clusters a label-0 pair's query can be served another text of its own cluster), and
    `correct_neighbour` the correct hits that served another pair's `a` (clusters only).
    """

    correct: int
    false: int
    miss: int
    positives: int
    pairs: int
    neighbour: int = 0
    same_text: int = 0
    correct_positive: int = 0
    correct_neighbour: int = 0

    @property
    def precision(self) -> float:
        hits = self.correct + self.false
        return self.correct / hits if hits else math.nan

    @property
    def recall(self) -> float:
        return self.correct_positive / self.positives if self.positives else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "precision": _finite(self.precision),
            "recall": _finite(self.recall),
        }


def judged(corpus: Corpus, candidates: Candidates, chosen: np.ndarray) -> dict[str, np.ndarray]:
    """Per pair, for `chosen` positions (-1: miss): `hit`, `served` (an index into
    `corpus.inserted`, -1 for a miss) and `correct` (the file's rule: clusters, or the pair's
    own `a`)."""
    rows = np.arange(len(corpus.pairs))
    hit = chosen >= 0
    served = np.where(hit, candidates.index[rows, np.maximum(chosen, 0)], -1)
    return {"hit": hit, "served": served, "correct": hit & corpus.correct(np.maximum(served, 0))}


def tally(corpus: Corpus, candidates: Candidates, chosen: np.ndarray) -> dict[str, Tally]:
    """Counts per source and `OVERALL` for `chosen` positions (-1: miss)."""
    rows = np.arange(len(corpus.pairs))
    decided = judged(corpus, candidates, chosen)
    hit, served, correct = decided["hit"], decided["served"], decided["correct"]
    labels = corpus.labels
    neighbour = hit & ~correct & (served != corpus.own)
    same_text = neighbour & (served == corpus.query_match)
    correct_neighbour = correct & (served != corpus.own)
    sources = corpus.source_array
    result: dict[str, Tally] = {}
    for source in [*corpus.sources(), OVERALL]:
        mask = np.ones(len(rows), dtype=bool) if source == OVERALL else sources == source
        result[source] = Tally(
            correct=int((correct & mask).sum()),
            false=int((hit & ~correct & mask).sum()),
            miss=int((~hit & mask).sum()),
            positives=int(((labels == 1) & mask).sum()),
            pairs=int(mask.sum()),
            neighbour=int((neighbour & mask).sum()),
            same_text=int((same_text & mask).sum()),
            correct_positive=int((correct & (labels == 1) & mask).sum()),
            correct_neighbour=int((correct_neighbour & mask).sum()),
        )
    return result


Z_95 = 1.959964  # the normal quantile of a two-sided 95 % interval


@dataclass(frozen=True, slots=True)
class Interval:
    """A 95 % interval of one source's precision and recall (`bootstrap_intervals`); `hits`
    is the number of hits the precision is measured on."""

    precision_low: float
    precision_high: float
    recall_low: float
    recall_high: float
    hits: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {k: v if isinstance(v, int) else _finite(v) for k, v in asdict(self).items()}


def wilson(successes: int, trials: int) -> tuple[float, float]:
    """The Wilson score interval (95 %) of a proportion; NaN for no trials."""
    if trials == 0:
        return math.nan, math.nan
    z2 = Z_95 * Z_95
    share = successes / trials
    centre = (share + z2 / (2 * trials)) / (1 + z2 / trials)
    half = Z_95 * math.sqrt(share * (1 - share) / trials + z2 / (4 * trials * trials))
    half /= 1 + z2 / trials
    return max(0.0, centre - half), min(1.0, centre + half)


def _percentiles(values: np.ndarray) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if not len(values):
        return math.nan, math.nan
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def resampled_sums(
    corpus: Corpus, columns: np.ndarray, rounds: int, seed: int
) -> dict[str, np.ndarray]:
    """Per source and `OVERALL`, (rounds, len(columns)) sums of the per-pair `columns` over
    resamples of the pairs drawn with replacement within each source (so every resample holds
    each source's number of pairs)."""
    rng = np.random.default_rng(seed)
    sums: dict[str, np.ndarray] = {}
    for source in corpus.sources():
        members = np.nonzero(corpus.source_array == source)[0]
        size = len(members)
        parts = []
        for begin in range(0, rounds, 100):  # 100 resamples at a time: memory stays small
            count = min(100, rounds - begin)
            draws = rng.integers(0, size, size=(count, size))
            flat = (draws + size * np.arange(count)[:, None]).ravel()
            weights = np.bincount(flat, minlength=count * size).reshape(count, size)
            parts.append(weights @ columns[:, members].T)
        sums[source] = np.concatenate(parts)
    sums[OVERALL] = sum(sums.values(), np.zeros((rounds, len(columns))))
    return sums


def bootstrap_intervals(
    corpus: Corpus, candidates: Candidates, chosen: np.ndarray, rounds: int = 1000, seed: int = 0
) -> dict[str, Interval]:
    """95 % percentile-bootstrap intervals of precision and recall per source and `OVERALL`
    for `chosen` (counted as `tally` counts): the pairs are resampled with replacement within
    each source, so every resample keeps the file's mix of sources; seeded, so a run repeats.
    Precision's interval is the wider of the bootstrap's and the Wilson score interval of the
    same counts: near 0 and 1 (every hit right, or all but one) the resamples hardly vary and
    the bootstrap alone would be too narrow, even of zero width. Pairs are resampled as if
    independent, although pairs that share a duplicate cluster are judged together, so the
    intervals are a little narrow. A few hundred hits measure a precision near 0.94 to about
    +-2.5 points; the dev file's thousand-odd to about +-1.5."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    decided = judged(corpus, candidates, chosen)
    positive = corpus.labels == 1
    columns = np.stack(
        [decided["hit"], decided["correct"], decided["correct"] & positive, positive]
    ).astype(np.float64)
    sums = resampled_sums(corpus, columns, rounds, seed)
    result = {}
    for source, table in sums.items():
        with np.errstate(invalid="ignore", divide="ignore"):
            precision = table[:, 1] / table[:, 0]
            recall = table[:, 2] / table[:, 3]
        mask = corpus.source_array == source if source != OVERALL else slice(None)
        hits, correct = (int(columns[c, mask].sum()) for c in (0, 1))  # as measured
        low, high = _percentiles(precision)
        if hits:  # never narrower than Wilson's (the bootstrap's alone is, near 0 and 1)
            wide_low, wide_high = wilson(correct, hits)
            low, high = min(low, wide_low), max(high, wide_high)
        result[source] = Interval(low, high, *_percentiles(recall), hits=hits)
    return result


def format_intervals(intervals: dict[str, Interval], rounds: int, out: TextIO) -> None:
    """One line per source: the 95 % interval of precision (and the hits it is measured on)
    and of recall."""
    print(f"  95 % intervals (bootstrap over the pairs, {rounds} resamples):", file=out)
    for source, i in intervals.items():
        print(
            f"  {source[:20]:<20} precision {_fmt(i.precision_low).strip()} to "
            f"{_fmt(i.precision_high).strip()} ({i.hits} hits), recall "
            f"{_fmt(i.recall_low).strip()} to {_fmt(i.recall_high).strip()}",
            file=out,
        )


def print_intervals(
    corpus: Corpus, candidates: Candidates, chosen: np.ndarray, rounds: int, out: TextIO
) -> dict[str, Any] | None:
    """`bootstrap_intervals` printed under a table and returned as JSON (None: `rounds` 0)."""
    if not rounds:
        return None
    intervals = bootstrap_intervals(corpus, candidates, chosen, rounds)
    format_intervals(intervals, rounds, out)
    return {source: i.as_dict() for source, i in intervals.items()}


VERIFIER_SWEEP = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995)


def verifier_scores(
    corpus: Corpus,
    candidates: Candidates,
    guard_scores: np.ndarray,
    score_pairs: Callable[[Sequence[str], Sequence[str], Sequence[float]], np.ndarray],
    progress: Progress | None = None,
) -> np.ndarray:
    """(n_pairs, k) the verifier's P(same question) of every candidate the guard's floor and
    vetoes let through (score > 0), 0 for the others: the verifier runs after the vetoes, as
    serving would run it, one call per query over its candidates, as serving batches them (a
    batch of many queries' pairs pads and rounds otherwise: up to 1e-3 apart in bfloat16).
    `score_pairs` gets the queries, the candidates and their guard scores
    (`tiercache.semantic.verifier.PairVerifier.scores`)."""
    out = np.zeros(candidates.index.shape, dtype=np.float64)
    rows = [i for i in range(candidates.index.shape[0]) if (guard_scores[i] > 0.0).any()]
    for done, i in enumerate(rows, 1):
        columns = [j for j in range(candidates.index.shape[1]) if guard_scores[i, j] > 0.0]
        texts = [corpus.inserted[candidates.index[i, j]] for j in columns]
        guard = [float(guard_scores[i, j]) for j in columns]
        values = score_pairs([corpus.pairs[i].b] * len(columns), texts, guard)
        for j, value in zip(columns, values, strict=True):
            out[i, j] = value
        if progress is not None and (done % 256 == 0 or done == len(rows)):
            progress(f"verifier: {done}/{len(rows)} lookups")
    return out


def served_exactly(corpus: Corpus, candidates: Candidates, scores: np.ndarray) -> np.ndarray:
    """`scores` (a guard's or a verifier's, (n_pairs, k)) with the candidate identical to its
    query (normalized as the cache keys it) at 1.0: serving answers such a query from the exact
    cache before the semantic stage decides anything. A query serving refuses (the zero vector:
    `embed_corpus`) finds nothing the exact way either here, since the semantic lookup is what
    the pairs measure: such a query, identical to an inserted text that the screen refused too,
    is counted a miss here where serving would answer it from the exact cache. Only when hits
    are judged by clusters: by the pair's own `a` alone (a file without clusters), serving
    another pair's identical text counts false whatever serving does, so the scores decide."""
    out = np.array(scores, dtype=np.float64, copy=True)
    if corpus.rule != "clusters":
        return out
    match = corpus.query_match
    for i in np.nonzero(match >= 0)[0]:
        hits = np.nonzero(candidates.index[i] == match[i])[0]
        if hits.size and candidates.cosine[i, hits[0]] > 0.0:
            out[i, hits[0]] = 1.0
    return out


def choose_by_verifier(scores: np.ndarray, threshold: float) -> np.ndarray:
    """(n_pairs,) position of the candidate the verifier scores highest at or above
    `threshold` (> 0), -1 for a miss."""
    accepted = (scores > 0.0) & (scores >= threshold)
    best = np.argmax(np.where(accepted, scores, -np.inf), axis=1)
    return np.where(accepted.any(axis=1), best, -1)


def served_texts(corpus: Corpus, candidates: Candidates, chosen: np.ndarray) -> list[str | None]:
    """Per pair, in input order: the inserted text `chosen` serves, or None for a miss."""
    return [
        None if position < 0 else corpus.inserted[candidates.index[i, position]]
        for i, position in enumerate(chosen.tolist())
    ]


def write_hits(path: Path, served: Sequence[str | None]) -> None:
    """`--hits`: one JSON line per pair, `{"served": text}` or `{"served": null}`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for text in served:
            handle.write(json.dumps({"served": text}, ensure_ascii=False) + "\n")


def best_cosine_thresholds(
    corpus: Corpus, candidates: Candidates, target: float
) -> dict[str, tuple[float, Tally] | None]:
    """Per source and `OVERALL`: the plain-cosine threshold (0.600..1.000 by 0.005) with the
    highest recall whose precision >= target, with its counts; None when none reaches it.

    Tuned on the very pairs it is scored on, so it flatters the baseline.
    """
    best: dict[str, tuple[float, Tally] | None] = {s: None for s in [*corpus.sources(), OVERALL]}
    for t in np.round(np.arange(0.60, 1.0001, 0.005), 3):
        counts = tally(corpus, candidates, choose_by_cosine(candidates.cosine, float(t)))
        for source, c in counts.items():
            if c.correct + c.false == 0 or c.precision < target:
                continue
            current = best[source]
            if current is None or c.recall > current[1].recall:
                best[source] = (float(t), c)
    return best


@dataclass(frozen=True, slots=True)
class Latency:
    """Per-query lookup time in microseconds (search + decision, no embedding)."""

    p50_us: float
    p99_us: float
    mean_us: float
    queries: int


def _latency(samples: list[float]) -> Latency:
    return Latency(
        p50_us=percentile(samples, 50) * 1e6,
        p99_us=percentile(samples, 99) * 1e6,
        mean_us=statistics.fmean(samples) * 1e6,
        queries=len(samples),
    )


def measure_latency(
    corpus: Corpus,
    embedded: Embedded,
    guard: SemanticGuard,
    threshold: float,
    baseline_threshold: float,
    k: int,
    limit: int = 5000,
) -> tuple[Latency, Latency]:
    """(guard, cosine baseline) lookup latency, one query at a time, on up to `limit` queries.

    Both: exact top-k search over every inserted vector. Guard: then `SemanticGuard.choose` over
    the k candidates; each query's text profile is computed in the timed region, candidates'
    are memoized beforehand (as a cache keeps them beside its entries; `profile`'s LRU).
    Baseline: then the nearest cosine against the threshold.
    """
    n = min(limit, len(corpus.pairs))
    feats.clear_profile_memo()
    for text in corpus.inserted:
        feats.profile(text)
    guard_samples: list[float] = []
    base_samples: list[float] = []
    clock = time.perf_counter
    for i in range(n):
        query_text = corpus.pairs[i].b
        vector = embedded.queries[i]
        t0 = clock()
        top, sims = search_one(embedded.inserted, vector, k)
        _ = bool(sims[0] >= baseline_threshold)
        t1 = clock()
        top, sims = search_one(embedded.inserted, vector, k)
        guard.choose(
            query_text,
            [(corpus.inserted[int(j)], float(c)) for j, c in zip(top, sims, strict=True)],
            threshold,
        )
        t2 = clock()
        base_samples.append(t1 - t0)
        guard_samples.append(t2 - t1)
    return _latency(guard_samples), _latency(base_samples)


# ---------------------------------------------------------------------------------------------
# The command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiercache eval-semantic",
        description=(
            "Semantic-cache hit quality on a pairs file (GPTCache's protocol): insert side a, "
            "query with side b, count correct hits, false hits and misses for the hit guard and "
            "for a plain cosine threshold."
        ),
    )
    parser.add_argument("--pairs", required=True, type=Path, help="JSON lines: a, b, label, source")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--target-precision",
        type=float,
        default=None,
        help="the guard's operating point (default: the packaged model's default)",
    )
    mode.add_argument(
        "--sweep", action="store_true", help="also print precision/recall over a range of settings"
    )
    parser.add_argument("--plot", type=Path, help="write a precision-recall plot (PNG)")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help="candidates per query (5)")
    parser.add_argument("--json", type=Path, dest="json_out", help="write the results as JSON")
    parser.add_argument(
        "--hits",
        type=Path,
        help="write what the guard served (the verifier, with --verifier), one JSON line per "
        'pair: {"served": text or null}',
    )
    parser.add_argument(
        "--verifier",
        type=Path,
        help="a pair verifier folder (tiercache_dev.train.verifier), as embedding_cache's "
        "`verifier` parameter names it: it decides among the candidates the guard's floor and "
        "vetoes let through",
    )
    parser.add_argument(
        "--verifier-threshold",
        type=float,
        help="the verifier's operating point, P(same question) at least this, in (0, 1] (0 or "
        "none: the one its verifier.json records, as serving)",
    )
    parser.add_argument(
        "--verifier-dtype",
        choices=DTYPES,
        help="the verifier's number format, as embedding_cache's `verifier_dtype` (default "
        "auto: bfloat16 where the CPU has it natively, else float32)",
    )
    parser.add_argument(
        "--bootstrap",
        type=int,
        default=1000,
        help="resamples for the 95 %% intervals of the precision and recall of the guard's (and "
        "the verifier's) table, at least 100 (0: none)",
    )
    parser.add_argument(
        "--baseline-threshold",
        type=float,
        default=BASELINE_THRESHOLD,
        help="plain cosine threshold to compare with (0.90)",
    )
    parser.add_argument("--guard", type=Path, help="a guard model file (default: the packaged one)")
    parser.add_argument(
        "--latency-queries",
        type=int,
        default=5000,
        help="queries timed one by one for the latency figures (5000)",
    )
    return parser


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def _fmt(value: float) -> str:
    return "   -  " if math.isnan(value) else f"{value:6.3f}"


def format_table(title: str, counts: dict[str, Tally], out: TextIO) -> None:
    """One row per source: false hits split into negative-pair / neighbour (same text)."""
    print(title, file=out)
    print(
        f"  {'source':<20} {'pairs':>6} {'pos':>5} {'correct':>7} {'false':>5} "
        f"{'(neg/nbr/same)':>15} {'miss':>5} {'precision':>9} {'recall':>6}",
        file=out,
    )
    for source, t in counts.items():
        split = f"{t.false - t.neighbour}/{t.neighbour}/{t.same_text}"
        print(
            f"  {source[:20]:<20} {t.pairs:>6} {t.positives:>5} {t.correct:>7} {t.false:>5} "
            f"{split:>15} {t.miss:>5} {_fmt(t.precision):>9} {_fmt(t.recall):>6}",
            file=out,
        )


def _sweep_rows(
    corpus: Corpus,
    candidates: Candidates,
    scores: np.ndarray,
    guard: SemanticGuard,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    guard_rows: list[dict[str, Any]] = []
    for target in SWEEP_TARGETS:
        try:
            threshold = guard.threshold_for(target)
        except ConfigError:
            continue
        chosen = choose_by_score(scores, candidates.cosine, threshold, guard.config.cosine_floor)
        counts = tally(corpus, candidates, chosen)
        guard_rows.append(
            {
                "target_precision": target,
                "threshold": threshold,
                **{s: t.as_dict() for s, t in counts.items()},
            }
        )
    cosine_rows: list[dict[str, Any]] = []
    for t in SWEEP_COSINES:
        counts = tally(corpus, candidates, choose_by_cosine(candidates.cosine, t))
        cosine_rows.append({"threshold": t, **{s: c.as_dict() for s, c in counts.items()}})
    return guard_rows, cosine_rows


def _print_sweep(
    name: str, key: str, rows: list[dict[str, Any]], sources: list[str], out: TextIO
) -> None:
    print(f"\n{name} sweep (precision / recall)", file=out)
    header = f"  {key:>22} " + " ".join(f"{s[:15]:>15}" for s in [*sources, OVERALL])
    print(header, file=out)
    for row in rows:
        cells = []
        for s in [*sources, OVERALL]:
            p, r = row[s]["precision"], row[s]["recall"]
            text = f"{'-' if p is None else f'{p:.3f}'}/{'-' if r is None else f'{r:.3f}'}"
            cells.append(text.rjust(15))
        label = f"{row[key]:.3f}"
        if key != "threshold":
            label += f" (score >= {row['threshold']:.2f})"
        print(f"  {label:>22} " + " ".join(cells), file=out)


def plot_curves(
    path: Path,
    corpus: Corpus,
    candidates: Candidates,
    scores: np.ndarray,
    guard: SemanticGuard,
    threshold: float,
    baseline_threshold: float,
    verifier: tuple[np.ndarray, float] | None = None,
) -> None:
    """Precision against recall for the guard (score thresholds) and plain cosine, per source;
    with `verifier` (its scores from `verifier_scores`, its threshold) the verifier's too."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    sources = [*corpus.sources(), OVERALL]
    figure, axes = plt.subplots(1, len(sources), figsize=(4.2 * len(sources), 4.2), squeeze=False)
    score_grid = np.unique(np.concatenate([np.linspace(0.0, 1.0, 201), [threshold]]))
    cosine_grid = np.unique(np.concatenate([np.linspace(0.6, 1.0, 161), [baseline_threshold]]))
    floor = guard.config.cosine_floor
    guard_curves = [
        tally(corpus, candidates, choose_by_score(scores, candidates.cosine, t, floor))
        for t in score_grid
    ]
    cosine_curves = [
        tally(corpus, candidates, choose_by_cosine(candidates.cosine, t)) for t in cosine_grid
    ]
    at_guard = tally(
        corpus, candidates, choose_by_score(scores, candidates.cosine, threshold, floor)
    )
    at_base = tally(corpus, candidates, choose_by_cosine(candidates.cosine, baseline_threshold))
    lines = [(guard_curves, "hit guard", "-"), (cosine_curves, "plain cosine", "--")]
    at_verifier = None
    if verifier is not None:
        vscores, vthreshold = verifier
        grid = np.unique(np.concatenate([np.linspace(0.01, 0.99, 99), [0.995, 0.999, vthreshold]]))
        lines.append(
            ([tally(corpus, candidates, choose_by_verifier(vscores, t)) for t in grid],
             "pair verifier", "-.")
        )  # fmt: skip
        at_verifier = tally(corpus, candidates, choose_by_verifier(vscores, vthreshold))
    for ax, source in zip(axes[0], sources, strict=True):
        for curves, label, style in lines:
            pts = [(c[source].recall, c[source].precision) for c in curves]
            pts = [(r, p) for r, p in pts if not (math.isnan(p) or math.isnan(r))]
            if pts:
                ax.plot([r for r, _ in pts], [p for _, p in pts], style, label=label)
        g, b = at_guard[source], at_base[source]
        ax.plot([g.recall], [g.precision], "o", label=f"guard @ {threshold:.3f}")
        ax.plot([b.recall], [b.precision], "s", label=f"cosine @ {baseline_threshold:.2f}")
        if at_verifier is not None and verifier is not None:
            v = at_verifier[source]
            ax.plot([v.recall], [v.precision], "D", label=f"verifier @ {verifier[1]:.3f}")
        ax.set_title(f"{source} ({at_base[source].positives} positives)")
        ax.set_xlabel("recall")
        ax.set_ylabel("precision")
        ax.set_xlim(0, 1)
        ax.set_ylim(0.4, 1.005)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_eval(
    args: argparse.Namespace,
    embed_factory: Callable[[], EmbedFn] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    screen: Callable[[str], str | None] | None = None,
) -> dict[str, Any]:
    """The whole command on parsed arguments (output: stdout, progress: stderr); returns what
    `--json` writes. `screen`: which texts serving refuses (default, with the real embedder:
    its `Screen`; with `embed_factory`: none unless given)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if args.k < 1:
        raise InvalidRequest(f"--k must be >= 1, got {args.k}")
    if args.verifier_threshold is not None and args.verifier is None:
        raise InvalidRequest("--verifier-threshold needs --verifier")
    if args.verifier_dtype is not None and args.verifier is None:
        raise InvalidRequest("--verifier-dtype needs --verifier")
    if args.bootstrap != 0 and args.bootstrap < 100:
        raise InvalidRequest(f"--bootstrap must be 0 or at least 100, got {args.bootstrap}")
    guard = load_guard(args.guard, args.target_precision)
    pairs = load_pairs(args.pairs)
    corpus = build_corpus(pairs)

    def progress(line: str) -> None:
        print(line, file=err, flush=True)

    progress(
        f"eval-semantic: {len(pairs)} pairs, {len(corpus.inserted)} distinct inserted texts, "
        f"sources {', '.join(corpus.sources())}"
    )
    load_start = time.perf_counter()
    if embed_factory is None:
        from tiercache.semantic.embedder import Embedder

        embedder = Embedder()
        if guard.config.embedder and embedder.identity.embedder_id != guard.config.embedder:
            progress(
                f"warning: the guard was trained for {guard.config.embedder}, "
                f"embedding with {embedder.identity.embedder_id}"
            )
        embed: EmbedFn = embedder.embed
        if screen is None:
            from tiercache.semantic.embedder import Screen

            screen = Screen().check
    else:
        embed = embed_factory()
    load_s = time.perf_counter() - load_start
    embedded = embed_corpus(corpus, embed, progress, screen=screen)
    candidates = search_topk(embedded.inserted, embedded.queries, args.k)
    matrix = candidate_features(corpus, candidates)
    guard_scores = guard.score_matrix(matrix)  # what the verifier reads
    scores = served_exactly(corpus, candidates, guard_scores)
    threshold = guard.threshold
    floor = guard.config.cosine_floor
    guard_chosen = choose_by_score(scores, candidates.cosine, threshold, floor)
    guard_counts = tally(corpus, candidates, guard_chosen)
    base_counts = tally(
        corpus, candidates, choose_by_cosine(candidates.cosine, args.baseline_threshold)
    )
    best = best_cosine_thresholds(corpus, candidates, BASELINE_TARGET_PRECISION)
    progress(f"timing {min(args.latency_queries, len(pairs))} lookups one by one")
    guard_latency, base_latency = measure_latency(
        corpus,
        embedded,
        guard,
        threshold,
        args.baseline_threshold,
        args.k,
        args.latency_queries,
    )

    point = guard.config.point_for(threshold)
    calibration = guard.config.info.get("calibration", {})
    calibrated = ", ".join(calibration.get("sources", [])) or "the training pairs"
    print(
        f"\npairs: {args.pairs.name}  ({len(pairs)} pairs, {len(corpus.inserted)} inserted, "
        f"k={args.k})",
        file=out,
    )
    print(
        f"embedding: {embedded.texts} texts in {embedded.seconds:.1f} s "
        f"({embedded.ms_per_text:.2f} ms per text, batched; model load {load_s:.1f} s)",
        file=out,
    )
    print(f"{JUDGED_BY[corpus.rule]}\n", file=out)
    if corpus.cluster_conflicts:
        progress(
            f"warning: {corpus.cluster_conflicts} pairs give their `a` another cluster than "
            "an earlier pair with the same normalized text (the first one is used)"
        )
    format_table(
        f"hit guard: target precision {guard.target_precision:g} -> score threshold "
        f"{threshold:.3f} (held-out at training on {calibrated}: precision "
        f"{point.precision:.3f}, recall {point.recall:.3f}); cosine floor {floor:g}",
        guard_counts,
        out,
    )
    guard_intervals = print_intervals(corpus, candidates, guard_chosen, args.bootstrap, out)
    print(
        f"  lookup latency (search + guard): p50 {guard_latency.p50_us:.0f} us, "
        f"p99 {guard_latency.p99_us:.0f} us\n",
        file=out,
    )
    format_table(f"plain cosine >= {args.baseline_threshold:g}", base_counts, out)
    print(
        f"  lookup latency (search + compare): p50 {base_latency.p50_us:.0f} us, "
        f"p99 {base_latency.p99_us:.0f} us\n",
        file=out,
    )
    print(
        f"plain cosine, per source the threshold with the most recall at precision >= "
        f"{BASELINE_TARGET_PRECISION:g} (tuned on these pairs):",
        file=out,
    )
    for source, found in best.items():
        if found is None:
            print(f"  {source[:20]:<20} none in [0.600, 1.000]", file=out)
        else:
            t, c = found
            print(
                f"  {source[:20]:<20} threshold {t:.3f}: correct {c.correct}, false {c.false}, "
                f"precision {_fmt(c.precision).strip()}, recall {_fmt(c.recall).strip()}",
                file=out,
            )
    result: dict[str, Any] = {
        "pairs_file": args.pairs.name,
        "pairs": len(pairs),
        "inserted": len(corpus.inserted),
        "k": args.k,
        "judged_by": corpus.rule,
        "cluster_conflicts": corpus.cluster_conflicts,
        "embedding": {
            "texts": embedded.texts,
            "seconds": round(embedded.seconds, 3),
            "ms_per_text": round(embedded.ms_per_text, 3),
            "model_load_s": round(load_s, 3),
        },
        "guard": {
            "target_precision": guard.target_precision,
            "threshold": threshold,
            "cosine_floor": floor,
            "held_out_at_training": asdict(point),
            "latency_us": asdict(guard_latency),
            "counts": {s: t.as_dict() for s, t in guard_counts.items()},
            "intervals": guard_intervals,
        },
        "bootstrap": args.bootstrap,
        "cosine_baseline": {
            "threshold": args.baseline_threshold,
            "latency_us": asdict(base_latency),
            "counts": {s: t.as_dict() for s, t in base_counts.items()},
        },
        "cosine_best_for_target": {
            "target_precision": BASELINE_TARGET_PRECISION,
            "by_source": {
                s: None if f is None else {"threshold": f[0], **f[1].as_dict()}
                for s, f in best.items()
            },
        },
    }
    if args.sweep:
        guard_rows, cosine_rows = _sweep_rows(corpus, candidates, scores, guard)
        _print_sweep("hit guard", "target_precision", guard_rows, corpus.sources(), out)
        _print_sweep("plain cosine", "threshold", cosine_rows, corpus.sources(), out)
        result["sweep"] = {"guard": guard_rows, "cosine": cosine_rows}
    served_by = "the guard's"
    hits_chosen = guard_chosen
    vscores: np.ndarray | None = None
    verifier_threshold = args.verifier_threshold
    if args.verifier is not None:
        from tiercache.semantic.verifier import PairVerifier, check_guard, resolve_threshold

        folder = args.verifier
        progress(f"loading the verifier from {folder}")
        verifier = PairVerifier(folder, dtype=args.verifier_dtype or "auto")
        progress(f"the verifier runs in {verifier.dtype}")
        try:  # only with the guard whose scores it was trained on, as serving
            check_guard(verifier, guard, folder)
        except ConfigError as exc:
            raise InvalidRequest(f"{exc.client_message()} (--guard)") from None
        try:  # as serving: 0 or none given is the folder's recorded operating point
            verifier_threshold = resolve_threshold(
                verifier_threshold, verifier.default_threshold, folder
            )
        except ConfigError as exc:
            raise InvalidRequest(f"{exc.client_message()} (--verifier-threshold)") from None
        vscores = served_exactly(
            corpus,
            candidates,
            verifier_scores(corpus, candidates, guard_scores, verifier.scores, progress),
        )
        hits_chosen = choose_by_verifier(vscores, verifier_threshold)
        served_by = "the verifier's"
        counts = tally(corpus, candidates, hits_chosen)
        format_table(
            f"pair verifier ({verifier.dtype}) after the guard's floor and vetoes: "
            f"P >= {verifier_threshold:g}",
            counts,
            out,
        )
        verifier_intervals = print_intervals(corpus, candidates, hits_chosen, args.bootstrap, out)
        rows = []
        for t in VERIFIER_SWEEP:
            swept = tally(corpus, candidates, choose_by_verifier(vscores, t))
            rows.append({"threshold": t, **{src: c.as_dict() for src, c in swept.items()}})
        _print_sweep("pair verifier", "threshold", rows, corpus.sources(), out)
        timed = [i for i in range(min(len(pairs), 200)) if (scores[i] > 0.0).any()]
        samples = []
        for i in timed:
            row = [(j, s) for j, s in zip(candidates.index[i], scores[i], strict=True) if s > 0]
            texts = [corpus.inserted[j] for j, _ in row]
            t0 = time.perf_counter()
            verifier.scores([corpus.pairs[i].b] * len(texts), texts, [s for _, s in row])
            samples.append(time.perf_counter() - t0)
        latency = _latency(samples) if samples else None
        if latency is not None:
            print(
                f"  verifier per lookup ({len(samples)} lookups, the candidates past the vetoes "
                f"in one batch): p50 {latency.p50_us / 1000:.1f} ms, "
                f"p99 {latency.p99_us / 1000:.1f} ms\n",
                file=out,
            )
        result["verifier"] = {
            "folder": str(args.verifier),
            "dtype": verifier.dtype,
            "threshold": verifier_threshold,
            "counts": {src: c.as_dict() for src, c in counts.items()},
            "intervals": verifier_intervals,
            "sweep": rows,
            "latency_us": None if latency is None else asdict(latency),
            "info": verifier.info,
        }
    if args.plot is not None:
        plot_curves(
            args.plot, corpus, candidates, scores, guard, threshold, args.baseline_threshold,
            None if vscores is None else (vscores, verifier_threshold),
        )  # fmt: skip
        print(f"\nplot: {args.plot}", file=out)
    if args.hits is not None:
        write_hits(args.hits, served_texts(corpus, candidates, hits_chosen))
        print(f"hits: {args.hits} (one line per pair, {served_by} decisions)", file=out)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"json: {args.json_out}", file=out)
    return result


def main_eval_semantic(
    argv: list[str] | None = None, embed_factory: Callable[[], EmbedFn] | None = None
) -> int:
    """`tiercache eval-semantic ...`; 0 on success, 2 on bad input or configuration."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.latency_queries < 1:  # before the embedding work, which takes a minute
        parser.error(f"--latency-queries must be >= 1, got {args.latency_queries}")
    try:
        run_eval(args, embed_factory)
    except TierCacheError as exc:
        print(f"tiercache eval-semantic: {exc.client_message()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main_eval_semantic())
