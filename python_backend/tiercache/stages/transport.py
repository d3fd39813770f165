"""Adapter transport: lora_cache encrypts the adapter files it hands llm, so that only stages
holding the server secret can read them.

Seals (tiercache.stages.seal) prove where an input came from, but they cannot keep a caller from
replaying its own sealed envelope (from a direct call of prompt_cache) into lora_cache, whose
response would then carry the adapter's files in clear: the adapter could be exported by anyone
allowed to use it. So every adapter file lora_cache sends (LORA_CONFIG, LORA_WEIGHTS, and
TensorRT-LLM's LORA_TRT_WEIGHTS / LORA_TRT_CONFIG), on the ensemble path and in its `weights`
admin answer, is a box: AES-256-GCM throughout (from `cryptography`, OpenSSL's, not
hand-written), in two layers as a key service would do it:

- the body: the file encrypted under a data key of its own (random), its associated data
  the format and the tensor's name. lora_cache keeps the bodies of the adapter versions it
  sends (`body_key`: the version's digest; bounded by `max_body_bytes`, least recently used
  out), so an adapter sent again costs a copy, not an encryption of every byte (0.5-1.4 ms per
  MiB on the 2-core CI machine: 113 ms for 64 MiB, on lora_cache's one serving thread);
- the wrapping: the data key encrypted under `derive_key(secret, "adapter transport")`, a
  random 96-bit nonce per box, the associated data binding the tensor's name and the request
  it answers (the envelope's seal, or the admin call's).

llm opens them before the engine call; a caller that replays an envelope gets a box whose data
key it cannot unwrap. A body that is altered, cut or moved under another box's wrapping does
not open (its GCM tag is the data key's), so lora_cache's seal covers a box's header and tag
(`seal_view`), not every byte of the body again. Empty stays empty.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact.keys import derive_key
from tiercache.shadow import ShadowQueue, shadow_bytes

TRANSPORT_PURPOSE = "adapter transport"
MAGIC = b"tcbox2"  # the format's version: a box from another format is refused, not misread
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_BYTES = 32
WRAPPED_BYTES = KEY_BYTES + TAG_BYTES
HEADER_BYTES = len(MAGIC) + NONCE_BYTES + WRAPPED_BYTES + NONCE_BYTES  # then the body's text
OVERHEAD = HEADER_BYTES + TAG_BYTES


class AdapterCipher:
    """Opens and closes adapter tensors under one deployment's transport key; keeps the bodies
    of what it closed with a `body_key`, up to `max_body_bytes` (0: none kept), a budget the
    memory controller may move (`resize`, valued by `shadow_reading`: the encryptions a
    larger one would have saved)."""

    __slots__ = (
        "_aead",
        "_bodies",
        "_body_bytes",
        "_ceiling",
        "_lock",
        "_shadow",
        "max_body_bytes",
    )

    def __init__(self, key: bytes, max_body_bytes: int = 0) -> None:
        if len(key) != 32:
            raise ValueError("an adapter transport key has 32 bytes (AES-256)")
        self._aead = AESGCM(key)
        self.max_body_bytes = max_body_bytes
        self._ceiling = max_body_bytes  # what `resize` may give it at most: its fixed size
        # (name, body_key) -> (data key, nonce + ciphertext + tag, seconds its encryption
        # took), least recently sent first
        self._bodies: OrderedDict[tuple[str, str], tuple[bytes, bytes, float]] = OrderedDict()
        self._body_bytes = 0
        self._lock = threading.Lock()
        # the bodies dropped lately (tiercache.shadow: what a larger budget would save)
        self._shadow: ShadowQueue[tuple[str, str]] = ShadowQueue(shadow_bytes(self.max_body_bytes))

    @classmethod
    def from_secret(cls, secret: bytes, max_body_bytes: int = 0) -> AdapterCipher:
        return cls(derive_key(secret, TRANSPORT_PURPOSE), max_body_bytes)

    @property
    def body_bytes(self) -> int:
        """Bytes of the bodies kept."""
        return self._body_bytes

    def resize(self, max_bytes: int) -> int:
        """A new byte bound for the bodies kept (tiercache.budgets), at most the one it was
        made with: the least recently sent are dropped at once down to it; returns it. Only
        for a cipher that keeps bodies (`max_body_bytes` > 0 when made): 0 here keeps none for
        now, and the shadow still measures what they would save (a body larger than the
        cipher's own bound could be kept by no budget: it is never counted)."""
        if not 0 <= max_bytes <= self._ceiling:
            raise ValueError(
                f"the transport cache's budget must be 0 to {self._ceiling} bytes, got {max_bytes}"
            )
        with self._lock:
            self.max_body_bytes = max_bytes
            self._shadow.resize(shadow_bytes(self.max_body_bytes))
            self._trim()
            return max_bytes

    def shadow_reading(self) -> tuple[float, float]:
        """(encryption seconds the bodies dropped lately would have saved when sent again,
        cumulative; the bytes the shadow spans now): `ShadowValue`'s reading."""
        with self._lock:
            return self._shadow.gained_s, float(self._shadow.bytes)

    def _trim(self) -> None:
        while self._body_bytes > self.max_body_bytes and self._bodies:
            old_key, (_, old, spent_s) = self._bodies.popitem(last=False)
            self._body_bytes -= len(old)
            self._shadow.add(old_key, len(old), spent_s)

    def close(self, name: str, data: bytes, bound: str, body_key: str | None = None) -> bytes:
        """`data` (the tensor `name` of the answer bound to the seal `bound`) as a box: MAGIC,
        the wrapping's nonce, the wrapped data key, then the body (its nonce, the ciphertext
        and its tag). With `body_key` (what names `data`'s content: an adapter version's digest)
        the body is kept and sent again for the same key. Empty stays empty: nothing to hide,
        and llm reads an empty tensor as "not sent"."""
        if not data:
            return b""
        return self._wrap(name, bound, self._body(name, body_key, lambda: data))

    def _wrap(self, name: str, bound: str, body: tuple[bytes, bytes]) -> bytes:
        data_key, sealed = body
        nonce = os.urandom(NONCE_BYTES)
        wrapped = self._aead.encrypt(nonce, data_key, _associated(name, bound))
        return b"".join((MAGIC, nonce, wrapped, sealed))

    def _body(
        self, name: str, body_key: str | None, data: Callable[[], bytes]
    ) -> tuple[bytes, bytes]:
        key = None if body_key is None else (name, body_key)
        if key is not None:
            with self._lock:
                kept = self._bodies.get(key)
                if kept is not None:
                    self._bodies.move_to_end(key)
                    return kept[0], kept[1]
        started = time.perf_counter()
        data_key, nonce = AESGCM.generate_key(bit_length=KEY_BYTES * 8), os.urandom(NONCE_BYTES)
        sealed = nonce + AESGCM(data_key).encrypt(nonce, data(), _body_associated(name))
        spent_s = time.perf_counter() - started
        if key is not None:
            with self._lock:
                self._shadow.credit(key, spent_s)  # a larger budget would have kept it
                if len(sealed) > self.max_body_bytes:
                    if len(sealed) <= self._ceiling:  # a larger budget would keep it
                        self._shadow.add(key, len(sealed), spent_s)
                elif key not in self._bodies:
                    self._bodies[key] = (data_key, sealed, spent_s)
                    self._body_bytes += len(sealed)
                    self._trim()
        return data_key, sealed

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
        nonce_at, wrapped_at, body_at = len(MAGIC), len(MAGIC) + NONCE_BYTES, HEADER_BYTES
        try:
            data_key = self._aead.decrypt(
                box[nonce_at:wrapped_at],
                box[wrapped_at : body_at - NONCE_BYTES],
                _associated(name, bound),
            )
            return AESGCM(data_key).decrypt(
                box[body_at - NONCE_BYTES : body_at], box[body_at:], _body_associated(name)
            )
        except InvalidTag as exc:
            raise Forbidden(
                f"{name} does not open: altered on the way, taken from another request, or "
                "closed under another secret"
            ) from exc

    def close_array(
        self, name: str, array: np.ndarray | None, bound: str, body_key: str | None = None
    ) -> bytes:
        """A numeric tensor (dtype and shape kept, numpy's .npy format without pickles) as a
        box; b"" for none or an empty array. With `body_key`, as `close`: a kept body is sent
        again without the array being written out."""
        if array is None or array.size == 0:
            return b""

        def data() -> bytes:
            buffer = io.BytesIO()
            np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
            return buffer.getvalue()

        return self._wrap(name, bound, self._body(name, body_key, data))

    def open_array(self, name: str, box: bytes | None, bound: str) -> np.ndarray | None:
        """The array in `box` (None for an empty box)."""
        data = self.open(name, box, bound)
        if not data:
            return None
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, EOFError, OSError) as exc:  # authentic: only another version sends this
            raise InvalidRequest(f"{name}: the box holds no array ({exc})") from exc


CLOSED_TENSORS = ("LORA_CONFIG", "LORA_WEIGHTS", "LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG")


def seal_views(values: dict[str, Any]) -> dict[str, Any]:
    """A response's tensors as lora_cache's seal covers them: its boxes by `seal_view`."""
    return {
        name: seal_view(value) if name in CLOSED_TENSORS and isinstance(value, bytes) else value
        for name, value in values.items()
    }


def seal_view(box: bytes) -> bytes:
    """What a seal covers of a box: its header (the wrapped data key and the body's nonce) and
    the body's tag, which fixes the body's every byte under that data key; anything that is no
    box of this format, whole (it will not open anyway)."""
    if len(box) < OVERHEAD or not box.startswith(MAGIC):
        return box
    return box[:HEADER_BYTES] + box[-TAG_BYTES:]


def _associated(name: str, bound: str) -> bytes:
    """What a box is bound to: its purpose, its tensor and the seal of the answer it is part
    of (length-prefixed, so no two pairs encode alike)."""
    n, b = name.encode("utf-8"), bound.encode("utf-8")
    return MAGIC + len(n).to_bytes(4, "big") + n + len(b).to_bytes(4, "big") + b


def _body_associated(name: str) -> bytes:
    """What a body is bound to: the format and its tensor (the request is the wrapping's)."""
    n = name.encode("utf-8")
    return MAGIC + b"body" + len(n).to_bytes(4, "big") + n
