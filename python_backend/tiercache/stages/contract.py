"""What the gateway's edge layer must agree on with the running stages before it serves a hit.

The edge layer (tiercache.gateway.edge) answers exact hits with prompt_cache's own lookup, built
from the stages' parameters in its own process. Built with another environment (no API key
file, another state folder's secret, another model file) or left running across a restart that
changed them, it would compute other tenants or other digests than the ensemble, and serve what
the ensemble refuses. So prompt_cache and llm each write, when they start, the settings that
decide whether and to whom an exact hit may be served (`<state>/edge/<stage>.json`):
prompt_cache its API key file, its secret's fingerprint, its engine identity and its limits;
llm its padding policy. The edge computes the same documents from its own configuration and
serves nothing while one differs or is missing: it fails closed, and every request then goes
to the ensemble.

The documents hold no secret: the secret appears as its one-way fingerprint
(`tiercache.exact.keys.secret_fingerprint`), trusted tenants as digests of their scopes. llm's
document also tells prompt_cache whom llm pads (`PaddedTenants`): those are not looked up at
the edge.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tiercache.errors import ConfigError
from tiercache.exact.keys import EngineIdentity, secret_fingerprint
from tiercache.exact.request import Limits
from tiercache.padding import PaddingPolicy

log = logging.getLogger(__name__)

CONTRACT_DIR = "edge"
PROMPT_CACHE = "prompt_cache"
LLM = "llm"
CHECK_INTERVAL_S = 1.0  # how often the edge re-reads the stages' documents (a stat each)


def contract_path(state_dir: Path, stage: str) -> Path:
    return state_dir / CONTRACT_DIR / f"{stage}.json"


def prompt_cache_terms(
    keys_file: Path | None,
    secret: bytes,
    engine: EngineIdentity,
    limits: Limits,
    deployment: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What prompt_cache decides a hit by: who the caller is (the key file, or none: the tenant
    input is trusted), the digest's key and engine, the limits a request must pass, and the
    tiers' own terms (`deployment_terms`)."""
    return {
        **caller_terms(keys_file, secret),
        "model": engine.model_id,
        "revision": engine.revision,
        "limits": {
            "max_prompt_chars": limits.max_prompt_chars,
            "max_tokens": limits.max_tokens,
            "max_stop_words": limits.max_stop_words,
        },
        "deployment": dict(deployment or {}),
    }


def deployment_terms(config: Any) -> dict[str, Any]:
    """What else decides which stored answers a hit may be (a prompt_cache-like config): how old
    an entry may be served (`ttl_s`, `redis_max_ttl_s`), which Redis it shares (URL without its
    password, and prefix: with another one, or none, the edge would hear other invalidations
    than the stages), and where adapters resolve from (another folder, other adapter digests).
    A stage restarted with other values makes the edge stop serving until it is built again."""
    redis = None
    if config.redis_url:
        parts = urlsplit(config.redis_url)
        netloc = f"{parts.hostname or ''}:{parts.port or ''}"
        redis = {"url": urlunsplit((parts.scheme, netloc, parts.path, "", "")),
                 "prefix": config.redis_prefix}  # fmt: skip
    return {
        "ttl_s": config.ttl_s,
        "redis_max_ttl_s": config.redis_max_ttl_s,
        "redis": redis,
        "adapters": str(config.adapters_path().resolve()),
        "adapters_manifest": config.adapters_manifest,
    }


def caller_terms(keys_file: Path | None, secret: bytes) -> dict[str, Any]:
    """Who a caller is and whose scopes it gets: the API key file (None: the tenant input is
    trusted) and the secret's fingerprint. The feedback model must agree on these with
    prompt_cache before it takes a verdict (CALLER_TERMS)."""
    return {
        "api_keys_file": None if keys_file is None else str(keys_file.resolve()),
        "secret": secret_fingerprint(secret),
    }


CALLER_TERMS = ("api_keys_file", "secret")


def llm_terms(padding: PaddingPolicy, kv_reuse_scope: str | None = None) -> dict[str, Any]:
    """What llm decides a hit's timing by: whether it pads, and whom it does not (each
    trusted scope as its SHA-256, which prompt_cache matches: `PaddedTenants`); and, with an
    engine reusing prefixes for one tenant (`trtllm_kv_reuse_tenant`), that tenant's scope as
    its SHA-256: llm refuses every other tenant, hits included, and so must the edge."""
    terms: dict[str, Any] = {"padding": None}
    if kv_reuse_scope is not None:
        terms["kv_reuse_tenant"] = _scope_hash(kv_reuse_scope)
    if not padding.enabled:
        return terms
    trusted = hashlib.sha256("\n".join(sorted(padding.trusted)).encode()).hexdigest()
    terms["padding"] = {
        "floor_s": padding.floor_s,
        "jitter_s": padding.jitter_s,
        "trusted": trusted,
        "trusted_hashes": sorted(_scope_hash(scope) for scope in padding.trusted),
    }
    return terms


def _scope_hash(scope: str) -> str:
    return hashlib.sha256(scope.encode("utf-8")).hexdigest()


class PaddedTenants:
    """Which tenant scopes llm pads, as llm published them (`<state>/edge/llm.json`), so that
    prompt_cache does not look their requests up: its answer would reach a caller who calls it
    directly, unpadded and unmasked (llm looks the answer up behind its padding instead).
    Re-read when the file changes (a stat at most every `interval_s`). Without the file (no
    llm has started on this state folder): nobody is padded, as before llm starts. A file that
    is there but cannot be read or is not llm's document, and a document without the hashes
    (an older release's), pad every tenant: failing closed. Thread-safe."""

    def __init__(
        self,
        state_dir: Path,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = contract_path(state_dir, LLM)
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._checked = -float("inf")
        self._stamp: tuple[int, int, int] | None = None
        self._policy: tuple[bool, frozenset[str]] = (False, frozenset())  # (pads, trusted)

    def pads(self, tenant_scope: str) -> bool:
        now = self._clock()
        if now - self._checked >= self._interval_s:
            with self._lock:
                if now - self._checked >= self._interval_s:
                    self._checked = now
                    self._reload()
        pads, trusted = self._policy  # one tuple: read whole, as it was written
        return pads and _scope_hash(tenant_scope) not in trusted

    def _reload(self) -> None:
        try:
            st = os.stat(self._path)
            stamp: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return
        self._stamp = stamp
        pads, trusted = False, frozenset[str]()
        if stamp is not None:
            try:
                document = json.loads(self._path.read_text())
                if not isinstance(document, dict) or "padding" not in document:
                    raise ValueError("not llm's terms")
                padding = document["padding"]
            except (OSError, ValueError) as exc:
                padding = {}  # unknown terms: every tenant deferred, as if all were padded
                log.warning(
                    "llm's published terms %s cannot be read (%s): prompt_cache defers every "
                    "tenant's lookup to llm until they can",
                    self._path,
                    exc,
                )
            if padding is not None:
                hashes = padding.get("trusted_hashes", []) if isinstance(padding, dict) else []
                pads = True
                trusted = frozenset(
                    h for h in (hashes if isinstance(hashes, list) else []) if isinstance(h, str)
                )
        if (pads, trusted) != self._policy:
            log.info(
                "prompt_cache %s lookups of padded tenants (%d trusted tenants)",
                "defers" if pads else "makes",
                len(trusted),
            )
        self._policy = (pads, trusted)


def write_terms(
    state_dir: Path, stage: str, terms: Mapping[str, Any], *, required: bool = False
) -> None:
    """Publish `stage`'s terms for the edge (atomically: a reader sees the old file or the
    new one). A failure is logged, not raised: the edge then stays closed, the stage serves;
    unless `required` (terms another stage relies on for safety, as prompt_cache does on whom
    llm pads), when it raises ConfigError and the stage does not start."""
    path = contract_path(state_dir, stage)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(terms, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        if required:
            raise ConfigError(
                f"could not publish {stage}'s terms in {path.parent} ({exc.strerror or exc}); "
                "other stages rely on them"
            ) from exc
        log.exception("could not publish %s's terms for the gateway's edge layer", stage)


class ContractCheck:
    """Whether the running stages' published terms are `expected` (stage -> the stage's state
    folder and the terms the gateway computed), re-read when a file changes, at most every
    `interval_s`. Thread-safe."""

    def __init__(
        self,
        expected: Mapping[str, tuple[Path, Mapping[str, Any]]],
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        compared: Collection[str] | None = None,
    ) -> None:
        """`compared`: the terms compared (None: all of each document)."""
        self._compared = None if compared is None else frozenset(compared)
        self._paths = {stage: contract_path(state, stage) for stage, (state, _) in expected.items()}
        # as JSON would give them back (tuples as lists, keys as strings)
        self._expected = {stage: json.loads(json.dumps(t)) for stage, (_, t) in expected.items()}
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_s = -float("inf")
        self._seen: dict[str, int | None] = {}
        self._holds = False
        self._reason = "not checked yet"

    @property
    def reason(self) -> str:
        """Why the contract does not hold ("" when it does)."""
        return self._reason

    def holds(self) -> bool:
        now = self._clock()
        if now - self._checked_s < self._interval_s:
            return self._holds
        with self._lock:
            if now - self._checked_s < self._interval_s:
                return self._holds
            self._checked_s = now
            seen = {stage: _mtime_ns(path) for stage, path in self._paths.items()}
            if seen != self._seen:
                self._seen = seen
                was = self._holds
                self._holds, self._reason = self._compare()
                if was != self._holds:
                    if self._holds:
                        log.info("the edge layer serves: the stages' terms match")
                    else:
                        log.warning("the edge layer is closed: %s", self._reason)
            return self._holds

    def _compare(self) -> tuple[bool, str]:
        for stage, path in self._paths.items():
            try:
                published = json.loads(path.read_text())
            except FileNotFoundError:
                return False, f"{stage} has published no terms ({path}): is it running?"
            except (OSError, ValueError) as exc:
                return False, f"{stage}'s terms ({path}) cannot be read: {exc}"
            if self._compared is not None and isinstance(published, dict):
                published = {k: v for k, v in published.items() if k in self._compared}
            if published != self._expected[stage]:
                differ = sorted(
                    k
                    for k in set(published) | set(self._expected[stage])
                    if published.get(k) != self._expected[stage].get(k)
                )
                return False, (
                    f"{stage} runs with other {', '.join(differ)} than this process's "
                    "configuration (start it in the stages' environment, and restart it with "
                    "them)"
                )
        return True, ""


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None
