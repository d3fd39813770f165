"""tiercache.stages.transport: the adapter files lora_cache sends llm, closed under the server
secret and bound to their tensor and their request."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.stages.transport import MAGIC, OVERHEAD, AdapterCipher

SECRET = b"s" * 32
BOUND = "e" * 64  # an envelope's seal


@pytest.fixture
def cipher() -> AdapterCipher:
    return AdapterCipher.from_secret(SECRET)


def test_a_box_opens_to_its_bytes_and_hides_them(cipher: AdapterCipher) -> None:
    weights = bytes(range(256)) * 64
    box = cipher.close("LORA_WEIGHTS", weights, BOUND)
    assert box.startswith(MAGIC) and len(box) == len(weights) + OVERHEAD
    assert weights[:64] not in box
    assert cipher.open("LORA_WEIGHTS", box, BOUND) == weights
    # a fresh nonce per box: the same file twice gives two different boxes
    assert cipher.close("LORA_WEIGHTS", weights, BOUND) != box


def test_empty_stays_empty(cipher: AdapterCipher) -> None:
    assert cipher.close("LORA_CONFIG", b"", BOUND) == b""
    assert cipher.open("LORA_CONFIG", b"", BOUND) == b""
    assert cipher.open("LORA_CONFIG", None, BOUND) == b""
    assert cipher.close_array("LORA_TRT_WEIGHTS", None, BOUND) == b""
    assert cipher.close_array("LORA_TRT_WEIGHTS", np.zeros((1, 0), np.float16), BOUND) == b""
    assert cipher.open_array("LORA_TRT_WEIGHTS", b"", BOUND) is None


def test_a_box_opens_only_for_its_tensor_request_and_secret(cipher: AdapterCipher) -> None:
    box = cipher.close("LORA_CONFIG", b'{"r": 8}', BOUND)
    other_secret = AdapterCipher.from_secret(b"t" * 32)
    flipped = box[:-1] + bytes([box[-1] ^ 1])
    refused = [
        lambda: cipher.open("LORA_WEIGHTS", box, BOUND),  # moved to another tensor
        lambda: cipher.open("LORA_CONFIG", box, "f" * 64),  # moved to another request
        lambda: cipher.open("LORA_CONFIG", box, ""),  # taken off its request
        lambda: other_secret.open("LORA_CONFIG", box, BOUND),  # another deployment
        lambda: cipher.open("LORA_CONFIG", flipped, BOUND),  # altered
    ]
    for attempt in refused:
        with pytest.raises(Forbidden, match="LORA_.* does not open"):
            attempt()


def test_what_is_no_box_is_refused_not_misread(cipher: AdapterCipher) -> None:
    for data in (b'{"r": 8}', MAGIC + b"short", b"tcbox0" + b"\0" * 64):
        with pytest.raises(Forbidden, match="is not an adapter box"):
            cipher.open("LORA_CONFIG", data, BOUND)


def test_arrays_keep_their_dtype_and_shape(cipher: AdapterCipher) -> None:
    weights = np.arange(2 * 3 * 8, dtype=np.float16).reshape(1, 6, 8)
    config = np.array([[[1, 0, 2], [3, 0, 2]]], dtype=np.int32)
    for name, array in (("LORA_TRT_WEIGHTS", weights), ("LORA_TRT_CONFIG", config)):
        opened = cipher.open_array(name, cipher.close_array(name, array, BOUND), BOUND)
        assert opened is not None
        assert opened.dtype == array.dtype and opened.shape == array.shape
        assert np.array_equal(opened, array)


def test_an_authentic_box_that_holds_no_array_is_an_invalid_request(
    cipher: AdapterCipher,
) -> None:
    box = cipher.close("LORA_TRT_CONFIG", b"not an npy file", BOUND)
    with pytest.raises(InvalidRequest, match="holds no array"):
        cipher.open_array("LORA_TRT_CONFIG", box, BOUND)


def test_a_transport_key_has_32_bytes() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        AdapterCipher(b"short")
