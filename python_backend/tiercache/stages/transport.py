"""Adapter transport: lora_cache encrypts the adapter files it hands llm, so that only stages
holding the server secret can read them.

Seals (tiercache.stages.seal) prove where an input came from, but they cannot keep a caller from
replaying its own sealed envelope (from a direct call of prompt_cache) into lora_cache, whose
response would then carry the adapter's files in clear: the adapter could be exported by anyone
allowed to use it. So every adapter file lora_cache sends (LORA_CONFIG, LORA_WEIGHTS, and
TensorRT-LLM's LORA_TRT_WEIGHTS / LORA_TRT_CONFIG), on the ensemble path and in its `weights`
admin answer, is AES-256-GCM ciphertext under `derive_key(secret, "adapter transport")`: a
random 96-bit nonce per tensor, the associated data binding the tensor's name and the request it
answers (the envelope's seal, or the admin call's). llm opens them before the engine call; a
caller that replays an envelope gets ciphertext it cannot open. AES-GCM comes from
`cryptography` (OpenSSL's), not hand-written: 0.5-1.4 ms per MiB each way on the 2-core CI
machine, paid on adapter loads only (when the engine holds the adapter the files are empty, and
empty stays empty).
"""

from __future__ import annotations

import io
import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact.keys import derive_key

TRANSPORT_PURPOSE = "adapter transport"
MAGIC = b"tcbox1"  # the format's version: a box from another format is refused, not misread
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = len(MAGIC) + NONCE_BYTES + TAG_BYTES


class AdapterCipher:
    """Opens and closes adapter tensors under one deployment's transport key."""

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("an adapter transport key has 32 bytes (AES-256)")
        self._aead = AESGCM(key)

    @classmethod
    def from_secret(cls, secret: bytes) -> AdapterCipher:
        return cls(derive_key(secret, TRANSPORT_PURPOSE))

    def close(self, name: str, data: bytes, bound: str) -> bytes:
        """`data` (the tensor `name` of the answer bound to the seal `bound`) as a box: MAGIC,
        nonce, ciphertext and tag. Empty stays empty: nothing to hide, and llm reads an empty
        tensor as "not sent"."""
        if not data:
            return b""
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, data, _associated(name, bound))

    def open(self, name: str, box: bytes | None, bound: str) -> bytes:
        """The bytes in `box`; b"" for an empty box. Forbidden when the box was not closed by
        this deployment for `name` and `bound` (altered, moved to another tensor or request,
        or another secret)."""
        if not box:
            return b""
        if len(box) < OVERHEAD or not box.startswith(MAGIC):
            raise Forbidden(
                f"{name} is not an adapter box of this deployment (lora_cache encrypts what "
                "it sends; stages with different secrets or versions?)"
            )
        nonce, sealed = box[len(MAGIC) : OVERHEAD - TAG_BYTES], box[OVERHEAD - TAG_BYTES :]
        try:
            return self._aead.decrypt(nonce, sealed, _associated(name, bound))
        except InvalidTag as exc:
            raise Forbidden(
                f"{name} does not open: altered on the way, taken from another request, or "
                "closed under another secret"
            ) from exc

    def close_array(self, name: str, array: np.ndarray | None, bound: str) -> bytes:
        """A numeric tensor (dtype and shape kept, numpy's .npy format without pickles) as a
        box; b"" for none or an empty array."""
        if array is None or array.size == 0:
            return b""
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
        return self.close(name, buffer.getvalue(), bound)

    def open_array(self, name: str, box: bytes | None, bound: str) -> np.ndarray | None:
        """The array in `box` (None for an empty box)."""
        data = self.open(name, box, bound)
        if not data:
            return None
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, EOFError, OSError) as exc:  # authentic: only another version sends this
            raise InvalidRequest(f"{name}: the box holds no array ({exc})") from exc


def _associated(name: str, bound: str) -> bytes:
    """What a box is bound to: its purpose, its tensor and the seal of the answer it is part
    of (length-prefixed, so no two pairs encode alike)."""
    n, b = name.encode("utf-8"), bound.encode("utf-8")
    return MAGIC + len(n).to_bytes(4, "big") + n + len(b).to_bytes(4, "big") + b
