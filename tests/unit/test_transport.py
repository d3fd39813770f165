"""tiercache.stages.transport: the adapter files lora_cache sends llm, closed under the server
secret and bound to their tensor and their request."""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.stages.transport import (
    HEADER_BYTES,
    MAGIC,
    NONCE_BYTES,
    OVERHEAD,
    TAG_BYTES,
    AdapterCipher,
    seal_view,
    seal_views,
)

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


def test_a_kept_body_is_sent_again_under_a_fresh_wrapping() -> None:
    """With a body_key, a version's body is encrypted once and kept: a second box for another
    request carries the same body under another wrapping, and each opens only for its own
    request; bodies past max_body_bytes go least recently sent first."""
    weights = bytes(range(256)) * 4
    body = len(weights) + NONCE_BYTES + TAG_BYTES
    cipher = AdapterCipher.from_secret(SECRET, max_body_bytes=2 * body + body // 2)
    first = cipher.close("LORA_WEIGHTS", weights, BOUND, "v1")
    second = cipher.close("LORA_WEIGHTS", weights, "f" * 64, "v1")
    assert first[HEADER_BYTES:] == second[HEADER_BYTES:]  # the body: encrypted once
    assert first[:HEADER_BYTES] != second[:HEADER_BYTES]  # its data key wrapped per request
    assert cipher.open("LORA_WEIGHTS", first, BOUND) == weights
    assert cipher.open("LORA_WEIGHTS", second, "f" * 64) == weights
    with pytest.raises(Forbidden, match="does not open"):
        cipher.open("LORA_WEIGHTS", second, BOUND)
    # another tensor of the same version is another body
    config = cipher.close("LORA_CONFIG", weights, BOUND, "v1")
    assert config[HEADER_BYTES:] != first[HEADER_BYTES:]
    assert cipher.body_bytes == 2 * body
    cipher.close("LORA_WEIGHTS", weights, BOUND, "v2")  # a third body: v1's weights go first
    assert cipher.body_bytes == 2 * body
    again = cipher.close("LORA_WEIGHTS", weights, BOUND, "v1")
    assert again[HEADER_BYTES:] != first[HEADER_BYTES:]  # encrypted anew
    assert cipher.open("LORA_WEIGHTS", again, BOUND) == weights
    # without a bound nothing is kept, and without a key neither
    plain = AdapterCipher.from_secret(SECRET)
    assert (
        plain.close("LORA_WEIGHTS", weights, BOUND, "v1")[HEADER_BYTES:]
        != plain.close("LORA_WEIGHTS", weights, BOUND, "v1")[HEADER_BYTES:]
    )
    assert (
        cipher.close("LORA_WEIGHTS", b"x", BOUND)[HEADER_BYTES:]
        != cipher.close("LORA_WEIGHTS", b"x", BOUND)[HEADER_BYTES:]
    )
    assert plain.body_bytes == 0


def test_a_body_moved_altered_or_cut_does_not_open(cipher: AdapterCipher) -> None:
    """A seal covers a box's header and tag only (seal_view): every other change of the body
    is caught by opening it."""
    kept = AdapterCipher.from_secret(SECRET, max_body_bytes=1 << 20)
    one = kept.close("LORA_WEIGHTS", b"a" * 100, BOUND, "v1")
    two = kept.close("LORA_WEIGHTS", b"b" * 100, BOUND, "v2")
    middle = HEADER_BYTES + 10
    altered = [
        one[:HEADER_BYTES] + two[HEADER_BYTES:],  # another version's body under one's key
        one[:middle] + bytes([one[middle] ^ 1]) + one[middle + 1 :],  # a bit of the text
        one[:middle] + one[middle + 1 :],  # a byte cut
        one[:-TAG_BYTES] + b"\0" + one[-TAG_BYTES:],  # a byte added
    ]
    assert seal_view(altered[1]) == seal_view(one)  # what the seal cannot see ...
    for box in altered:
        with pytest.raises(Forbidden, match="does not open"):
            kept.open("LORA_WEIGHTS", box, BOUND)  # ... opening does
    assert seal_view(one) == one[:HEADER_BYTES] + one[-TAG_BYTES:]
    assert seal_view(b"no box") == b"no box" and seal_view(b"") == b""
    assert seal_views({"LORA_WEIGHTS": one, "LORA_EVICT": "[]"}) == {
        "LORA_WEIGHTS": seal_view(one),
        "LORA_EVICT": "[]",
    }


def test_the_kept_bodies_follow_their_budget_and_measure_what_more_would_save() -> None:
    """`resize` drops the least recently sent bodies at once down to the new bound; a body
    dropped, or too large to keep, and sent again is credited with its encryption's seconds
    in `shadow_reading` (what the memory controller values the budget by); a body kept and
    sent again credits nothing."""
    weights = bytes(range(256)) * 64
    body = len(weights) + NONCE_BYTES + TAG_BYTES
    cipher = AdapterCipher.from_secret(SECRET, max_body_bytes=2 * body)
    for version in ("v1", "v2"):
        cipher.close("LORA_WEIGHTS", weights, BOUND, version)
    assert cipher.body_bytes == 2 * body
    cipher.close("LORA_WEIGHTS", weights, BOUND, "v1")  # kept: no encryption, nothing credited
    assert cipher.shadow_reading()[0] == 0.0
    assert cipher.resize(body) == body
    assert cipher.body_bytes == body  # v2, sent least recently, went
    gained, span = cipher.shadow_reading()
    assert gained == 0.0 and span == body  # dropped, not yet asked for again
    first = cipher.close("LORA_WEIGHTS", weights, BOUND, "v2")  # asked again: encrypted anew
    gained, _ = cipher.shadow_reading()
    assert gained > 0.0
    assert cipher.open("LORA_WEIGHTS", first, BOUND) == weights
    assert cipher.resize(0) == 0 and cipher.body_bytes == 0
    cipher.close("LORA_WEIGHTS", weights, BOUND, "v3")  # too large to keep: shadowed
    again = cipher.close("LORA_WEIGHTS", weights, BOUND, "v3")
    assert cipher.shadow_reading()[0] > gained  # a bound of one body would have saved that
    assert cipher.body_bytes == 0 and cipher.open("LORA_WEIGHTS", again, BOUND) == weights
    for wrong in (-1, 2 * body + 1):  # not past the bound it was made with either
        with pytest.raises(ValueError, match="must be 0 to"):
            cipher.resize(wrong)
    # a body no budget could keep (past that bound) is never counted: the controller would
    # give this cache memory for nothing
    small = AdapterCipher.from_secret(SECRET, max_body_bytes=body // 2)
    for _ in range(3):
        small.close("LORA_WEIGHTS", weights, BOUND, "v9")
    assert small.shadow_reading() == (0.0, 0.0) and small.body_bytes == 0
