"""What the pipeline's hops hand an internal stage, sealed as the hops seal it, for tests that call
a stage directly; and the checks a fake stage behind BLS makes on what a stage sends it.

Every stage's sealer comes from its `state_dir`'s secret file (`tiercache.stages.parts.
open_sealer`: `<state_dir>/secret`, created on first use, or `$TIERCACHE_SECRET_FILE`), so
`sealer_for(state_dir)` gives a test the deployment's own sealer. Sealing and checking are the
package's own functions (tiercache.stages.seal, .envelope, .common, .embedding_cache and
.torch_llm), so these helpers follow any change to what a hop seals. The helpers that build or
read Triton tensors import the Triton boundary when called: it needs the pb_utils stand-in
installed first (the `pb_utils` fixture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tiercache.exact.request import GenerationRequest
from tiercache.stages.envelope import Envelope, Freshness, check_sealed, seal_of
from tiercache.stages.parts import open_adapter_cipher, open_sealer
from tiercache.stages.seal import (
    ADMIN_LABEL,
    ANSWER_LABEL,
    ANSWER_TENSORS,
    ENGINE_INPUTS,
    ENVELOPE_LABEL,
    LORA_LABEL,
    SEAL_CHARS,
    Part,
    Sealer,
    check_tensors,
    float_bytes,
    lora_inputs,
    seal_tensors,
    text_bytes,
    trust_array,
)
from tiercache.stages.transport import AdapterCipher, seal_views
from tiercache.vocabulary import CacheStatus


def sealer_for(state_dir: Path | str) -> Sealer:
    """The sealer of every stage started with `state_dir`."""
    return open_sealer(Path(state_dir))


def cipher_for(state_dir: Path | str) -> AdapterCipher:
    """What closes and opens the adapter files of every stage started with `state_dir`."""
    return open_adapter_cipher(Path(state_dir))


# ---- prompt_cache's envelope --------------------------------------------------------------------


def sealed(
    sealer: Sealer,
    envelope: Envelope | GenerationRequest,
    cached_text: str = "",
    tokens: tuple[int, int, int] = (0, 0, 0),
) -> bytes:
    """The envelope's wire form as prompt_cache hands it on (a bare request: as llm hands the
    engine its request, a bypass envelope); `cached_text` is the exact hit's answer, `tokens`
    its stored token counts."""
    if isinstance(envelope, GenerationRequest):
        envelope = Envelope(request=envelope)
    return envelope.seal(sealer, cached_text, tokens)


def sealed_miss(sealer: Sealer, request: GenerationRequest, **fields: Any) -> bytes:
    """A miss's envelope (no cached text), with the envelope's other `fields`."""
    return sealed(sealer, Envelope(request=request, status=CacheStatus.MISS, **fields))


def sealed_payload(sealer: Sealer, payload: bytes, cached_text: str = "") -> bytes:
    """Any bytes sealed as an envelope, so that a malformed envelope passes the seal check and
    reaches the decoder: `Envelope.seal`'s wire form over `payload` instead of an envelope's
    JSON (the one place here that spells a seal out; no package function seals raw bytes)."""
    return sealer.seal(ENVELOPE_LABEL, payload, text_bytes(cached_text)).encode() + payload


def opened(sealer: Sealer, data: bytes | str, cached_text: str = "") -> Envelope:
    """The envelope a stage sent, its seal checked (Forbidden when unsealed or altered)."""
    wire = data.encode() if isinstance(data, str) else data
    # the seal only: what a stage sent (a keyed envelope's key is the later stages' to check)
    return Envelope.decode(check_sealed(wire, sealer, cached_text))


def altered(data: bytes, old: bytes, new: bytes) -> bytes:
    """`data` with `old` replaced by `new`, its seal left as it was (an altered envelope)."""
    seal, payload = data[:SEAL_CHARS], data[SEAL_CHARS:]
    assert old in payload, f"{old!r} is not in the envelope"
    return seal + payload.replace(old, new)


# ---- embedding_cache's answer, as llm receives it -----------------------------------------------


def answer_seal(
    sealer: Sealer,
    envelope: bytes,
    text: str,
    status: str,
    similarity: float = 0.0,
    vector: np.ndarray | None = None,
    tokens: tuple[int, int, int] = (0, 0, 0),
    neighbours: tuple[str, ...] = (),
    trust: tuple[float, bool] = (0.0, False),
) -> str:
    """ANSWER_SEAL as embedding_cache makes it for this answer to the envelope `envelope`."""
    from tiercache.stages.embedding_cache import Answer
    from tiercache.stages.embedding_cache import answer_seal as seal

    answer = Answer(text, status, similarity, vector, tokens, neighbours, *trust)
    return seal(sealer, seal_of(envelope), answer)


def check_answer(sealer: Sealer, envelope: bytes, outputs: dict[str, Any]) -> None:
    """Forbidden unless embedding_cache's ANSWER_SEAL verifies over its `outputs` (by name, as
    it sent them), as llm checks it."""
    check_tensors(
        sealer,
        outputs.get("ANSWER_SEAL"),
        ANSWER_LABEL,
        ANSWER_TENSORS,
        {
            "ANSWER_TEXT": outputs["ANSWER_TEXT"],
            "ANSWER_STATUS": outputs["ANSWER_STATUS"],
            "SIMILARITY": float_bytes(outputs["SIMILARITY"]),
            "EMBEDDING": outputs.get("EMBEDDING"),
            "ANSWER_TOKENS": outputs.get("ANSWER_TOKENS"),
            "NEIGHBOURS": outputs.get("NEIGHBOURS"),
            "HIT_TRUST": outputs.get("HIT_TRUST"),
        },
        bound=seal_of(envelope),
        what="embedding_cache's answer",
    )


def llm_answer(
    sealer: Sealer,
    envelope: bytes,
    text: str,
    status: str,
    similarity: float = 0.0,
    vector: np.ndarray | None = None,
    seal: str | None = None,
    tokens: tuple[int, int, int] = (0, 0, 0),
    neighbours: tuple[str, ...] = (),
    trust: tuple[float, bool] = (0.0, False),
) -> list[Any]:
    """embedding_cache's answer as the ensemble hands it to llm (ANSWER_TEXT as CACHED_TEXT,
    ANSWER_STATUS as LOOKUP_STATUS) with its ANSWER_SEAL (`seal`: another one, e.g. a stale one
    over other values; "": none at all)."""
    import triton_python_backend_utils as pb_utils

    from tiercache.triton import io

    if seal is None:
        seal = answer_seal(
            sealer, envelope, text, status, similarity, vector, tokens, neighbours, trust
        )
    embedding = np.zeros((1, 0), np.float32) if vector is None else vector.reshape(1, -1)
    tensors = [
        io.bytes_tensor("ENVELOPE", [envelope]),
        io.bytes_tensor("CACHED_TEXT", [text]),
        io.bytes_tensor("LOOKUP_STATUS", [status]),
        io.scalar_tensor("SIMILARITY", similarity, np.float32),
        pb_utils.Tensor("EMBEDDING", embedding.astype(np.float32)),
        pb_utils.Tensor("ANSWER_TOKENS", np.array([tokens], dtype=np.int32)),
        io.bytes_tensor("NEIGHBOURS", [",".join(neighbours)]),
        pb_utils.Tensor("HIT_TRUST", trust_array(*trust).reshape(1, -1)),
    ]
    if seal:
        tensors.append(io.bytes_tensor("ANSWER_SEAL", [seal]))
    return tensors


def llm_exact(envelope: bytes, text: str, tokens: tuple[int, int, int] = (0, 0, 0)) -> list[Any]:
    """An exact hit as the ensemble hands it to llm: prompt_cache's envelope, text and token
    counts (EXACT_TEXT, EXACT_TOKENS, under the envelope's seal), with embedding_cache's
    pass-through for it (`EmbeddingCacheStage.exact_hit`: empty and unsealed)."""
    import triton_python_backend_utils as pb_utils

    from tiercache.triton import io

    return [
        io.bytes_tensor("ENVELOPE", [envelope]),
        io.bytes_tensor("EXACT_TEXT", [text]),
        pb_utils.Tensor("EXACT_TOKENS", np.array([tokens], dtype=np.int32)),
        io.bytes_tensor("CACHED_TEXT", [""]),
        io.bytes_tensor("LOOKUP_STATUS", [CacheStatus.EXACT.value]),
        io.scalar_tensor("SIMILARITY", 0.0, np.float32),
        pb_utils.Tensor("EMBEDDING", np.zeros((1, 0), np.float32)),
        pb_utils.Tensor("ANSWER_TOKENS", np.zeros((1, 3), dtype=np.int32)),
        io.bytes_tensor("NEIGHBOURS", [""]),
        pb_utils.Tensor("HIT_TRUST", trust_array(0.0, False).reshape(1, -1)),
        io.bytes_tensor("ANSWER_SEAL", [""]),
    ]


# ---- lora_cache's adapter tensors, as llm receives them -----------------------------------------


def lora_seal(
    sealer: Sealer, envelope: bytes, values: dict[str, Part], trtllm: bool = False
) -> str:
    """LORA_SEAL as lora_cache makes it over its adapter tensors `values` (by name; absent ones
    empty) for the envelope `envelope` (its boxes by their seal views)."""
    return seal_tensors(
        sealer, LORA_LABEL, lora_inputs(trtllm), seal_views(values), bound=seal_of(envelope)
    )


# The adapter files lora_cache encrypts (tiercache.stages.transport): bytes, and numpy arrays.
CLOSED_FILES = ("LORA_CONFIG", "LORA_WEIGHTS")
CLOSED_ARRAYS = ("LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG")


def closed_lora(
    cipher: AdapterCipher, bound: bytes | str, files: dict[str, Part]
) -> dict[str, Part]:
    """lora_cache's adapter tensors as it sends them: `files` (by name, in clear) with the
    adapter files closed for the answer `bound` (an envelope, whose seal it is, or an admin
    call's seal)."""
    seal = seal_of(bound) if isinstance(bound, bytes) else bound
    closed = dict(files)
    for name in CLOSED_FILES:
        if name in closed:
            value = closed[name]
            data = value.encode() if isinstance(value, str) else value
            assert data is None or isinstance(data, bytes), name
            closed[name] = cipher.close(name, data or b"", seal)
    for name in CLOSED_ARRAYS:
        if name in closed:
            array = closed[name]
            assert array is None or isinstance(array, np.ndarray), name
            closed[name] = cipher.close_array(name, array, seal)
    return closed


def opened_lora(
    cipher: AdapterCipher, bound: bytes | str, outputs: dict[str, Any]
) -> dict[str, Any]:
    """lora_cache's `outputs` (by name, as it sent them) with the adapter files opened (as llm
    opens them; Forbidden when one does not open for `bound`)."""
    seal = seal_of(bound) if isinstance(bound, bytes) else bound
    opened = dict(outputs)
    for name in CLOSED_FILES:
        if name in opened:
            opened[name] = cipher.open(name, opened[name], seal)
    for name in CLOSED_ARRAYS:
        if name in opened:
            opened[name] = cipher.open_array(name, opened[name], seal)
    return opened


def check_lora(
    sealer: Sealer, envelope: bytes, values: dict[str, Part], seal: str, trtllm: bool = False
) -> None:
    """Forbidden unless lora_cache's LORA_SEAL over `values` verifies, as llm checks it."""
    check_tensors(
        sealer,
        seal,
        LORA_LABEL,
        lora_inputs(trtllm),
        seal_views(values),
        bound=seal_of(envelope),
        what="lora_cache's adapter tensors",
    )


# ---- engine calls (llm, lora_cache -> torch_llm) ------------------------------------------------


def engine_inputs(sealer: Sealer, **values: str | bytes) -> list[Any]:
    """torch_llm's input tensors with ENGINE_SEAL, as llm and lora_cache send them."""
    from tiercache.stages.common import engine_inputs as inputs

    assert set(values) <= set(ENGINE_INPUTS), sorted(set(values) - set(ENGINE_INPUTS))
    return inputs(sealer, dict(values))


def engine_call(sealer: Sealer, request: Any) -> tuple[Any, GenerationRequest | None]:
    """What a fake engine behind BLS reads from a stage's call: its adapter order and request,
    once its ENGINE_SEAL and its envelope's seal verified (torch_llm's own check)."""
    from tiercache.stages.torch_llm import decode_call

    blobs: dict[str, bytes | None] = {}
    for tensor in request.inputs():
        (value,) = tensor.as_numpy().reshape(-1)
        blobs[tensor.name()] = value.encode() if isinstance(value, str) else bytes(value)
    return decode_call(sealer, Freshness(), blobs)


# ---- lora_cache's admin calls (llm, cache_admin -> lora_cache) ----------------------------------


def admin_inputs(sealer: Sealer, admin: str) -> list[Any]:
    """lora_cache's ADMIN with its ADMIN_SEAL, as llm and cache_admin send it."""
    from tiercache.stages.common import admin_inputs as inputs

    return inputs(sealer, admin)


def admin_seal(sealer: Sealer, admin: str) -> str:
    """The ADMIN_SEAL `admin_inputs` sends with `admin`."""
    (seal,) = [t for t in admin_inputs(sealer, admin) if t.name() == "ADMIN_SEAL"]
    return str(seal.as_numpy().reshape(-1)[0].decode())


def admin_call(sealer: Sealer, request: Any) -> str:
    """The ADMIN text a fake lora_cache behind BLS was sent, once its ADMIN_SEAL verified."""
    values = {t.name(): t.as_numpy().reshape(-1)[0].decode() for t in request.inputs()}
    admin = values["ADMIN"]
    sealer.check(values.get("ADMIN_SEAL"), ADMIN_LABEL, admin.encode(), what="ADMIN")
    return admin
