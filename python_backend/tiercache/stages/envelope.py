"""The inter-stage envelope: what prompt_cache decided about one request, handed to every later
stage and to the engine in one BYTES tensor (`ENVELOPE`), with one codec.

The envelope is not the cache key: the key's canonical form is `tiercache.exact.keys.key_fields`,
a subset of the request, hashed with the tenant scope, engine and adapter. The envelope carries
the whole canonical request plus the lookup's outcome (status, digest, whether the answer may be
written back, the semantic scope and whether to look it up) and the cache directives that are
not part of the key (tags, max-age).

Decoding treats its input as hostile: any stage (and the engine) can be called directly. On the
wire the envelope is its seal (tiercache.stages.seal, 64 hex characters, over the JSON and the
exact hit's text) followed by the JSON; `open` checks the seal before it parses anything, so an
unsealed or altered envelope is Forbidden, and a malformed, unknown-version or mistyped one is
an InvalidRequest, for that request alone.

A seal proves that this server's pipeline made an envelope, not that its caller may still send
it: a caller of prompt_cache holds its own requests' sealed envelopes and could replay them
into the later stages after its API key was revoked. So an envelope also carries when it was
issued and the hash of the API key that sent it, and a stage acts on it only while it is
recent and that key still allows it (`Freshness`, checked by `Envelope.open` after the seal).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tiercache.config import PARAMETERS
from tiercache.errors import Forbidden, InvalidRequest, Unavailable
from tiercache.exact.keys import Digest
from tiercache.exact.request import HISTORY_ROLES, GenerationRequest, Turn
from tiercache.exact.tenant_keys import KeyFile
from tiercache.stages.seal import ENVELOPE_LABEL, NO_TOKENS, SEAL_CHARS, Sealer, Tokens, hit_parts
from tiercache.vocabulary import REQUEST_DRAFT_SOURCES, CacheStatus

ENVELOPE_VERSION = 5
ENVELOPE_TENSOR = "ENVELOPE"
MAX_ENVELOPE_BYTES = 1 << 20  # an envelope is a few KiB; a larger one was not made by a stage
# An envelope's issue time is whole seconds rounded down to this step, so a repeated exact hit
# seals the same envelope for up to this long (prompt_cache's memo; llm's decoded hits are kept
# by it too) and the age check allows it. At 10 s, a hot set of 2,048 prompts served at 330
# requests/s came back every 6 s, and about 60 % of hits were a new step's, sealed and decoded
# anew; a minute adds at most 50 s to the 300 s replay window (envelope_max_age_s).
ISSUE_STEP_S = 60
DEFAULT_MAX_AGE_S: float = PARAMETERS["envelope_max_age_s"].default
FUTURE_SLACK_S = 60.0  # how far ahead of a stage's clock an issue time may be (a clock step)


def issued_now(clock: Callable[[], float] = time.time) -> int:
    """The issue time of an envelope made now: the host's clock in whole seconds, rounded down
    to ISSUE_STEP_S."""
    now = int(clock())
    return now - now % ISSUE_STEP_S


def check_envelope_size(data: bytes | None) -> None:
    """InvalidRequest for an ENVELOPE over MAX_ENVELOPE_BYTES: refused before any seal's HMAC
    reads it (a direct caller's megabytes would cost the stage's thread their hashing)."""
    if data is not None and len(data) > MAX_ENVELOPE_BYTES:
        raise InvalidRequest(f"{ENVELOPE_TENSOR}: {len(data)} bytes, over {MAX_ENVELOPE_BYTES}")


@dataclass(frozen=True, slots=True)
class Envelope:
    request: GenerationRequest
    status: CacheStatus = CacheStatus.BYPASS  # prompt_cache's lookup: exact, miss or bypass
    digest: Digest | None = None  # the exact key; None: not cacheable (never coalesced or stored)
    write_back: bool = False  # whether llm may store the answer
    semantic_scope: str = ""  # "" when semantic caching does not apply
    semantic_lookup: bool = False  # whether embedding_cache looks the request up
    cache_tags: tuple[str, ...] = ()  # cache_control tags the stored answer carries
    max_age_s: float | None = None  # the oldest cached answer this request accepts (None: any)
    # Where answers to the same prompt under any max_tokens or stop words are kept as drafts
    # for speculative decoding (tiercache.exact.keys; only greedy answers are kept there).
    draft_digest: str = ""
    # cache_control `verify-semantic`: llm has the engine verify a semantic hit before serving it
    verify_semantic: bool = False
    # prompt_cache's ttl_s: the oldest answer it serves, which llm's own reads of the tiers (the
    # re-check before generating, another replica's answer) keep to as well (0: no cap)
    serve_ttl_s: float = 0.0
    # SHA-256 of the API key that sent the request (tiercache.exact.tenant_keys; "" without a
    # key file, and in llm's engine calls, which no caller sees)
    key: str = ""
    # when it was made (`issued_now`): a stage refuses it once older than envelope_max_age_s
    issued_s: int = field(default_factory=issued_now)

    def seal(self, sealer: Sealer, cached_text: str = "", tokens: Tokens = NO_TOKENS) -> bytes:
        """The wire form: the seal over the JSON and `cached_text` (prompt_cache's exact hit's
        answer, "" otherwise) with its stored token counts, then the JSON."""
        payload = self.encode()
        parts = hit_parts(cached_text, tokens)
        return sealer.seal(ENVELOPE_LABEL, payload, *parts).encode() + payload

    @classmethod
    def open(
        cls,
        data: bytes | None,
        sealer: Sealer,
        freshness: Freshness,
        cached_text: str = "",
        tokens: Tokens = NO_TOKENS,
    ) -> Envelope:
        """The envelope in the wire form `data`, its seal checked against `cached_text` and
        `tokens` first, then `freshness`: Forbidden when unsealed, altered, too old or sent
        with a key that no longer allows it, InvalidRequest when malformed."""
        envelope = cls.decode(check_sealed(data, sealer, cached_text, tokens))
        freshness.check(envelope)
        return envelope

    def encode(self) -> bytes:
        """Compact JSON (sorted keys, UTF-8), versioned; unsealed (see `seal`)."""
        r = self.request
        document = {
            "v": ENVELOPE_VERSION,
            "request": {
                "prompt": r.prompt,
                "max_tokens": r.max_tokens,
                "temperature": r.temperature,
                "top_p": r.top_p,
                "top_k": r.top_k,
                "seed": r.seed,
                "stop_words": list(r.stop_words),
                "stream": r.stream,
                "lora_name": r.lora_name,
                "lora_task_id": r.lora_task_id,
                "lora_digest": r.lora_digest,
                "tenant_scope": r.tenant_scope,
                "history": [list(turn) for turn in r.history],
                "raw_prompt": r.raw_prompt,
                "speculate": r.speculate,
                "drafts": [list(draft) for draft in r.drafts],
                "index_answer": r.index_answer,
            },
            "status": self.status.value,
            "digest": self.digest,
            "write_back": self.write_back,
            "semantic_scope": self.semantic_scope,
            "semantic_lookup": self.semantic_lookup,
            "cache_tags": list(self.cache_tags),
            "max_age_s": self.max_age_s,
            "draft_digest": self.draft_digest,
            "verify_semantic": self.verify_semantic,
            "serve_ttl_s": self.serve_ttl_s,
            "key": self.key,
            "issued_s": self.issued_s,
        }
        # orjson (the hit path's JSON: about a tenth of json.dumps's time here); every value is
        # a str, bool, finite float, None or an int of at most 64 bits (seed: uint64), which it
        # writes as json.dumps would read them back
        return orjson.dumps(document, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def decode(cls, data: bytes | str) -> Envelope:
        """The envelope in the JSON `data` (unsealed: `open` checks the seal, then calls this);
        InvalidRequest naming the first problem."""
        if not data:
            raise InvalidRequest(f"{ENVELOPE_TENSOR} is required")
        try:
            # orjson: a number past a double's range, NaN or Infinity is not JSON to it, so
            # every float read here is finite (`_fields` relies on it)
            document = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"{ENVELOPE_TENSOR} is not JSON: {exc}") from None
        top = _object(document, ENVELOPE_TENSOR)
        version = _read(top, "v", int, ENVELOPE_TENSOR)
        if version != ENVELOPE_VERSION:
            raise InvalidRequest(
                f"{ENVELOPE_TENSOR} version {version} is not supported (this stage speaks "
                f"version {ENVELOPE_VERSION}; are all stages of one release?)"
            )
        where = f"{ENVELOPE_TENSOR}.request"
        fields = _object(_read(top, "request", dict, ENVELOPE_TENSOR), where)
        values = _fields(fields, _REQUEST_FIELDS, where)
        values[_HISTORY] = _history(values[_HISTORY], where)
        values[_DRAFTS] = _drafts(values[_DRAFTS], where)
        request = GenerationRequest(*values)
        (status, digest, *rest) = _fields(top, _ENVELOPE_FIELDS, ENVELOPE_TENSOR)
        try:
            lookup = CacheStatus(status)
        except ValueError:
            raise InvalidRequest(f"{ENVELOPE_TENSOR}.status {status!r} is unknown") from None
        return cls(request, lookup, Digest(digest) if digest else None, *rest)


class Freshness:
    """What a stage checks of an envelope past its seal before acting on it: that it was issued
    at most `max_age_s` ago (plus ISSUE_STEP_S) and not ahead of the clock, and, with the
    deployment's key file, that the API key that sent it is still there and still allows its
    adapter. Revoking a key thus ends its kept envelopes' replays within a second (the key
    file's reload check), and `max_age_s` bounds what a replay can do after anything else a
    request was checked against changed (an adapter taken out of the folder, a key's words).
    A stage without a key file (or whose envelopes no caller sees: torch_llm's engine calls)
    checks the age alone."""

    __slots__ = ("max_age_s", "keys", "_clock")

    def __init__(
        self,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        keys: KeyFile | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_age_s = max_age_s
        self.keys = keys
        self._clock = clock

    def check(self, envelope: Envelope) -> None:
        """Forbidden, naming why, unless `envelope` may still be acted on."""
        age_s = self._clock() - envelope.issued_s
        if age_s > self.max_age_s + ISSUE_STEP_S:
            raise Forbidden(
                f"{ENVELOPE_TENSOR} was issued {age_s:.0f} s ago, over the {self.max_age_s:g} s "
                "a request may take between stages (envelope_max_age_s): a replay, or a "
                "stalled stage"
            )
        if age_s < -FUTURE_SLACK_S:
            raise Forbidden(f"{ENVELOPE_TENSOR} is dated {-age_s:.0f} s ahead of this host's clock")
        if self.keys is None:
            if envelope.key:  # prompt_cache checked a key this stage cannot check again
                raise Unavailable(
                    "this stage runs without the API key file prompt_cache reads: give every "
                    "stage the same api_keys_file (or $TIERCACHE_API_KEYS_FILE, as tiercache "
                    "serve --api-keys sets it)"
                )
            return
        if not envelope.key:
            raise Forbidden(
                f"{ENVELOPE_TENSOR} names no API key, and this server requires one (stages "
                "started with different key files?)"
            )
        grant = self.keys.grant_of(envelope.key)
        if grant is None:
            raise Forbidden(
                "the API key that sent this request has been revoked (or the stages read "
                "different key files)"
            )
        lora_name = envelope.request.lora_name
        if lora_name and grant.adapters is not None and lora_name not in grant.adapters:
            raise Forbidden(f"the API key that sent this request may no longer use {lora_name!r}")


def check_sealed(
    data: bytes | None, sealer: Sealer, cached_text: str = "", tokens: Tokens = NO_TOKENS
) -> bytes:
    """The envelope's JSON in the wire form `data`, undecoded, once its seal verifies against
    `cached_text` and `tokens`: Forbidden when unsealed or altered, InvalidRequest when
    missing or over MAX_ENVELOPE_BYTES (before its HMAC reads it)."""
    if not data:
        raise InvalidRequest(f"{ENVELOPE_TENSOR} is required")
    check_envelope_size(data)
    payload = data[SEAL_CHARS:]
    parts = hit_parts(cached_text, tokens)
    sealer.check(seal_of(data), ENVELOPE_LABEL, payload, *parts, what=ENVELOPE_TENSOR)
    return payload


def seal_of(data: bytes | None) -> str:
    """The seal at the head of a wire envelope, unchecked ("" when there is none): later hops
    bind their own seals to it."""
    if not data or len(data) < SEAL_CHARS:
        return ""
    try:
        return data[:SEAL_CHARS].decode("ascii")
    except UnicodeDecodeError:
        return ""


class ReceivedEnvelope:
    """An envelope as a stage received it, checked and decoded on first use: a stage that only
    passes a hit on never pays for it, and no stage does it twice."""

    __slots__ = ("data", "_sealer", "_freshness", "_cached_text", "_tokens", "_envelope")

    def __init__(
        self,
        data: bytes | None,
        sealer: Sealer,
        freshness: Freshness,
        cached_text: str = "",
        tokens: Tokens = NO_TOKENS,
    ) -> None:
        self.data = data
        self._sealer = sealer
        self._freshness = freshness
        self._cached_text = cached_text
        self._tokens = tokens
        self._envelope: Envelope | None = None

    @property
    def seal(self) -> str:
        """The envelope's seal, unchecked (see `seal_of`)."""
        return seal_of(self.data)

    def get(self) -> Envelope:
        """The envelope, its seal and freshness checked when first read; Forbidden when
        unsealed, altered or not fresh, InvalidRequest when missing or malformed."""
        envelope = self._envelope
        if envelope is None:
            self._envelope = envelope = Envelope.open(
                self.data, self._sealer, self._freshness, self._cached_text, self._tokens
            )
        return envelope

    def fresh(self) -> Envelope:
        """`get`, its freshness checked again if it was read before: a stage that keeps a
        received envelope for later requests (llm's decoded hits) calls this once per
        request."""
        if self._envelope is None:
            return self.get()
        self._freshness.check(self._envelope)
        return self._envelope


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object")
    return value


def _history(value: list[Any], where: str) -> tuple[Turn, ...]:
    """The request's earlier turns: a list of [role, content] pairs of known roles."""
    turns: list[Turn] = []
    for turn in value:
        if (
            type(turn) is not list
            or len(turn) != 2
            or type(turn[0]) is not str
            or turn[0] not in HISTORY_ROLES
            or type(turn[1]) is not str
        ):
            raise InvalidRequest(f"{where}.history must be a list of [role, content] pairs")
        turns.append((turn[0], turn[1]))
    return tuple(turns)


MAX_REQUEST_DRAFTS = 8  # llm hands on at most 6: an answer, 4 neighbours, a semantic hit's


def _drafts(value: list[Any], where: str) -> tuple[tuple[str, str], ...]:
    """The engine call's drafts: a list of [source, text] pairs of the sources llm hands on,
    at most MAX_REQUEST_DRAFTS (each is compared with the answer at every decoding step)."""
    if len(value) > MAX_REQUEST_DRAFTS:
        raise InvalidRequest(f"{where}.drafts holds {len(value)}, at most {MAX_REQUEST_DRAFTS}")
    drafts: list[tuple[str, str]] = []
    for draft in value:
        if (
            type(draft) is not list
            or len(draft) != 2
            or draft[0] not in REQUEST_DRAFT_SOURCES
            or type(draft[1]) is not str
        ):
            raise InvalidRequest(f"{where}.drafts must be a list of [source, text] pairs")
        drafts.append((draft[0], draft[1]))
    return tuple(drafts)


# What decode reads, in the order of the fields it builds: (name, kind, optional), kinds as
# `_read` takes them. GenerationRequest's fields in order, then Envelope's past `request`.
_REQUEST_FIELDS: tuple[tuple[str, type, bool], ...] = (
    ("prompt", str, False),
    ("max_tokens", int, False),
    ("temperature", float, False),
    ("top_p", float, False),
    ("top_k", int, False),
    ("seed", int, True),
    ("stop_words", tuple, False),
    ("stream", bool, False),
    ("lora_name", str, False),
    ("lora_task_id", int, False),
    ("lora_digest", str, False),
    ("tenant_scope", str, False),
    ("history", list, False),  # then `_history`
    ("raw_prompt", bool, False),
    ("speculate", bool, False),
    ("drafts", list, False),  # then `_drafts`
    ("index_answer", bool, False),
)
_HISTORY = 12
_DRAFTS = 15
_ENVELOPE_FIELDS: tuple[tuple[str, type, bool], ...] = (
    ("status", str, False),  # then CacheStatus
    ("digest", str, True),  # then Digest, or None when empty
    ("write_back", bool, False),
    ("semantic_scope", str, False),
    ("semantic_lookup", bool, False),
    ("cache_tags", tuple, False),
    ("max_age_s", float, True),
    ("draft_digest", str, False),
    ("verify_semantic", bool, False),
    ("serve_ttl_s", float, False),
    ("key", str, False),
    ("issued_s", int, False),
)


def _fields(
    document: dict[str, Any], schema: tuple[tuple[str, type, bool], ...], where: str
) -> list[Any]:
    """The values of `schema`'s fields in `document`, in its order, each checked as `_read`
    checks it (which reads any that is not plainly of its kind, and names the problem). On
    the hit path of every stage: one pass, a value of exactly its kind taken as it is (a
    float is finite: orjson reads no other)."""
    values: list[Any] = []
    append = values.append
    get = document.get
    for name, kind, optional in schema:
        value = get(name, _ABSENT)
        if type(value) is kind:
            append(value)
        else:
            append(_read(document, name, kind, where, optional))
    return values


_ABSENT = object()


def _read(
    document: dict[str, Any], name: str, kind: type, where: str, optional: bool = False
) -> Any:
    """`document[name]` as `kind`; InvalidRequest naming the field. Exact type checks (JSON's
    true is never an integer here); a float also takes an integer and must be finite; a tuple
    is a JSON list of strings. On the hit path of every stage: kept to plain lookups."""
    try:
        value = document[name]
    except KeyError:
        raise InvalidRequest(f"{where} lacks {name!r}") from None
    if value is None and optional:
        return None
    actual = type(value)
    if kind is float and (actual is float or actual is int):
        if not math.isfinite(value):
            raise InvalidRequest(f"{where}.{name} must be finite")
        return float(value)
    if actual is kind:
        return value
    if kind is tuple and actual is list:
        if not all(type(v) is str for v in value):
            raise InvalidRequest(f"{where}.{name} must be a list of strings")
        return tuple(value)
    raise InvalidRequest(f"{where}.{name} has the wrong type")
