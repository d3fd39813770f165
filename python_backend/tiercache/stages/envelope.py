"""The inter-stage envelope: what prompt_cache decided about one request, handed to every later
stage and to the engine in one BYTES tensor (`ENVELOPE`), with one codec.

The envelope is not the cache key: the key's canonical form is `tiercache.exact.keys.key_fields`,
a subset of the request, hashed with the tenant scope, engine and adapter. The envelope carries
the whole canonical request plus the lookup's outcome (status, digest, whether the answer may be
written back, the semantic scope and whether to look it up) and the cache directives that are
not part of the key (tags, max-age).

Decoding treats its input as hostile: any stage (and the engine) can be called directly, so a
malformed, unknown-version or mistyped envelope is an InvalidRequest for that request alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tiercache.errors import InvalidRequest
from tiercache.exact.keys import Digest
from tiercache.exact.request import GenerationRequest
from tiercache.vocabulary import CacheStatus

ENVELOPE_VERSION = 1
ENVELOPE_TENSOR = "ENVELOPE"


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

    def encode(self) -> bytes:
        """Canonical JSON (sorted keys, UTF-8), versioned."""
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
            },
            "status": self.status.value,
            "digest": self.digest,
            "write_back": self.write_back,
            "semantic_scope": self.semantic_scope,
            "semantic_lookup": self.semantic_lookup,
            "cache_tags": list(self.cache_tags),
            "max_age_s": self.max_age_s,
        }
        text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return text.encode("utf-8")

    @classmethod
    def decode(cls, data: bytes | str) -> Envelope:
        """The envelope in `data`; InvalidRequest naming the first problem."""
        if not data:
            raise InvalidRequest(f"{ENVELOPE_TENSOR} is required")
        try:
            document = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"{ENVELOPE_TENSOR} is not JSON: {exc}") from None
        top = _Fields(document, ENVELOPE_TENSOR)
        version = top.integer("v")
        if version != ENVELOPE_VERSION:
            raise InvalidRequest(
                f"{ENVELOPE_TENSOR} version {version} is not supported (this stage speaks "
                f"version {ENVELOPE_VERSION}; are all stages of one release?)"
            )
        fields = _Fields(top.value("request", dict), f"{ENVELOPE_TENSOR}.request")
        request = GenerationRequest(
            prompt=fields.string("prompt"),
            max_tokens=fields.integer("max_tokens"),
            temperature=fields.number("temperature"),
            top_p=fields.number("top_p"),
            top_k=fields.integer("top_k"),
            seed=fields.integer("seed", optional=True),
            stop_words=fields.strings("stop_words"),
            stream=fields.boolean("stream"),
            lora_name=fields.string("lora_name"),
            lora_task_id=fields.integer("lora_task_id"),
            lora_digest=fields.string("lora_digest"),
            tenant_scope=fields.string("tenant_scope"),
        )
        status = top.string("status")
        try:
            lookup = CacheStatus(status)
        except ValueError:
            raise InvalidRequest(f"{ENVELOPE_TENSOR}.status {status!r} is unknown") from None
        digest = top.string("digest", optional=True)
        max_age_s = top.number("max_age_s", optional=True)
        return cls(
            request=request,
            status=lookup,
            digest=Digest(digest) if digest else None,
            write_back=top.boolean("write_back"),
            semantic_scope=top.string("semantic_scope"),
            semantic_lookup=top.boolean("semantic_lookup"),
            cache_tags=top.strings("cache_tags"),
            max_age_s=max_age_s,
        )


class ReceivedEnvelope:
    """An envelope as a stage received it, decoded on first use: a stage that only passes a
    hit on never pays for decoding it, and no stage decodes it twice."""

    __slots__ = ("data", "_envelope")

    def __init__(self, data: bytes | None) -> None:
        self.data = data
        self._envelope: Envelope | None = None

    def get(self) -> Envelope:
        """The envelope; InvalidRequest when it is missing or malformed."""
        if self._envelope is None:
            self._envelope = Envelope.decode(self.data or b"")
        return self._envelope


class _Fields:
    """Typed reads from one decoded JSON object; every problem is an InvalidRequest."""

    def __init__(self, document: Any, where: str) -> None:
        if not isinstance(document, dict):
            raise InvalidRequest(f"{where} must be a JSON object")
        self._document = document
        self._where = where

    def value(self, name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        if name not in self._document:
            raise InvalidRequest(f"{self._where} lacks {name!r}")
        value = self._document[name]
        if value is None and optional:
            return None
        # bool is an int in Python: a flag is never a number and a number never a flag.
        is_bool = isinstance(value, bool)
        wants_bool = kind is bool or (isinstance(kind, tuple) and bool in kind)
        if not isinstance(value, kind) or (is_bool and not wants_bool):
            raise InvalidRequest(f"{self._where}.{name} has the wrong type")
        return value

    def string(self, name: str, optional: bool = False) -> Any:
        return self.value(name, str, optional)

    def integer(self, name: str, optional: bool = False) -> Any:
        return self.value(name, int, optional)

    def boolean(self, name: str) -> bool:
        return bool(self.value(name, bool))

    def number(self, name: str, optional: bool = False) -> Any:
        value = self.value(name, (int, float), optional)
        if value is None:
            return None
        if not math.isfinite(value):
            raise InvalidRequest(f"{self._where}.{name} must be finite")
        return float(value)

    def strings(self, name: str) -> tuple[str, ...]:
        values = self.value(name, list)
        if not all(isinstance(v, str) for v in values):
            raise InvalidRequest(f"{self._where}.{name} must be a list of strings")
        return tuple(values)
