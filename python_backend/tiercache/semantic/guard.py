"""The semantic hit guard: decides whether a cached prompt may answer a reworded query.

A plain semantic cache serves the nearest cached prompt when its cosine clears one threshold;
on real paraphrase data that serves wrong answers often (numbers, negations and names change the
question while the cosine barely moves). The guard scores a (query, candidate, cosine) triple with
a small logistic model over `tiercache.semantic.features` and accepts it when the probability of
"same question" reaches a threshold chosen for a target precision.

Contract:
- `GuardConfig` is frozen and comes from `guard_model.json` (packaged beside this module, written
  by `python -m tiercache_dev.train.guard`): feature names (must equal
  `features.FEATURE_NAMES`), logistic coefficients and intercept, a hard cosine floor, vetoes,
  the embedder it was trained for, and an operating table of (threshold, held-out precision,
  held-out recall) rows.
- A candidate under the cosine floor never hits (a cheap pre-filter), nor does one on which a
  veto fires (a feature at or above its veto value: a changed number, a negation flip, a swapped
  named entity, swapped roles); `score` is 0.0 for both.
- `threshold_for(p)` is the lowest threshold from which on every row of the table has held-out
  precision >= p; it is non-decreasing in p. An unreachable p raises `ConfigError`.
- Pure Python and the standard library at serve time (numpy only for `score_matrix`); no
  scikit-learn, no Triton.
- Scores and thresholds are calibrated for the embedder named in the config; another embedder
  needs its own model (`python -m tiercache_dev.train.guard`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.errors import ConfigError
from tiercache.semantic import features as feats

MODEL_PATH = Path(__file__).with_name("guard_model.json")
MODEL_FORMAT = "tiercache-semantic-guard/1"


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """One row of the operating table, measured on held-out folds of the training pairs."""

    threshold: float
    precision: float
    recall: float


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """The trained guard as stored in guard_model.json (see the module docstring)."""

    feature_names: tuple[str, ...]
    coefficients: tuple[float, ...]
    intercept: float
    cosine_floor: float
    default_target_precision: float
    operating_table: tuple[OperatingPoint, ...]  # ascending threshold
    vetoes: tuple[tuple[int, float], ...] = ()  # (feature index, value at which it rejects)
    embedder: str = ""
    info: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "guard model") -> GuardConfig:
        """Validate and build; any problem is a `ConfigError` that names `source`."""
        try:
            if data.get("format") != MODEL_FORMAT:
                raise ValueError(f"format must be {MODEL_FORMAT!r}, got {data.get('format')!r}")
            names = tuple(str(n) for n in data["features"])
            coefficients = tuple(float(c) for c in data["coefficients"])
            if len(names) != len(coefficients):
                raise ValueError(f"{len(names)} features but {len(coefficients)} coefficients")
            table = data["operating_table"]
            columns = list(table["columns"])
            if columns[:3] != ["threshold", "precision", "recall"]:
                raise ValueError("operating_table columns must start threshold, precision, recall")
            rows = tuple(
                OperatingPoint(float(r[0]), float(r[1]), float(r[2])) for r in table["rows"]
            )
            if not rows:
                raise ValueError("operating_table has no rows")
            if any(b.threshold <= a.threshold for a, b in zip(rows, rows[1:], strict=False)):
                raise ValueError("operating_table thresholds must be strictly ascending")
            vetoes = []
            for name, value in dict(data.get("vetoes", {})).items():
                if name not in names:
                    raise ValueError(f"veto on unknown feature {name!r}")
                vetoes.append((names.index(name), float(value)))
            config = cls(
                feature_names=names,
                coefficients=coefficients,
                intercept=float(data["intercept"]),
                cosine_floor=float(data["cosine_floor"]),
                default_target_precision=float(data["default_target_precision"]),
                operating_table=rows,
                vetoes=tuple(vetoes),
                embedder=str(data.get("embedder", "")),
                info={k: v for k, v in data.items() if k in ("calibration", "training", "notes")},
            )
        except (KeyError, TypeError, ValueError) as exc:
            detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ConfigError(f"{source}: malformed semantic guard model: {detail}") from None
        numbers = [config.intercept, config.cosine_floor, *config.coefficients]
        numbers += [value for _, value in config.vetoes]  # a NaN veto never fires
        numbers += [n for r in config.operating_table for n in (r.threshold, r.precision, r.recall)]
        numbers.append(config.default_target_precision)
        for value in numbers:
            if not math.isfinite(value):
                raise ConfigError(f"{source}: non-finite number in the semantic guard model")
        return config

    def threshold_for(self, target_precision: float) -> float:
        """The lowest threshold from which on every row's held-out precision >= the target."""
        if not 0.0 < target_precision <= 1.0:
            raise ConfigError(f"target_precision must be in (0, 1], got {target_precision!r}")
        chosen: float | None = None
        for point in reversed(self.operating_table):
            if point.precision < target_precision:
                break
            chosen = point.threshold
        if chosen is None:
            best = max(p.precision for p in self.operating_table)
            last = self.operating_table[-1]
            raise ConfigError(
                f"target_precision {target_precision:g} is not held from any threshold on in "
                f"the guard's operating table (held-out precision: best row {best:.4f}, "
                f"highest threshold {last.threshold:g}: {last.precision:.4f})"
            )
        return chosen

    def point_for(self, threshold: float) -> OperatingPoint:
        """The table row at `threshold` (the nearest one at or above it, else the last)."""
        for point in self.operating_table:
            if point.threshold >= threshold - 1e-12:
                return point
        return self.operating_table[-1]

    def local_precision(self) -> tuple[np.ndarray, np.ndarray]:
        """(thresholds, P(right)) per score band of the operating table: the rows give the
        precision and recall of every hit at or above each threshold, so the band between two
        thresholds holds (recall difference) right hits among (recall / precision difference)
        hits; pooled into a non-decreasing curve (pool-adjacent-violators, each band weighted
        by its hits), since a higher score is never meant to be less often right."""
        thresholds = np.array([p.threshold for p in self.operating_table])
        right = np.array([p.recall for p in self.operating_table] + [0.0])
        hits = right[:-1] / np.maximum([p.precision for p in self.operating_table], 1e-12)
        hits = np.append(hits, 0.0)
        band_right = np.maximum(right[:-1] - right[1:], 0.0)
        band_hits = np.maximum(hits[:-1] - hits[1:], band_right)
        blocks: list[list[float]] = []  # [right, hits, bands] pooled
        for r, h in zip(band_right, band_hits, strict=True):
            blocks.append([r, h, 1])
            while len(blocks) > 1 and _rate(blocks[-2]) > _rate(blocks[-1]):
                last = blocks.pop()
                blocks[-1] = [a + b for a, b in zip(blocks[-1], last, strict=True)]
        curve = np.concatenate([np.full(int(b[2]), _rate(b)) for b in blocks])
        return thresholds, np.clip(curve, 0.0, 1.0)


def _rate(block: list[float]) -> float:
    right, hits, _ = block
    return right / hits if hits > 0 else 0.0


@dataclass(frozen=True, slots=True)
class SemanticGuard:
    """Scores and accepts semantic-cache candidates with a `GuardConfig`.

    `target_precision` (None: the config's default) fixes `threshold`, the score a candidate
    needs when a call passes no threshold of its own.
    """

    config: GuardConfig
    target_precision: float | None = None
    threshold: float = field(init=False)
    _calibration: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.config.feature_names != feats.FEATURE_NAMES:
            raise ConfigError(
                "semantic guard model was trained on features "
                f"{list(self.config.feature_names)}, this code computes {list(feats.FEATURE_NAMES)}"
            )
        target = self.target_precision
        if target is None:
            target = self.config.default_target_precision
        object.__setattr__(self, "target_precision", target)
        object.__setattr__(self, "threshold", self.config.threshold_for(target))
        object.__setattr__(self, "_calibration", self.config.local_precision())

    def scoring_digest(self) -> str:
        """SHA-256 of what the score is computed from (features, coefficients, intercept,
        floor, vetoes): a verifier trained on this guard's scores names it."""
        c = self.config
        what = [c.feature_names, c.coefficients, c.intercept, c.cosine_floor, c.vetoes]
        return hashlib.sha256(json.dumps(what).encode("utf-8")).hexdigest()

    def threshold_for(self, target_precision: float) -> float:
        """See `GuardConfig.threshold_for`."""
        return self.config.threshold_for(target_precision)

    def vetoed(self, vector: Sequence[float]) -> bool:
        """True when a veto fires on this feature vector."""
        return any(vector[i] >= value for i, value in self.config.vetoes)

    def score_vector(self, vector: Sequence[float]) -> float:
        """Probability of "same question" for one feature vector (layout `FEATURE_NAMES`);
        0.0 when the cosine is under the floor or a veto fires."""
        if vector[0] < self.config.cosine_floor or self.vetoed(vector):
            return 0.0
        z = self.config.intercept
        for w, x in zip(self.config.coefficients, vector, strict=True):
            z += w * x
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-z))
        e = math.exp(z)
        return e / (1.0 + e)

    def score_matrix(self, matrix: np.ndarray) -> np.ndarray:
        """Vectorized `score_vector` over the last axis of `matrix` (..., n_features)."""
        z = matrix @ np.asarray(self.config.coefficients, dtype=np.float64) + self.config.intercept
        scores = 1.0 / (1.0 + np.exp(-z))
        blocked = matrix[..., 0] < self.config.cosine_floor
        for i, value in self.config.vetoes:
            blocked |= matrix[..., i] >= value
        return np.where(blocked, 0.0, scores)

    def score(self, query: str, candidate: str, cosine: float) -> float:
        """Probability that `candidate` asks the same as `query` (0.0: floor or veto)."""
        if cosine < self.config.cosine_floor:
            return 0.0
        return self.score_vector(feats.features(query, candidate, cosine))

    def calibrated(self, query: str, candidate: str, cosine: float) -> float:
        """P(serving `candidate` for `query` is right) as the guard's calibration measured it
        for hits at this score (`GuardConfig.local_precision`; 0.0 when the floor or a veto
        refuses it): the trust gate's score (tiercache.semantic.entry_trust). The guard's own
        score is a ranking (the same text scores 0.86), not this probability."""
        return float(self.calibrate(np.array([self.score(query, candidate, cosine)]))[0])

    def calibrate(self, scores: np.ndarray) -> np.ndarray:
        """`calibrated` for guard scores already computed (0.0 stays 0.0)."""
        thresholds, curve = self._calibration
        band = np.maximum(np.searchsorted(thresholds, scores, side="right") - 1, 0)
        return np.where(scores > 0.0, curve[band], 0.0)

    def accept(
        self, query: str, candidate: str, cosine: float, threshold: float | None = None
    ) -> bool:
        """True when `candidate` may answer `query` (threshold None: `self.threshold`)."""
        if cosine < self.config.cosine_floor:
            return False
        limit = self.threshold if threshold is None else threshold
        return self._passes(self.score(query, candidate, cosine), limit)

    @staticmethod
    def _passes(score: float, limit: float) -> bool:
        return score > 0.0 and score >= limit

    def choose(
        self,
        query: str,
        candidates: Sequence[tuple[str, float]],
        threshold: float | None = None,
    ) -> int | None:
        """Index of the best accepted (text, cosine) candidate by score, or None for a miss.

        Ties go to the earlier candidate (callers pass them nearest first).
        """
        limit = self.threshold if threshold is None else threshold
        best: int | None = None
        best_score = -1.0
        for i, (text, cosine) in enumerate(candidates):
            if cosine < self.config.cosine_floor:
                continue
            s = self.score_vector(feats.features(query, text, cosine))
            if self._passes(s, limit) and s > best_score:
                best, best_score = i, s
        return best


def read_guard_config(path: Path | str | None = None) -> GuardConfig:
    """Parse a guard model file (default: the packaged guard_model.json)."""
    where = Path(path) if path is not None else MODEL_PATH
    try:
        data = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"semantic guard model {where} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"semantic guard model {where} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"semantic guard model {where} must hold a JSON object")
    return GuardConfig.from_dict(data, source=str(where))


def load_guard(
    path: Path | str | None = None, target_precision: float | None = None
) -> SemanticGuard:
    """The guard from `path` (None: the packaged model) at `target_precision` (None: the
    model's default)."""
    return SemanticGuard(read_guard_config(path), target_precision)
