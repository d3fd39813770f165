"""model_repository/embedding_cache/1/model.py against the pb_utils stand-in, with a fake embedder
behind BLS. embedding_cache is internal: it takes prompt_cache's sealed envelope and seals its
answer for llm (ANSWER_SEAL); an unsealed or altered envelope is refused alone, nothing embedded
or sealed for it, and the rest of its batch served. An exact hit's text goes from prompt_cache to
llm directly: here it gets an empty, unsealed pass-through."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import seals

from tiercache.errors import Forbidden
from tiercache.exact.keys import Digest
from tiercache.exact.request import GenerationRequest
from tiercache.semantic.entry_trust import length_class, record_outcome
from tiercache.semantic.vectors import vector_key
from tiercache.stages.envelope import Envelope
from tiercache.stages.seal import Sealer
from tiercache.vocabulary import CacheStatus, Tier

SCOPE, OTHER_SCOPE = "s" * 64, "t" * 64


class FakeEmbedder:
    """The embedder model: one [n, d] batch of unit vectors back for [n, 1] texts; records them."""

    def __init__(self, pb_utils: ModuleType) -> None:
        self.pb = pb_utils
        self.dimensions = 0  # set once the stage says how many it keeps
        self.calls: list[list[str]] = []

    def __call__(self, request: Any) -> list[Any]:
        texts = [t.decode() for t in request.inputs()[0].as_numpy().reshape(-1)]
        self.calls.append(texts)
        vectors = np.zeros((len(texts), self.dimensions), dtype=np.float32)
        vectors[:, 0] = 1.0
        return [self.pb.InferenceResponse([self.pb.Tensor("EMBEDDING", vectors)])]


@pytest.fixture
def embedder(pb_utils: ModuleType, monkeypatch: pytest.MonkeyPatch) -> FakeEmbedder:
    fake = FakeEmbedder(pb_utils)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "embedder", fake)
    return fake


@pytest.fixture
def model(
    load_model: Callable[[str], ModuleType], tmp_path: Path, embedder: FakeEmbedder
) -> Iterator[Any]:
    instance = load_model("embedding_cache").TritonPythonModel()
    config = {"parameters": {"state_dir": {"string_value": str(tmp_path)}}}
    instance.initialize(
        {
            "model_config": json.dumps(config),
            "model_name": "embedding_cache",
            "model_instance_name": "embedding_cache_0",
        }
    )
    embedder.dimensions = instance.stage.core.vectors.dimensions
    yield instance
    instance.finalize()


def started(load_model: Callable[[str], ModuleType], parameters: dict[str, str]) -> Any:
    """The stage's model.py, initialized with these parameters (string values)."""
    instance = load_model("embedding_cache").TritonPythonModel()
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    instance.initialize(
        {
            "model_config": json.dumps(config),
            "model_name": "embedding_cache",
            "model_instance_name": "embedding_cache_0",
        }
    )
    return instance


@pytest.fixture
def sealer(tmp_path: Path) -> Sealer:
    """The deployment's sealer (the stage's state_dir is tmp_path)."""
    return seals.sealer_for(tmp_path)


def envelope(
    sealer: Sealer, prompt: str, status: CacheStatus, cached_text: str = "", **fields: Any
) -> bytes:
    """prompt_cache's sealed envelope for `prompt` (`cached_text`: an exact hit's answer)."""
    sent = Envelope(
        request=GenerationRequest(prompt), status=status, digest=Digest("d" * 64), **fields
    )
    return seals.sealed(sealer, sent, cached_text)


def semantic_miss(sealer: Sealer, prompt: str) -> bytes:
    """An exact miss embedding_cache looks up by meaning, in SCOPE."""
    return envelope(sealer, prompt, CacheStatus.MISS, semantic_scope=SCOPE, semantic_lookup=True)


def request(pb_utils: ModuleType, data: bytes, cached_text: str = "") -> Any:
    return pb_utils.InferenceRequest(
        [
            pb_utils.Tensor(name, np.array([[value]], dtype=np.object_))
            for name, value in (("ENVELOPE", data), ("CACHED_TEXT", cached_text.encode()))
        ]
    )


def answer(response: Any) -> dict[str, Any]:
    """The response's outputs by name, as llm reads them."""
    assert not response.has_error(), response.error().message()
    outputs: dict[str, Any] = {}
    for tensor in response.output_tensors():
        array = tensor.as_numpy()
        if tensor.name() in ("EMBEDDING", "ANSWER_TOKENS", "HIT_TRUST"):
            outputs[tensor.name()] = array
        elif array.dtype == np.object_:
            outputs[tensor.name()] = array.reshape(-1)[0].decode()
        else:
            outputs[tensor.name()] = float(array.reshape(-1)[0])
    return outputs


def assert_forbidden(pb_utils: ModuleType, response: Any, fragment: str) -> None:
    assert response.has_error(), "served"
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message().startswith("forbidden: ")
    assert fragment in response.error().message()
    assert response.output_tensors() == []  # no answer, no ANSWER_SEAL


def test_only_sealed_envelopes_are_looked_up_and_answered_with_a_seal(
    pb_utils: ModuleType, model: Any, sealer: Sealer, embedder: FakeEmbedder
) -> None:
    """An envelope sent without its seal, one moved to another tenant's semantic scope, one
    sealed by another deployment: each refused alone, nothing embedded or sealed for it; the
    good semantic miss of the batch is answered with an ANSWER_SEAL llm accepts. Requests
    that come with an exact hit's text (the real one, a planted one, one with a miss turned
    into an exact hit) are not looked up and get the empty, unsealed pass-through
    (`exact_hit`): the hit's text goes from prompt_cache to llm, which checks it."""
    stranger = Sealer.from_secret(b"another deployment's secret....")
    looked_up = semantic_miss(sealer, "How do I bake bread?")
    hit = envelope(sealer, "What is Triton?", CacheStatus.EXACT, "the answer")
    planted = envelope(sealer, "Who are you?", CacheStatus.MISS)
    requests = [
        request(pb_utils, semantic_miss(sealer, "A direct call?")[64:]),
        request(
            pb_utils, seals.altered(semantic_miss(sealer, "Whose scope?"), b"s" * 64, b"t" * 64)
        ),
        request(pb_utils, semantic_miss(stranger, "Another deployment?")),
        request(pb_utils, looked_up),
        request(pb_utils, hit, "the attacker's answer"),
        request(pb_utils, seals.altered(planted, b'"status":"miss"', b'"status":"exact"'), "x"),
        request(pb_utils, semantic_miss(sealer, "Skipped by its text?"), "x"),
        request(pb_utils, hit, "the answer"),
    ]
    *refused, miss, planted_text, altered_hit, skipped, exact = model.execute(requests)
    assert len(refused) == 3
    for response in refused:
        assert_forbidden(pb_utils, response, "ENVELOPE's seal does not verify")
    # the good miss, sealed for llm (bound to its envelope)
    out = answer(miss)
    assert (out["ANSWER_TEXT"], out["ANSWER_STATUS"]) == ("", "miss")
    assert out["EMBEDDING"].shape == (1, embedder.dimensions)
    seals.check_answer(sealer, looked_up, out)
    # anything with a text: the pass-through, carrying nothing and sealed by nothing
    for response in (planted_text, altered_hit, skipped, exact):
        out = answer(response)
        assert (out["ANSWER_TEXT"], out["ANSWER_STATUS"], out["ANSWER_SEAL"]) == ("", "exact", "")
        assert out["ANSWER_TOKENS"].reshape(-1).tolist() == [0, 0, 0]
        with pytest.raises(Forbidden, match="not sealed"):
            seals.check_answer(sealer, hit, out)
    # only the good semantic miss was embedded, and only its vector is kept
    assert embedder.calls == [["How do I bake bread?"]]
    core = model.stage.core
    prompts = [
        "A direct call?",
        "Whose scope?",
        "Another deployment?",
        "How do I bake bread?",
        "Skipped by its text?",
    ]
    kept = [p for p in prompts if core.vectors.get(vector_key(core.embedder_key, p)) is not None]
    assert kept == ["How do I bake bread?"]
    model.stage.metrics.flush()
    outcomes = {k: c.metric.value() for k, c in model.stage.outcomes.items() if c.metric.value()}
    assert outcomes == {"error": len(refused), "miss": 1, "skipped": 4}


def test_an_empty_exact_hits_token_counts_pass_on_only_as_prompt_cache_sealed_them(
    pb_utils: ModuleType, model: Any, sealer: Sealer
) -> None:
    """An exact hit whose stored answer is empty (the engine stopped at once) has no text to
    hand llm directly: its envelope is opened here, against the CACHED_TOKENS bound into its
    seal, and passed on as ANSWER_TOKENS under this stage's seal; other counts are refused."""
    sent = Envelope(
        request=GenerationRequest("What is Triton?"),
        status=CacheStatus.EXACT,
        digest=Digest("d" * 64),
    )
    empty = seals.sealed(sealer, sent, "", (31, 0, 0))

    def with_tokens(tokens: list[int]) -> Any:
        hit = request(pb_utils, empty, "")
        tensors = [*hit.inputs(), pb_utils.Tensor("CACHED_TOKENS", np.array([tokens], np.int32))]
        return pb_utils.InferenceRequest(tensors)

    passed, forged = model.execute([with_tokens([31, 0, 0]), with_tokens([31, 0, 1])])
    out = answer(passed)
    assert (out["ANSWER_TEXT"], out["ANSWER_STATUS"]) == ("", "exact")
    assert out["ANSWER_TOKENS"].reshape(-1).tolist() == [31, 0, 0]
    seals.check_answer(sealer, empty, out)
    assert_forbidden(pb_utils, forged, "ENVELOPE's seal does not verify")


def test_the_verifier_parameters_choose_the_stages_decision(
    load_model: Callable[[str], ModuleType], tmp_path: Path, embedder: FakeEmbedder
) -> None:
    """`verifier` names a trained folder: the stage decides with it at
    `verifier_threshold` (0: the folder's own operating point) and in `verifier_dtype`; a
    folder that is not a verifier fails the model's load with the reason."""
    pytest.importorskip("peft")
    from verifier_folders import untrained_verifier

    from tiercache.errors import ConfigError
    from tiercache.semantic.verifier import BUILTIN_FOLDER, INFO_FILE, VerifiedChoice

    folder, info = untrained_verifier(tmp_path / "verifier", operating_point=0.75)

    def start(**parameters: str) -> Any:
        values = {"state_dir": str(tmp_path / "state"), **parameters}
        config = {"parameters": {k: {"string_value": v} for k, v in values.items()}}
        instance = load_model("embedding_cache").TritonPythonModel()
        instance.initialize(
            {
                "model_config": json.dumps(config),
                "model_name": "embedding_cache",
                "model_instance_name": "embedding_cache_0",
            }
        )
        return instance

    for threshold, expected in (("0", 0.75), ("0.9", 0.9)):
        instance = start(verifier=str(folder), verifier_threshold=threshold)
        choose = instance.stage.core._choose
        assert isinstance(choose, VerifiedChoice) and choose.threshold == expected
        instance.finalize()
    # the pairs it reads are counted and each call timed in the stage's metrics
    instance = start(verifier=str(folder))
    choose = instance.stage.core._choose
    choose("how do i reset my password?", [("how can i change my password?", 0.9)])
    assert choose.pairs_scored == 1
    metrics = instance.stage.metrics
    metrics.flush()
    family = metrics._families["tiercache_embedding_cache_verifier_pairs_total"]
    assert sum(m.value() for m in family.metrics) == 1
    timed = metrics._families["tiercache_embedding_cache_verifier_seconds_count"]
    assert sum(m.value() for m in timed.metrics) == 1
    instance.finalize()
    instance = start()  # the default decides with the guard alone
    assert not isinstance(instance.stage.core._choose, VerifiedChoice)
    instance.finalize()
    instance = start(verifier="builtin")  # the shipped one, at the point chosen on dev
    choose = instance.stage.core._choose
    builtin = json.loads((BUILTIN_FOLDER / INFO_FILE).read_text())
    assert isinstance(choose, VerifiedChoice)
    assert choose.threshold == builtin["operating_point"]["threshold"]
    instance.finalize()
    # verifier_dtype: the number format the verifier runs in; another name fails the load
    instance = start(verifier="builtin", verifier_dtype="int8")
    assert instance.stage.core._choose._score_pairs.__self__.dtype == "int8"
    instance.finalize()
    with pytest.raises(ConfigError, match="verifier_dtype"):
        start(verifier="builtin", verifier_dtype="float16")
    (folder / INFO_FILE).write_text(json.dumps({**info, "operating_point": {}}))
    with pytest.raises(ConfigError, match="no operating_point"):
        start(verifier=str(folder))
    with pytest.raises(ConfigError, match="verifier.json"):
        start(verifier=str(tmp_path / "nowhere"))


def test_with_a_confidence_floor_an_unsure_answer_is_not_served_to_a_rewording(
    load_model: Callable[[str], ModuleType],
    pb_utils: ModuleType,
    tmp_path: Path,
    embedder: FakeEmbedder,
    sealer: Sealer,
) -> None:
    """`confidence_floor` (issue 19): the neighbour whose stored answer the engine was unsure
    of (confidence 0.3 < 0.5) is not served (outcome unsure, the request goes on as a miss);
    one it was sure of (0.9) is."""
    parameters = {"state_dir": str(tmp_path), "confidence_floor": "0.5"}
    instance = started(load_model, parameters)
    try:
        core = instance.stage.core
        embedder.dimensions = core.vectors.dimensions
        row = np.zeros(core.vectors.dimensions, dtype=np.float32)
        row[0] = 1.0  # the fake embedder's vector for every text: similarity 1
        prompt = "How do I reset my password?"
        for scope, digest, confidence in ((SCOPE, "1" * 64, 0.3), (OTHER_SCOPE, "2" * 64, 0.9)):
            core.answers.put(digest, f"answer {confidence}", mean_logprob=math.log(confidence))
            core.index.add(scope, digest, prompt, row)
        asks = [
            envelope(sealer, prompt, CacheStatus.MISS, semantic_scope=scope, semantic_lookup=True)
            for scope in (SCOPE, OTHER_SCOPE)
        ]
        unsure, sure = instance.execute([request(pb_utils, data) for data in asks])
        assert (answer(unsure)["ANSWER_STATUS"], answer(unsure)["ANSWER_TEXT"]) == ("miss", "")
        assert (answer(sure)["ANSWER_STATUS"], answer(sure)["ANSWER_TEXT"]) == (
            "semantic",
            "answer 0.9",
        )
        instance.stage.metrics.flush()
        outcomes = instance.stage.outcomes
        assert outcomes["unsure"].metric.value() == outcomes["semantic"].metric.value() == 1
    finally:
        instance.finalize()


def test_with_a_total_its_answers_l1_follows_the_budgets(
    load_model: Callable[[str], ModuleType], tmp_path: Path, embedder: FakeEmbedder
) -> None:
    """cache_memory_bytes under L1's fixed size: embedding_cache's answers' L1 and its
    vectors' L1 shrink to it together within a tick, the least valuable first to its floor,
    and are published in the host's ledger, as prompt_cache's is."""
    parameters = {
        "state_dir": str(tmp_path),
        "cache_memory_bytes": str(8 << 20),
        "budget_interval_s": "0.05",
    }
    instance = started(load_model, parameters)
    try:
        l1 = instance.stage.core.answers.store(Tier.L1)
        vectors = instance.stage.core.vectors
        deadline = time.monotonic() + 10.0
        while (
            l1.stats().max_bytes + vectors._l1_max_bytes > 8 << 20 and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        answers_bytes, vector_bytes = l1.stats().max_bytes, vectors._l1_max_bytes
        assert answers_bytes + vector_bytes == 8 << 20
        # nothing measured yet (both worth 0 per byte): the first listed is cut to its floor
        # first, the rest comes out of the vectors (16 MiB fixed)
        assert (answers_bytes, vector_bytes) == (1 << 20, 7 << 20)
        published = list((tmp_path / "budgets").iterdir())
        assert [p.name.split(".")[0] for p in published] == ["embedding_cache"]
        rows = json.loads(published[0].read_text())
        assert {row[0] for row in rows} == {"l1", "vectors"}  # rows: name first
    finally:
        instance.finalize()
    assert instance.stage.budgets is not None and not instance.stage.budgets._thread.is_alive()


def test_a_graphs_budget_bounds_the_scopes_graphs_and_follows_the_machine(
    load_model: Callable[[str], ModuleType], tmp_path: Path, embedder: FakeEmbedder
) -> None:
    """`semantic_graph_max_bytes` bounds this process's HNSW graphs from the start and joins
    the stage's budgets (published in the host's ledger beside L1 and the vectors)."""
    parameters = {
        "state_dir": str(tmp_path),
        "semantic_graph_max_bytes": str(4 << 20),
        "cache_memory_bytes": str(8 << 20),
        "budget_interval_s": "0.05",
    }
    instance = started(load_model, parameters)
    try:
        index = instance.stage.core.index
        assert index._graph_budget is not None and index._graph_budget <= 4 << 20
        deadline = time.monotonic() + 10.0
        folder, published = tmp_path / "budgets", []
        while not published and time.monotonic() < deadline:
            time.sleep(0.05)  # the first tick creates the folder and publishes
            published = list(folder.iterdir()) if folder.is_dir() else []
        assert published, "no budgets published within 10 s"
        rows = json.loads(published[0].read_text())
        assert {row[0] for row in rows} == {"l1", "vectors", "semantic_graphs"}
    finally:
        instance.finalize()


@pytest.mark.parametrize(("quantile", "verified"), [("0", 0.0), ("0.1", 1.0)])
def test_a_serve_quantile_sends_a_hit_the_mean_would_serve_to_the_engine(
    load_model: Callable[[str], ModuleType],
    pb_utils: ModuleType,
    tmp_path: Path,
    embedder: FakeEmbedder,
    sealer: Sealer,
    quantile: str,
    verified: float,
) -> None:
    """`semantic_serve_quantile`: a fresh entry the guard is sure of, in a tenant with no
    outcomes yet, is served on the predictive P(right) (0) and sent to the engine to verify
    under a credible bound (0.1: the posterior 90 % sure), at max_error 0.1 (P(right) 0.94
    on the mean, 0.81 at the 0.1 quantile, for the guard's score of the same text)."""
    parameters = {
        "state_dir": str(tmp_path),
        "semantic_max_error": "0.1",
        "semantic_audit_rate": "0",
        "semantic_serve_quantile": quantile,
    }
    instance = started(load_model, parameters)
    try:
        core = instance.stage.core
        assert core.trust.policy.bound_quantile == float(quantile)
        embedder.dimensions = core.vectors.dimensions
        row = np.zeros(core.vectors.dimensions, dtype=np.float32)
        row[0] = 1.0
        prompt = "How do I reset my password?"
        core.answers.put("2" * 64, "answer 2")
        core.index.add(OTHER_SCOPE, "2" * 64, prompt, row)
        data = seals.sealed(
            sealer,
            Envelope(
                request=GenerationRequest(prompt),
                status=CacheStatus.MISS,
                digest=Digest("d" * 64),
                semantic_scope=OTHER_SCOPE,
                semantic_lookup=True,
            ),
            "",
        )
        (response,) = instance.execute([request(pb_utils, data)])
        got = answer(response)
        assert (got["ANSWER_STATUS"], got["ANSWER_TEXT"]) == ("semantic", "answer 2")
        assert got["HIT_TRUST"].reshape(-1).tolist()[1] == verified
    finally:
        instance.finalize()


def test_with_a_max_error_the_trust_gate_serves_verifies_or_misses_under_its_seal(
    load_model: Callable[[str], ModuleType],
    pb_utils: ModuleType,
    tmp_path: Path,
    embedder: FakeEmbedder,
    sealer: Sealer,
) -> None:
    """`semantic_max_error` (issue 18 item 4): once the tenant's outcomes show its scores hold,
    an entry the guard is sure of is served (HIT_TRUST [score, 0]); one the engine refuted is
    sent to verify (HIT_TRUST [score, 1]) for a greedy request and missed (outcome untrusted)
    for a sampled one; HIT_TRUST is under the answer's seal, as llm checks it."""
    parameters = {
        "state_dir": str(tmp_path),
        "semantic_max_error": "0.05",
        "semantic_audit_rate": "0",
    }
    instance = started(load_model, parameters)
    try:
        core = instance.stage.core
        embedder.dimensions = core.vectors.dimensions
        row = np.zeros(core.vectors.dimensions, dtype=np.float32)
        row[0] = 1.0  # the fake embedder's vector for every text: similarity 1
        prompt = "How do I reset my password?"
        for scope, digest in ((SCOPE, "1" * 64), (OTHER_SCOPE, "2" * 64)):
            core.answers.put(digest, f"answer {digest[0]}")
            core.index.add(scope, digest, prompt, row)
        score = core.trust.score(prompt, prompt, 1.0)
        assert score > 0.99  # the same text: the guard is sure
        length = length_class("answer 1")  # answers of this length calibrate each other
        for i in range(40):  # the tenant's other hits at this score were verified right
            record_outcome(core.answers, f"{i:064x}", score, True, "", float(i + 1), "", length)
        # the engine refuted it
        record_outcome(core.answers, "1" * 64, score, False, "", 99.0, "", length)
        greedy = GenerationRequest(prompt)
        sampled = GenerationRequest(prompt, temperature=0.7)
        asks = [
            (greedy, SCOPE),
            (sampled, SCOPE),
            (greedy, OTHER_SCOPE),
        ]
        sent = [
            seals.sealed(
                sealer,
                Envelope(
                    request=req,
                    status=CacheStatus.MISS,
                    digest=Digest("d" * 64),
                    semantic_scope=scope,
                    semantic_lookup=True,
                ),  # fmt: skip
                "",
            )
            for req, scope in asks
        ]
        verify, missed, served = instance.execute([request(pb_utils, data) for data in sent])
        for response, data in ((verify, sent[0]), (missed, sent[1]), (served, sent[2])):
            seals.check_answer(sealer, data, answer(response))
        got = answer(verify)
        assert (got["ANSWER_STATUS"], got["ANSWER_TEXT"]) == ("semantic", "answer 1")
        assert got["HIT_TRUST"].reshape(-1).tolist() == [pytest.approx(score), 1.0]
        got = answer(missed)
        assert (got["ANSWER_STATUS"], got["ANSWER_TEXT"]) == ("miss", "")
        assert got["HIT_TRUST"].size == 0
        got = answer(served)
        assert (got["ANSWER_STATUS"], got["ANSWER_TEXT"]) == ("semantic", "answer 2")
        assert got["HIT_TRUST"].reshape(-1).tolist() == [pytest.approx(score), 0.0]
        instance.stage.metrics.flush()
        outcomes, decisions = instance.stage.outcomes, instance.stage.trust_decisions
        assert outcomes["untrusted"].metric.value() == 1
        assert decisions["verify"].metric.value() == decisions["serve"].metric.value() == 1
        assert core.trust.policy.bound_quantile == 0.0  # the predictive P(right), by default
    finally:
        instance.finalize()
