"""The adapter registry: adapter names -> versions (task id, content digest) and their files.

Where adapters live. Each adapter is a folder in PEFT format (`adapter_config.json` and
`adapter_model.safetensors`): every subfolder of `root` whose name is a valid adapter name, plus
the entries of an optional JSON manifest, which may point anywhere and fix task ids:

    {"adapters": [{"name": "french", "path": "french", "task_id": 7, "pin": true}]}

`path` is relative to the manifest's folder (default: `<root>/<name>`); `task_id` and `pin` are
optional. A manifest entry shadows a root folder of the same name. The manifest is read once, at
construction; root is rescanned when an unknown name is asked for (when root's mtime changed,
else at most once per `rescan_interval_s`), so new folders appear without a restart, and a
folder that is gone is dropped the next time its name is resolved.

Versions. A version's digest is the SHA-256 of this canonical encoding of the two files:

    b"tiercache-lora-v1\\x00", then for adapter_config.json and adapter_model.safetensors, in
    this order: the file name (ASCII), b"\\x00", its length as 8 bytes big-endian, its bytes

(the length prefixes make the encoding unambiguous). `resolve` is cheap on the request path: it
stats the two files and re-reads and re-digests them only when their signature (inode, size,
mtime_ns, ctime_ns) changed. ctime is there because `cp -p` and `shutil.copy2` set mtime back to
the source's: a same-size file copied over in place would otherwise go unnoticed (ctime cannot be
set from user space). A changed signature with the same bytes is the same version. As in git's
"racily clean" index entries, a signature taken less than RACY_NS after the files' own timestamps
is not trusted (filesystem timestamps are coarse: a write in the same tick leaves them as they
were), so such files are re-read on each resolve until they are older than that.

Task ids are small integers, stable per name across restarts and processes: persisted in
`<state_dir>/lora/task_ids.json` under an fcntl lock, replaced atomically, first id 1, never
given to another name (a retired id is not reused either).

Errors: a malformed name is InvalidRequest; an unknown name is NotFound; a known adapter whose
folder is broken (a file missing or unreadable, a config that is not a LoRA config, a truncated
safetensors file) is Unavailable: the request is fine, the server's folder is not (often a copy
in progress), and the same request works once the folder is fixed. Manifest and task-id file
problems are ConfigError.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.adapter_types import (
    ADAPTER_FILES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterRef,
    AdapterWeights,
    adapter_digest,
)
from tiercache.errors import ConfigError, InvalidRequest, NotFound, TierCacheError, Unavailable

log = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")
TASK_IDS_VERSION = 1
# After a damaged task-id file, new ids start this far above the highest id still readable in it,
# so an id the damaged part held is not handed out again (unless that many were issued past it).
TASK_IDS_REPAIR_GAP = 1 << 20
_TASK_ID_PAIR = re.compile(r'"([^"\\]{1,128})": *([0-9]{1,18})\b')
KNOWN_IN_MESSAGE = 20  # names listed in an unknown-adapter message
READ_ATTEMPTS = 3  # a folder that changes under every read attempt is reported as Unavailable
RACY_NS = 2_000_000_000  # a signature younger than this may miss a write in the same tick
# An adapter's files are read whole by prompt_cache and lora_cache: a larger one (a whole model's
# weights put in an adapter folder by mistake) is refused, not loaded (docs/lora.md).
MAX_ADAPTER_FILE_BYTES = 2 << 30

Signature = tuple[tuple[int, int, int, int], ...]
"""(inode, size, mtime_ns, ctime_ns) of each adapter file, in ADAPTER_FILES order."""


def check_name(name: str) -> str:
    """`name` if it is a valid adapter name (it also names a folder), else InvalidRequest."""
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(
            f"invalid adapter name {name[:80]!r}: 1 to 64 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


def check_ref(ref: AdapterRef) -> AdapterRef:
    """`ref` if its fields are well formed (a request carries them as text), else InvalidRequest."""
    check_name(ref.name)
    if ref.task_id < 1:
        raise InvalidRequest(f"adapter {ref.name!r}: task id must be >= 1, got {ref.task_id}")
    if not DIGEST_PATTERN.fullmatch(ref.digest):
        raise InvalidRequest(f"adapter {ref.name!r}: digest must be 64 lowercase hex characters")
    return ref


@dataclass(frozen=True, slots=True)
class AdapterListing:
    """One adapter as the registry sees it now: its version, or why it cannot be served."""

    name: str
    ref: AdapterRef | None
    problem: str  # "" when ref is set
    pinned: bool  # pinned by the manifest


@dataclass(slots=True)
class _Entry:
    name: str
    folder: Path
    from_manifest: bool
    signature: Signature | None = None
    racy: bool = False  # `signature` too close to the files' timestamps to be trusted
    ref: AdapterRef | None = None
    problem: TierCacheError | None = None  # the content problem of `signature`'s files
    # one reader of its files at a time: concurrent resolves of a changed adapter wait for
    # that read rather than each hold a whole copy (up to 2 GiB a file) at once
    reading: threading.Lock = field(default_factory=threading.Lock, repr=False)


class AdapterRegistry:
    """Adapter names -> current versions and their files. Thread-safe; see the module docstring."""

    def __init__(
        self,
        root: Path,
        state_dir: Path,
        manifest: Path | None = None,
        *,
        rescan_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        """`clock` paces rescans; `wall_clock_ns` is compared with file timestamps."""
        self.root = Path(root)
        self._task_ids = TaskIds(Path(state_dir) / "lora" / "task_ids.json")
        self._clock = clock
        self._wall_clock_ns = wall_clock_ns
        self._rescan_interval_s = rescan_interval_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._pinned: tuple[str, ...] = ()
        if manifest is not None:
            fixed = self._read_manifest(Path(manifest))
            self._task_ids.fix(fixed)
        self._last_scan_s = 0.0
        self._scanned_mtime_ns = -1
        self._scan()

    # -- lookups -----------------------------------------------------------------------------

    def resolve(self, name: str) -> AdapterRef:
        """The current version of adapter `name` (errors as in the module docstring)."""
        check_name(name)
        with self._lock:
            entry = self._entry(name)
            if not self._changed(entry):
                return self._ready(entry)
        # Its files changed (or are too fresh to trust): read and hash them without the lock,
        # so resolves of every other adapter (prompt_cache's hit path among them) do not wait
        # on this one's bytes (up to 2 GiB a file); one thread at a time for this adapter.
        with entry.reading:
            with self._lock:
                if not self._changed(entry):  # read by the thread this one waited for
                    return self._ready(entry)
            loaded = _read_checked(entry.name, entry.folder)
            with self._lock:
                self._commit(entry, loaded)
                return self._ready(entry)

    def read(self, ref: AdapterRef) -> AdapterWeights:
        """The files of version `ref`, checked against its digest. Unavailable when the folder no
        longer holds that version (callers keep older versions in memory for in-flight work)."""
        check_ref(ref)
        with self._lock:
            entry = self._entries.get(ref.name)
            if entry is None:
                self._scan_if_due()
                entry = self._entries.get(ref.name)
        if entry is None:
            raise Unavailable(f"adapter {ref.name!r} is gone; retry")
        try:
            _, config, weights = _read_files(ref.name, entry.folder)
        except Unavailable as exc:
            raise Unavailable(f"adapter {ref.short} cannot be read: {exc.message}") from exc
        if adapter_digest(config, weights) != ref.digest:
            raise Unavailable(
                f"adapter {ref.name!r} changed since this request was resolved; retry"
            )
        _check_files(ref.name, config, weights)  # a digest from outside may name broken files
        return AdapterWeights(ref, config.decode("utf-8"), weights)

    def names(self) -> tuple[str, ...]:
        """Every adapter name known now (also broken ones), sorted; rescans root when due."""
        with self._lock:
            self._scan_if_due()
            return tuple(sorted(self._entries))

    def listing(self) -> tuple[AdapterListing, ...]:
        """Every adapter with its current version or its problem, sorted by name."""
        out = []
        for name in self.names():
            pinned = name in self._pinned
            try:
                out.append(AdapterListing(name, self.resolve(name), "", pinned))
            except NotFound:
                continue  # removed since names()
            except TierCacheError as exc:
                out.append(AdapterListing(name, None, exc.message, pinned))
        return tuple(out)

    def refs(self) -> tuple[AdapterRef, ...]:
        """The current version of every adapter that can be served (best effort: broken folders
        are left out; `listing` says why)."""
        return tuple(item.ref for item in self.listing() if item.ref is not None)

    def pinned(self) -> tuple[str, ...]:
        """The names the manifest pins."""
        return self._pinned

    def file_stats(self, name: str) -> tuple[int, float]:
        """(bytes, updated_s) of adapter `name`'s files as they are now: their total size and
        their newest modification time (what the fleet compares versions by, see
        tiercache.lora.fleet). Errors as `resolve`; the files may change right after."""
        check_name(name)
        with self._lock:
            folder = self._entry(name).folder
        signature = _signature(name, folder)
        nbytes = sum(size for _, size, _, _ in signature)
        return nbytes, max(mtime_ns for _, _, mtime_ns, _ in signature) / 1e9

    # -- internals (called with the lock held) ------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            self._scan_if_due()
            entry = self._entries.get(name)
        if entry is None:
            names = sorted(self._entries)
            known = ", ".join(names[:KNOWN_IN_MESSAGE]) or "none"
            if len(names) > KNOWN_IN_MESSAGE:
                known += f" and {len(names) - KNOWN_IN_MESSAGE} more"
            raise NotFound(f"unknown adapter {name!r} (known: {known})")
        return entry

    def _changed(self, entry: _Entry) -> bool:
        """Whether `entry`'s files must be read (again); NotFound when its folder is gone."""
        if not entry.from_manifest and not entry.folder.is_dir():
            if self._entries.get(entry.name) is entry:  # a rescan may have dropped it already
                del self._entries[entry.name]
            raise NotFound(f"unknown adapter {entry.name!r}: its folder was removed")
        return entry.racy or _signature(entry.name, entry.folder) != entry.signature

    def _ready(self, entry: _Entry) -> AdapterRef:
        if entry.problem is not None:
            # a copy each time: raising the stored one again added every caller's frames to
            # its traceback, and kept them (each request's prompt among them) for as long as
            # the folder stayed broken
            raise copy.copy(entry.problem).with_traceback(None)
        if entry.ref is None:
            raise RuntimeError(f"adapter {entry.name!r}: loaded without a version or a problem")
        return entry.ref

    def _commit(self, entry: _Entry, loaded: _Loaded) -> None:
        """`entry` as its files were read (`_read_checked`): a version with its task id, or
        the problem they have. Two resolves that read at once both commit; should the older
        read commit last, the next resolve sees the newer signature and reads again."""
        signature = loaded.signature
        # ctime, which every write sets to the kernel's clock: an mtime in the future (copied
        # with its times from a host whose clock runs ahead) would keep the entry racy, and
        # re-read on every resolve, until this clock passed it
        newest_ns = max(ctime_ns for _, _, _, ctime_ns in signature)
        entry.racy = newest_ns >= self._wall_clock_ns() - RACY_NS
        previous, previous_problem = entry.ref, entry.problem
        entry.signature, entry.ref, entry.problem = signature, None, None
        if loaded.problem is not None:
            entry.problem = loaded.problem
            if previous_problem is None or previous_problem.message != loaded.problem.message:
                log.warning("adapter %s in %s: %s", entry.name, entry.folder, entry.problem.message)
            return
        try:
            task_id = self._task_ids.assign(entry.name)
        except Exception as exc:
            # not loaded: the next resolve tries again (with the signature kept, it would
            # find neither a version nor a problem until the files changed)
            entry.signature = None
            log.warning("adapter %s: its task id could not be recorded: %s", entry.name, exc)
            raise Unavailable(
                f"adapter {entry.name!r}: its task id could not be recorded "
                f"({type(exc).__name__}); retry"
            ) from exc
        entry.ref = AdapterRef(entry.name, task_id, loaded.digest)
        if entry.ref != previous:
            log.info("adapter %s is version %s (task id %d)", entry.name, entry.ref.short, task_id)

    def _scan_if_due(self) -> None:
        """Rescan when the root folder's mtime changed (a folder was added, removed or renamed:
        one stat, so a new adapter is served at once) or at most every `rescan_interval_s`."""
        if self._root_mtime_ns() != self._scanned_mtime_ns:
            self._scan()
        elif self._clock() - self._last_scan_s >= self._rescan_interval_s:
            self._scan()

    def _root_mtime_ns(self) -> int:
        try:
            return self.root.stat().st_mtime_ns
        except OSError:
            return -1

    def _scan(self) -> None:
        """Add root's new folders, drop root entries whose folder is gone (manifest entries stay:
        they are declared, so a missing folder is reported as a problem, not as unknown)."""
        self._last_scan_s = self._clock()
        self._scanned_mtime_ns = self._root_mtime_ns()
        try:
            found = {
                p.name: p
                for p in self.root.iterdir()
                if p.is_dir() and NAME_PATTERN.fullmatch(p.name)
            }
        except FileNotFoundError:
            found = {}
        except OSError as exc:
            log.warning("cannot list adapters folder %s: %s", self.root, exc)
            return
        for name, entry in list(self._entries.items()):
            if not entry.from_manifest and name not in found:
                del self._entries[name]
        for name, folder in found.items():
            if name not in self._entries:
                self._entries[name] = _Entry(name, folder, from_manifest=False)

    def _read_manifest(self, path: Path) -> dict[str, int]:
        """Register the manifest's entries; returns the task ids it fixes. ConfigError on any
        problem, naming the manifest."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"adapters manifest {path}: cannot read it: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("adapters"), list):
            raise ConfigError(f'adapters manifest {path}: expected {{"adapters": [...]}}')
        if set(data) - {"adapters"}:
            raise ConfigError(f"adapters manifest {path}: unknown keys {sorted(set(data))}")
        fixed: dict[str, int] = {}
        owners: dict[int, str] = {}
        pinned = []
        for i, item in enumerate(data["adapters"]):
            where = f"adapters manifest {path}, entry {i}"
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ConfigError(f"{where}: expected an object with a string 'name'")
            unknown = set(item) - {"name", "path", "task_id", "pin"}
            if unknown:
                raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
            name = item["name"]
            try:
                check_name(name)
            except InvalidRequest as exc:
                raise ConfigError(f"{where}: {exc.message}") from exc
            if name in self._entries:
                raise ConfigError(f"{where}: adapter {name!r} is listed twice")
            folder = item.get("path", None)
            if folder is not None and (not isinstance(folder, str) or not folder):
                raise ConfigError(f"{where}: 'path' must be a non-empty string")
            resolved = path.parent / folder if folder else self.root / name
            task_id = item.get("task_id")
            if task_id is not None:
                if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 1:
                    raise ConfigError(f"{where}: 'task_id' must be an integer >= 1")
                if task_id in owners:
                    raise ConfigError(
                        f"{where}: task id {task_id} is given to both "
                        f"{owners[task_id]!r} and {name!r}"
                    )
                owners[task_id] = name
                fixed[name] = task_id
            pin = item.get("pin", False)
            if not isinstance(pin, bool):
                raise ConfigError(f"{where}: 'pin' must be true or false")
            if pin:
                pinned.append(name)
            self._entries[name] = _Entry(name, resolved, from_manifest=True)
        self._pinned = tuple(pinned)
        return fixed


# -- files ------------------------------------------------------------------------------------


def _signature(name: str, folder: Path) -> Signature:
    parts = []
    for file_name in ADAPTER_FILES:
        try:
            st = os.stat(folder / file_name)
        except FileNotFoundError:
            raise Unavailable(f"adapter {name!r} has no {file_name}") from None
        except OSError as exc:
            raise Unavailable(f"adapter {name!r}: cannot stat {file_name}: {exc.strerror}") from exc
        parts.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class _Loaded:
    """An adapter's files as one read found them: their signature, and their digest or the
    problem they have."""

    signature: Signature
    digest: str
    problem: Unavailable | None


def _read_checked(name: str, folder: Path) -> _Loaded:
    """Read, check and hash adapter `name`'s files (no lock held: the slow part of a resolve).
    Unavailable when they cannot be read; a content problem is returned, not raised."""
    signature, config, weights = _read_files(name, folder)
    try:
        _check_files(name, config, weights)
    except Unavailable as exc:
        return _Loaded(signature, "", exc)
    return _Loaded(signature, adapter_digest(config, weights), None)


def _read_files(name: str, folder: Path) -> tuple[Signature, bytes, bytes]:
    """Both files and the signature they were read under: a read that overlaps a change is
    retried, so the bytes always belong to the returned signature."""
    for _ in range(READ_ATTEMPTS):
        before = _signature(name, folder)
        try:
            config = _read_regular(name, folder / CONFIG_FILE)
            weights = _read_regular(name, folder / WEIGHTS_FILE)
        except FileNotFoundError:
            continue  # replaced or removed between the stat and the read: look again
        except OSError as exc:
            raise Unavailable(f"adapter {name!r}: cannot read its files: {exc.strerror}") from exc
        if _signature(name, folder) == before:
            return before, config, weights
    raise Unavailable(f"adapter {name!r} kept changing while it was read; retry")


def _read_regular(name: str, path: Path) -> bytes:
    """The bytes of the regular file `path`, at most MAX_ADAPTER_FILE_BYTES; Unavailable for
    anything else (a FIFO or a device would block the read, and with it the registry's lock;
    a file over the bound is refused unread). Anything but a regular file is refused before it
    is opened (opening a device can act on it), then opened without blocking and checked again
    on the open descriptor (it may have been replaced between the two)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise Unavailable(f"adapter {name!r}: {path.name} is not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unavailable(f"adapter {name!r}: {path.name} is not a regular file")
        if st.st_size > MAX_ADAPTER_FILE_BYTES:
            raise Unavailable(
                f"adapter {name!r}: {path.name} has {st.st_size} bytes, over the "
                f"{MAX_ADAPTER_FILE_BYTES >> 30} GiB an adapter file may have"
            )
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=True) as handle:
            fd = -1  # closed by the handle
            return handle.read(MAX_ADAPTER_FILE_BYTES + 1)
    finally:
        if fd >= 0:
            os.close(fd)


def _check_files(name: str, config: bytes, weights: bytes) -> None:
    """Unavailable unless `config` is a PEFT LoRA config and `weights` a whole safetensors file."""
    try:
        document = json.loads(config.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nesting
        raise Unavailable(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise Unavailable(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = document.get("peft_type")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise Unavailable(
            f"adapter {name!r}: {CONFIG_FILE} has peft_type {peft_type!r}, expected 'LORA'"
        )
    # safetensors: an 8-byte little-endian header length, that many bytes of JSON header, then
    # the tensors' data, which the header's data_offsets must cover exactly (a file copied in
    # place and read half-written has a whole header and part of its data: the engine would
    # refuse it as the caller's bad input, where the folder is what is not ready)
    header_bytes = int.from_bytes(weights[:8], "little") if len(weights) >= 8 else -1
    if header_bytes < 2 or len(weights) < 8 + header_bytes or weights[8:9] != b"{":
        raise Unavailable(f"adapter {name!r}: {WEIGHTS_FILE} is not a whole safetensors file")
    data_bytes = len(weights) - 8 - header_bytes
    if _data_end(weights[8 : 8 + header_bytes]) != data_bytes:
        raise Unavailable(
            f"adapter {name!r}: {WEIGHTS_FILE} is not a whole safetensors file (its header "
            f"describes other than the {data_bytes} bytes of data it holds: still being written?)"
        )


def _data_end(header: bytes) -> int | None:
    """Where a safetensors header's tensors end in its data (the largest `data_offsets` end; 0
    without tensors); None for a header that is not one."""
    try:
        document = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    end = 0
    for key, entry in document.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(x) is int and x >= 0 for x in offsets)
            or offsets[0] > offsets[1]
        ):
            return None
        end = max(end, offsets[1])
    return end


# -- task ids ---------------------------------------------------------------------------------


class TaskIds:
    """name -> task id, persisted in one JSON file shared by every process on the host.

    File: {"version": 1, "next_task_id": N, "task_ids": {name: id}}. Every change happens under an
    exclusive fcntl lock on `<file>.lock` and replaces the file atomically; ids only grow, so an
    id retired by a manifest change is never handed out again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._known: dict[str, int] = {}  # ids never change once given, so they can be kept
        self._lock = threading.Lock()

    def assign(self, name: str) -> int:
        """`name`'s id, giving it the next free one on first use."""
        with self._lock:
            if name in self._known:
                return self._known[name]
            with self._locked_file() as (ids, next_id):
                if name not in ids:
                    ids[name] = next_id
                    self._write(ids, next_id + 1)
                self._known.update(ids)
            return self._known[name]

    def fix(self, fixed: dict[str, int]) -> None:
        """Give the manifest's names their ids; ConfigError if one already belongs to another
        name (ids are never reused, so the manifest must pick a free one)."""
        if not fixed:
            return
        with self._lock, self._locked_file() as (ids, next_id):
            owners = {task_id: name for name, task_id in ids.items()}
            for name, task_id in fixed.items():
                owner = owners.get(task_id, name)
                if owner != name:
                    raise ConfigError(
                        f"adapters manifest: task id {task_id} for {name!r} already belongs to "
                        f"{owner!r} ({self.path}); task ids are never reused"
                    )
            changed = any(ids.get(name) != task_id for name, task_id in fixed.items())
            ids.update(fixed)
            if changed:
                self._write(ids, max(next_id, max(fixed.values()) + 1))
            self._known = dict(ids)

    @contextlib.contextmanager
    def _locked_file(self) -> Iterator[tuple[dict[str, int], int]]:
        # The folder 0700 and the lock 0600, like the rest of the state directory (the ids
        # file itself is written 0600 by mkstemp).
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield self._read()
        finally:
            os.close(fd)  # releases the lock

    def _read(self) -> tuple[dict[str, int], int]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, 1
        except OSError as exc:
            raise ConfigError(f"adapter task ids {self.path}: unreadable: {exc}") from exc
        try:
            data = json.loads(raw.decode("utf-8"))
            ids = {str(name): int(task_id) for name, task_id in data["task_ids"].items()}
            next_id = int(data["next_task_id"])
        except (
            UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError
        ) as exc:  # fmt: skip
            return self._repair(raw, exc)
        return ids, max([next_id, *(i + 1 for i in ids.values())])

    def _repair(self, raw: bytes, problem: Exception) -> tuple[dict[str, int], int]:
        """A damaged file (truncated, overwritten; the file is only ever replaced whole, so this
        is damage from outside): moved aside as `<name>.corrupt-<stamp>`, the `"name": id` pairs
        still readable kept, new ids above them by TASK_IDS_REPAIR_GAP, written back at once.
        Called under the file lock. Ids only matter to TensorRT-LLM's adapter cache; answers are
        keyed by adapter content digests, so a name that gets a new id costs one adapter load."""
        text = raw.decode("utf-8", errors="replace")
        ids = {m.group(1): int(m.group(2)) for m in _TASK_ID_PAIR.finditer(text)}
        for field_name in ("version", "next_task_id"):
            ids.pop(field_name, None)
        next_id = max(ids.values(), default=0) + 1 + TASK_IDS_REPAIR_GAP
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{os.getpid()}")
        os.replace(self.path, aside)
        log.warning(
            "adapter task ids %s are damaged (%s); moved aside to %s, %d ids kept, new ids from %d",
            self.path,
            problem,
            aside.name,
            len(ids),
            next_id,
        )
        self._write(ids, next_id)
        return ids, next_id

    def _write(self, ids: dict[str, int], next_id: int) -> None:
        data = {"version": TASK_IDS_VERSION, "next_task_id": next_id, "task_ids": ids}
        fd, tmp = tempfile.mkstemp(prefix=".task_ids.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(data, out, sort_keys=True, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
