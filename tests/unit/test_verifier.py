"""tiercache.semantic.verifier: a pair verifier folder loads over the packaged MiniLM weights
and scores pairs; one trained on other weights, or not a verifier, is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")

from verifier_folders import untrained_verifier  # noqa: E402

from tiercache.errors import ConfigError  # noqa: E402
from tiercache.semantic.embedder import resolve_embedder  # noqa: E402
from tiercache.semantic.guard import load_guard  # noqa: E402
from tiercache.semantic.verifier import INFO_FILE, PairVerifier, open_verified_choice  # noqa: E402


def untrained(folder: Path, revision: str) -> Path:
    return untrained_verifier(folder, revision)[0]


def test_scores_are_probabilities_one_per_pair_and_repeatable(tmp_path: Path) -> None:
    _, identity = resolve_embedder()
    folder = untrained(tmp_path / "v", identity.revision)
    verifier = PairVerifier(folder, threads=1, dtype="float32")
    assert verifier.dtype == "float32"
    queries = ["How do I reset my password?", "What is the capital of France?"]
    texts = ["How can I change my password?", "Top 10 movies of 2020"]
    first = verifier.scores(queries, texts)
    assert first.shape == (2,) and ((first >= 0) & (first <= 1)).all()
    assert np.array_equal(first, verifier.scores(queries, texts))
    assert verifier.scores([], []).shape == (0,)
    with pytest.raises(ValueError, match="differ in length"):
        verifier.scores(queries, texts[:1])
    # its linear layers run packed for oneDNN (6 per layer, the pooler and the classifier),
    # and it scores what the plain model scores, to float32 rounding
    assert verifier.packed_layers == 6 * 6 + 2
    assert np.allclose(first, plain_scores(folder, queries, texts), rtol=0, atol=1e-5)


def test_the_number_formats_score_as_float32_does(tmp_path: Path) -> None:
    """bfloat16 (packed for oneDNN) and int8 (torch's dynamic quantization) score the shipped
    verifier's pairs within a few hundredths of float32 and decide them alike at its point;
    `auto` is bfloat16 exactly where torch has native bfloat16 on this CPU; another name is a
    ConfigError before anything loads."""
    import torch

    from tiercache.semantic.verifier import BUILTIN, native_bfloat16, resolve_dtype

    native = native_bfloat16()
    assert resolve_dtype("auto") == ("bfloat16" if native else "float32")
    assert resolve_dtype("int8") == "int8"
    with pytest.raises(ConfigError, match="one of auto, float32, bfloat16, int8"):
        PairVerifier(BUILTIN, dtype="float16")
    queries = [
        "how do i improve my english speaking skills?",
        "how can i lose weight fast?",
        "what are the advantages of a democratic government?",
        "which is the best laptop under 500 dollars?",
    ]
    texts = [
        "how can i improve my spoken english?",
        "what is the fastest way to lose weight?",
        "what are the disadvantages of a democratic government?",
        "which laptop should i buy?",
    ]
    guard = [0.7, 0.6, 0.8, 0.5]
    exact = PairVerifier(BUILTIN, threads=1, dtype="float32")
    reference = exact.scores(queries, texts, guard)
    point = exact.default_threshold
    assert point is not None
    for dtype in ("bfloat16", "int8"):
        verifier = PairVerifier(BUILTIN, threads=1, dtype=dtype)
        assert verifier.dtype == dtype
        found = verifier.scores(queries, texts, guard)
        assert found.dtype == np.float64 and ((found >= 0) & (found <= 1)).all()
        assert np.abs(found - reference).max() < 0.05, (dtype, found, reference)
        assert ((found >= point) == (reference >= point)).all()
        assert not np.array_equal(found, reference)  # it did run in another format
        if dtype == "bfloat16":
            assert verifier._model.dtype == torch.bfloat16
            if native:  # three layers of six linears, the pooler, the classifier
                assert verifier.packed_layers == 3 * 6 + 2
        else:
            assert verifier.packed_layers == 0  # quantized layers are not oneDNN's linear
    # open_verified_choice passes the format on
    choice = open_verified_choice(load_guard(), BUILTIN, 0.0, threads=1, dtype="int8")
    assert choice.threshold == point and choice._score_pairs.__self__.dtype == "int8"


def test_auto_is_bfloat16_only_where_the_cpu_computes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` reads the CPU's own flags: an AVX-512 CPU without avx512_bf16 or AMX (where
    oneDNN would emulate bfloat16, slower than float32) runs float32."""
    import torch

    from tiercache.semantic import verifier as module

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    for flags, expected in (
        ({"avx512_f": True, "avx512_bw": True, "avx512_bf16": False}, "float32"),
        ({"avx512_f": True, "avx512_bf16": True}, "bfloat16"),
        ({"amx_bf16": True, "avx512_bf16": False}, "bfloat16"),
        ({}, "float32"),
    ):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda flags=flags: flags)
        assert module.resolve_dtype("auto") == expected, flags
        assert module.resolve_dtype("float32") == "float32"

    def unreadable() -> dict[str, bool]:
        raise RuntimeError("no cpuinfo")

    monkeypatch.setattr(torch.cpu, "get_capabilities", unreadable)
    assert module.resolve_dtype("auto") == "float32"


def test_the_config_offers_the_verifiers_formats() -> None:
    from tiercache.config import EmbeddingCacheConfig
    from tiercache.semantic.verifier import DTYPES

    field = {f.name: f for f in dataclasses.fields(EmbeddingCacheConfig)}["verifier_dtype"]
    assert field.metadata["choices"] == DTYPES and field.default == "auto"


def plain_scores(folder: Path, queries: list[str], texts: list[str]) -> np.ndarray:
    """The verifier's scores from its model built without packing."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer, BertForSequenceClassification

    base, _ = resolve_embedder()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = BertForSequenceClassification.from_pretrained(str(base), num_labels=1)
    model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload().eval()
    batch = tokenizer(queries, texts, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        return torch.sigmoid(model(**batch).logits.squeeze(-1)).double().numpy()


def test_a_verifier_of_other_weights_or_no_verifier_is_refused(tmp_path: Path) -> None:
    folder = untrained(tmp_path / "v", "0" * 64)
    with pytest.raises(ConfigError, match="trained on embedder weights 0000"):
        PairVerifier(folder)
    (folder / INFO_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ConfigError, match="format is not"):
        PairVerifier(folder)
    (folder / INFO_FILE).unlink()
    with pytest.raises(ConfigError, match=INFO_FILE):
        PairVerifier(folder)


def test_a_written_verifier_names_no_path_of_the_machine_and_still_loads(tmp_path: Path) -> None:
    from tiercache_dev.train.verifier import portable

    base, identity = resolve_embedder()
    folder = untrained(tmp_path / "v", identity.revision)
    assert str(base) in (folder / "adapter_config.json").read_text()  # peft wrote the folder
    portable(folder, identity.embedder_id)
    for name in ("adapter_config.json", "README.md"):
        assert str(base) not in (folder / name).read_text()
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == identity.embedder_id
    assert PairVerifier(folder, threads=1).scores(["a?"], ["b?"]).shape == (1,)


def test_a_malformed_verifier_json_or_adapter_is_a_config_error(tmp_path: Path) -> None:
    _, identity = resolve_embedder()
    folder = untrained(tmp_path / "v", identity.revision)
    good = json.loads((folder / INFO_FILE).read_text())
    for info, message in (
        ({**good, "base": None}, "trained on embedder weights None"),
        ({**good, "hyper": {"max_length": None}}, "max_length None"),
        ([good], "format is not"),
    ):
        (folder / INFO_FILE).write_text(json.dumps(info))
        with pytest.raises(ConfigError, match=message):
            PairVerifier(folder)
    (folder / INFO_FILE).write_text(json.dumps({**good, "operating_point": None}))
    assert PairVerifier(folder).default_threshold is None  # loads; a threshold must be given
    (folder / "adapter_model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ConfigError, match="cannot load"):
        PairVerifier(folder)


def hard_pairs_file(path: Path, rows: int = 8) -> Path:
    """A few lines as tiercache_dev.train.hard_pairs writes them (train-split QQP indices)."""
    lines = []
    for n in range(rows):
        lines.append(
            {
                "a": f"How do I learn topic {n}?",
                "b": f"How can I learn topic {n}?" if n % 2 else f"Why learn topic {n + 1}?",
                "label": n % 2,
                "index": 20 * n + 1 + n % 9,
                "rank": 0,
                "cosine": 0.9,
                "guard": 0.3 + 0.05 * n,
            }
        )
    lines.append({"a": "What is x?", "b": "What's x?", "label": 1, "index": 2, "rank": -1})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_verifier_trained_on_top_of_the_guard_adds_the_guards_log_odds(tmp_path: Path) -> None:
    """`tiercache_dev.train.verifier --guard-input --layers 2` writes a verifier that keeps two
    of MiniLM's layers and whose logit is the model's plus its trained weight times the guard
    score's log-odds; it refuses to score without the guard's scores."""
    from tiercache_dev.train import verifier as train

    folder = tmp_path / "v"
    argv = ["--train", str(hard_pairs_file(tmp_path / "pairs.jsonl")), "--out", str(folder)]
    argv += ["--guard-input", "--layers", "2", "--batch", "4", "--threads", "1"]
    assert train.main(argv) == 0
    info = json.loads((folder / INFO_FILE).read_text())
    assert info["hyper"]["layers"] == 2 and info["data"]["pairs"] == 8  # the rank -1 row left out
    verifier = PairVerifier(folder, threads=1)
    assert verifier.layers == 2 and verifier.packed_layers == 2 * 6 + 2
    weight = verifier.guard_weight
    assert weight == info["guard_input"]["weight"] and 0.5 < weight < 1.5  # two steps from 1
    guard = load_guard()  # hard_pairs scores with the packaged guard: the verifier names it
    assert verifier.guard_digest == guard.scoring_digest()
    assert open_verified_choice(guard, str(folder), 0.8, threads=1).threshold == 0.8
    other = dataclasses.replace(
        guard, config=dataclasses.replace(guard.config, intercept=guard.config.intercept + 1)
    )
    with pytest.raises(ConfigError, match="trained on the scores of guard"):
        open_verified_choice(other, str(folder), 0.8, threads=1)
    query, text = ["How do I learn topic 3?"] * 2, ["How can I learn topic 3?"] * 2
    low, high = verifier.scores(query, text, [0.2, 0.9])

    def logit(p: float) -> float:
        return float(np.log(p / (1 - p)))

    assert logit(high) - logit(low) == pytest.approx(weight * (logit(0.9) - logit(0.2)), rel=1e-6)
    with pytest.raises(ValueError, match="guard"):
        verifier.scores(query, text)
    with pytest.raises(SystemExit, match="--guard-input must match"):
        train.main([*argv[:4], "--init", str(folder), "--layers", "2"])
    for bad, message in (
        ({"guard_input": {**info["guard_input"], "weight": "1"}}, "guard_input.weight"),
        ({"guard_input": {**info["guard_input"], "weight": float("nan")}}, "guard_input.weight"),
        ({"guard_input": {**info["guard_input"], "weight": 10**400}}, "guard_input.weight"),
        ({"guard_input": {"weight": 1.0}}, "guard_input.guard None"),
        ({"hyper": {**info["hyper"], "layers": 7}}, "hyper.layers 7"),
    ):
        (folder / INFO_FILE).write_text(json.dumps({**info, **bad}))
        with pytest.raises(ConfigError, match=message):
            PairVerifier(folder)


def test_a_fully_tuned_verifier_keeps_its_trained_weights_and_refuses_other_tensors(
    tmp_path: Path,
) -> None:
    """`train.verifier --full --layers 2` writes every trained tensor (the two kept layers, the
    pooler, the classifier; not the embeddings) and no adapter; it loads with those tensors,
    scores as the trained model did, and a file with a tensor missing, extra or of another
    shape, or an unknown `hyper.tuning`, is refused."""
    from safetensors.torch import load_file, save_file

    from tiercache.semantic.verifier import FULL_WEIGHTS
    from tiercache_dev.train import verifier as train

    folder = tmp_path / "v"
    argv = ["--train", str(hard_pairs_file(tmp_path / "pairs.jsonl")), "--out", str(folder)]
    argv += ["--guard-input", "--layers", "2", "--batch", "4", "--threads", "1", "--full"]
    assert train.main(argv) == 0
    info = json.loads((folder / INFO_FILE).read_text())
    assert info["hyper"]["tuning"] == "full" and info["hyper"]["lr"] == 5e-5
    assert not (folder / "adapter_config.json").exists()
    tensors = load_file(str(folder / FULL_WEIGHTS))
    assert not any(name.startswith("bert.embeddings.") for name in tensors)
    assert {name.split(".")[3] for name in tensors if ".layer." in name} == {"0", "1"}
    assert "classifier.weight" in tensors and "bert.pooler.dense.weight" in tensors
    verifier = PairVerifier(folder, threads=1, dtype="float32", packed_linears=False)
    assert verifier.layers == 2
    loaded = dict(verifier._model.named_parameters())
    for name in ("classifier.weight", "bert.encoder.layer.1.output.dense.bias"):
        assert np.array_equal(loaded[name].detach().numpy(), tensors[name].numpy())
    query, text = ["How do I learn topic 3?"], ["How can I learn topic 3?"]
    before = verifier.scores(query, text, [0.5])[0]
    tensors["classifier.bias"] = tensors["classifier.bias"] + 2.0  # the file is what is read
    save_file(tensors, str(folder / FULL_WEIGHTS))
    after = PairVerifier(folder, threads=1, dtype="float32").scores(query, text, [0.5])[0]
    assert np.log(after / (1 - after)) - np.log(before / (1 - before)) == pytest.approx(2.0, 1e-4)
    shrunk = {k: v for k, v in tensors.items() if k != "classifier.bias"}
    wide = {**tensors, "classifier.bias": tensors["classifier.bias"].repeat(2)}
    extra = {
        **tensors,
        "bert.encoder.layer.2.output.dense.bias": tensors["classifier.bias"].clone(),
    }
    for bad, message in ((shrunk, "missing"), (wide, "has shape"), (extra, "extra")):
        save_file(bad, str(folder / FULL_WEIGHTS))
        with pytest.raises(ConfigError, match=message):
            PairVerifier(folder, threads=1)
    (folder / INFO_FILE).write_text(json.dumps({**info, "hyper": {**info["hyper"], "tuning": "x"}}))
    with pytest.raises(ConfigError, match="hyper.tuning 'x'"):
        PairVerifier(folder, threads=1)
    with pytest.raises(SystemExit, match="not with --full"):
        train.main([*argv, "--init", str(folder)])


def test_the_shipped_verifier_loads_by_name_and_tells_rewordings_from_other_questions() -> None:
    """`builtin` is the verifier the package ships (trained on top of the guard, its operating
    point chosen on the dev pairs): it loads over the packaged embedder, states its data and
    terms, and, the guard's score held equal, scores a rewording above a changed question."""
    from tiercache.semantic.verifier import BUILTIN, BUILTIN_FOLDER

    verifier = PairVerifier(BUILTIN, threads=1)
    assert verifier.guard_weight is not None and verifier.layers == 3  # MiniLM's first three
    assert verifier.guard_digest == load_guard().scoring_digest()  # the packaged guard's
    point = verifier.info["operating_point"]
    assert verifier.default_threshold == point["threshold"]
    assert point["chosen_on"] == "semantic_pairs_dev.jsonl"
    assert "index mod 20 in 1..9" in verifier.info["data"]["split"]
    card = (BUILTIN_FOLDER / "README.md").read_text()
    assert "non-commercial" in card and "Apache-2.0" in card
    config = json.loads((BUILTIN_FOLDER / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == resolve_embedder()[1].embedder_id  # portable
    rewordings = [
        ("how do i improve my english speaking skills?", "how can i improve my spoken english?"),
        ("how can i lose weight fast?", "what is the fastest way to lose weight?"),
        ("how can i make money online?", "how do i make money online?"),
    ]
    changed = [
        (
            "how do i convert ethanoic acid to ethanol?",
            "how do i convert ethanol to ethanoic acid?",
        ),
        (
            "what are the advantages of a democratic government?",
            "what are the disadvantages of a democratic government?",
        ),
        ("which is the best laptop under 500 dollars?", "which laptop should i buy?"),
    ]
    pairs = rewordings + changed
    # every pair at the same guard score: what tells them apart is the cross-encoder's reading
    found = verifier.scores([a for a, _ in pairs], [b for _, b in pairs], [0.7] * len(pairs))
    same, other = found[: len(rewordings)], found[len(rewordings) :]
    assert same.min() > other.max()
    # at its operating point it serves rewordings and none of the changed questions
    assert (same >= point["threshold"]).sum() >= 2 and (other < point["threshold"]).all()
