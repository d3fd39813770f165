"""How far the semantic guard can go on a pairs file, and one verifier that was tried.

Usage::

    .venv/bin/python -m tiercache_dev.diagnostics.guard_limits
        [--pairs ../shared/eval/semantic_pairs_dev.jsonl] [--embeddings-cache FILE.npz]
        [--token-alignment]

Part 1, the ceilings (always): the packaged guard is run through the protocol of
`tiercache eval-semantic` at several thresholds. Each false hit is either a *neighbour* (another
pair's `a` served; `same` of them hold the query's identical text) or a *label-0* hit (a
"not the same question" pair's own `a` served). Besides the precision the protocol counts, the
table shows two ceilings: the precision if every neighbour hit were a miss instead, and if every
label-0 hit were. Neither ceiling is reachable by a guard that judges one candidate at a time;
they bound what any such guard could show on this file.

Part 2, `--token-alignment`: a verifier tried and not adopted. BERTScore-style alignment of the
embedder's own contextual token vectors (no other model): for each token of one side the best
cosine with any token of the other, giving an F1 and the worst-aligned content token. It is
scored the way `tiercache_dev.train.guard` scores the shipped features (five grouped folds,
out-of-fold scores through the protocol) with and without the two alignment features, and the
two are compared at equal overall recall and at the calibration point (gptcache-mock at 0.97).
Embedding the token vectors of every text takes about 45 s on two cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tiercache.semantic import evaluate as ev
from tiercache.semantic import features as feats
from tiercache.semantic.guard import load_guard
from tiercache_dev.train import guard as tg

CEILING_THRESHOLDS = (0.3, 0.5, 0.58, 0.7, 0.8)
RECALL_POINTS = (0.3, 0.4, 0.45, 0.5, 0.6)
GRID = tuple(round(t, 3) for t in np.arange(0.02, 0.99, 0.005))


def embedded_corpus(corpus: ev.Corpus, cache: Path | None, say: Callable[[str], None]):
    if cache is not None and cache.is_file():
        data = np.load(cache)
        if data["inserted"].shape[0] == len(corpus.inserted):
            say(f"embeddings from {cache.name}")
            return ev.Embedded(data["inserted"], data["queries"], 0.0, 0)
    from tiercache.semantic.embedder import Embedder

    embedded = ev.embed_corpus(corpus, Embedder().embed, say)
    if cache is not None:
        np.savez(cache, inserted=embedded.inserted, queries=embedded.queries)
    return embedded


def ceilings(corpus: ev.Corpus, cand: ev.Candidates, matrix: np.ndarray) -> None:
    guard = load_guard()
    flat = matrix.reshape(-1, matrix.shape[-1])
    scores = guard.score_matrix(flat).reshape(matrix.shape[:2])
    rows = np.arange(len(corpus.pairs))
    print(f"\nCeilings of the packaged guard (default threshold {guard.threshold:.2f})")
    header = (
        f"{'source':<14} {'thr':>5} {'correct':>7} {'nbr':>5} {'same':>5} {'label0':>6} "
        f"{'P':>6} {'P_no_nbr':>8} {'P_no_l0':>8} {'R':>6}"
    )
    print(header)
    for source in [*corpus.sources(), ev.OVERALL]:
        mask = np.ones(len(rows), bool) if source == ev.OVERALL else corpus.source_array == source
        positives = int(((corpus.labels == 1) & mask).sum())
        for t in CEILING_THRESHOLDS:
            chosen = ev.choose_by_score(scores, cand.cosine, t, 0.0)
            hit = (chosen >= 0) & mask
            served = np.where(hit, cand.index[rows, np.maximum(chosen, 0)], -1)
            own = served == corpus.own
            correct = int((hit & own & (corpus.labels == 1)).sum())
            nbr = int((hit & ~own).sum())
            same = int((hit & ~own & (served == corpus.query_match)).sum())
            label0 = int((hit & own & (corpus.labels == 0)).sum())

            def share(c: int, other: int) -> str:
                return f"{c / (c + other):.3f}" if c + other else "-"

            print(
                f"{source:<14} {t:5.2f} {correct:7d} {nbr:5d} {same:5d} {label0:6d} "
                f"{share(correct, nbr + label0):>6} {share(correct, label0):>8} "
                f"{share(correct, nbr):>8} {correct / positives:6.3f}"
            )


def token_vectors(texts: list[str], say: Callable[[str], None]) -> dict[str, tuple]:
    """Per text: (L2-normalized contextual token vectors, token ids), [CLS]/[SEP] dropped."""
    from sentence_transformers import SentenceTransformer

    from tiercache.semantic.embedder import resolve_embedder

    folder, _ = resolve_embedder()
    model = SentenceTransformer(str(folder), device="cpu")
    start = time.perf_counter()
    out: dict[str, tuple] = {}
    for begin in range(0, len(texts), 512):
        chunk = texts[begin : begin + 512]
        vectors = model.encode(chunk, output_value="token_embeddings", batch_size=64)
        for text, v in zip(chunk, vectors, strict=True):
            v = v.numpy().astype(np.float32)
            ids = model.tokenizer(text, truncation=True, max_length=v.shape[0])["input_ids"]
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
            out[text] = (v[1:-1], np.asarray(ids[1 : v.shape[0] - 1]))
        say(
            f"token vectors: {min(len(texts), begin + 512)}/{len(texts)} texts "
            f"({time.perf_counter() - start:.1f} s)"
        )
    vocab = model.tokenizer.convert_ids_to_tokens(list(range(model.tokenizer.vocab_size)))
    content = np.array(
        [
            not (t.startswith("[") or not any(ch.isalnum() for ch in t))
            and t.lstrip("#").lower() not in feats.STOPWORDS
            for t in vocab
        ]
    )
    return {"vectors": out, "content": content}


def alignment(tok: dict, query: str, candidate: str) -> tuple[float, float]:
    """(BERTScore-style F1, worst-aligned content token) of two texts."""
    q, qi = tok["vectors"][query]
    c, ci = tok["vectors"][candidate]
    if len(q) == 0 or len(c) == 0:
        return 0.0, 0.0
    sims = q @ c.T
    best_q, best_c = sims.max(1), sims.max(0)
    r, p = float(best_q.mean()), float(best_c.mean())
    qm, cm = tok["content"][qi], tok["content"][ci]
    worst = min(
        float(best_q[qm].min()) if qm.any() else 1.0,
        float(best_c[cm].min()) if cm.any() else 1.0,
    )
    return (2 * r * p / (r + p) if r + p > 0 else 0.0), worst


def out_of_fold(
    corpus: ev.Corpus, cand: ev.Candidates, x: np.ndarray, usable: np.ndarray, fold: np.ndarray
) -> np.ndarray:
    correct = ev.correct_candidates(corpus, cand)
    oof = np.zeros(cand.cosine.shape)
    for f in range(int(fold.max()) + 1):
        train = (fold != f)[:, None] & usable
        coef, intercept = tg.fit(x[train], correct[train].astype(int), 1.0)
        held = fold == f
        oof[held] = tg.scores_of(x[held], coef, intercept)  # as train_guard scores them
    return oof


def compare(corpus: ev.Corpus, cand: ev.Candidates, oof: np.ndarray, name: str) -> None:
    sources = [*corpus.sources(), ev.OVERALL]
    grid = [(t, ev.tally(corpus, cand, ev.choose_by_score(oof, cand.cosine, t, 0.0))) for t in GRID]

    def line(label: str, t: float, counts: dict[str, ev.Tally]) -> None:
        cells = "  ".join(f"{s} {counts[s].precision:.3f}/{counts[s].recall:.3f}" for s in sources)
        print(f"  {name:<22} {label:<16} thr {t:.3f}  {cells}")

    for target in RECALL_POINTS:
        t, counts = next(((t, c) for t, c in grid if c[ev.OVERALL].recall <= target), grid[-1])
        line(f"overall R~{target}", t, counts)
    calib = corpus.sources()[0]
    for t, counts in grid:
        c = counts[calib]
        if c.correct + c.false >= tg.MIN_HITS and c.precision >= tg.REQUIRED_PRECISION:
            line(f"{calib} P>=0.97", t, counts)
            break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pairs", type=Path, default=tg.DEFAULT_PAIRS)
    parser.add_argument("--embeddings-cache", type=Path, help="reuse/keep embeddings (.npz)")
    parser.add_argument("--token-alignment", action="store_true", help="also run part 2")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {line}", file=sys.stderr, flush=True)

    pairs = ev.load_pairs(args.pairs)
    corpus = ev.build_corpus(pairs)
    embedded = embedded_corpus(corpus, args.embeddings_cache, say)
    cand = ev.search_topk(embedded.inserted, embedded.queries, ev.DEFAULT_K)
    matrix = ev.candidate_features(corpus, cand)
    ceilings(corpus, cand, matrix)
    if not args.token_alignment:
        return 0

    texts = list(dict.fromkeys([*corpus.inserted, *(p.b for p in pairs)]))
    tok = token_vectors(texts, say)
    extra = np.zeros((*cand.index.shape, 2))
    for i, pair in enumerate(pairs):
        for j in range(cand.index.shape[1]):
            extra[i, j] = alignment(tok, pair.b, corpus.inserted[cand.index[i, j]])
    query_texts = np.array([p.b for p in pairs], dtype=object)
    cand_texts = np.array(corpus.inserted, dtype=object)[cand.index]
    same = (cand_texts == query_texts[:, None]) & (cand.index != corpus.own[:, None])
    usable = (cand.cosine >= tg.COSINE_FLOOR) & ~same & ~tg.vetoed(matrix)
    fold = tg.fold_of(tg.groups_by_shared_text(pairs), 5, tg.SEED)
    print("\nHeld-out precision/recall (five grouped folds), shipped features against + alignment")
    compare(corpus, cand, out_of_fold(corpus, cand, matrix, usable, fold), "shipped 6 features")
    both = np.concatenate([matrix, extra], axis=-1)
    compare(corpus, cand, out_of_fold(corpus, cand, both, usable, fold), "+ F1, worst token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
