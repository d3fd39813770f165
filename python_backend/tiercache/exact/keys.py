"""Cache keys: scoped SHA-256 digests over a canonical encoding.

A key covers everything that changes the value: the tenant scope, the engine's model
id and weight revision, the adapter, and the canonical request. The tenant enters only as a keyed
hash with a server secret, so digests of two tenants cannot be compared or guessed from outside.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

from tiercache.errors import ConfigError
from tiercache.exact.request import GenerationRequest

log = logging.getLogger(__name__)

Digest = NewType("Digest", str)
"""Hex SHA-256 of a canonical request encoding; the exact-cache key."""

TenantScope = NewType("TenantScope", str)

KEY_SCHEMA_VERSION = 1
SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """Which weights answer: a model id and a digest of the weight file(s)."""

    model_id: str
    revision: str


def tenant_scope(secret: bytes, tenant: str) -> TenantScope:
    """HMAC-SHA256 of the tenant under the server secret (the empty tenant is a scope too)."""
    return TenantScope(hmac.digest(secret, b"tenant\x00" + tenant.encode("utf-8"), "sha256").hex())


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one purpose ("stage seal", "redis values", ...) derived from the server
    secret (HMAC-SHA256 under the secret of a labelled purpose): one secret on disk, a separate key
    per use, so a MAC made for one purpose is never valid for another."""
    if not purpose:
        raise ValueError("a derived key needs a purpose")
    return hmac.new(secret, b"tiercache-key\x00" + purpose.encode("utf-8"), hashlib.sha256).digest()


# The purposes of the keys that sign what replicas keep in Redis (`derive_key`; the signer is
# `tiercache.exact.redis_tier.Signer`): L3 values, invalidation records and messages, semantic rows.
REDIS_VALUES = "redis values"
REDIS_INVALIDATIONS = "invalidations"
REDIS_SEMANTIC_ROWS = "semantic rows"


def secret_fingerprint(secret: bytes) -> str:
    """What a fleet may show of its secret (Redis keeps it, `check_fleet_secret`): the hex of
    `derive_key(secret, "fingerprint")`. One-way, and a key of its own purpose, so knowing it
    helps neither to find the secret nor to sign anything."""
    return derive_key(secret, "fingerprint").hex()


def key_fields(request: GenerationRequest) -> dict[str, object]:
    """The request's part of its key, its canonical form: everything that changes the generated
    text (not `stream`: it only changes chunking; not the adapter version or the tenant scope:
    they enter the key document beside it). The conversation's earlier turns and the raw-prompt
    flag enter only when set, so a one-turn templated request keeps the digest it always had."""
    fields: dict[str, object] = {
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "seed": request.seed,
        "stop_words": list(request.stop_words),
        "lora_name": request.lora_name,
    }
    if request.history:
        fields["history"] = [list(turn) for turn in request.history]
    if request.raw_prompt:
        fields["raw_prompt"] = True
    return fields


def _document(scope: TenantScope, engine: EngineIdentity, adapter_digest: str) -> dict:
    return {
        "v": KEY_SCHEMA_VERSION,
        "scope": scope,
        "model": engine.model_id,
        "revision": engine.revision,
        "adapter_digest": adapter_digest,
    }


# json.dumps with these options, built once (dumps builds an encoder per call); stateless, so
# shared by every thread
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _sha256_of(document: dict) -> str:
    """SHA-256 over a canonical JSON encoding (sorted keys, no spaces, UTF-8)."""
    return hashlib.sha256(_CANONICAL_JSON.encode(document).encode("utf-8")).hexdigest()


def request_digest(
    scope: TenantScope,
    engine: EngineIdentity,
    request: GenerationRequest,
    adapter_digest: str = "",
) -> Digest:
    """The exact-cache key of `request` in `scope` on `engine` (with `adapter_digest`)."""
    return Digest(
        _sha256_of({**_document(scope, engine, adapter_digest), "request": key_fields(request)})
    )


def draft_digest(
    scope: TenantScope,
    engine: EngineIdentity,
    request: GenerationRequest,
    adapter_digest: str = "",
) -> Digest:
    """Where greedy answers to `request`'s prompt are kept as drafts for speculative decoding,
    whatever their max_tokens or stop words: the exact key's document without those and without
    the sampling parameters (a draft only needs to be likely; the engine verifies every token).
    In the tenant's scope and the adapter's, like every key, so a draft never carries another
    tenant's text."""
    fields = {
        "prompt": request.prompt,
        "lora_name": request.lora_name,
        "history": [list(turn) for turn in request.history],
        "raw_prompt": request.raw_prompt,
    }
    return Digest(_sha256_of({**_document(scope, engine, adapter_digest), "draft": fields}))


def semantic_scope(
    scope: TenantScope,
    engine: EngineIdentity,
    request: GenerationRequest,
    embedder_key: str,
    adapter_digest: str = "",
) -> str:
    """The scope a semantic hit must stay inside: everything in the exact key except the prompt,
    plus the embedder (vectors of two embedders are not comparable). Two requests in one scope
    differ only in wording, so one's answer can serve the other."""
    fields = key_fields(request)
    del fields["prompt"]
    return _sha256_of(
        {**_document(scope, engine, adapter_digest), "embedder": embedder_key, "request": fields}
    )


def load_or_create_secret(path: Path) -> bytes:
    """The server secret: read from `path`, or created there once (0600) and kept across restarts.

    Race-free across processes: the secret is written whole to a private temporary file, then
    hard-linked into place; `link` fails if another process got there first, and then its secret is
    read. No process can ever read a partly written secret.
    """
    if path.exists():
        return _read_secret(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(SECRET_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)
            _sync_folder(path.parent)  # the name too: a power cut lost it, and every entry
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_secret(path)


def _sync_folder(folder: Path) -> None:
    """fsync `folder` (a name just made in it survives a power cut); a folder that cannot be
    opened or synced (some filesystems) is logged, not raised: the file itself is written."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("could not sync the folder %s after writing a secret in it: %s", folder, exc)


def _others_may_write(info: os.stat_result) -> bool:
    """Whether a user other than this process's (or root) may write what `info` describes:
    writable by others, or by a group this process is not in."""
    if info.st_mode & 0o002:
        return True
    groups = {os.getegid(), *os.getgroups()}
    return bool(info.st_mode & 0o020) and info.st_gid not in groups


MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup


def _placed_by_us(folder: os.stat_result, where: str) -> bool:
    """Whether only this process's user or root could have put an entry in the folder `where`
    (`folder` its stat; made the entry, or replaced it since): one owned by this user or root
    that no other user may write, or one on a read-only mount (a Kubernetes secret volume is
    a world-writable tmpfs folder, mounted read-only). A shared folder, sticky or not, is not:
    where hard links to others' files may be made (fs.protected_hardlinks off, as in many
    containers), another user can plant a name for a root-owned file of known content."""
    if folder.st_uid not in (os.geteuid(), 0):
        return False
    if not _others_may_write(folder):
        return True
    try:
        return bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _walk(path: Path, what: str) -> tuple[os.stat_result, os.stat_result, str]:
    """Follow `path` as the kernel does, each component in turn, every link on the way (in a
    folder of the path too, relative or absolute): the final entry's lstat, its folder's stat
    and that folder's real path. ConfigError for a link another user could have made or
    replaced (theirs, or in a folder `_placed_by_us` does not take)."""
    pending = list(path.absolute().parts[1:])
    current, links = "/", 0
    try:
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":  # `current` has no link in it: its parent is the real one
                current = os.path.dirname(current)
                continue
            name = os.path.join(current, part)
            entry = os.lstat(name)
            if stat.S_ISLNK(entry.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise ConfigError(f"{what} {path}: more than {MAX_LINKS} links on the way")
                held = entry.st_uid in (os.geteuid(), 0)
                if not held or not _placed_by_us(os.stat(current), current):
                    raise ConfigError(
                        f"{what} {path} is reached through a link ({name}) another user could "
                        "have made or replaced: point the setting at the file itself, or keep "
                        "the link in a folder only this user or root may write"
                    )
                target = os.readlink(name)
                if os.path.isabs(target):
                    current = "/"
                pending = [*Path(target).parts[1 if os.path.isabs(target) else 0 :], *pending]
                continue
            if not pending:
                return entry, os.stat(current), current
            current = name
    except OSError as exc:  # the file was opened: a name that no longer leads there changed
        raise ConfigError(f"{what} {path} changed while it was read ({exc}): try again") from exc
    raise ConfigError(f"{what} {path} names a folder, not a file")


def check_trusted_file(path: Path, info: os.stat_result, what: str) -> None:
    """ConfigError unless the file `info` describes (the `fstat` of the file opened at `path`)
    could only have been chosen by this process's user or root, and is the file `path` names.
    Refused: a file another user may write (writable by others, or by a group this process is
    not in); a link on the way to it, in the file's name or in a folder's (a mounted secret is
    often one), that another user could have made or replaced (theirs, or in a folder they may
    write: a link to a root-owned file of known content would pass every check of the file
    itself); and the file itself when another user could have put it in its folder or may
    replace it (a folder they own or may write, sticky or not, unless mounted read-only). A
    secret or token another user chose would be theirs to know: the seals, or the admin gate,
    would be theirs too. A file of another uid in a folder only this user or root writes (a
    secret bind-mounted into a container running as root, a mounted secret volume) is the
    operator's, and taken."""
    if _others_may_write(info):
        raise ConfigError(
            f"{what} {path} can be written by other users (mode {info.st_mode & 0o777:o}): "
            "chmod 600 it"
        )
    entry, holder, folder = _walk(path, what)
    if (entry.st_dev, entry.st_ino) != (info.st_dev, info.st_ino):
        raise ConfigError(f"{what} {path} changed while it was read: try again")
    if not _placed_by_us(holder, folder):
        raise ConfigError(
            f"{what} {path} (owned by uid {info.st_uid}) is in a folder ({folder}) another "
            "user may write or owns: they may have put it there, or may replace it; keep it "
            "in a folder only this user or root may write"
        )


def read_trusted_file(path: Path, what: str) -> bytes:
    """The bytes of the file at `path`, ConfigError unless `check_trusted_file` takes it
    (checked on the file opened, so it is the file read)."""
    with path.open("rb") as handle:
        check_trusted_file(path, os.fstat(handle.fileno()), what)
        return handle.read()


def read_secret(path: Path) -> bytes:
    """The server secret at `path`, never created: ConfigError when there is none (an admin
    tool given the wrong place must not make a secret of its own)."""
    try:
        return _read_secret(path)
    except FileNotFoundError:
        raise ConfigError(
            f"no server secret at {path}: give the replicas' secret file ($TIERCACHE_SECRET_FILE, "
            "or --state-dir naming the folder that holds `secret`)"
        ) from None


def replace_secret(path: Path, secret: bytes) -> None:
    """Write `secret` to `path` atomically (0600): readers see the old file or the new one."""
    if len(secret) < SECRET_BYTES:
        raise ValueError(f"a server secret has at least {SECRET_BYTES} bytes, got {len(secret)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secret)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _sync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _read_secret(path: Path) -> bytes:
    with path.open("rb") as handle:
        info = os.fstat(handle.fileno())
        check_trusted_file(path, info, "secret file")
        data = handle.read()
    if len(data) < SECRET_BYTES:
        raise RuntimeError(f"server secret file {path} is shorter than {SECRET_BYTES} bytes")
    if info.st_mode & 0o044:  # a Kubernetes secret volume's default mode is 0644
        log.warning(
            "the server secret %s can be read by other users (mode %o): whoever reads it can "
            "forge stage seals, work out tenant scopes and sign Redis values; make it 0600 "
            "(or 0400, a secret volume's defaultMode)",
            path,
            stat.S_IMODE(info.st_mode),
        )
    return data


def file_digest(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes (weight revisions)."""
    h = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()
