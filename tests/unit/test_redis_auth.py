"""Redis as an untrusted store, without a Redis (tiercache.exact.redis_tier, .invalidation,
tiercache.semantic.redis_rows): the signer and its binding to name, purpose and secret, the signed
invalidation records and semantic rows, the secret's fingerprint, and the Redis password from
the environment, redacted wherever a URL is shown. With a real redis-server:
tests/integration/test_redis_tier.py, test_invalidation_redis.py, test_redis_rows_auth.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiercache.errors import ConfigError
from tiercache.exact.codec import CacheEntry
from tiercache.exact.invalidation import signed_member, verified_member
from tiercache.exact.keys import (
    REDIS_INVALIDATIONS,
    REDIS_SEMANTIC_ROWS,
    REDIS_VALUES,
    derive_key,
    secret_fingerprint,
)
from tiercache.exact.redis_tier import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    SIGNED,
    RedisLink,
    Signer,
    redact_url,
    redis_password,
    url_has_password,
)
from tiercache.exact.watermarks import Invalidation
from tiercache.semantic.redis_rows import SharedRow, fields_verify, sign_fields
from tiercache.vocabulary import InvalidationKind

SECRET = b"s" * 32
NAME = "tiercache:e:0123"


def test_a_sealed_value_opens_only_under_its_name_purpose_and_secret() -> None:
    signer = Signer(SECRET, REDIS_VALUES)
    stored = signer.seal(NAME, b"codec bytes")
    assert stored.startswith(b"TCA1") and len(stored) == 4 + 32 + len(b"codec bytes")
    assert signer.unseal(NAME, stored) == b"codec bytes"
    assert signer.refused == 0
    refused = [
        signer.unseal("tiercache:e:4567", stored),  # copied under another key
        Signer(SECRET, REDIS_INVALIDATIONS).unseal(NAME, stored),  # made for another purpose
        Signer(b"t" * 32, REDIS_VALUES).unseal(NAME, stored),  # another fleet's secret
        signer.unseal(NAME, stored[:-1] + b"X"),  # the value altered
        signer.unseal(NAME, stored[:4] + bytes(32) + stored[36:]),  # the tag altered
        signer.unseal(NAME, b"TCE1" + stored[4:]),  # another magic (an older release's value)
        signer.unseal(NAME, stored[:20]),  # truncated
        signer.unseal(NAME, b""),
    ]
    assert refused == [None] * len(refused)
    assert signer.refused == 6  # the two other signers counted theirs


def test_parts_are_length_prefixed_so_a_boundary_cannot_move() -> None:
    signer = Signer(SECRET, REDIS_VALUES)
    assert signer.tag("ab", b"c") != signer.tag("a", b"bc")
    assert signer.tag("k", b"a", b"bc") != signer.tag("k", b"ab", b"c")
    assert len(signer.tag("k", b"")) == 32


def test_the_fingerprint_is_a_key_of_its_own_purpose() -> None:
    fingerprint = secret_fingerprint(SECRET)
    assert fingerprint == derive_key(SECRET, "fingerprint").hex() and len(fingerprint) == 64
    assert fingerprint != secret_fingerprint(b"t" * 32)
    assert all(bytes.fromhex(fingerprint) != derive_key(SECRET, p) for p in SIGNED)
    assert SECRET.hex() not in fingerprint


def test_links_of_one_fleet_verify_each_other_and_a_link_without_a_secret_trusts_nobody() -> None:
    fleet = [RedisLink.from_url("redis://127.0.0.1:1/0", secret=SECRET, environ={})]
    fleet.append(RedisLink.from_url("redis://127.0.0.1:1/0", secret=SECRET, environ={}))
    stranger = RedisLink.from_url("redis://127.0.0.1:1/0", environ={})  # a random secret
    stored = fleet[0].signer(REDIS_VALUES).seal(NAME, b"v")
    assert fleet[1].signer(REDIS_VALUES).unseal(NAME, stored) == b"v"
    assert stranger.signer(REDIS_VALUES).unseal(NAME, stored) is None
    assert fleet[1].signer(REDIS_VALUES) is fleet[1].signer(REDIS_VALUES)  # one per purpose
    assert stranger.health().forged == {REDIS_VALUES: 1}
    with pytest.raises(ValueError, match="unknown signing purpose"):
        stranger.signer("stage seal")
    for link in (*fleet, stranger):
        link.close()


def test_an_invalidation_record_verifies_only_as_written() -> None:
    signer = Signer(SECRET, REDIS_INVALIDATIONS)
    events = "tiercache:invalidated"
    inv = Invalidation(InvalidationKind.TAG, "kb:v1|x", 1_764_412_345.125)  # "|" in a value
    member = signed_member(signer, events, inv)
    assert verified_member(signer, events, member.encode()) == inv
    assert verified_member(signer, events, member) == inv
    tag, body = member.split("|", 1)
    altered = [
        f"{tag}|{body.replace('1764412345.125', '1764412345.0')}",  # an older at_s: resurrect
        f"{tag}|{body.replace('1764412345.125', '1864412345.125')}",  # a later one: wipe
        f"{tag}|{body.replace('tag:', 'tenant:')}",
        f"{tag}|{body.replace('kb:v1', 'kb:v2')}",
        inv.member(),  # an older release's member, unsigned
        "zz" * 32 + "|" + body,  # not hex
        "",
    ]
    for forged in altered:
        assert verified_member(signer, events, forged) is None, forged
    assert verified_member(signer, "other:invalidated", member) is None  # another set
    assert signer.refused == len(altered) + 1


def test_a_semantic_row_verifies_only_with_its_fields_and_stream() -> None:
    signer = Signer(SECRET, REDIS_SEMANTIC_ROWS)
    row = SharedRow.of_entry(
        "scope", "d1", "a prompt", np.ones(4, np.float32), "emb@1", CacheEntry("", 1.0), "host"
    )
    fields = sign_fields(signer, "tiercache:semantic", row.to_fields())
    read = {name.encode(): value for name, value in fields.items()}  # as XREAD returns them
    assert fields_verify(signer, "tiercache:semantic", read)
    assert SharedRow.from_fields(read).digest == "d1"
    assert not fields_verify(signer, "other:semantic", read)
    assert not fields_verify(signer, "tiercache:semantic", {**read, b"v": bytes(16)})
    assert not fields_verify(
        signer, "tiercache:semantic", {k: v for k, v in read.items() if k != b"t"}
    )
    assert signer.refused == 3


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        ("redis://:pa55@cache:6379/0", "redis://:***@cache:6379/0"),
        ("redis://app:pa55@cache:6379/0", "redis://app:***@cache:6379/0"),
        ("rediss://app:p%40ss:w@cache/0", "rediss://app:***@cache/0"),
        ("redis://cache/0?password=pa55&db=1", "redis://cache/0?password=***&db=1"),
        ("unix://:pa55@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
    ],
)
def test_a_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "pa55" not in redact_url(url) and "p%40ss" not in redact_url(url)
    assert url_has_password(url) == (shown != url)
    link = RedisLink.from_url(url, environ={})
    assert link.url == shown
    link.close()


@pytest.mark.parametrize("url", ["redis://u:pa#55@h:6379", "redis://u:pa/55@h:6379/0"])
def test_a_password_that_breaks_the_url_is_not_shown_in_pieces(url: str) -> None:
    """An unescaped "#" or "/" ends the host part before the "@": the URL came out whole."""
    assert "55" not in redact_url(url) and "6379" not in redact_url(url)


def test_the_password_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert redis_password({}) is None
    assert redis_password({PASSWORD_ENV: "pa55"}) == "pa55"
    named = tmp_path / "password"
    named.write_text("pa55\r\n")
    assert redis_password({PASSWORD_FILE_ENV: str(named)}) == "pa55"
    with pytest.raises(ConfigError, match="not both"):
        redis_password({PASSWORD_ENV: "pa55", PASSWORD_FILE_ENV: str(named)})
    with pytest.raises(ConfigError, match="cannot be read"):
        redis_password({PASSWORD_FILE_ENV: str(tmp_path / "missing")})
    named.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        redis_password({PASSWORD_FILE_ENV: str(named)})


def test_a_password_given_twice_is_refused_without_showing_it() -> None:
    with pytest.raises(ConfigError, match="given twice") as twice:
        RedisLink.from_url("redis://:pa55@cache:6379/0", environ={PASSWORD_ENV: "other"})
    assert "pa55" not in twice.value.message and "other" not in twice.value.message
    link = RedisLink.from_url("redis://cache:6379/0", environ={PASSWORD_ENV: "pa55"})
    assert link.client.connection_pool.connection_kwargs["password"] == "pa55"
    assert "pa55" not in link.url
    link.close()


def test_a_stream_entry_whose_id_is_not_a_redis_id_is_skipped() -> None:
    """A hostile store's id ("x") was kept as the follower's place and made `_id_tuple` raise
    at every start, killing the follower without releasing the host's lock."""
    from tiercache.semantic.redis_rows import _entries, _id_tuple

    reply = [[b"k", [(b"1-1", {b"m": b"1"}), (b"x", {b"m": b"2"}), (b"2-0", {b"m": b"3"})]]]
    assert [ident for ident, _ in _entries(reply, "k")] == ["1-1", "2-0"]
    assert _id_tuple("x") == (0, 0) and _id_tuple("17-3") == (17, 3)
