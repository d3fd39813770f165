"""Canonical generation requests.

A request reaches the core as `RawInputs` (optional fields, as the client sent them) and leaves
`canonicalize` as a validated, normalized `GenerationRequest`. Two raw requests that must produce
the same answer canonicalize to equal `GenerationRequest`s: spacing and Unicode form of the prompt,
omitted versus explicit default parameters, float spelling, the order of stop words, and sampling
parameters that cannot change a greedy result are all normalized away.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tiercache.errors import InvalidRequest

DEFAULT_MAX_TOKENS = 128
DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
MAX_TEMPERATURE = 2.0


UTF8_MAX_BYTES_PER_CHAR = 4
ECHO_CHARS = 64  # an input echoed back in an error message is cut to this many characters
ECHO_WORDS = 8  # unknown cache_control words listed in an error message


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-deployment bounds on one request (stage parameters where one exists).

    Sizes are checked twice: on the raw input, in bytes, before it is decoded or normalized
    (NFKC can expand a character up to 18-fold, and decoding or normalizing an unbounded input
    is work an attacker chooses), and on the normalized text, in characters. The byte bounds
    that have no parameter of their own follow from the character bounds (UTF-8 takes at most
    4 bytes a character) or are fixed: tenant names, `cache_control` and adapter names are short.
    """

    max_prompt_chars: int = 16_384
    max_tokens: int = 1_024
    max_stop_words: int = 16
    max_stop_word_chars: int = 64
    max_tenant_chars: int = 256
    max_tenant_bytes: int = 256
    max_cache_control_bytes: int = 1_024
    max_lora_name_bytes: int = 256
    max_history_turns: int = 64
    max_history_chars: int = 65_536

    @property
    def max_prompt_bytes(self) -> int:
        """Raw UTF-8 bytes of `text_input`: enough for `max_prompt_chars` characters of any
        script before normalization."""
        return UTF8_MAX_BYTES_PER_CHAR * self.max_prompt_chars

    @property
    def max_stop_word_bytes(self) -> int:
        """Raw UTF-8 bytes of one stop word; with the count bound, all of them together take
        at most `max_stop_words` times this (4 KiB by default)."""
        return UTF8_MAX_BYTES_PER_CHAR * self.max_stop_word_chars

    @property
    def max_history_bytes(self) -> int:
        """Raw bytes of `history`'s JSON: its characters in any script plus, per turn, room for
        the JSON around them (keys, quotes, escapes)."""
        return UTF8_MAX_BYTES_PER_CHAR * self.max_history_chars + 64 * self.max_history_turns


DEFAULT_LIMITS = Limits()


def echo(value: str, limit: int = ECHO_CHARS) -> str:
    """`value` quoted for an error message, cut to `limit` characters (an ellipsis marks the
    cut): a client's input is never echoed back whole."""
    return repr(value if len(value) <= limit else value[:limit] + "\u2026")


def _echo_number(value: int) -> str:
    text = str(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "\u2026"


_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_.:/@+=-]{1,128}$")
MAX_TAGS = 16


@dataclass(frozen=True, slots=True)
class CacheControl:
    """The parsed `cache_control` input: comma- or space-separated words; the word names are
    case-insensitive, tag values are not.

    - `no-cache`: skip lookup (the answer is generated, and stored unless `no-store`).
    - `no-store`: do not write the answer back.
    - `allow-sampled`: cache a sampled request that has no seed (off by default: its answers vary).
    - `no-semantic`: exact lookup only; the answer is not added to the semantic index either.
    - `semantic-only`: skip the exact lookup and look up by meaning only.
    - `no-speculate`: decode a miss one token per step (no speculative decoding; the answer is
      the same either way, only its speed differs).
    - `verify-semantic`: a semantic hit's answer is served only once the engine has checked,
      in one forward pass over prompt plus answer, that it is exactly its own output (status
      `verified`); where it is not, decoding continues from the agreed prefix (a miss).
    - `max-age=<seconds>`: serve a cached answer only if it is at most that old (a finite
      number >= 0); an older one is a miss for this request and stays for others. The semantic
      lookup is skipped (it cannot tell an answer's age), so `semantic-only` is refused with it.
    - `tag=<name>` (repeatable, at most 16): labels stored with the answer (not part of the
      key), e.g. `tag=kb:v7`, so `tiercache.exact.invalidation` can drop every answer carrying it.
      Names are 1-128 characters of letters, digits and `_ . : / @ + = -`.
    """

    no_cache: bool = False
    no_store: bool = False
    allow_sampled: bool = False
    no_semantic: bool = False
    semantic_only: bool = False
    max_age_s: float | None = None
    tags: tuple[str, ...] = ()
    no_speculate: bool = False
    verify_semantic: bool = False

    WORDS = (
        "no-cache",
        "no-store",
        "allow-sampled",
        "no-semantic",
        "semantic-only",
        "no-speculate",
        "verify-semantic",
    )
    VALUED = ("max-age=<seconds>", "tag=<name>")

    @classmethod
    def parse(cls, text: str | None) -> CacheControl:
        if text is None:
            return cls()
        words: set[str] = set()
        unknown: set[str] = set()
        max_ages: list[float] = []
        tags: set[str] = set()
        for raw in text.replace(",", " ").split():
            name, has_value, value = raw.partition("=")
            name = name.lower()
            if not has_value:
                (words if name in cls.WORDS else unknown).add(name)
            elif name == "max-age":
                max_ages.append(_parse_max_age(value))
            elif name == "tag":
                tags.add(checked_tag(value, "cache_control tag"))
            else:
                unknown.add(raw)
        if unknown:
            listed = ", ".join(echo(word) for word in sorted(unknown)[:ECHO_WORDS])
            if len(unknown) > ECHO_WORDS:
                listed += f" and {len(unknown) - ECHO_WORDS} more"
            raise InvalidRequest(
                f"unknown cache_control word(s) {listed}; "
                f"known: {', '.join(cls.WORDS + cls.VALUED)}"
            )
        if len(set(max_ages)) > 1:
            raise InvalidRequest("cache_control has more than one max-age")
        if len(tags) > MAX_TAGS:
            raise InvalidRequest(f"cache_control has {len(tags)} tags, at most {MAX_TAGS}")
        max_age_s = max_ages[0] if max_ages else None
        if max_age_s is not None and "semantic-only" in words:
            raise InvalidRequest(
                "cache_control max-age cannot be combined with semantic-only (a semantic hit's "
                "age is not checked)"
            )
        return cls(
            no_cache="no-cache" in words,
            no_store="no-store" in words,
            allow_sampled="allow-sampled" in words,
            no_semantic="no-semantic" in words,
            semantic_only="semantic-only" in words,
            max_age_s=max_age_s,
            tags=tuple(sorted(tags)),
            no_speculate="no-speculate" in words,
            verify_semantic="verify-semantic" in words,
        )


def _parse_max_age(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequest(
            f"cache_control max-age must be a finite number of seconds >= 0, got {echo(value)}"
        )
    return seconds


@dataclass(frozen=True, slots=True)
class RawInputs:
    """Inputs as the client sent them; None means the client omitted the input. Text inputs may
    be the raw bytes (UTF-8) or already decoded: `canonicalize` bounds their size before it
    decodes or normalizes them either way."""

    text_input: str | bytes | None
    max_tokens: int | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_words: Sequence[str | bytes] | None = None
    tenant: str | bytes | None = None
    cache_control: str | bytes | None = None
    lora_name: str | bytes | None = None
    history: str | bytes | None = None  # JSON: the earlier turns, [{"role", "content"}, ...]
    raw_prompt: bool | None = None


HISTORY_ROLES = frozenset({"system", "user", "assistant"})
Turn = tuple[str, str]
"""One earlier turn of a conversation: (role, content), role one of HISTORY_ROLES."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated, canonical request: what the engine runs.

    Greedy requests (temperature 0) carry top_p=1, top_k=0 and seed=None whatever the client sent,
    because those parameters cannot change a greedy result. The exact-cache key covers a subset
    of it (`tiercache.exact.keys.key_fields`); the stages hand it on inside the inter-stage
    envelope (`tiercache.stages.envelope`), with what prompt_cache decided about it.
    """

    prompt: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    seed: int | None = None
    stop_words: tuple[str, ...] = field(default_factory=tuple)
    stream: bool = False
    lora_name: str = ""
    # The adapter version lora_name resolved to (set by prompt_cache; the digest enters the key
    # document itself, see tiercache.exact.keys). 0 / "" for the base model.
    lora_task_id: int = 0
    lora_digest: str = ""
    # The tenant scope (HMAC, tiercache.exact.keys.tenant_scope; set by prompt_cache) that the
    # engine's prefix KV blocks are keyed by, so KV is never shared across tenants. The scope
    # enters the cache key document itself.
    tenant_scope: str = ""
    # The conversation before `prompt` (the last user turn): the engine applies the chat
    # template once to [*history, user prompt]. Part of the key, and so of the semantic scope:
    # a reworded last turn hits only after the same earlier turns.
    history: tuple[Turn, ...] = ()
    # `prompt` is the model's input as it is (already rendered, or a plain completion): the
    # engine tokenizes it without the chat template. Never with `history`.
    raw_prompt: bool = False
    # Whether the engine may decode it speculatively (cache_control `no-speculate` turns it
    # off), and the texts it may draft from, as (source, text) pairs (cached answers in the
    # request's own scope, sources REQUEST_DRAFT_SOURCES, set by llm from the cache for the
    # engine call); not in the key: the answer is the same either way.
    speculate: bool = True
    drafts: tuple[tuple[str, str], ...] = ()
    # Whether the engine may keep the answer among its scope's draft sources (its answer
    # index); llm sets it false for a request whose answer is not stored (`no-store`).
    index_answer: bool = True

    def text_chars(self) -> int:
        """The characters of text it holds (prompt, history, stop words): what a memo entry
        holding it, or its raw inputs, counts for it (tiercache.exact.memo)."""
        history = sum(len(content) for _, content in self.history)
        return len(self.prompt) + history + sum(len(word) for word in self.stop_words)

    def pinned(self, tenant_scope: str, lora_task_id: int, lora_digest: str) -> GenerationRequest:
        """This request pinned to its tenant scope and adapter version (prompt_cache, once per
        request): `dataclasses.replace` of those three fields, built directly (a third of its
        time; tests/unit/test_request.py checks that the two agree)."""
        return GenerationRequest(
            self.prompt,
            self.max_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.stop_words,
            self.stream,
            self.lora_name,
            lora_task_id,
            lora_digest,
            tenant_scope,
            self.history,
            self.raw_prompt,
            self.speculate,
            self.drafts,
            self.index_answer,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def deterministic(self) -> bool:
        """True when the same request always yields the same text (greedy, or seeded sampling)."""
        return self.greedy or self.seed is not None


def normalize_text(text: str) -> str:
    """NFKC, then every run of Unicode whitespace becomes one space, trimmed at both ends."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


@functools.lru_cache(maxsize=4096)  # a few values per deployment (temperatures, top_p)
def canonical_float(value: float) -> float:
    """The shortest decimal that round-trips through float32, so FP32 0.7 and Python 0.7 agree;
    -0.0 is 0.0 (they compare and hash equal, so one must not key differently from the other)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="0")) + 0.0


def _check_float(name: str, value: float, low: float, high: float, low_open: bool = False) -> float:
    """`value` in canonical form, its range checked on that form (the FP32 value every caller's
    tensor carries: 1e-300 is 0.0 there, so it is out of (0, 1] for any caller)."""
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    value = canonical_float(value)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"{name} must be in {bracket}{low:g}, {high:g}], got {value:g}")
    return value


@dataclass(frozen=True, slots=True)
class Canonical:
    """What `canonicalize` returns: the request plus the per-call context that is not the key."""

    request: GenerationRequest
    tenant: str
    cache_control: CacheControl

    @property
    def cacheable(self) -> bool:
        return self.request.deterministic or self.cache_control.allow_sampled

    @property
    def semantic_eligible(self) -> bool:
        """Greedy, or sampled with a seed; not opted out. An unseeded sampled answer is one draw
        of many, so it never stands in for a reworded request (even with allow-sampled)."""
        return self.request.deterministic and not self.cache_control.no_semantic


def canonicalize(raw: RawInputs, limits: Limits = DEFAULT_LIMITS) -> Canonical:
    """Validate `raw` and build its canonical form; raises `InvalidRequest` naming the problem.

    Every text input's size is checked in bytes first, before it is decoded or normalized."""
    if raw.text_input is None:
        raise InvalidRequest("text_input is required")
    text = _bounded_text("text_input", raw.text_input, limits.max_prompt_bytes)
    raw_prompt = bool(raw.raw_prompt)
    # A raw prompt is the model's input: its spacing is part of it (a rendered template's
    # newlines), so only its Unicode form is normalized.
    prompt = unicodedata.normalize("NFKC", text) if raw_prompt else normalize_text(text)
    if not prompt.strip():
        raise InvalidRequest("text_input is empty")
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidRequest(
            f"text_input has {len(prompt)} characters, over the limit of {limits.max_prompt_chars}"
        )

    default_max_tokens = min(DEFAULT_MAX_TOKENS, limits.max_tokens)
    max_tokens = default_max_tokens if raw.max_tokens is None else int(raw.max_tokens)
    if max_tokens < 1 or max_tokens > limits.max_tokens:
        raise InvalidRequest(
            f"max_tokens must be in [1, {limits.max_tokens}], got {_echo_number(max_tokens)}"
        )

    temperature = DEFAULT_TEMPERATURE if raw.temperature is None else raw.temperature
    temperature = _check_float("temperature", temperature, 0.0, MAX_TEMPERATURE)
    top_p = DEFAULT_TOP_P if raw.top_p is None else raw.top_p
    top_p = _check_float("top_p", top_p, 0.0, 1.0, low_open=True)
    top_k = DEFAULT_TOP_K if raw.top_k is None else int(raw.top_k)
    if not 0 <= top_k < 2**31:  # the engines take it as int32 (a larger one wrapped around)
        raise InvalidRequest(
            f"top_k must be in [0, 2**31 - 1] (0 disables it), got {_echo_number(top_k)}"
        )
    seed = raw.seed
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidRequest(f"seed must fit in uint64, got {_echo_number(seed)}")

    stop_words = _canonical_stop_words(raw.stop_words, limits)
    history = _canonical_history(raw.history, limits)
    if history and raw_prompt:
        raise InvalidRequest(
            "history cannot be combined with raw_prompt (a raw prompt is the whole model input)"
        )

    tenant = canonical_tenant(raw.tenant, limits)
    lora_name = ""
    if raw.lora_name is not None:
        lora_name = _bounded_text("lora_name", raw.lora_name, limits.max_lora_name_bytes).strip()
    cache_control = None
    if raw.cache_control is not None:
        cache_control = _bounded_text(
            "cache_control", raw.cache_control, limits.max_cache_control_bytes
        )

    if temperature == 0.0:
        top_p, top_k, seed = DEFAULT_TOP_P, DEFAULT_TOP_K, None
    request = GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop_words=stop_words,
        stream=bool(raw.stream) if raw.stream is not None else False,
        lora_name=lora_name,
        history=history,
        raw_prompt=raw_prompt,
    )
    control = CacheControl.parse(cache_control)
    if control.no_speculate:
        request = dataclasses.replace(request, speculate=False)
    return Canonical(request, tenant, control)


def _utf8_size(name: str, value: str | bytes, max_bytes: int) -> int:
    """`value`'s size in UTF-8 bytes, or InvalidRequest when it is over `max_bytes` or is not
    encodable text (a lone surrogate, which JSON allows). A str of more characters than
    `max_bytes` is refused without encoding it."""
    if isinstance(value, bytes):
        size = len(value)
    elif len(value) > max_bytes:
        size = len(value)  # at least that many bytes
    else:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                f"{name} is not valid Unicode (a lone surrogate at character {exc.start})"
            ) from exc
    if size > max_bytes:
        raise InvalidRequest(f"{name} has {size} or more bytes, over the limit of {max_bytes}")
    return size


def _decode(name: str, value: str | bytes) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid UTF-8 (byte {exc.start})") from exc


def checked_tag(value: str, what: str = "tag") -> str:
    """`value` when it is a cache tag (1-128 characters of letters, digits and _ . : / @ + =
    -, what `cache_control: tag=` takes); InvalidRequest naming `what` otherwise."""
    if not _TAG_PATTERN.match(value):
        raise InvalidRequest(
            f"{what} {echo(value)} is not 1-128 characters of letters, digits and _ . : / @ + = -"
        )
    return value


def canonical_tenant(value: str | bytes | None, limits: Limits = DEFAULT_LIMITS) -> str:
    """The `tenant` input as every stage names the tenant by: its size checked before it is
    decoded, NFKC, stripped ("" when omitted); InvalidRequest past the limits."""
    tenant = ""
    if value is not None:
        tenant = unicodedata.normalize(
            "NFKC", _bounded_text("tenant", value, limits.max_tenant_bytes)
        ).strip()
    if len(tenant) > limits.max_tenant_chars:
        raise InvalidRequest(f"tenant is longer than {limits.max_tenant_chars} characters")
    return tenant


def _bounded_text(name: str, value: str | bytes, max_bytes: int) -> str:
    """`value` as text, its size checked before it is decoded."""
    _utf8_size(name, value, max_bytes)
    return _decode(name, value)


def _canonical_stop_words(words: Sequence[str | bytes] | None, limits: Limits) -> tuple[str, ...]:
    if not words:
        return ()
    # Count and sizes are checked on what the client sent (duplicates and empty words
    # included), before decoding and NFKC: together they bound the total bytes too.
    if len(words) > limits.max_stop_words:
        raise InvalidRequest(f"at most {limits.max_stop_words} stop_words, got {len(words)}")
    for word in words:
        _utf8_size("a stop word", word, limits.max_stop_word_bytes)
    # Stop words keep their whitespace ("\n" is a common one); only the Unicode form is normalized.
    normalized = {unicodedata.normalize("NFKC", _decode("stop_words", w)) for w in words}
    normalized.discard("")
    for word in normalized:
        if len(word) > limits.max_stop_word_chars:
            raise InvalidRequest(
                f"a stop word is longer than {limits.max_stop_word_chars} characters"
            )
    return tuple(sorted(normalized))


def _canonical_history(text: str | bytes | None, limits: Limits) -> tuple[Turn, ...]:
    """`history`'s JSON as canonical turns: each content normalized as a prompt is (an empty
    one is kept: an assistant turn may be empty), bounded in bytes before it is parsed and in
    turns and characters after."""
    if text is None:
        return ()
    decoded = _bounded_text("history", text, limits.max_history_bytes)
    if not decoded.strip():
        return ()
    try:
        turns = json.loads(decoded)
    except ValueError as exc:
        raise InvalidRequest(f"history is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("history is nested too deeply") from None
    if not isinstance(turns, list):
        raise InvalidRequest('history must be a JSON list of {"role", "content"} objects')
    if len(turns) > limits.max_history_turns:
        raise InvalidRequest(
            f"history has {len(turns)} turns, over the limit of {limits.max_history_turns}"
        )
    canonical: list[Turn] = []
    chars = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or set(turn) != {"role", "content"}:
            raise InvalidRequest(
                f'history[{i}] must be an object with exactly "role" and "content"'
            )
        role, content = turn["role"], turn["content"]
        if not isinstance(role, str) or role not in HISTORY_ROLES:
            raise InvalidRequest(
                f"history[{i}].role must be one of {', '.join(sorted(HISTORY_ROLES))}, "
                f"got {echo(str(role))}"
            )
        if not isinstance(content, str):
            raise InvalidRequest(f"history[{i}].content must be a string")
        # JSON's \u escapes can spell a lone surrogate, which no later step could encode.
        _utf8_size(f"history[{i}].content", content, limits.max_history_bytes)
        content = normalize_text(content)
        chars += len(content)
        canonical.append((role, content))
    if chars > limits.max_history_chars:
        raise InvalidRequest(
            f"history has {chars} characters, over the limit of {limits.max_history_chars}"
        )
    return tuple(canonical)
