"""The cache's admin operations (the `cache_admin` model's core): stats, invalidate, flush, warm.

The admin runs in its own process, over the host's tiers: L2 (LMDB on this host) and, with
`redis_url`, L3 (Redis) plus the invalidation channel. The L1 of each prompt_cache process is
not reachable from here:

- `stats` reports L2 and L3; L1's counters are prompt_cache's metrics.
- `invalidate` goes through `Invalidator`: the watermark goes into the host's invalidation log,
  which every process of the host notes before each read (prompt_cache's L1 copies are not
  served either), and the host's L2 is swept; with Redis it is also recorded and published, L3
  is swept, and every replica does the same.
- `flush` empties this host's L2 and the shared L3, and writes no watermark: L1 copies, and
  other replicas' L2, keep serving what they hold until it ages out. It gives space back; to
  stop serving something, invalidate it.

`warm` stores answers under exactly the digest prompt_cache computes: each prompt goes through
`PromptCache.lookup` (validation, canonicalization, tenant scope, adapter version, cache_control),
and the answer is stored as the llm stage stores a generated one (tags, scope, adapter).

Every operation needs the operator's admin token (`AdminGate`): 32 random bytes in a 0600 file,
`<state dir>/admin_token` unless `$TIERCACHE_ADMIN_TOKEN_FILE` names another, created once at the
first start. Whoever can read that file may administer the cache; nobody else can.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.admin_ops import parse_admin as parse_admin_ops
from tiercache.errors import (
    ConfigError,
    Forbidden,
    InvalidRequest,
    NotFound,
    TierCacheError,
    Unavailable,
)
from tiercache.exact.invalidation import Invalidator, checked_digest
from tiercache.exact.keys import SECRET_BYTES, load_or_create_secret, tenant_scope
from tiercache.exact.prompt_cache import PromptCache
from tiercache.exact.redis_tier import RedisLink
from tiercache.exact.request import RawInputs, canonical_tenant, checked_tag
from tiercache.exact.tiered import TieredCache
from tiercache.vocabulary import InvalidationKind, Tier

log = logging.getLogger("tiercache")

LoraAdmin = Callable[[dict[str, Any]], dict[str, Any]]
"""One call of lora_cache's internal admin ops (`{"op": "list"}`, `{"op": "warm", "names":
[...]}`) -> its answer (NotFound for an unknown adapter name). cache_admin makes it over BLS,
sealed (tiercache.stages.seal): lora_cache takes admin calls from the pipeline only, so the
operator's token guards them here."""

ADMIN_OPS: dict[str, frozenset[str]] = {
    "stats": frozenset({"op"}),
    "invalidate": frozenset({"op", "key", "tag", "tenant", "adapter", "sweep_shared"}),
    "flush": frozenset({"op", "confirm"}),
    "warm": frozenset({"op", "prompts", "adapters"}),
    "adapters": frozenset({"op", "warm"}),
}
_KINDS = ("key", "tag", "tenant", "adapter")
_DIGEST = re.compile(r"[0-9a-fA-F]{64}")  # an adapter content digest (hex SHA-256)
# A warmed prompt's keys: the ensemble's inputs (as prompt_cache reads them) plus the answer.
_STR_FIELDS = ("text_input", "tenant", "cache_control", "lora_name", "history")
_INT_FIELDS = ("max_tokens", "top_k", "seed")
_NUMBER_FIELDS = ("temperature", "top_p")
_PROMPT_FIELDS = frozenset(
    {*_STR_FIELDS, *_INT_FIELDS, *_NUMBER_FIELDS, "stop_words", "stream", "raw_prompt", "answer"}
)
L1_NOTE = (
    "L1 lives in each prompt_cache process and is not reachable from cache_admin: see "
    "prompt_cache's tiercache_store_* metrics"
)


ADMIN_TOKEN_FILE_ENV = "TIERCACHE_ADMIN_TOKEN_FILE"
ADMIN_TOKEN_FILE_NAME = "admin_token"


def admin_token_path(state_dir: Path, environ: Mapping[str, str] | None = None) -> Path:
    """Where the admin token is: `$TIERCACHE_ADMIN_TOKEN_FILE`, else `<state_dir>/admin_token`.
    One function for the stage, `tiercache serve` and the tests, so they name the same file."""
    named = (os.environ if environ is None else environ).get(ADMIN_TOKEN_FILE_ENV)
    return Path(named) if named else state_dir / ADMIN_TOKEN_FILE_NAME


def load_or_create_admin_token(path: Path) -> str:
    """The admin token: the bytes of the file at `path`, hex-encoded (the form ADMIN_TOKEN
    carries). A missing file is created once with 32 random bytes, 0600, race-free across
    processes: the server secret's own recipe (`tiercache.exact.keys.load_or_create_secret`), so
    the stage and `tiercache serve` starting side by side agree. An operator's own file serves as
    it is if it holds at least 32 bytes; ConfigError if it holds fewer."""
    try:
        token = load_or_create_secret(path).hex()
    except RuntimeError as exc:  # load_or_create_secret's "shorter than 32 bytes"
        raise ConfigError(
            f"admin token file {path} holds fewer than {SECRET_BYTES} bytes: delete it (a new "
            f"one is made) or put at least {SECRET_BYTES} random bytes in it"
        ) from exc
    if path.stat().st_mode & 0o077:
        log.warning(
            "admin token file %s is readable by other users: whoever reads it may flush, warm "
            "and invalidate the cache (chmod 600 it)",
            path,
        )
    return token


MAX_ADMIN_BYTES = 64 << 20  # one admin call's JSON (a warm call's prompts and answers)
MAX_WARM_PROMPTS = 1_000  # prompts of one warm call (the client sends a file in parts)
MAX_WARM_ADAPTERS = 64  # adapter names of one warm call
MAX_WARM_ANSWER_CHARS = 1 << 20  # a warmed answer's length (a generation's is far shorter)


@dataclass(frozen=True, slots=True)
class GateStats:
    """Admin calls let through and refused since start (monotonic totals)."""

    allowed: int
    refused_missing: int
    refused_wrong: int


class AdminGate:
    """Lets an admin call through only with the operator's token; refuses it with Forbidden
    before anything else happens (not even parsing), and counts it.

    The comparison is `hmac.compare_digest`, whose time does not depend on where a wrong token
    first differs, so a caller cannot find the token byte by byte from response times. A
    missing token and a wrong one get different messages: that tells an attacker nothing
    about the token and tells an operator which mistake they made."""

    def __init__(self, token: str) -> None:
        if len(token) < 2 * SECRET_BYTES:
            raise ValueError(f"an admin token has at least {2 * SECRET_BYTES} hex digits")
        self._expected = token.encode("ascii")
        self._lock = threading.Lock()
        self._allowed = 0
        self._missing = 0
        self._wrong = 0

    def check(self, given: str | None) -> None:
        """Return if `given` is the token; Forbidden otherwise."""
        if not given:
            with self._lock:
                self._missing += 1
            raise Forbidden(
                "cache_admin needs the operator's admin token in ADMIN_TOKEN (the hex of the "
                "admin_token file `tiercache serve` names at start; tiercache-client "
                "--admin-token-file reads it)"
            )
        if not hmac.compare_digest(given.encode("utf-8"), self._expected):
            with self._lock:
                self._wrong += 1
            raise Forbidden("ADMIN_TOKEN is not the operator's admin token")
        with self._lock:
            self._allowed += 1

    def stats(self) -> GateStats:
        with self._lock:
            return GateStats(self._allowed, self._missing, self._wrong)


@dataclass(frozen=True, slots=True)
class AdminAnswer:
    result: dict[str, Any]


def parse_admin(text: str) -> dict[str, Any]:
    """The ADMIN JSON object; InvalidRequest for bad JSON, an unknown op or unknown keys."""
    return parse_admin_ops(text, ADMIN_OPS)


def _finite(item: dict[str, Any], name: str) -> float | None:
    """`item[name]` (a number, checked) as a finite float; InvalidRequest for one that is not
    (an integer past float's range, which JSON allows)."""
    value = item.get(name)
    if value is None:
        return None
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be a finite number")
    return number


def raw_inputs(item: dict[str, Any]) -> RawInputs:
    """A warmed prompt's ensemble inputs, type-checked as the wire would (values are
    prompt_cache's to validate)."""
    unknown = set(item) - _PROMPT_FIELDS
    if unknown:
        raise InvalidRequest(f"unknown keys {sorted(unknown)}")
    for name in _STR_FIELDS:
        if name in item and not isinstance(item[name], str):
            raise InvalidRequest(f"{name} must be a string")
    for name in _INT_FIELDS:
        if name in item and (isinstance(item[name], bool) or not isinstance(item[name], int)):
            raise InvalidRequest(f"{name} must be an integer")
    for name in _NUMBER_FIELDS:
        value = item.get(name)
        if name in item and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise InvalidRequest(f"{name} must be a number")
    words = item.get("stop_words")
    if words is not None and (
        not isinstance(words, list) or not all(isinstance(w, str) for w in words)
    ):
        raise InvalidRequest("stop_words must be a list of strings")
    for name in ("stream", "raw_prompt"):
        if name in item and not isinstance(item[name], bool):
            raise InvalidRequest(f"{name} must be a boolean")
    temperature, top_p = _finite(item, "temperature"), _finite(item, "top_p")
    return RawInputs(
        text_input=item.get("text_input"),
        max_tokens=item.get("max_tokens"),
        stream=item.get("stream"),
        temperature=temperature,
        top_p=top_p,
        top_k=item.get("top_k"),
        seed=item.get("seed"),
        stop_words=words,
        tenant=item.get("tenant"),
        cache_control=item.get("cache_control"),
        lora_name=item.get("lora_name"),
        history=item.get("history"),
        raw_prompt=item.get("raw_prompt"),
    )


class Admin:
    """Admin operations over `cache` (L2 and optionally L3; no L1). `prompts` computes digests
    as prompt_cache does (it must share the cache, secret, engine identity, limits and adapter
    registry of the deployment); `lora_admin` reaches lora_cache (None: adapter operations are
    refused)."""

    def __init__(
        self,
        prompts: PromptCache,
        secret: bytes,
        lora_admin: LoraAdmin | None = None,
        link: RedisLink | None = None,
    ) -> None:
        """`link`: the cache's Redis link (invalidations reach every replica through it)."""
        self.prompts = prompts
        self.cache: TieredCache = prompts.cache
        self._secret = secret
        self.link = link
        self.invalidator = Invalidator(self.cache, self.link)
        self.lora_admin = lora_admin

    def run(self, text: str) -> AdminAnswer:
        """One ADMIN call. InvalidRequest for a malformed one, NotFound for an unknown adapter,
        Unavailable when Redis (or lora_cache) cannot be reached."""
        data = parse_admin(text)
        op = data["op"]
        if op == "stats":
            return AdminAnswer(self.stats())
        if op == "invalidate":
            return AdminAnswer(self.invalidate(data))
        if op == "flush":
            if data.get("confirm") is not True:
                raise InvalidRequest('flush deletes every entry of L2 and L3: send "confirm": true')
            return AdminAnswer(self.flush())
        if op == "adapters":
            return AdminAnswer(self.adapters(data.get("warm")))
        return AdminAnswer(self.warm(data.get("prompts"), data.get("adapters")))

    def stats(self) -> dict[str, Any]:
        tiers: dict[str, Any] = {"l1": {"reachable": False, "note": L1_NOTE}}
        for tier, store in self.cache.stores():
            s = store.stats()
            reachable = True  # this host's tiers answer or raise; Redis is asked
            if tier is Tier.L3 and self.link is not None:
                reachable = bool(self.link.call(lambda c: c.ping(), False))
            tiers[tier.value] = {
                "reachable": reachable,
                "entries": s.entries,
                "bytes": s.bytes,
                "max_bytes": s.max_bytes,
                "hits": s.hits,
                "misses": s.misses,
                "evictions": s.evictions,
                "corrupt": s.corrupt,
            }
        return {
            "op": "stats",
            "tiers": tiers,
            "redis": self.link is not None,
            "invalidations_seen": len(self.cache.invalidations),
        }

    def invalidate(self, data: dict[str, Any]) -> dict[str, Any]:
        given = [k for k in _KINDS if k in data]
        if len(given) != 1:
            raise InvalidRequest(f"invalidate needs exactly one of {', '.join(_KINDS)}")
        name = given[0]
        value = data[name]
        if not isinstance(value, str) or not value.strip():
            raise InvalidRequest(f"invalidate: {name} must be a non-empty string")
        sweep_shared = data.get("sweep_shared", True)
        if not isinstance(sweep_shared, bool):
            raise InvalidRequest("invalidate: sweep_shared must be a boolean")
        kind = InvalidationKind(name)
        if kind is InvalidationKind.TENANT:
            # checked and normalized as prompt_cache takes the tenant input (a lone surrogate,
            # an over-long name: the caller's error, not an internal one)
            value = tenant_scope(self._secret, canonical_tenant(value))
        elif kind is InvalidationKind.TAG:
            value = checked_tag(value.strip(), "invalidate: tag")  # else it could match nothing
        elif kind is InvalidationKind.ADAPTER:
            value = self._adapter_digest(value.strip())
        elif kind is InvalidationKind.KEY:
            value = checked_digest(value, "key")
        report = self.invalidator.invalidate(kind, value, sweep_shared=sweep_shared)
        inv = report.invalidation
        return {
            "op": "invalidate",
            "kind": inv.kind.value,
            "value": inv.value,
            "at_s": inv.at_s,
            "dropped_l2": report.dropped_local,
            "dropped_l3": report.dropped_shared,
            "published": report.published,
            "reaches": "every replica (L1, L2, L3)"
            if report.published
            else "this host only (no Redis: its processes through the host's invalidation log)",
        }

    def flush(self) -> dict[str, Any]:
        """Delete every entry of each tier; Unavailable, naming what was flushed before, when
        one cannot be (Redis down or failing part way: send it again)."""
        flushed: dict[str, int] = {}
        for tier, store in self.cache.stores():
            entries = store.stats().entries
            try:
                store.clear()
            except Unavailable as exc:
                done = ", ".join(f"{name} ({n} entries)" for name, n in flushed.items())
                raise Unavailable(
                    f"{tier.value} could not be flushed ({exc}); flushed before it: "
                    f"{done or 'nothing'}; send it again"
                ) from None
            flushed[tier.value] = entries
        note = (
            "prompt_cache's L1 and other replicas' L2 keep their copies; invalidate to stop serving"
        )
        return {"op": "flush", "flushed": flushed, "note": note}

    def _adapter_digest(self, value: str) -> str:
        """A content digest as given; anything else is an adapter name, resolved to the digest of
        its current version (NotFound when the registry does not know it)."""
        if _DIGEST.fullmatch(value):
            return value.lower()
        resolve = self.prompts.resolve_adapter
        if resolve is None:
            raise NotFound(f"unknown adapter {value!r}: no adapters are configured")
        return resolve(value).digest

    def warm(self, prompts: object, adapters: object) -> dict[str, Any]:
        """At most MAX_WARM_PROMPTS prompts and MAX_WARM_ADAPTERS adapters a call: the stage
        is one instance, and a call of a million stored on for minutes after its client gave
        up, every other admin call (an invalidation) waiting behind it (`tiercache-client
        warm` sends a larger file in parts)."""
        if prompts is None and adapters is None:
            raise InvalidRequest("warm needs prompts, adapters or both")
        if prompts is not None and not isinstance(prompts, list):
            raise InvalidRequest("warm: prompts must be a list of objects")
        if isinstance(prompts, list) and len(prompts) > MAX_WARM_PROMPTS:
            raise InvalidRequest(
                f"warm: {len(prompts)} prompts in one call, at most {MAX_WARM_PROMPTS} (send "
                "them in parts: tiercache-client warm does)"
            )
        if isinstance(adapters, list) and len(adapters) > MAX_WARM_ADAPTERS:
            raise InvalidRequest(
                f"warm: {len(adapters)} adapters in one call, at most {MAX_WARM_ADAPTERS}"
            )
        names: list[str] = []
        if adapters is not None:
            if not isinstance(adapters, list) or not all(
                isinstance(n, str) and n for n in adapters
            ):
                raise InvalidRequest("warm: adapters must be a list of adapter names")
            names = list(adapters)
        result: dict[str, Any] = {"op": "warm"}
        if names:
            result["adapters"] = self._lora({"op": "warm", "names": names})  # NotFound first
        if prompts is not None:
            items = [self.warm_prompt(item) for item in prompts]
            result["prompts"] = items
            result["stored"] = sum(1 for i in items if i["status"] == "stored")
            result["failed"] = len(items) - result["stored"]
        return result

    def adapters(self, warm: object = None) -> dict[str, Any]:
        """lora_cache's report of every adapter's tier (and the fleet's, with Redis); with
        `warm` (adapter names), those are first loaded into the engine."""
        if warm is None or warm == []:
            return self._lora({"op": "list"})
        if not isinstance(warm, list) or not all(isinstance(n, str) and n for n in warm):
            raise InvalidRequest("adapters: warm must be a list of adapter names")
        return self._lora({"op": "warm", "names": list(warm)})

    def _lora(self, op: dict[str, Any]) -> dict[str, Any]:
        if self.lora_admin is None:
            raise InvalidRequest("adapter operations are not available here (no lora_cache)")
        return self.lora_admin(op)

    def warm_prompt(self, item: object) -> dict[str, Any]:
        """Store one prompt's answer; reports `stored` with its digest, or `error` and why (a
        store that fails too: the prompts before and after it are still reported)."""
        try:
            if not isinstance(item, dict):
                raise InvalidRequest("each prompt must be a JSON object")
            answer = item.get("answer")
            if not isinstance(answer, str) or not answer:
                raise InvalidRequest("answer must be a non-empty string")
            if len(answer) > MAX_WARM_ANSWER_CHARS:  # no generation makes one this long
                raise InvalidRequest(
                    f"answer holds {len(answer)} characters, at most {MAX_WARM_ANSWER_CHARS}"
                )
            try:
                answer.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON allows a lone surrogate; UTF-8 does not
                raise InvalidRequest("answer is not valid Unicode (a lone surrogate?)") from exc
            # The digest through prompt_cache's own path, without reading the cache: an answer
            # already there is replaced.
            found = self.prompts.lookup(
                raw_inputs({k: v for k, v in item.items() if k != "answer"}), read=False
            )
            if found.digest is None:
                raise InvalidRequest("not cacheable (a sampled request without a seed)")
            if not found.write_back:
                raise InvalidRequest("cache_control no-store: never stored")
            request = found.request
            stored = self.cache.put(
                found.digest,
                answer,
                tags=found.cache_tags,
                tenant_scope=request.tenant_scope,
                adapter=request.lora_digest,
            )
            if stored is None:
                raise Unavailable("an invalidation issued this instant covers it: warm it again")
        except TierCacheError as exc:
            return {"status": "error", "error": exc.client_message()}
        except Exception as exc:  # noqa: BLE001 - this prompt's failure; the others still go
            # (a full disk, a damaged store): logged whole, reported by type only (no paths)
            log.exception("warming a prompt failed")
            return {"status": "error", "error": f"storing it failed: {type(exc).__name__}"}
        return {"status": "stored", "digest": found.digest}
