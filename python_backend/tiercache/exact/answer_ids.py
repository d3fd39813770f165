"""Answer ids: what a response names its answer by, so that the caller can give feedback on it.

Every response whose request has a digest carries an `answer_id`: which cache entry the answer
is (the request's own digest for an exact hit, a generation or a verified semantic hit; the
neighbour's for a semantic hit), how it was served, for a semantic hit the similarity it was
served at and the trust gate's score (tiercache.semantic.entry_trust; 0.0 without one), and
the adapter the request named (`adapter_tag`: a key limited to some adapters may give feedback
only on answers of those, or of the base model). The `feedback` model takes the id back
(tiercache.feedback).

The id is sealed, not merely signed: AES-256-GCM under `derive_key(secret, "answer ids")`, a
random 96-bit nonce per id, the tenant scope it was served to as associated data.

- A caller cannot forge one (the tag), so it can only give feedback on answers it was served.
- An id opens only under the tenant scope it was issued to: feedback must come from the same
  tenant (authenticated by its API key when a key file is configured), so an id that leaks to
  another tenant is useless there.
- It tells nothing: two responses with the same answer get unrelated ids, and a hit's id and a
  miss's have the same length, so a padded tenant (tiercache.padding) learns from it neither
  whether it was served from the cache nor which other request shared its answer.

`cryptography`'s AESGCM (OpenSSL), as for adapter transport (tiercache.stages.transport).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact.keys import derive_key

ANSWER_IDS_PURPOSE = "answer ids"
PREFIX = "a3."  # the format's version: an id of another format is refused, not misread
NONCE_BYTES = 12
NONCES_PER_BATCH = 256
ADAPTER_TAG_BYTES = 16
BASE_MODEL_TAG = bytes(ADAPTER_TAG_BYTES)  # a request without an adapter
# served as, digest, similarity, trust score, issued at (unix seconds), adapter tag
_BODY = struct.Struct(f">B32sffd{ADAPTER_TAG_BYTES}s")
_AAD = b"tiercache answer id\x00"
_URL_SAFE = bytes.maketrans(b"+/", b"-_")  # base64url, as base64.urlsafe_b64encode writes it
_KNOWN_PARTS = 4096  # answers whose digest bytes, tag and associated data are kept (`_parts_of`)


def _id_chars(prefix: str, body: struct.Struct) -> int:
    sealed = NONCE_BYTES + body.size + 16  # nonce, ciphertext, GCM tag
    return len(prefix) + len(base64.urlsafe_b64encode(bytes(sealed)).rstrip(b"="))


ID_CHARS = _id_chars(PREFIX, _BODY)
"""Every id's length (characters): the same for every answer."""
# Earlier formats, still opened (ids already handed out): before the adapter tag (its tag reads
# None: unknown), and before the trust score too (its score reads 0.0)
_V2_PREFIX, _V2_BODY = "a2.", struct.Struct(">B32sffd")
_V2_CHARS = _id_chars(_V2_PREFIX, _V2_BODY)
_V1_PREFIX, _V1_BODY = "a1.", struct.Struct(">B32sfd")
_V1_CHARS = _id_chars(_V1_PREFIX, _V1_BODY)


@functools.lru_cache(maxsize=1024)
def adapter_tag(lora_name: str) -> bytes:
    """What an answer id names its request's adapter by (sealed inside the id): the first 16
    bytes of the SHA-256 of the adapter's name; BASE_MODEL_TAG without one."""
    if not lora_name:
        return BASE_MODEL_TAG
    return hashlib.sha256(b"tiercache adapter\x00" + lora_name.encode("utf-8")).digest()[
        :ADAPTER_TAG_BYTES
    ]


class ServedAs(int, Enum):
    # the request's own entry, in ids issued before its answer was made (a generation's id
    # until 2026-12-07, and an exact hit's before CACHED): only opened, no longer issued
    OWN = 0
    SEMANTIC = 1  # a neighbour's entry, served as a semantic hit
    # the request's own entry, made before the id was issued: an exact hit's, and since
    # 2026-12-07 a generation's (issued with its final response), so an entry made clearly
    # after the id is another answer (tiercache.feedback)
    CACHED = 2

    @property
    def kind(self) -> str:
        """What reports and metrics call it: an exact hit is "own", as a generation is (the id
        is sealed, and nothing a caller reads from it tells a hit from a miss)."""
        return "semantic" if self is ServedAs.SEMANTIC else "own"


@dataclass(frozen=True, slots=True)
class AnswerRef:
    """What an answer id names."""

    digest: str  # the cache entry's digest (hex SHA-256)
    served: ServedAs
    similarity: float = 0.0  # a semantic hit's (the neighbour's cosine); 0.0 otherwise
    issued_s: float = 0.0  # when the answer was served (unix seconds)
    score: float = 0.0  # a semantic hit's calibrated score, when a trust gate decided it
    # the request's adapter (`adapter_tag`); None in an id issued before ids named it
    adapter: bytes | None = None

    def adapter_allowed(self, adapters: frozenset[str] | None) -> bool:
        """Whether a key that may use `adapters` (None: any) may judge this answer: one of
        the base model, or of an adapter among them. An id that does not name its adapter
        passes only a key without an adapter limit."""
        if adapters is None:
            return True
        if self.adapter is None:
            return False
        return self.adapter == BASE_MODEL_TAG or any(
            adapter_tag(name) == self.adapter for name in adapters
        )


class Nonces:
    """Random 96-bit nonces drawn from the OS's CSPRNG (`random_bytes`, os.urandom) NONCES_PER_BATCH
    at a time: one `getrandom` system call per batch instead of one per response, and no other
    system call per nonce. Each nonce is handed out once: a child forked by Python (os.fork, and
    multiprocessing's fork) starts a batch of its own, because `_after_fork_in_child` resets
    every live instance there, with a new lock in case another thread held the old one at the
    fork. A process forked without Python's fork hooks must not issue ids. Thread-safe. Also
    the gateway's response ids (random, not secret, drawn the same way for the same cost)."""

    __slots__ = ("__weakref__", "_random_bytes", "_lock", "_batch", "_next")

    def __init__(self, random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        self._random_bytes = random_bytes
        self._reset()
        _LIVE_NONCES.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._batch, self._next = b"", 0

    def take(self) -> bytes:
        with self._lock:
            if self._next >= len(self._batch):
                self._batch, self._next = self._random_bytes(NONCE_BYTES * NONCES_PER_BATCH), 0
            start = self._next
            self._next = start + NONCE_BYTES
            return self._batch[start : start + NONCE_BYTES]


_LIVE_NONCES: weakref.WeakSet[Nonces] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for nonces in list(_LIVE_NONCES):
        nonces._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


class AnswerIds:
    """Issues and opens answer ids under one deployment's secret. Thread-safe."""

    __slots__ = ("_aead", "_nonces", "_parts")

    def __init__(self, secret: bytes, random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        """`random_bytes(n)`: n bytes from a CSPRNG, for the ids' nonces."""
        self._aead = AESGCM(derive_key(secret, ANSWER_IDS_PURPOSE))
        self._nonces = Nonces(random_bytes)
        # (digest, tenant scope, adapter) -> what every id of that answer there seals alike:
        # the digest's bytes, the adapter tag and the associated data (an exact hit's id is
        # issued again on every repeat; a fresh nonce makes each id new all the same)
        self._parts: dict[tuple[str, str, str], tuple[bytes, bytes, bytes]] = {}

    def issue(self, ref: AnswerRef, tenant_scope: str, lora_name: str = "") -> str:
        """The id of the answer `ref` names, served to `tenant_scope` for a request that named
        adapter `lora_name` ("": the base model) (issued now unless `ref` says when)."""
        parts = self._parts_of(ref.digest, tenant_scope, lora_name)
        return self._seal(parts, ref.served, ref.similarity, ref.score, ref.issued_s)

    def issue_digest(
        self, digest: str, served: ServedAs, tenant_scope: str, lora_name: str = ""
    ) -> str:
        """`issue(AnswerRef(digest, served), tenant_scope, lora_name)`, issued now, without
        building the ref (an exact hit's id: its request's own digest)."""
        return self._seal(self._parts_of(digest, tenant_scope, lora_name), served, 0.0, 0.0, 0.0)

    def _parts_of(
        self, digest: str, tenant_scope: str, lora_name: str
    ) -> tuple[bytes, bytes, bytes]:
        key = (digest, tenant_scope, lora_name)
        parts = self._parts.get(key)
        if parts is not None:
            return parts
        try:
            raw = bytes.fromhex(digest)
        except ValueError as exc:
            raise ValueError(f"an answer's digest is hex, got {digest!r}") from exc
        if len(raw) != 32:
            raise ValueError(f"an answer's digest is 32 bytes, got {len(raw)}")
        parts = (raw, adapter_tag(lora_name), _AAD + tenant_scope.encode("utf-8"))
        if len(self._parts) >= _KNOWN_PARTS:
            self._parts = {}  # a new dict: other threads may be reading this one
        self._parts[key] = parts
        return parts

    def _seal(
        self,
        parts: tuple[bytes, bytes, bytes],
        served: ServedAs,
        similarity: float,
        score: float,
        issued_s: float,
    ) -> str:
        digest, tag, aad = parts
        body = _BODY.pack(served, digest, similarity, score, issued_s or time.time(), tag)
        nonce = self._nonces.take()
        sealed = nonce + self._aead.encrypt(nonce, body, aad)
        encoded = binascii.b2a_base64(sealed, newline=False).translate(_URL_SAFE)
        return PREFIX + encoded.rstrip(b"=").decode("ascii")

    def open(self, answer_id: str, tenant_scope: str) -> AnswerRef:
        """What `answer_id` names. InvalidRequest when it is not an answer id at all;
        Forbidden when it was not issued by this deployment or not to `tenant_scope` (the
        two cannot be told apart, by design)."""
        text = answer_id.strip()
        if text.startswith(PREFIX) and len(text) == ID_CHARS:
            body_format = _BODY
        elif text.startswith(_V2_PREFIX) and len(text) == _V2_CHARS:
            body_format = _V2_BODY
        elif text.startswith(_V1_PREFIX) and len(text) == _V1_CHARS:
            body_format = _V1_BODY
        else:
            raise InvalidRequest(
                f"answer_id is not an answer id (ids start {PREFIX!r} and have {ID_CHARS} "
                "characters: copy the answer_id of the response)"
            )
        encoded = text[len(PREFIX) :]
        try:
            sealed = base64.b64decode(
                encoded + "=" * (-len(encoded) % 4), altchars=b"-_", validate=True
            )
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest("answer_id is not an answer id (not base64url)") from exc
        if base64.urlsafe_b64encode(sealed).rstrip(b"=").decode("ascii") != encoded:
            # the last character's unused bits set: one id, one spelling
            raise InvalidRequest("answer_id is not an answer id (not canonical base64url)")
        if len(sealed) != NONCE_BYTES + body_format.size + 16:
            raise InvalidRequest("answer_id is not an answer id (wrong length)")
        nonce, box = sealed[:NONCE_BYTES], sealed[NONCE_BYTES:]
        try:
            body = self._aead.decrypt(nonce, box, _AAD + tenant_scope.encode("utf-8"))
        except InvalidTag as exc:
            raise Forbidden(
                "answer_id was not issued to this tenant by this deployment (another tenant's, "
                "altered, or from before a secret rotation)"
            ) from exc
        adapter: bytes | None = None
        if body_format is _V1_BODY:
            served, digest, similarity, issued_s = _V1_BODY.unpack(body)
            score = 0.0
        elif body_format is _V2_BODY:
            served, digest, similarity, score, issued_s = _V2_BODY.unpack(body)
        else:
            served, digest, similarity, score, issued_s, adapter = _BODY.unpack(body)
        try:
            served_as = ServedAs(served)
        except ValueError as exc:  # sealed by us, so only a newer release's kind
            raise InvalidRequest(f"answer_id: unknown kind {served}") from exc
        return AnswerRef(
            digest.hex(), served_as, float(similarity), float(issued_s), float(score), adapter
        )
