"""API keys -> tenants: who may read and write which tenant's cache.

Without a key file the `tenant` input is trusted as sent: anyone who can reach the server can
name any tenant (docs/security.md). With one, prompt_cache takes the tenant from the caller's
key: the key reaches it as a request parameter (Triton forwards the gRPC/HTTP `authorization`
header into the request's parameters when started with `--grpc-header-forward-pattern`, as
`tiercache serve` does), a request without a known key is refused, and a `tenant` input that
disagrees with the key's tenant is refused. Each key may also be limited to some adapters and
some `cache_control` words.

The file (JSON, 0600, written by `tiercache keys add`) stores keys hashed: SHA-256 of the key,
which is 32 random bytes, so a plain hash is as hard to invert as the key is to guess (no
password stretching needed). It is re-read when it changes (checked at most once a second), so
keys are added and revoked without a restart.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.errors import ConfigError, Forbidden, InvalidRequest
from tiercache.exact.keys import read_trusted_file
from tiercache.exact.request import CacheControl, canonical_tenant
from tiercache.log_throttle import LogThrottle

log = logging.getLogger(__name__)

KEYS_VERSION = 1
KEY_PREFIX = "tc_"
AUTH_PARAMETER = "authorization"  # the forwarded header's name (gRPC metadata is lowercase)
CACHE_CONTROL_NAMES = (*CacheControl.WORDS, "max-age", "tag")
RELOAD_CHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class TenantGrant:
    """What one key allows: its tenant, and the adapters and cache_control words it may use
    (None: any)."""

    key_id: str
    tenant: str
    adapters: frozenset[str] | None = None
    cache_control: frozenset[str] | None = None
    # the key's SHA-256 as the file stores it: what an envelope names the key by (a stage
    # checks a kept envelope's key is still there: tiercache.stages.envelope.Freshness)
    key_hash: str = ""

    def check(self, tenant_input: str | None, lora_name: str, control: CacheControl) -> None:
        """Forbidden when the request names another tenant, an adapter or a cache_control
        word this key does not allow. `tenant_input` is the normalized `tenant` input (None:
        omitted)."""
        if tenant_input is not None and tenant_input != self.tenant:
            raise Forbidden("the tenant input does not match the API key's tenant")
        if lora_name and self.adapters is not None and lora_name not in self.adapters:
            raise Forbidden(f"this API key may not use adapter {lora_name!r}")
        if self.cache_control is not None:
            refused = sorted(set(used_words(control)) - self.cache_control)
            if refused:
                raise Forbidden(f"this API key may not use cache_control {', '.join(refused)}")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.key_id,
            "tenant": self.tenant,
            "adapters": None if self.adapters is None else sorted(self.adapters),
            "cache_control": None if self.cache_control is None else sorted(self.cache_control),
        }


def used_words(control: CacheControl) -> tuple[str, ...]:
    """The cache_control word names a parsed request used (`max-age` and `tag` by name)."""
    flags = {
        "no-cache": control.no_cache,
        "no-store": control.no_store,
        "allow-sampled": control.allow_sampled,
        "no-semantic": control.no_semantic,
        "semantic-only": control.semantic_only,
        "no-speculate": control.no_speculate,
        "verify-semantic": control.verify_semantic,
        "max-age": control.max_age_s is not None,
        "tag": bool(control.tags),
    }
    return tuple(name for name, used in flags.items() if used)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_from_parameter(value: object) -> str | None:
    """The key in a forwarded `authorization` value ("Bearer <key>" or the bare key)."""
    if not isinstance(value, str) or not value.strip():
        return None
    scheme, _, rest = value.strip().partition(" ")
    return rest.strip() if scheme.lower() == "bearer" and rest else value.strip()


class KeyFile:
    """The grants of one key file, reloaded when the file changes. Thread-safe."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[str, TenantGrant] = {}
        self._signature: tuple[int, int, int, int] | None = None
        self._reload()  # a missing or malformed file fails the stage's start (ConfigError)
        self._checked_s = clock()

    def authorize(self, key: str | None) -> TenantGrant:
        """The grant of `key`; Forbidden when it is missing or unknown."""
        if not key:
            raise Forbidden(
                "an API key is required (send it in the authorization header: Bearer <key>)"
            )
        self._maybe_reload()
        grant = self._grants.get(hash_key(key))
        if grant is None:
            raise Forbidden("unknown API key")
        return grant

    def grant_of(self, key_hash: str) -> TenantGrant | None:
        """The grant of the key whose SHA-256 is `key_hash` (None: not, or no longer, in the
        file)."""
        self._maybe_reload()
        return self._grants.get(key_hash)

    def grants(self) -> list[TenantGrant]:
        """The grants read last."""
        with self._lock:
            return list(self._grants.values())

    def _maybe_reload(self) -> None:
        now = self._clock()
        with self._lock:
            if now - self._checked_s < RELOAD_CHECK_S:
                return
            self._checked_s = now
        try:
            self._reload()
        except ConfigError as exc:
            # Failing closed: a file removed or broken to revoke a key must not leave every
            # key read before in force. Every key is refused until the file reads again.
            with self._lock:
                self._grants = {}
            _log_reload_failure(self.path, exc)

    def _reload(self) -> None:
        """Read the file when its signature changed. ConfigError when it cannot be read or
        parsed; the signature of a file that failed is kept, so it is read again only once
        it changes (and its failure is reported once)."""
        try:
            stat = self.path.stat()
        except OSError as exc:
            with self._lock:
                known, self._signature = self._signature == _MISSING, _MISSING
            if known:
                raise _Unchanged from None
            raise ConfigError(f"API key file {self.path} cannot be read: {exc}") from exc
        # ctime too: chmod and chown move it alone (a file made unreadable to the stages by
        # an edit as another user, then given back, must be read again)
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        with self._lock:
            if signature == self._signature:
                return
            self._signature = signature
        try:
            grants = {entry_hash: grant for entry_hash, grant in _read(self.path)}
        except _Unreadable:
            with self._lock:  # not kept: read again at the next check, whatever changed
                if self._signature == signature:
                    self._signature = None
            raise
        with self._lock:
            if self._signature == signature:
                self._grants = grants


_MISSING = (-1, -1, -1, -1)  # the signature of a file that could not be found (stat failed)


class _Unreadable(ConfigError):
    """The file is there but could not be read (permissions, too many open files): not a
    verdict on its contents, so it is tried again at the next check."""


class _Unchanged(ConfigError):
    """The file is still missing, as at the last check: nothing new to report."""

    def __init__(self) -> None:
        super().__init__("unchanged")


_UNREADABLE_LOG = LogThrottle()  # an unreadable file is tried again at every check


def _log_reload_failure(path: Path, exc: ConfigError) -> None:
    if isinstance(exc, _Unchanged):
        return
    if isinstance(exc, _Unreadable) and not _UNREADABLE_LOG.ready():
        return
    log.error(
        "API key file %s cannot be used; every API key is refused until it can: %s",
        path,
        exc.message,
    )


def _read(path: Path) -> Iterator[tuple[str, TenantGrant]]:
    try:  # whoever could have chosen it may mint a key for any tenant: checked at each read
        data = read_trusted_file(path, "API key file")
    except OSError as exc:
        raise _Unreadable(f"API key file {path} cannot be read: {exc}") from exc
    except ConfigError as exc:  # its folder or a link may be made safe without touching it
        raise _Unreadable(exc.message) from exc
    try:
        document = json.loads(data.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError too
        raise ConfigError(f"API key file {path} is not readable JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("version") != KEYS_VERSION:
        raise ConfigError(f"API key file {path}: expected {{'version': {KEYS_VERSION}, 'keys'}}")
    keys = document.get("keys")
    if not isinstance(keys, list):
        raise ConfigError(f"API key file {path}: 'keys' must be a list")
    for i, entry in enumerate(keys):
        yield _entry(path, i, entry)


def _entry(path: Path, index: int, entry: object) -> tuple[str, TenantGrant]:
    where = f"API key file {path}, key {index}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be an object")
    digest, tenant, key_id = entry.get("sha256"), entry.get("tenant"), entry.get("id")
    if not isinstance(digest, str) or len(digest) != 64:
        raise ConfigError(f"{where}: 'sha256' must be the key's hex SHA-256")
    if not isinstance(tenant, str) or not isinstance(key_id, str):
        raise ConfigError(f"{where}: 'id' and 'tenant' must be strings")
    tenant = _tenant(where, tenant)
    adapters = _names(where, entry.get("adapters"), None)
    words = _names(where, entry.get("cache_control"), CACHE_CONTROL_NAMES)
    return digest, TenantGrant(key_id, tenant, adapters, words, digest)


def _tenant(where: str, name: str) -> str:
    """A key's tenant as every stage names tenants (`canonical_tenant`: NFKC, stripped), so a
    key file's "acme " is the tenant an invalidation or a `tenant` input calls "acme"."""
    try:
        return canonical_tenant(name)
    except InvalidRequest as exc:
        raise ConfigError(f"{where}: 'tenant' {exc}") from exc


def _names(where: str, value: object, allowed: tuple[str, ...] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: adapters and cache_control are lists of names (or null)")
    unknown = [v for v in value if allowed is not None and v not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown cache_control names {unknown}")
    return frozenset(value)


# -- the operator's side (tiercache keys ...) -------------------------------------------------


def add_key(
    path: Path,
    tenant: str,
    adapters: list[str] | None = None,
    cache_control: list[str] | None = None,
) -> tuple[str, TenantGrant]:
    """A new random key for `tenant`, stored hashed in `path` (created 0600); the key itself is
    returned once and kept nowhere."""
    key = KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    key_id = "k_" + secrets.token_hex(6)
    grant = TenantGrant(
        key_id,
        _tenant("the new key", tenant),
        None if adapters is None else frozenset(adapters),
        None if cache_control is None else frozenset(cache_control),
        hash_key(key),
    )
    if grant.cache_control is not None:
        _names("the new key", sorted(grant.cache_control), CACHE_CONTROL_NAMES)
    path = path.resolve()  # a symlink's target is what the server reads: edit that file
    with _locked(path):
        entries = _entries(path)
        entries.append({**grant.to_json(), "sha256": grant.key_hash})
        _write(path, entries)
    return key, grant


def revoke_key(path: Path, key_id: str) -> bool:
    """Remove the key `key_id`; False when there is none."""
    path = path.resolve()  # a symlink's target is what the server reads: edit that file
    with _locked(path):
        entries = _entries(path)
        kept = [e for e in entries if e.get("id") != key_id]
        if len(kept) == len(entries):
            return False
        _write(path, kept)
    return True


def list_grants(path: Path) -> list[TenantGrant]:
    return [grant for _, grant in _read(path)] if path.exists() else []


def _entries(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    list(_read(path))  # refuse to extend a malformed file
    entries: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))["keys"]
    return entries


def _write(path: Path, entries: list[dict[str, Any]]) -> None:
    """The key file replaced whole (readers see the old one or the new one), durably (the
    folder synced after the rename: a revoked key does not come back after a power cut). The
    new file keeps the old one's owner, group and mode where this user may give them (an
    operator's `sudo tiercache keys revoke` must not leave a root-owned 0600 file the server's
    user cannot read, which refuses every key); a new file is 0600."""
    text = json.dumps({"version": KEYS_VERSION, "keys": entries}, indent=2, sort_keys=True)
    try:
        before: os.stat_result | None = path.stat()
    except FileNotFoundError:
        before = None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
            handle.flush()
            if before is not None:
                _keep_owner(handle.fileno(), before, path)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    # the new file is in force from here: a folder that cannot be synced (or opened to sync
    # it: a write-and-search-only folder) is logged, so the change is still reported done
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # those: nothing to sync there
            log.warning(
                "the key file %s is replaced, but its folder could not be synced (%s): the "
                "change could be lost in a power cut",
                path,
                exc,
            )


def _keep_owner(fd: int, before: os.stat_result, path: Path) -> None:
    """Give the open new key file the old one's owner, group and mode (read and write bits:
    whoever read the old one reads the new one); an owner this user may not give is logged,
    not fatal."""
    if (before.st_uid, before.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.fchown(fd, before.st_uid, before.st_gid)
        except OSError:  # not permitted; EINVAL for an id the user namespace does not map
            log.warning(
                "the key file %s was owned by %d:%d and is now this user's: the server must "
                "still be able to read it (chown it back)",
                path,
                before.st_uid,
                before.st_gid,
            )
    os.fchmod(fd, stat.S_IMODE(before.st_mode) & 0o666)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One writer at a time (a lock file beside the key file)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
