"""Seals: how an internal stage knows that what it was handed came from this server's pipeline.

Every model of a Triton repository can be called directly, so the internal stages (and the
engine) cannot trust their inputs as such. The edge authenticates once and seals; every hop that
hands a later stage something it acts on seals that too, bound to the envelope's seal; every stage
that acts on an input checks its seal first and refuses (Forbidden) what is unsealed or altered:

  prompt_cache     seals ENVELOPE with CACHED_TEXT and CACHED_TOKENS   (label "envelope")
                   (an exact hit's, which llm also receives directly:
                   EXACT_TEXT, EXACT_TOKENS)
  embedding_cache  seals its answer (text, status, similarity, vector,
                   token counts), except an exact hit's empty
                   pass-through, which llm never reads                  ("answer")
  lora_cache       seals the adapter files and evictions it sends       ("lora")
  llm, lora_cache  seal every engine call (all of torch_llm's inputs)   ("engine")
  llm, cache_admin seal lora_cache's admin calls (ADMIN)                ("lora admin")

A seal is HMAC-SHA256 under `derive_key(secret, "stage seal")`, the server secret being the
host's secret file that only the stages (and the gateway's edge layer, which computes
prompt_cache's digests, tiercache.gateway.edge) read; over a label and length-prefixed parts, so
parts cannot be shifted from one field to the next and a seal made for one hop is never valid at
another. What a seal cannot stop: a caller of prompt_cache gets its own request's sealed envelope
and may replay it into the later stages, which then act exactly as they would for that request
through the ensemble (docs/security.md says what that exposes); this is why lora_cache encrypts
the adapter files it sends (tiercache.stages.transport).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact.keys import derive_key

SEAL_CHARS = 64  # hex of an HMAC-SHA256
# The hops' labels (the table above).
ENVELOPE_LABEL = "envelope"
ANSWER_LABEL = "answer"
LORA_LABEL = "lora"
ENGINE_LABEL = "engine"
ADMIN_LABEL = "lora admin"
EMBED_LABEL = "embed"  # each text embedding_cache sends the embedder (TEXT_SEAL, one per row)


class Sealer:
    """Seals and checks under one key (the deployment's, derived from its secret)."""

    __slots__ = ("_mac",)

    def __init__(self, key: bytes) -> None:
        if len(key) < 32:
            raise ValueError("a seal key has at least 32 bytes")
        self._mac = hmac.new(key, digestmod=hashlib.sha256)  # keyed once; copied per seal

    @classmethod
    def from_secret(cls, secret: bytes) -> Sealer:
        return cls(derive_key(secret, "stage seal"))

    def seal(self, label: str, *parts: bytes) -> str:
        """The hex seal of `parts` for the hop `label`. One message into a copy of the keyed
        context: the key's pads are hashed once, not per seal (a 700-byte seal in 1.5 us
        against 2.0 for the one-shot `hmac.digest`, 6.4 against 9.4 with cold caches)."""
        mac = self._mac.copy()
        mac.update(label.encode("ascii") + b"".join(struct.pack(">Q", len(p)) + p for p in parts))
        return mac.hexdigest()

    def check(self, seal: str | None, label: str, *parts: bytes, what: str) -> None:
        """Forbidden unless `seal` is the seal of `parts` for `label` (compared in constant
        time). `what` names the input in the error."""
        if not seal:
            raise Forbidden(
                f"{what} is not sealed: this stage is internal and takes requests from this "
                "server's pipeline only (call the ensemble)"
            )
        expected = self.seal(label, *parts).encode("ascii")
        if not hmac.compare_digest(seal.encode("utf-8", "replace"), expected):  # any text
            raise Forbidden(
                f"{what}'s seal does not verify: altered on the way, or not sealed by this "
                "deployment (stages with different secrets?)"
            )


def text_bytes(text: str | None) -> bytes:
    return (text or "").encode("utf-8")


Tokens = tuple[int, int, int]
"""A stored answer's token accounting (tiercache.exact.codec.CacheEntry): its generation's
prompt and completion token counts, and 1 when that generation stopped at `max_tokens` (its
finish reason `length`), else 0."""
NO_TOKENS: Tokens = (0, 0, 0)  # unknown (a warmed answer), or no hit


def hit_parts(text: str | None, tokens: Tokens = NO_TOKENS) -> tuple[bytes, ...]:
    """An exact hit's answer as the envelope's seal binds it: its text and, when known, the
    stored answer's token counts (nothing more when unknown, so such seals are as before)."""
    if tokens == NO_TOKENS:
        return (text_bytes(text),)
    return (text_bytes(text), struct.pack("<qqq", *tokens))


def tokens_array(tokens: Tokens) -> np.ndarray:
    """Token accounting as the INT32 [3] tensors CACHED_TOKENS and ANSWER_TOKENS carry it."""
    return np.array(tokens, dtype=np.int32)


def tokens_of(array: np.ndarray | None) -> Tokens:
    """The token accounting in a CACHED_TOKENS / ANSWER_TOKENS tensor; NO_TOKENS when it is
    absent or not three values (it is reported, never acted on)."""
    if array is None or array.size != 3:
        return NO_TOKENS
    flat = array.reshape(-1)
    return (max(int(flat[0]), 0), max(int(flat[1]), 0), int(int(flat[2]) == 1))


def float_bytes(value: float | None) -> bytes:
    """A float as the FP32 tensor carries it (both ends of a hop see the same bits)."""
    return b"" if value is None else struct.pack("<f", value)


def array_bytes(array: np.ndarray | None) -> bytes:
    """A numeric tensor's values (shape aside), little-endian; b"" when absent."""
    if array is None:
        return b""
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.astype(flat.dtype.newbyteorder("<"), copy=False).tobytes()


Part = str | bytes | np.ndarray | None

# What each hop's seal covers, by tensor name (an omitted tensor seals as empty).
ANSWER_TENSORS = (
    "ANSWER_TEXT",
    "ANSWER_STATUS",
    "SIMILARITY",
    "EMBEDDING",
    "ANSWER_TOKENS",
    "NEIGHBOURS",
    "HIT_TRUST",
)
ENGINE_INPUTS = ("LORA_OP", "LORA", "LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT", "ENVELOPE")
# lora_cache -> llm: the PEFT files (engine_kind torch_llm) or TensorRT-LLM's tensors (the
# TensorRT-LLM ensemble passes only those; deploy/tensorrt_llm).
PEFT_LORA_INPUTS = ("LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT")
TRT_LORA_INPUTS = ("LORA_TASK_ID", "LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG")


def lora_inputs(trtllm: bool) -> tuple[str, ...]:
    """The adapter tensors lora_cache seals and llm checks for an engine kind."""
    return TRT_LORA_INPUTS if trtllm else PEFT_LORA_INPUTS


def part_bytes(value: Part) -> bytes:
    """A tensor's value as a seal part: str as UTF-8, bytes as they are, arrays by their
    values; None as b"" (an omitted input reads as empty)."""
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return array_bytes(value)


def answer_tensors(
    text: str,
    status: str,
    similarity: float | None,
    vector: np.ndarray | None,
    tokens: np.ndarray | None = None,
    neighbours: str | None = None,
    trust: np.ndarray | None = None,
) -> dict[str, Part]:
    """embedding_cache's answer as its seal covers it (ANSWER_TENSORS): what embedding_cache
    sends and what llm reads (ANSWER_TEXT arrives as llm's CACHED_TEXT, ANSWER_STATUS as its
    LOOKUP_STATUS), the similarity as FP32, the vector's float32 values, a hit's token
    counts as INT32 (`tokens_array`), a miss's draft neighbours (`neighbours_text`) and a
    semantic hit's trust decision (`trust_array`)."""
    return {
        "ANSWER_TEXT": text,
        "ANSWER_STATUS": status,
        "SIMILARITY": float_bytes(similarity),
        "EMBEDDING": None if vector is None else vector.astype(np.float32, copy=False),
        "ANSWER_TOKENS": None if tokens is None else tokens.astype(np.int32, copy=False),
        "NEIGHBOURS": neighbours,
        "HIT_TRUST": None if trust is None else trust.astype(np.float32, copy=False),
    }


_NO_TRUST = np.zeros(0, dtype=np.float32)


def trust_array(score: float, verify: bool) -> np.ndarray:
    """The HIT_TRUST tensor's values: a semantic hit's calibrated score and 1.0 when the engine
    must verify it first (tiercache.semantic.entry_trust); empty when no trust gate decided
    (so a deployment whose ensemble does not pass the tensor seals the same bytes)."""
    if score == 0.0 and not verify:
        return _NO_TRUST
    return np.array([score, 1.0 if verify else 0.0], dtype=np.float32)


def trust_of(values: np.ndarray | None) -> tuple[float, bool]:
    """(score, verify) from a HIT_TRUST tensor (sealed by embedding_cache); InvalidRequest when
    it is not empty or a score in [0, 1] and a 0/1 flag."""
    if values is None or values.size == 0:
        return 0.0, False
    flat = values.reshape(-1)
    if flat.size != 2 or not 0.0 <= float(flat[0]) <= 1.0 or float(flat[1]) not in (0.0, 1.0):
        raise InvalidRequest("HIT_TRUST must be empty or [score in 0..1, 0|1]")
    return float(flat[0]), bool(flat[1])


# A miss's semantic neighbours whose answers llm reads as drafts (issue 17): at most this many.
MAX_NEIGHBOURS = 4
_DIGEST = re.compile(r"[0-9a-f]{64}")


def neighbours_text(digests: Sequence[str]) -> str:
    """The NEIGHBOURS tensor's text: the answer digests, comma-separated."""
    return ",".join(digests)


def neighbours_of(text: str | None) -> tuple[str, ...]:
    """The answer digests in a NEIGHBOURS tensor (sealed by embedding_cache); InvalidRequest
    when it is not up to MAX_NEIGHBOURS digests."""
    if not text:
        return ()
    digests = tuple(text.split(","))
    if len(digests) > MAX_NEIGHBOURS or not all(_DIGEST.fullmatch(d) for d in digests):
        raise InvalidRequest(f"NEIGHBOURS must be up to {MAX_NEIGHBOURS} answer digests")
    return digests


def tensor_parts(names: Iterable[str], values: dict[str, Part], bound: str = "") -> list[bytes]:
    """The tensors `names` (by name, absent ones empty) as seal parts, after `bound` (the
    envelope's seal, where the hop has one)."""
    parts = [bound.encode("ascii")]
    for name in names:
        parts += [name.encode("ascii"), part_bytes(values.get(name))]
    return parts


def seal_tensors(
    sealer: Sealer, label: str, names: Iterable[str], values: dict[str, Part], bound: str = ""
) -> str:
    return sealer.seal(label, *tensor_parts(names, values, bound))


def check_tensors(
    sealer: Sealer,
    seal: str | None,
    label: str,
    names: Iterable[str],
    values: dict[str, Part],
    *,
    bound: str = "",
    what: str,
) -> None:
    """Forbidden unless `seal` is `seal_tensors` of the same values."""
    sealer.check(seal, label, *tensor_parts(names, values, bound), what=what)
