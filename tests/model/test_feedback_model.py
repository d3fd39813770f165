"""model_repository/feedback/1/model.py against the pb_utils stand-in: verdicts on answer ids,
the tenant from the caller's API key, and closed while prompt_cache on the host publishes other
caller terms (another key file, another secret)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from tiercache.exact.answer_ids import AnswerIds, AnswerRef, ServedAs
from tiercache.exact.keys import tenant_scope
from tiercache.exact.tenant_keys import RELOAD_CHECK_S, add_key
from tiercache.stages.contract import (
    CHECK_INTERVAL_S,
    LLM,
    PROMPT_CACHE,
    caller_terms,
    write_terms,
)

DIGEST = hashlib.sha256(b"an answer").hexdigest()


def start(load_model: Callable[[str], ModuleType], state: Path, keys: Path | None = None) -> Any:
    instance = load_model("feedback").TritonPythonModel()
    parameters = {"state_dir": str(state)}
    if keys is not None:
        parameters["api_keys_file"] = str(keys)
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    instance.initialize({"model_config": json.dumps(config), "model_name": "feedback"})
    return instance


def call(pb_utils: ModuleType, authorization: str | None = None, **inputs: str) -> Any:
    tensors = [
        pb_utils.Tensor(name, np.array([[value.encode()]], dtype=np.object_))
        for name, value in inputs.items()
    ]
    request = pb_utils.InferenceRequest(tensors)
    if authorization is not None:
        request.kwargs["parameters"] = {"authorization": authorization}
    return request


def result(response: Any) -> dict[str, Any] | str:
    """The FEEDBACK_RESULT JSON, or the error message."""
    if response.has_error():
        return str(response.error().message())
    (tensor,) = response.output_tensors()
    parsed: dict[str, Any] = json.loads(tensor.as_numpy().reshape(-1)[0])
    return parsed


def test_bad_feedback_drops_the_entry_for_its_own_tenant_only(
    load_model: Callable[[str], ModuleType], pb_utils: ModuleType, tmp_path: Path
) -> None:
    instance = start(load_model, tmp_path)
    try:
        secret = (tmp_path / "secret").read_bytes()
        write_terms(tmp_path, PROMPT_CACHE, {**caller_terms(None, secret), "model": "m"})
        write_terms(tmp_path, LLM, {"padding": None})  # llm pads nobody: full answers
        scope = tenant_scope(secret, "acme")
        cache = instance.stage.core.invalidator.cache
        cache.put(DIGEST, "a wrong answer", tenant_scope=scope)
        answer_id = AnswerIds(secret).issue(AnswerRef(DIGEST, ServedAs.OWN), scope)
        responses = instance.execute(
            [
                call(pb_utils, ANSWER_ID=answer_id, VERDICT="bad", tenant="globex"),
                call(pb_utils, ANSWER_ID=answer_id, VERDICT="bad"),  # the default tenant
                call(pb_utils, ANSWER_ID="a1.nope", VERDICT="bad", tenant="acme"),
                call(pb_utils, ANSWER_ID=answer_id, VERDICT="so-so", tenant="acme"),
                call(pb_utils, VERDICT="bad", tenant="acme"),
                call(pb_utils, ANSWER_ID=answer_id, VERDICT="good", tenant=" acme "),
            ]
        )
        outcomes = [result(r) for r in responses]
        assert all(isinstance(o, str) and o.startswith("forbidden: ") for o in outcomes[:2])
        assert all(isinstance(o, str) and "invalid" in o for o in outcomes[2:5]), outcomes
        assert outcomes[5] == {
            "verdict": "good",
            "accepted": True,
            "served": "own",
            "invalidated": False,
            "published": False,
            "endorsed": True,
            "reaches": "counted; the cached answer ranks higher where it is cached next",
        }
        found = cache.get(DIGEST)
        assert found is not None  # nothing above dropped it
        assert found.entry.endorsements == 1
        (bad,) = instance.execute(
            [call(pb_utils, ANSWER_ID=answer_id, VERDICT="BAD", tenant="acme")]
        )
        assert result(bad) == {
            "verdict": "bad",
            "accepted": True,
            "served": "own",
            "invalidated": True,
            "published": False,
            "endorsed": False,
            "reaches": "this host only (no Redis)",
        }
        assert cache.get(DIGEST) is None
        stage = instance.stage
        stage.metrics.flush()
        refused = {k: c.metric.value() for k, c in stage.refused.items()}
        assert refused == {"forbidden": 2, "invalid": 3, "closed": 0, "unavailable": 0}
        assert stage.invalidations.metric.value() == 1
        # Once llm pads some tenant, answers say nothing of how the answer was served.
        write_terms(tmp_path, LLM, {"padding": {"floor_s": 0.05, "jitter_s": 0, "trusted": ""}})
        time.sleep(CHECK_INTERVAL_S)
        (masked,) = instance.execute(
            [call(pb_utils, ANSWER_ID=answer_id, VERDICT="good", tenant="acme")]
        )
        assert result(masked) == {"verdict": "good", "accepted": True}
    finally:
        instance.finalize()


def test_with_a_key_file_the_tenant_is_the_keys_and_without_prompt_cache_s_it_is_closed(
    load_model: Callable[[str], ModuleType], pb_utils: ModuleType, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.json"
    acme_key, _ = add_key(keys, "acme")
    globex_key, _ = add_key(keys, "globex")
    cheap_key, _ = add_key(keys, "acme", cache_control=["no-store"])
    instance = start(load_model, tmp_path, keys)
    try:
        secret = (tmp_path / "secret").read_bytes()
        scope = tenant_scope(secret, "acme")
        answer_id = AnswerIds(secret).issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.9), scope)

        def good(authorization: str | None, **tenant: str) -> Any:
            (response,) = instance.execute(
                [call(pb_utils, authorization, ANSWER_ID=answer_id, VERDICT="good", **tenant)]
            )
            return result(response)

        # prompt_cache has published nothing yet, then terms without the key file: closed
        assert "feedback is closed" in str(good(f"Bearer {acme_key}"))
        write_terms(tmp_path, PROMPT_CACHE, caller_terms(None, secret))
        time.sleep(CHECK_INTERVAL_S)  # the terms are re-read at most this often
        assert "feedback is closed" in str(good(f"Bearer {acme_key}"))
        write_terms(tmp_path, PROMPT_CACHE, caller_terms(keys, secret))
        write_terms(tmp_path, LLM, {"padding": None})
        time.sleep(CHECK_INTERVAL_S)
        assert good(f"Bearer {acme_key}") == {
            "verdict": "good",
            "accepted": True,
            "served": "semantic",
            "invalidated": False,
            "published": False,
            "endorsed": False,
            "reaches": "counted",
        }
        assert str(good(None, tenant="acme")).startswith("forbidden: ")  # no key
        assert str(good(f"Bearer {globex_key}")).startswith("forbidden: ")  # its own tenant
        assert str(good(f"Bearer {globex_key}", tenant="acme")).startswith("forbidden: ")
        # a key limited to cheap cache_control words may not force a regeneration by `bad`
        (bad,) = instance.execute(
            [call(pb_utils, f"Bearer {cheap_key}", ANSWER_ID=answer_id, VERDICT="bad")]
        )
        assert "may not use cache_control no-cache" in str(result(bad))
        # a key limited to some adapters judges answers of those, and of the base model, only
        brief_key, _ = add_key(keys, "acme", adapters=["brief"])
        time.sleep(max(CHECK_INTERVAL_S, RELOAD_CHECK_S) + 0.1)  # the key file is re-read
        ids = AnswerIds(secret)
        caps_id = ids.issue(AnswerRef(DIGEST, ServedAs.OWN), scope, "caps")
        brief_id = ids.issue(AnswerRef(DIGEST, ServedAs.OWN), scope, "brief")
        verdicts = [
            (caps_id, "bad"),
            (caps_id, "good"),
            (brief_id, "good"),
            (answer_id, "good"),  # the base model's
        ]
        answers = instance.execute(
            [call(pb_utils, f"Bearer {brief_key}", ANSWER_ID=i, VERDICT=v) for i, v in verdicts]
        )
        outcomes = [result(r) for r in answers]
        for refused in outcomes[:2]:
            assert "may not use the adapter of the answer answer_id names" in str(refused)
        assert [o["accepted"] for o in outcomes[2:]] == [True, True]  # type: ignore[index]
        (full,) = instance.execute(
            [call(pb_utils, f"Bearer {acme_key}", ANSWER_ID=caps_id, VERDICT="good")]
        )
        assert result(full)["accepted"] is True  # type: ignore[index]
        stage = instance.stage
        stage.metrics.flush()
        assert stage.refused["closed"].metric.value() == 2
        assert stage.refused["forbidden"].metric.value() == 6
    finally:
        instance.finalize()


def test_errors_tell_the_caller_no_paths_no_redis_address_and_no_echo_of_large_inputs(
    load_model: Callable[[str], ModuleType], pb_utils: ModuleType, tmp_path: Path
) -> None:
    from tiercache.errors import Unavailable

    keys = tmp_path / "keys.json"
    acme_key, _ = add_key(keys, "acme")
    instance = start(load_model, tmp_path, keys)
    try:
        secret = (tmp_path / "secret").read_bytes()
        answer_id = AnswerIds(secret).issue(
            AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.9), tenant_scope(secret, "acme")
        )

        def give(**inputs: str) -> Any:
            (response,) = instance.execute([call(pb_utils, f"Bearer {acme_key}", **inputs)])
            return result(response)

        closed = str(give(ANSWER_ID=answer_id, VERDICT="good"))
        assert "feedback is closed" in closed and str(tmp_path) not in closed
        write_terms(tmp_path, PROMPT_CACHE, caller_terms(keys, secret))
        write_terms(tmp_path, LLM, {"padding": None})
        time.sleep(CHECK_INTERVAL_S)
        # Inputs far over their bound: refused before decoding, never echoed back whole.
        for name, value in (("VERDICT", "x" * 100_000), ("ANSWER_ID", "a" * 100_000)):
            inputs = {"ANSWER_ID": answer_id, "VERDICT": "good", name: value}
            refused = str(give(**inputs))
            assert name in refused and len(refused) < 300, refused[:300]
        odd = str(give(ANSWER_ID=answer_id, VERDICT="meh" * 5))
        assert "verdict must be one of" in odd and len(odd) < 300
        # An invalidation Redis did not take: the caller is not told where Redis is.

        def unreachable(*_: Any, **__: Any) -> Any:
            raise Unavailable("Redis redis://10.9.8.7:6390/0 is unavailable: applied here only")

        instance.stage.core.give = unreachable
        failed = str(give(ANSWER_ID=answer_id, VERDICT="bad"))
        assert "applied on this server only" in failed and "10.9.8.7" not in failed
    finally:
        instance.finalize()
