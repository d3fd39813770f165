"""model_repository/llm/1/model.py indexing its answers' prompts (the semantic row it writes once
the answer is stored) under the per-tenant cap on semantic scopes: each row that starts a scope
counts toward its request's tenant scope (`semantic_max_scopes_per_tenant`), so a tenant past
its cap is refused (counted, never an error: its answer is served) while another tenant still
starts scopes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import seals
from test_llm_model import OTHER_TENANT, TENANT, FakeTorchLlm, final, run, text_tensor

from tiercache.exact.keys import Digest
from tiercache.exact.request import GenerationRequest
from tiercache.semantic.row_log import scope_tag
from tiercache.semantic.store import SemanticStore
from tiercache.stages.envelope import Envelope
from tiercache.stages.seal import Sealer
from tiercache.vocabulary import CacheStatus

DIMENSIONS = 384  # the default embedder's (all-MiniLM-L6-v2)


def miss_with_vector(
    pb_utils: ModuleType, sealer: Sealer, tenant: str, scope: str, digest: str
) -> list[object]:
    """A miss to write back and index in `scope`, with embedding_cache's sealed vector and
    lora_cache's (empty) adapter tensors."""
    request = GenerationRequest("What is Triton?", tenant_scope=tenant)
    sent = Envelope(
        request=request,
        status=CacheStatus.MISS,
        digest=Digest(digest),
        write_back=True,
        semantic_scope=scope,
        semantic_lookup=True,
    )
    envelope = seals.sealed(sealer, sent)
    vector = np.zeros(DIMENSIONS, np.float32)
    vector[int(digest[0], 16)] = 1.0
    tensors = seals.llm_answer(sealer, envelope, "", CacheStatus.MISS, vector=vector)
    lora: dict[str, str | bytes] = {"LORA_CONFIG": "", "LORA_WEIGHTS": b"", "LORA_EVICT": ""}
    tensors += [text_tensor(pb_utils, name, value) for name, value in lora.items()]
    tensors.append(text_tensor(pb_utils, "LORA_SEAL", seals.lora_seal(sealer, envelope, lora)))
    return tensors


def test_each_tenant_starts_scopes_up_to_its_own_cap(
    pb_utils: ModuleType,
    load_model: Callable[[str], ModuleType],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sealer = seals.sealer_for(tmp_path)
    monkeypatch.setitem(pb_utils.BLS_MODELS, "torch_llm", FakeTorchLlm(pb_utils, sealer))
    model = load_model("llm").TritonPythonModel()
    parameters = {
        "state_dir": {"string_value": str(tmp_path)},
        "semantic_max_scopes_per_tenant": {"string_value": "1"},
    }
    model.initialize({"model_config": json.dumps({"parameters": parameters}), "model_name": "llm"})
    scopes = {"mine-16": "1" * 64, "mine-32": "2" * 64, "theirs-16": "3" * 64}
    batch = [
        miss_with_vector(pb_utils, sealer, TENANT, scopes["mine-16"], "5" * 64),
        miss_with_vector(pb_utils, sealer, TENANT, scopes["mine-32"], "6" * 64),
        miss_with_vector(pb_utils, sealer, OTHER_TENANT, scopes["theirs-16"], "7" * 64),
    ]
    responses = run(pb_utils, model, batch)
    assert [final(pb_utils, r) for r in responses] == [("Hello there", "miss")] * 3
    path = model.stage.semantic.path
    model.finalize()  # waits for the write-backs, and their index rows
    assert model.stage.semantic.scopes_refused == 1
    store = SemanticStore(path, dimensions=DIMENSIONS)
    mine = [store.manifest(scope_tag(scopes[name])) for name in ("mine-16", "mine-32")]
    assert sum(m is not None for m in mine) == 1  # the first of the two rows indexed
    assert store.manifest(scope_tag(scopes["theirs-16"])) is not None
    assert (store.scopes_started_by(TENANT), store.scopes_started_by(OTHER_TENANT)) == (1, 1)
    store.close()
